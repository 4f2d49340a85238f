"""The step-boundary job, last after every step: every rank agrees (one small all-reduce on a CPU group) on saving
a checkpoint now (by time), on stopping (preemption, or a job's request) and on committing an asynchronous save;
then checkpoints are saved by interval, by time, at the last step, before a preemption exit and before a
requested stop. The storage policy: a failed save is reported in one line and retried at the next interval while
training goes on; when no later save would retry it (the final, the emergency save), the run fails."""

from __future__ import annotations

import time

from disttrain.checkpoint.manager import SaveFailed
from disttrain.core.errors import EXIT_PREEMPTED
from disttrain.train.jobs import Job, every
from disttrain.train.resilience import StepControl
from disttrain.train.resume import train_state


class Preempted(Exception):
    """Raised after the emergency checkpoint; the worker exits with EXIT_PREEMPTED."""


class CheckpointFailed(Exception):
    """The final or the emergency checkpoint could not be saved; the worker exits with EXIT_STORAGE."""


class StepBoundary(Job):
    label, collective = "step-boundary agreement", True

    def __init__(self, run):
        self.training_run, self.checkpoints, ckpt = run, run.checkpoints, run.cfg.checkpoint
        self.interval, self.every_minutes, self.save_final = ckpt.every_steps, ckpt.every_minutes, ckpt.save_final
        self.last_step = run.cfg.train.steps
        self.control: StepControl | None = None

    def start(self, trainer) -> None:
        self.control = StepControl(self.every_minutes, self.training_run.runtime.rank)

    def due(self, step: int) -> bool:
        return True

    def run(self, trainer) -> None:
        step = trainer.step
        pending = self.checkpoints.pending_step is not None
        decision = self.control.decide(not self.checkpoints.local_write_done(), trainer.stop_reason is not None)
        if pending and not decision.write_pending:
            self.commit_pending(trainer)
        if decision.preempted:
            self.save(trainer, reason="preemption", last=True)
            self.commit_pending(trainer, last=True)
            trainer.metrics.event("preempted", step=step, exit_code=EXIT_PREEMPTED)
            trainer.metrics.message(f"preempted: saved step {step}; exiting with {EXIT_PREEMPTED} so the launcher "
                                    "restarts or requeues the run")
            raise Preempted(step)
        if decision.stop:
            trainer.stopping = True
            reason = trainer.stop_reason or "a job on another rank asked to stop"
            trainer.metrics.event("stopped", step=step, reason=reason)
            trainer.metrics.message(f"step {step}: stopping ({reason})")
        final = (step == self.last_step or decision.stop) and self.save_final
        if every(self.interval, step) or decision.save_due or final:
            self.save(trainer, last=step == self.last_step or decision.stop)  # no later save would retry it
            self.control.saved()

    def finish(self, trainer) -> None:
        self.commit_pending(trainer, last=True)

    def close(self) -> None:
        if self.control is not None:
            self.control.close()

    def save(self, trainer, reason: str = "interval", last: bool = False) -> None:
        """Synchronous: saved and committed. Async: `blocking_s` is what training waited for. `last`: no later
        save would retry a failure (the final or the emergency save)."""
        t0, step = time.perf_counter(), trainer.step
        self.training_run.engine.check_finite()  # never save the update of a step whose gradients were not finite
        trainer.watchdog.enter(f"step {step}: checkpoint save", collective=True)
        try:
            path = self.checkpoints.save(step, self.training_run.engine, train_state(self.training_run, trainer.progress))
        except SaveFailed as exc:
            self._failed(trainer, exc, last)
            return
        seconds = time.perf_counter() - t0
        if self.checkpoints.pending_step is None:
            trainer.metrics.event("checkpoint_saved", step=step, path=str(path), seconds=seconds, reason=reason)
        else:
            trainer.metrics.event("checkpoint_started", step=step, path=str(path), blocking_s=seconds, reason=reason)
        self.training_run.instruments.faults.after_save(step)

    def commit_pending(self, trainer, last: bool = False) -> None:
        try:
            done = self.checkpoints.commit_pending()
        except SaveFailed as exc:
            self._failed(trainer, exc, last)
            return
        if done:
            trainer.metrics.event("checkpoint_saved", step=done[0], path=str(self.checkpoints.step_dir(done[0])),
                                  seconds=done[1], reason="async")

    @staticmethod
    def _failed(trainer, exc: SaveFailed, last: bool) -> None:
        trainer.metrics.event("checkpoint_failed", step=exc.step, message=str(exc), last=last)
        if last:
            raise CheckpointFailed(str(exc))
        trainer.metrics.message(f"warning: {exc}; training continues, the next checkpoint retries")
