"""The training loop: step through the engine, then notify the jobs that are due (train/jobs.py: metrics,
evaluation, the replica check, rebalancing, checkpoints and preemption, sampling, and the user's own). It never
asks which engine runs, and no job is timed or scheduled here: each decides when it is due."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from disttrain.core import interrupts
from disttrain.data.source import truncation_warnings, validation_gaps
from disttrain.observe.console import announce
from disttrain.observe.metrics import MetricsLogger
from disttrain.train.engine import StepResult
from disttrain.train.job_list import default_jobs
from disttrain.train.resilience import NullWatchdog, Watchdog, WatchdogPhases
from disttrain.train.resume import Progress, maybe_resume
from disttrain.train.step_boundary import CheckpointFailed, Preempted

__all__ = ["CheckpointFailed", "Preempted", "StepOutcome", "TrainResult", "Trainer"]


@dataclass
class TrainResult:
    final_step: int
    final_loss: float | None
    run_dir: str
    sample: str | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step gave: the engine's sums (this rank's), the learning rate it used, its data wait."""

    step: int
    result: StepResult  # loss sum, valid targets, gradient norm (tensors)
    lr: float
    data_time: float


class Trainer:
    def __init__(self, run, jobs: list | None = None):
        """`run`: train/run.py's TrainingRun; `jobs`: the loop's jobs in order (default: job_list.py's)."""
        self.run, self.engine, self.progress = run, run.engine, Progress()
        self.jobs = default_jobs(run) if jobs is None else jobs
        self.watchdog, self.metrics, self.outcome = NullWatchdog(), None, None
        self.final_loss = self.sample = self.stop_reason = None
        self.stopping = False

    @property
    def step(self) -> int:
        return self.progress.step

    def fit(self) -> TrainResult:
        try:
            self._begin()  # inside: a job refusing to start (a lost file, say) still stops the watchdog's thread
            while self.step < self.run.cfg.train.steps and not self.stopping:
                if interrupts.interrupted():  # a Ctrl-C that native code swallowed (a save's writer)
                    raise KeyboardInterrupt
                self.outcome = self._train_step()
                self._notify()
            self._each("finish", self)
            self.metrics.event("finished", step=self.step, run_dir=str(self.run.cfg.run_dir))
        except BaseException:
            if interrupts.interrupted():  # Ctrl-C: nothing more is written; an unfinished async save goes
                self.run.checkpoints.abandon_pending()
                if self.metrics is not None:
                    self.metrics.event("interrupted", step=self.step, newest_checkpoint=self.run.checkpoints.newest)
            raise
        finally:
            self._close()
        return TrainResult(self.step, self.final_loss, str(self.run.cfg.run_dir), self.sample)

    def request_stop(self, reason: str) -> None:
        """A job's request to end the run at this step's boundary (every rank agrees, a checkpoint is saved)."""
        self.stop_reason = reason

    def global_sums(self, *local: torch.Tensor) -> list[float]:
        """Collective: float64 sums added over every group the engine names (data parallel; the pipeline too,
        where only the last stage has the loss)."""
        t = torch.stack([x.detach().double() for x in local]).to(self.run.runtime.device)
        for group in self.engine.loss_groups:
            dist.all_reduce(t, group=group)
        return t.tolist()

    # ---------------------------------------------------------------- the parts of fit
    def _begin(self) -> None:
        run, cfg = self.run, self.run.cfg
        maybe_resume(run, self.progress)
        runtime = run.runtime
        self.metrics = MetricsLogger(cfg.run_dir, cfg.metrics, runtime.rank, runtime.env.local_rank, cfg.train.steps,
                                     self.step, run_config=cfg.model_dump(mode="json", by_alias=True))
        self._announce()
        d = cfg.distributed
        if d.watchdog_factor:
            self.watchdog = Watchdog(runtime.rank, runtime.world_size, d.watchdog_factor, d.watchdog_min_s,
                                     str(cfg.run_dir / "logs" / f"rank_{runtime.rank:05d}.log"))
            self.engine.phases.subscribe(WatchdogPhases(self.watchdog), outermost=True)
        self._each("start", self)

    def _announce(self) -> None:
        run, cfg, p = self.run, self.run.cfg, self.progress
        data, tokenizer = cfg.data, run.data.tokenizer
        gaps = validation_gaps(data.source, run.data.val_samples, data.seq_len) if cfg.train.eval_every else []
        cut = truncation_warnings(data.source, run.data.loader.windows, data.seq_len)
        what = "tokens" if tokenizer is not None else "samples"
        announce(self.metrics, step=p.step, world_size=run.runtime.world_size, layout=run.layout,
                 model=run.model.spec.label, num_params=run.model.num_params, trainable=run.model.trainable_params,
                 loss=getattr(getattr(run.engine, "mean_loss", None), "description", ""),
                 attention=run.model.spec.attention if run.layout.cp == 1 else
                 f"{cfg.parallel.cp_method} context-parallel attention (parallel.cp={run.layout.cp})",
                 device=f"{run.runtime.device.type}/{run.runtime.backend}",
                 tokenizer=tokenizer.name if tokenizer is not None else None,
                 per_step=f"{run.data.tokens_per_step:,} {what}", warnings=[*cfg.warnings, *gaps, *cut],
                 shares=run.data.loader.shares if run.layout.balanced else None,
                 rebalance_every=cfg.parallel.balance_every if run.balancer.auto else 0,
                 skipped=p.skipped_checkpoints, checkpoint_dir=str(run.checkpoints.dir),
                 resumed_from=p.resumed_from, changes=p.config_changes,
                 optimizer_split=getattr(getattr(run.engine, "optimizer", None), "split", dict)(),
                 float8=run.model.float8)

    def _train_step(self) -> StepOutcome:
        run, tools, step = self.run, self.run.instruments, self.step + 1
        started = time.perf_counter()
        self.watchdog.enter(f"step {step}: loading data")
        micro_batches = next(run.data.loader)
        data_time = time.perf_counter() - started
        tools.breakdown.add_seconds("data", data_time)
        tools.comm_profiler.start(step)
        lr = self.engine.lr()  # the rate this step uses
        try:
            result = self.engine.train_step(micro_batches, step)
        finally:
            tools.comm_profiler.stop()
        self.progress.step = step
        self.progress.tokens_seen += run.data.tokens_per_step
        self.watchdog.step_done(step)
        self.metrics.observe_step(time.perf_counter() - started)
        tools.faults.after_step(step, run.model.module)
        return StepOutcome(step, result, lr, data_time)

    def _notify(self) -> None:
        for job in self.jobs:
            if job.due(self.step):
                self.watchdog.enter(f"step {self.step}: {getattr(job, 'label', type(job).__name__)}",
                                    collective=getattr(job, "collective", False))
                job.run(self)
        self.watchdog.touch()  # evaluation and saving are not step time

    def _each(self, method: str, *args) -> None:
        """Call `method` of every job that has it (a user's job need not: train/jobs.py's Job has them all)."""
        for job in self.jobs:
            if callable(getattr(job, method, None)):
                getattr(job, method)(*args)

    def _close(self) -> None:
        self.watchdog.close()
        self._each("close")
        if self.metrics is not None:
            self.metrics.close()
        self.run.data.loader.close()
