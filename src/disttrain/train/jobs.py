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
