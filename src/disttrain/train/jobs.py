"""The loop's jobs: after every optimizer step the Trainer asks each job whether it is due, and runs those that are.

A job is any object with `due(step) -> bool` and `run(trainer)`; optionally `label` (what the hang watchdog
reports while it runs), `collective` (whether it communicates: then every rank must find it due at the same
steps), `start(trainer)` (after resuming, before the first step), `finish(trainer)` (after the last step) and
`close()` (always, last). Subclass `Job` for the defaults. A job reads the Trainer: `trainer.step`,
`trainer.outcome` (the step's loss sum, valid targets, gradient norm, learning rate, data seconds),
`trainer.run` (the assembled run: model, data, engine, config), `trainer.metrics` (`event`, `message`,
`log_step`), `trainer.global_sums(...)` (a collective) and `trainer.request_stop(reason)`: every rank agrees
at the step's end, saves a checkpoint (as after the last step) and stops, exit status 0.

Which jobs a run has, in which order, is job_list.py's; your own come from `train.callbacks`. docs/guide.md,
"Your own jobs", has an example.
"""

from __future__ import annotations

from disttrain.observe.health import check_replicas_in_sync


class Job:
    """The defaults of a job: never due, nothing to start, finish or close."""

    label = "job"
    collective = False

    def start(self, trainer) -> None:
        pass

    def due(self, step: int) -> bool:
        return False

    def run(self, trainer) -> None:
        pass

    def finish(self, trainer) -> None:
        pass

    def close(self) -> None:
        pass


def every(interval: int, step: int) -> bool:
    """Whether `step` falls on an interval of `interval` steps; an interval of 0 switches the job off."""
    return bool(interval) and step % interval == 0


class FiniteCheck(Job):
    """`metrics.nonfinite=stop`: whether a step since the last check had a non-finite gradient norm, read on the
    steps where other jobs read the model or its loss (logging, the replica check, evaluation) and the last step,
    before them, so that a NaN is named as such rather than as a diverged replica (and before every save,
    train/step_boundary.py): steps in between make no host sync for it."""

    label = "non-finite check"

    def __init__(self, engine, intervals: tuple[int, ...], last_step: int):
        self.engine, self.intervals, self.last_step = engine, intervals, last_step

    def due(self, step: int) -> bool:
        return any(every(interval, step) for interval in self.intervals) or step == self.last_step

    def run(self, trainer) -> None:
        self.engine.check_finite()


class SkippedUpdates(Job):
    """`metrics.nonfinite=skip_step`: say that this step's update was dropped."""

    label = "skipped-update notice"

    def __init__(self, engine):
        self.engine = engine

    def due(self, step: int) -> bool:
        return bool(self.engine.skipped_steps) and self.engine.skipped_steps[-1] == step

    def run(self, trainer) -> None:
        trainer.metrics.event("nonfinite_step_skipped", step=trainer.step)
        trainer.metrics.message(f"warning: step {trainer.step} had a non-finite gradient norm: update skipped")


class ReplicaSyncCheck(Job):
    """Parameters of data-parallel replicas compared every `metrics.sync_check_every` steps (observe/health.py)."""

    label, collective = "replica sync check", True

    def __init__(self, interval: int, model, replica_group):
        self.interval, self.model, self.group = interval, model, replica_group

    def due(self, step: int) -> bool:
        return every(self.interval, step)

    def run(self, trainer) -> None:
        check_replicas_in_sync(self.model, self.group, trainer.step)


class StuckLoss(Job):
    """A model that cannot learn, said once: the global loss of the first `STEPS` steps of a fresh run constant
    to `TOLERANCE` over different batches means outputs that do not depend on the input (an embedding scaled
    to zero, a head or norm left at zero, uninitialised memory). Each step keeps its local loss sum on the device
    (no host sync); step `STEPS` reduces them all in one collective."""

    label, collective = "stuck-loss check", True
    STEPS, TOLERANCE = 10, 1e-6

    def __init__(self, total_steps: int):
        self.armed, self.total_steps, self.sums, self.targets = False, total_steps, [], []

    def start(self, trainer) -> None:
        self.armed = trainer.step == 0 and self.total_steps >= self.STEPS

    def due(self, step: int) -> bool:
        return self.armed and step <= self.STEPS

    def run(self, trainer) -> None:
        result = trainer.outcome.result
        self.sums.append(result.loss_sum.detach())
        self.targets.append(result.targets)
        if trainer.step < self.STEPS:
            return
        losses = [total / float(count) for total, count in zip(trainer.global_sums(*self.sums), self.targets)]
        self.sums, self.targets = [], []
        if max(losses) - min(losses) <= self.TOLERANCE:
            line = (f"the loss stayed at {losses[0]:.6f} (within {self.TOLERANCE:g}) over steps 1-{self.STEPS} "
                    "on different batches: the model is not learning (its output does not depend on the input; "
                    "check its initialisation, model.init_from and optim.lr)")
            trainer.metrics.event("warning", step=trainer.step, message=line)
            trainer.metrics.message(f"warning: {line}")


class Rebalance(Job):
    """`parallel.balance=auto`: a new split of the global batch from measured speed, used from the next step."""

    label, collective = "balance measurement all-gather", True

    def __init__(self, balancer, loader):
        self.balancer, self.loader = balancer, loader

    def due(self, step: int) -> bool:
        return self.balancer.due(step)

    def run(self, trainer) -> None:
        event = self.balancer.rebalance(trainer.step)
        if event is not None:
            self.loader.set_shares(self.balancer.shares)
            trainer.metrics.event("rebalance", **event)
            trainer.metrics.message(f"step {event['step']}: rebalanced micro-batches per data-parallel rank "
                                    f"{event['previous_shares']} -> {event['shares']} (seconds per micro-batch "
                                    f"{event['seconds_per_micro_batch']})")
