"""The config sections around a run: where checkpoints go and when, what is measured and where it is sent, how
processes talk and are watched, and the run directory. Every key described (docs/config.md is generated from
these)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from disttrain.config.sections import Section


class CheckpointConfig(Section):
    """Sharded checkpoints (DCP), committed by a marker written last."""

    dir: str = Field("", description="empty: <run dir>/checkpoints; or an fsspec URL (s3://bucket/prefix, gs://, "
                     "az://) with credentials from the environment or a profile")
    every_steps: int = Field(0, ge=0, description="save every N steps (0: off)")
    every_minutes: float = Field(0.0, ge=0, description="save when this many minutes passed since the last save, "
                                 "decided by rank 0 for all (0: off)")
    keep_last: int = Field(0, ge=0, description="keep only the newest N committed checkpoints (0: all)")
    async_save: bool = Field(False, alias="async", description="training continues while the shards are written; "
                             "committed when every rank finished")
    save_final: bool = Field(True, description="save after the last step")
    resume: str = Field("auto", description="auto (the newest committed checkpoint, if any), none, or a checkpoint "
                        "directory")

    @model_validator(mode="after")
    def _check(self) -> "CheckpointConfig":
        if self.resume not in ("auto", "none") and "://" not in self.resume and not Path(self.resume).is_dir():
            raise ValueError(f"checkpoint.resume={self.resume}: no such checkpoint directory "
                             "(allowed: auto, none, or an existing checkpoints/step_* directory)")
        return self


class MetricsConfig(Section):
    """What is measured, and the sinks it goes to (rank 0's unless said)."""

    log_every: int = Field(1, ge=0, description="log (console and metrics.jsonl) every N steps (0: off)")
    jsonl: bool = Field(True, description="write <run dir>/metrics.jsonl")
    tensorboard: bool = Field(False, description="write TensorBoard scalars to <run dir>/tensorboard")
    prometheus_port: int = Field(0, ge=0, le=65535, description="every rank serves Prometheus metrics on this port + "
                                 "its local rank (0: off)")
    prometheus_host: str = Field("127.0.0.1", description="the address the Prometheus endpoints listen on")
    peak_tflops: float = Field(0.0, ge=0, description="per-device peak TFLOP/s for MFU; 0: a known GPU's dense peak "
                               "for the matmul dtype, no MFU on CPU")
    sync_check_every: int = Field(100, ge=0, description="compare parameter checksums across data-parallel replicas "
                                  "every N steps; a mismatch stops the run with exit 3 (0: off)")
    comm_profile_every: int = Field(200, ge=0, description="profile one step in N for seconds per collective kind "
                                    "(0: off)")
    mlflow: bool = Field(False, description="also log to MLflow (<run dir>/mlruns unless MLFLOW_TRACKING_URI is set)")
    wandb: bool = Field(False, description="also log to Weights & Biases (offline in <run dir>/wandb unless "
                        "WANDB_MODE=online)")
    nonfinite: Literal["stop", "skip_step"] = Field("stop", description="a non-finite gradient norm: stop (exit 3, "
                                                    "at the next logging step or save, which name the step: no host "
                                                    "sync per step) or skip_step (drop that update, logged; one host "
                                                    "sync per step)")


class DistributedConfig(Section):
    """How processes talk, and when a silent one counts as hung."""

    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl with CUDA, else gloo")
    timeout_s: float = Field(600.0, gt=0, description="collective timeout before a hung rank errors out")
    watchdog_factor: float = Field(20.0, ge=0, description="hang = no step for this many median step times: stacks to "
                                   "the log, exit 124 (0: off)")
    watchdog_min_s: float = Field(300.0, gt=0, description="never call a hang before this many seconds")


class RunSection(Section):
    """The run directory: a run name is one run."""

    name: str = Field("", description="empty: the config file's name; the run directory is run.dir/run.name")
    dir: str = Field("runs", description="the folder of run directories")
    allow_changes: bool = Field(False, description="auto-resume this run although its data, optimizer, schedule, "
                                "batch, seed or precision changed (refused otherwise: that is another run)")
