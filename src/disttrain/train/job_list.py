"""Which jobs a run has, in the order they run after each step: the built-in ones (train/jobs.py and the
modules beside it), then the user's own from `train.callbacks` (`FILE.py:Name` or `package.module:Name`, each
called with no arguments to make the job), then the step-boundary agreement (whose checkpoint and stop decisions
come last, so a stop a user job requests takes effect at the same step) and sampling (after the last step)."""

from __future__ import annotations

from disttrain.core.errors import UserError
from disttrain.train.evaluation import Evaluation, Sampling
from disttrain.train.jobs import FiniteCheck, Rebalance, ReplicaSyncCheck, SkippedUpdates, StuckLoss
from disttrain.train.step_boundary import StepBoundary
from disttrain.train.step_metrics import StepMetrics


def user_jobs(refs: list[str]) -> list:
    """`train.callbacks`: each reference called with no arguments; what it makes must have due() and run()."""
    from disttrain.core.user_code import load_function

    jobs = []
    for ref in refs:
        make = load_function("train.callbacks", ref)
        try:
            job = make()
        except Exception as exc:
            raise UserError(f"train.callbacks={ref}: calling it raised {type(exc).__name__}: "
                            f"{(str(exc).splitlines() or [''])[0]}") from None
        if not (callable(getattr(job, "due", None)) and callable(getattr(job, "run", None))):
            raise UserError(f"train.callbacks={ref}: made {type(job).__name__}, which has no due(step) and "
                            "run(trainer) (a job of the loop: disttrain.train.jobs.Job)")
        jobs.append(job)
    return jobs


def default_jobs(run) -> list:
    """Every job of `run` (train/run.py's TrainingRun), in order."""
    cfg = run.cfg
    checked = (cfg.metrics.log_every, cfg.metrics.sync_check_every, cfg.train.eval_every)
    jobs = [FiniteCheck(run.engine, checked, cfg.train.steps), SkippedUpdates(run.engine),
            ReplicaSyncCheck(cfg.metrics.sync_check_every, run.model.module, run.meshes.replica_group(run.layout)),
            StepMetrics(run), StuckLoss(cfg.train.steps), Evaluation(run)]
    if run.layout.balanced:
        jobs.append(Rebalance(run.balancer, run.data.loader))
    if cfg.train.objective == "dpo" and cfg.dpo.precompute_reference:  # first: before any other job reads the loss
        from disttrain.train.reference_logps import ReferencePass

        jobs.insert(0, ReferencePass(run))
    return [*jobs, *user_jobs(cfg.train.callbacks), StepBoundary(run), Sampling(run)]
