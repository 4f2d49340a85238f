"""This rank's share of a run, under any launcher: the run directory's claim, the process group, the assembled run,
the loop, and the exit status that says how it ended (launch/this_process.py leaves with it)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable

from disttrain.checkpoint.run_directory import AlreadyFinished, RunDirectory
from disttrain.config.resolve import resolve_run
from disttrain.core import interrupts
from disttrain.core.errors import EXIT_HEALTH, EXIT_PREEMPTED, EXIT_STORAGE, UserError
from disttrain.distributed.env import detect_env, device_type
from disttrain.launch import this_process
from disttrain.observe.quiet import quiet_third_party


def train_here(cfg, env=None, jobs_after_checkpoints: Callable | None = None) -> int:
    """Resolve the run for this world, hold (or check) its directory, and train this rank; the exit status.
    `env`: where this process sits (default: from its environment, distributed/env.py); `jobs_after_checkpoints`:
    run -> jobs of the loop that run after the step boundary's checkpoint (a launcher's own, launch/ray_worker.py)."""
    env = env or detect_env()
    interrupts.install()
    resolved = resolve_run(cfg, env.world_size, device_type())
    try:
        with RunDirectory.for_rank(cfg, resolved, env.rank) as run_dir:
            return _train(cfg, env, resolved, run_dir, jobs_after_checkpoints)
    except AlreadyFinished as exc:  # every rank found it before starting anything
        if env.rank == 0:
            print(exc, flush=True)
        return 0


def _train(cfg, env, resolved, run_dir: RunDirectory, jobs_after_checkpoints: Callable | None = None) -> int:
    from disttrain.distributed.runtime import init_distributed, shutdown
    from disttrain.observe.health import NonFiniteError, ReplicaDivergence
    from disttrain.train.builder import build_run
    from disttrain.train.job_list import default_jobs
    from disttrain.train.loop import CheckpointFailed, Preempted, Trainer

    setup_logging(cfg.run_dir, env.rank)
    log = logging.getLogger("disttrain.launch")
    log.info("process started at %.3f (restart %s%s)", this_process.STARTED,
             os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
             ", forked from the launcher" if this_process.STARTED_BY_FORK else "")
    lay = resolved.layout
    log.info("resolved run: world %d (pp %d, dp_replicate %d, dp_shard %d, tp %d), model %s, tokenizer %s, dtypes "
             "param %s, compute %s, reduce %s", lay.world_size, lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp,
             resolved.spec.name, resolved.tokenizer, resolved.param_dtype, resolved.compute_dtype, resolved.reduce_dtype)
    trainer = None
    try:
        runtime = init_distributed(env, cfg.distributed.backend, cfg.distributed.timeout_s)
        try:
            run = build_run(cfg, runtime, resolved)
            jobs = default_jobs(run)
            if jobs_after_checkpoints is not None:  # after the step boundary (checkpoints, stop), before sampling
                jobs[-1:-1] = jobs_after_checkpoints(run)
            trainer = Trainer(run, jobs)
        except UserError:  # found while assembling (weights that do not fit, a job that is not one): leave nothing
            run_dir.forget_if_fresh(env.rank)
            raise
        result = trainer.fit()
    except Preempted:
        return EXIT_PREEMPTED
    except CheckpointFailed as exc:  # the storage policy: the last save failed, the run must not look done
        return _stopped("disttrain.checkpoint", exc, env.rank, EXIT_STORAGE, log_level=logging.INFO)
    except (NonFiniteError, ReplicaDivergence) as exc:  # a health check stopped the run
        return _stopped("disttrain.health", exc, env.rank, EXIT_HEALTH)
    except BaseException as exc:  # Ctrl-C, or what it caused here (a peer that left mid-collective)
        if not interrupts.interrupted():
            raise
        return _interrupted(trainer, cfg, env.rank, log, exc)
    finally:  # also on a UserError found once running (it reaches the CLI's one error path)
        shutdown()
    trainer.run.instruments.faults.at_exit()
    if env.rank == 0:
        loss = f"final loss {result.final_loss:.4f}, " if result.final_loss is not None else ""
        print(f"done: {result.final_step} steps, {loss}run directory {Path(result.run_dir).resolve()}", flush=True)
    return 0


def _interrupted(trainer, cfg, rank: int, log, exc: BaseException) -> int:
    """One line from rank 0: where the run stopped and what a restart resumes from."""
    if trainer is None:
        where, newest = "start-up", _newest_on_disk(cfg)
    else:
        where, newest = f"step {trainer.step}", trainer.run.checkpoints.newest or "none"
    log.info("interrupted (Ctrl-C) at %s (%s); newest checkpoint: %s", where, type(exc).__name__, newest)
    if rank == 0:
        print(f"disttrain: interrupted at {where}; newest checkpoint: {newest}", file=sys.stderr, flush=True)
    return interrupts.EXIT_INTERRUPTED


def _newest_on_disk(cfg) -> str:
    from disttrain.checkpoint.manager import CheckpointManager

    try:
        return CheckpointManager(cfg.checkpoint_dir, rank=-1).latest() or "none"
    except Exception:  # no directory yet, or a store that cannot be reached: nothing to point at
        return "none"


def _stopped(logger: str, exc: Exception, rank: int, code: int, log_level: int = logging.ERROR) -> int:
    """The reason in the rank's log file, and one line on the console from rank 0."""
    logging.getLogger(logger).log(log_level, "stopped: %s" if log_level == logging.INFO else "%s", exc)
    if rank == 0:
        print(f"disttrain: stopped: {exc}", file=sys.stderr, flush=True)
    return code


def setup_logging(run_dir: Path, rank: int) -> None:
    """This rank's log file in the run directory (everything from INFO), warnings also on the console."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(logs / f"rank_{rank:05d}.log")
    file_handler.setFormatter(fmt)
    # The console gets each warning once, as the run's own lines read (`warning: ...`): rank 0's warnings, and
    # errors from every rank (a hang is one rank's story); the timestamped records stay in the log files.
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
    console.setFormatter(_ConsoleFormat("" if rank == 0 else f"rank {rank}: "))
    root = logging.getLogger("disttrain")
    root.setLevel(logging.INFO)
    root.handlers[:] = [file_handler, console]
    quiet_third_party()


class _ConsoleFormat(logging.Formatter):
    """`warning: ...` / `error: rank 1: ...`: the run's own spelling of its console lines."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {self.prefix}{record.getMessage()}"
