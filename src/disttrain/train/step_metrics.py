"""The metrics job: on logging steps, the step record every sink gets (console, metrics.jsonl, TensorBoard,
Prometheus, MLflow, W&B): the global loss, throughput over the steps since the last record, where the time went,
memory, and what the engine, the router and the balancer report."""

from __future__ import annotations

import time

from disttrain.observe.health import rank_stats
from disttrain.observe.metrics import peak_memory_bytes
from disttrain.observe.model_bytes import memory_stats
from disttrain.train.jobs import Job, every


class StepMetrics(Job):
    """Every `metrics.log_every` steps and at the last step. Collective: the loss and per-rank statistics."""

    label, collective = "metrics all-reduce", True

    def __init__(self, run):
        self.training_run, self.interval, self.last_step = run, run.cfg.metrics.log_every, run.cfg.train.steps
        self.window_start, self.window_first_step = time.perf_counter(), 0

    def start(self, trainer) -> None:
        self.window_start, self.window_first_step = time.perf_counter(), trainer.step

    def due(self, step: int) -> bool:
        return bool(self.interval) and (every(self.interval, step) or step == self.last_step)

    def run(self, trainer) -> None:
        profiler = self.training_run.instruments.comm_profiler
        elapsed = time.perf_counter() - self.window_start - profiler.take_overhead()
        record = self.record(trainer, trainer.step - self.window_first_step, elapsed)
        trainer.final_loss = record["loss"]
        trainer.metrics.log_step(record)
        routing = self.training_run.model.routing
        for line in routing.warnings if routing is not None else ():
            trainer.metrics.event("warning", step=trainer.step, message=line)
            trainer.metrics.message(f"warning: {line}")
        self.window_start, self.window_first_step = time.perf_counter(), trainer.step
        profiler.take_overhead()

    def record(self, trainer, window_steps: int, elapsed: float) -> dict:
        """Collective (loss, peak memory and per-rank compute time over ranks): the step record of the last
        `window_steps` steps, `elapsed` seconds."""
        run, outcome, engine = self.training_run, trainer.outcome, self.training_run.engine
        device, tools = run.runtime.device, run.instruments
        result = outcome.result
        tokens_per_sec = run.data.tokens_per_step * window_steps / elapsed
        loss = trainer.global_sums(result.loss_sum)[0] / float(result.targets)
        record = {"step": trainer.step, "time": time.time(), "loss": loss,
                  "lr": outcome.lr, "grad_norm": float(result.grad_norm), "tokens_per_sec": tokens_per_sec,
                  "step_time_s": elapsed / window_steps, "data_time_s": outcome.data_time,
                  "tokens_seen": trainer.progress.tokens_seen, "world_size": run.runtime.world_size}
        if tools.peak_flops and tools.flops_per_token:
            record["mfu"] = tools.flops_per_token * tokens_per_sec / (tools.peak_flops * run.runtime.world_size)
        record.update(tools.breakdown.collect(window_steps))
        comm = tools.comm_profiler.take()
        if comm:
            record.update(comm)
            record["comm_time_s"] = sum(comm.values())
        record.update(memory_stats(device))
        record.update(rank_stats(outcome.data_time + tools.compute_clock.seconds, peak_memory_bytes(device), device))
        record.update(engine.extra_metrics())
        record.update(engine.mean_loss.metrics())  # a preference objective's rewards
        if run.model.routing is not None:
            record.update(run.model.routing.record())
        if run.layout.balanced:
            record["balance_shares"] = list(run.balancer.shares)
        if engine.skipped_steps:
            record["skipped_steps_total"] = len(engine.skipped_steps)
        return record
