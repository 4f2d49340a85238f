"""Metrics hub: rank-0 console progress and metrics.jsonl (one JSON object per record), plus the
optional TensorBoard and Prometheus sinks in `sinks.py`."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ConsoleProgress:
    """A live rich progress bar on a terminal; plain lines when output is a file or pipe."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.total, self.enabled = total_steps, enabled
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self._progress = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        done = step - self.start_step
        rate = done / max(1e-9, time.perf_counter() - self.t0)
        eta = (self.total - step) / rate if rate > 0 else 0.0
        info = f"loss {record['loss']:.4f} | {record['tokens_per_sec']:,.0f} tok/s"
        if "mfu" in record:
            info += f" | mfu {100 * record['mfu']:.1f}%"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        else:
            width = len(str(self.total))
            print(f"step {step:>{width}}/{self.total} | {info} | lr {record['lr']:.2e} | eta {_fmt_duration(eta)}",
                  flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class MetricsLogger:
    """One hub, several sinks: rank 0 writes the console, metrics.jsonl and the trackers
    (TensorBoard, MLflow, Weights & Biases); every rank serves Prometheus. Every rank holds a
    logger, so callers need no rank checks."""

    def __init__(self, run_dir: Path, metrics_cfg, rank: int, local_rank: int, total_steps: int, start_step: int,
                 run_config: dict | None = None):
        self.enabled = rank == 0
        self.console = ConsoleProgress(total_steps, start_step, self.enabled)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1) if self.enabled and metrics_cfg.jsonl else None
        self.trackers: list = []  # rank 0: log_step(record), event(name, fields), close()
        if self.enabled:
            from disttrain.observe import sinks

            if metrics_cfg.tensorboard:
                self.trackers.append(sinks.TensorBoardSink(run_dir / "tensorboard"))
            if metrics_cfg.mlflow:
                self.trackers.append(sinks.MLflowSink(run_dir, run_config or {}))
            if metrics_cfg.wandb:
                self.trackers.append(sinks.WandbSink(run_dir, run_config or {}))
        self.prometheus = None
        if metrics_cfg.prometheus_port:
            from disttrain.observe.sinks import PrometheusSink

            self.prometheus = PrometheusSink(metrics_cfg.prometheus_port + local_rank, metrics_cfg.prometheus_host, rank)

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def observe_step(self, seconds: float) -> None:
        """Every step, every rank: cheap host-side bookkeeping only."""
        if self.prometheus is not None:
            self.prometheus.observe_step(seconds)

    def log_step(self, record: dict) -> None:
        if self.prometheus is not None:
            self.prometheus.log_step(record)
        if self.enabled:
            self._write(record)
            self.console.update(record)
            for tracker in self.trackers:
                tracker.log_step(record)

    def event(self, name: str, **fields) -> None:
        if self.enabled:
            self._write({"event": name, "time": time.time(), **fields})
            for tracker in self.trackers:
                tracker.event(name, fields)

    def message(self, text: str) -> None:
        self.console.message(text)

    def close(self) -> None:
        self.console.close()
        for sink in [*self.trackers, self.prometheus]:
            if sink is not None:
                sink.close()
        self.trackers, self.prometheus = [], None
        if self._file is not None:
            self._file.close()
            self._file = None
