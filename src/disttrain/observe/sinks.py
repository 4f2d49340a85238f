"""Optional metric sinks: TensorBoard, MLflow and Weights & Biases (rank 0), Prometheus (every rank,
on port + local_rank).

Prometheus names follow its conventions: `disttrain_` prefix, base units (`_seconds`, `_bytes`),
`_total` for counters, and a `rank` label so one dashboard shows every rank of the job.
"""

from __future__ import annotations

from pathlib import Path


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_step(self, record: dict) -> None:
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"train/{key}", value, record["step"])

    def event(self, name: str, fields: dict) -> None:
        if name == "eval":
            self.writer.add_scalar("eval/loss", fields["val_loss"], fields["step"])

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


class MLflowSink:
    """MLflow tracking, offline by default: a file store in <run dir>/mlruns unless MLFLOW_TRACKING_URI
    points at a server. The resolved config is logged as parameters."""

    def __init__(self, run_dir: Path, run_config: dict):
        import os

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
            self.mlflow.log_metric("eval_loss", float(fields["val_loss"]), step=int(fields["step"]))

    def close(self) -> None:
        self.mlflow.end_run()


class WandbSink:
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
            self.run.log({"eval/loss": float(fields["val_loss"])}, step=int(fields["step"]))

    def close(self) -> None:
        self.run.finish()


class PrometheusSink:
    """Serves this rank's metrics over HTTP; `step_seconds` is observed every step, the rest at log steps."""

    def __init__(self, port: int, host: str, rank: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = CollectorRegistry()
        labels = {"rank": str(rank)}
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

        def gauge(name, doc):
            return Gauge(name, doc, ["rank"], registry=self.registry).labels(**labels)

        self.tokens_per_second = gauge("disttrain_tokens_per_second", "Global training throughput in tokens/s")
        self.loss = gauge("disttrain_loss", "Mean token cross-entropy of the last logged global batch")
        self.learning_rate = gauge("disttrain_learning_rate", "Learning rate of the last logged step")
        self.grad_norm = gauge("disttrain_grad_norm", "Global gradient norm before clipping")
        self.memory_peak = gauge("disttrain_memory_peak_bytes", "Peak memory, max over ranks")
        self.step = gauge("disttrain_step", "Last completed optimizer step")
        self.mfu = gauge("disttrain_mfu_ratio", "Model FLOPs utilisation (0-1), when peak FLOP/s is known")
        self.phase_seconds = Gauge("disttrain_step_phase_seconds", "Mean seconds per step of each phase on this rank "
                                   "(data, forward, backward, comm_exposed, optimizer)", ["rank", "phase"],
                                   registry=self.registry)
        self.comm_seconds = Gauge("disttrain_collective_seconds", "Seconds per step in each collective kind on this "
                                  "rank (last profiled step)", ["rank", "collective"], registry=self.registry)
        self.memory = Gauge("disttrain_memory_bytes", "This rank's memory: allocated/reserved/peak (CUDA) or rss (CPU)",
                            ["rank", "kind"], registry=self.registry)
        self.rank_compute = gauge("disttrain_rank_compute_seconds", "Slowest rank's per-step compute time")
        self.slowest_rank = gauge("disttrain_slowest_rank", "Rank id with the longest compute time at the last log")
        self.loss_scale = gauge("disttrain_loss_scale", "fp16 dynamic loss scale")
        self.overflows = gauge("disttrain_fp16_overflow_steps", "fp16 steps skipped for inf/NaN gradients so far")
        self.pp_bubble = gauge("disttrain_pipeline_bubble_ratio", "Measured idle share of the pipeline schedule")
        self.rank = str(rank)
        self.steps = Counter("disttrain_steps", "Optimizer steps completed by this process", ["rank"],
                             registry=self.registry).labels(**labels)
        self.step_seconds = Histogram("disttrain_step_seconds", "Wall time of one optimizer step on this rank",
                                      ["rank"], buckets=buckets, registry=self.registry).labels(**labels)
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def observe_step(self, seconds: float) -> None:
        self.steps.inc()
        self.step_seconds.observe(seconds)

    def log_step(self, record: dict) -> None:
        self.step.set(record["step"])
        self.tokens_per_second.set(record["tokens_per_sec"])
        self.loss.set(record["loss"])
        self.learning_rate.set(record["lr"])
        self.grad_norm.set(record["grad_norm"])
        self.memory_peak.set(record["mem_peak_bytes"])
        if "mfu" in record:
            self.mfu.set(record["mfu"])
        for key, value in record.items():
            if key.startswith("time_") and key.endswith("_s"):
                self.phase_seconds.labels(rank=self.rank, phase=key[5:-2]).set(value)
            elif key.startswith("comm_") and key.endswith("_s") and key != "comm_time_s":
                self.comm_seconds.labels(rank=self.rank, collective=key[5:-2]).set(value)
            elif key in ("mem_allocated_bytes", "mem_reserved_bytes", "mem_rank_peak_bytes", "mem_rss_bytes"):
                self.memory.labels(rank=self.rank, kind=key[4:-6]).set(value)
        optional = {"rank_compute_max_s": self.rank_compute, "slowest_rank": self.slowest_rank,
                    "loss_scale": self.loss_scale, "fp16_overflows_total": self.overflows, "pp_bubble": self.pp_bubble}
        for key, metric in optional.items():
            if key in record:
                metric.set(record[key])

    def close(self) -> None:
        self.server.shutdown()
