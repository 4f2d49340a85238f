"""Metric sinks: the `Sink` protocol and the file-based sinks (metrics.jsonl, TensorBoard, MLflow,
Weights & Biases). A new sink is a class here (or in its own module) plus one entry in the hub's
REGISTRY (observe/metrics.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


class Sink:
    """What the hub sends a sink; each method is a no-op unless overridden."""

    def observe_step(self, seconds: float) -> None:
        """Every step, every rank: cheap host-side bookkeeping only."""

    def log_step(self, record: dict) -> None:
        """A logging step's record (keys in docs/guide.md)."""

    def event(self, name: str, fields: dict) -> None:
        """A run event: checkpoint saved, resumed, eval, preempted, ..."""

    def message(self, text: str) -> None:
        """A line for people."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class SinkContext:
    run_dir: Path
    metrics_cfg: object
    rank: int
    local_rank: int
    total_steps: int
    start_step: int
    run_config: dict


class JsonlSink(Sink):
    """metrics.jsonl: one JSON object per step record or event (events carry an `event` key)."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def log_step(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def event(self, name: str, fields: dict) -> None:
        self.file.write(json.dumps({"event": name, "time": time.time(), **fields}) + "\n")

    def close(self) -> None:
        self.file.close()


class TensorBoardSink(Sink):
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_step(self, record: dict) -> None:
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"train/{key}", value, record["step"])
        for layer, counts in record.get("moe_tokens_per_expert", {}).items():  # expert e's bin holds its tokens
            self.writer.add_histogram_raw(f"moe/tokens_per_expert/{layer}", min=0, max=len(counts) - 1,
                                          num=sum(counts), sum=sum(e * c for e, c in enumerate(counts)),
                                          sum_squares=sum(e * e * c for e, c in enumerate(counts)),
                                          bucket_limits=[e + 0.5 for e in range(len(counts))],
                                          bucket_counts=counts, global_step=record["step"])

    def event(self, name: str, fields: dict) -> None:
        if name == "eval":
            self.writer.add_scalar("eval/loss", fields["val_loss"], fields["step"])
            for source, value in fields.get("val_loss_by_source", {}).items():
                self.writer.add_scalar(f"eval/loss/{source}", value, fields["step"])

    def close(self) -> None:
        self.writer.close()


def _numeric(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class MLflowSink(Sink):
    """MLflow tracking, offline by default: a file store in <run dir>/mlruns unless MLFLOW_TRACKING_URI
    points at a server. The resolved config is logged as parameters."""

    def __init__(self, run_dir: Path, run_config: dict):
        import os

        # MLflow 3.x refuses its file store unless asked; a local folder is what an offline run wants.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "disttrain"))
        mlflow.start_run(run_name=run_dir.name)
        params = _flatten(run_config)
        keys = sorted(params)
        for i in range(0, len(keys), 100):  # MLflow takes at most 100 parameters per call
            mlflow.log_params({k: params[k][:500] for k in keys[i:i + 100]})

    def log_step(self, record: dict) -> None:
        self.mlflow.log_metrics(_numeric(record), step=int(record["step"]))

    def event(self, name: str, fields: dict) -> None:
        if name == "eval":
            self.mlflow.log_metrics({"eval_loss": float(fields["val_loss"]), **{
                f"eval_loss_{k}": float(v) for k, v in fields.get("val_loss_by_source", {}).items()}},
                step=int(fields["step"]))

    def close(self) -> None:
        self.mlflow.end_run()


class WandbSink(Sink):
    """Weights & Biases, offline by default (WANDB_MODE=online to sync): files in <run dir>/wandb,
    uploadable later with `wandb sync`."""

    def __init__(self, run_dir: Path, run_config: dict):
        import os

        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "disttrain"), name=run_dir.name,
                              dir=str(run_dir), mode=os.environ.get("WANDB_MODE", "offline"), config=run_config)

    def log_step(self, record: dict) -> None:
        self.run.log({f"train/{k}": v for k, v in _numeric(record).items()}, step=int(record["step"]))

    def event(self, name: str, fields: dict) -> None:
        if name == "eval":
            self.run.log({"eval/loss": float(fields["val_loss"]), **{
                f"eval/loss/{k}": float(v) for k, v in fields.get("val_loss_by_source", {}).items()}},
                step=int(fields["step"]))

    def close(self) -> None:
        self.run.finish()
