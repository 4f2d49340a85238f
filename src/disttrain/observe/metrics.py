"""The metrics hub: one object the loop talks to, fanning out to every enabled sink."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from disttrain.observe.sinks import JsonlSink, MLflowSink, Sink, SinkContext, TensorBoardSink, WandbSink


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


@dataclass(frozen=True)
class SinkEntry:
    name: str
    enabled: Callable[[object], bool]  # from the `metrics` config section
    make: Callable[[SinkContext], Sink]
    every_rank: bool = False  # False: rank 0 only


def _console(ctx: SinkContext) -> Sink:
    from disttrain.observe.console import ConsoleProgress

    return ConsoleProgress(ctx.total_steps, ctx.start_step, True)


def _prometheus(ctx: SinkContext) -> Sink:
    from disttrain.observe.prometheus import PrometheusSink

    m = ctx.metrics_cfg
    return PrometheusSink(m.prometheus_port + ctx.local_rank, m.prometheus_host, ctx.rank)


REGISTRY: list[SinkEntry] = [
    SinkEntry("console", lambda m: True, _console),
    SinkEntry("jsonl", lambda m: m.jsonl, lambda ctx: JsonlSink(ctx.run_dir / "metrics.jsonl")),
    SinkEntry("tensorboard", lambda m: m.tensorboard, lambda ctx: TensorBoardSink(ctx.run_dir / "tensorboard")),
    SinkEntry("mlflow", lambda m: m.mlflow, lambda ctx: MLflowSink(ctx.run_dir, ctx.run_config)),
    SinkEntry("wandb", lambda m: m.wandb, lambda ctx: WandbSink(ctx.run_dir, ctx.run_config)),
    SinkEntry("prometheus", lambda m: bool(m.prometheus_port), _prometheus, every_rank=True),
]


def build_sinks(ctx: SinkContext) -> list[Sink]:
    return [e.make(ctx) for e in REGISTRY if (e.every_rank or ctx.rank == 0) and e.enabled(ctx.metrics_cfg)]


class MetricsLogger:
    """One hub, many sinks (observe/sinks.py REGISTRY): rank 0 feeds the console, metrics.jsonl and
    the trackers; every rank feeds Prometheus. Every rank holds a hub, so callers need no rank checks."""

    def __init__(self, run_dir: Path, metrics_cfg, rank: int, local_rank: int, total_steps: int, start_step: int,
                 run_config: dict | None = None):
        self.sinks = build_sinks(SinkContext(run_dir, metrics_cfg, rank, local_rank, total_steps, start_step,
                                             run_config or {}))

    def observe_step(self, seconds: float) -> None:
        for sink in self.sinks:
            sink.observe_step(seconds)

    def log_step(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log_step(record)

    def event(self, name: str, **fields) -> None:
        for sink in self.sinks:
            sink.event(name, fields)

    def message(self, text: str) -> None:
        for sink in self.sinks:
            sink.message(text)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
