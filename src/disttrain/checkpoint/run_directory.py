"""The one owner of a run directory: it checks that this command may write there, claims it (one writer per
run, renewed until released), removes a directory that this command created when nothing of a run was written
in it, and says how the run ended.

    with RunDirectory.for_launch(cfg, resolved, rdzv_id, rdzv_endpoint) as run_dir:   # the launcher
        code = start_workers(...)
        code = run_dir.exit_code(code)

    with RunDirectory.for_rank(cfg, resolved, rank) as run_dir:   # a worker (under any launcher)
        ... build and train; run_dir.forget_if_fresh() when the run could not be assembled

A worker under disttrain's own launcher finds the launcher's claim key in its environment and holds nothing
itself; under a plain torchrun or srun every rank checks (reads only) and rank 0 holds the claim. Which checks
refuse a run (another live holder, mixed runs, a checkpoint that cannot load or belongs to another run) is
run_identity.py's.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from disttrain.checkpoint import lease
from disttrain.checkpoint.run_identity import check_run_dir, held_by
from disttrain.core import storage
from disttrain.core.errors import EXIT_PREEMPTED, EXIT_STORAGE, UserError

DONE, PREEMPTED, STORAGE_FAILED = "done", "preempted", "storage failed"
EARLIER = "previous"  # where the files of an earlier run that cannot be resumed are moved (<run dir>/previous/<time>)


class AlreadyFinished(Exception):
    """The run under this name finished at the step this command would train to; str() is the one line."""


def unused(run_dir: Path) -> bool:
    """Nothing in the run directory but a claim: nothing of a run was written there."""
    return not run_dir.exists() or all(p.name == lease.LEASE or p.name.startswith(f".{lease.LEASE}")
                                       for p in run_dir.iterdir())


class RunDirectory:
    def __init__(self, cfg, resolved, key: str, claims: bool):
        """`key`: this job's claim key (lease.py); `claims`: whether this process holds the claim."""
        self.cfg, self.resolved, self.key, self.claims = cfg, resolved, key, claims
        self.path: Path = cfg.run_dir
        self.existed = self.path.exists()
        self.fresh = unused(self.path)  # nothing of a run in it yet
        self.started = time.time()
        self._held: list[lease.Lease] = []

    @classmethod
    def for_launch(cls, cfg, resolved, rdzv_id: str | None, rdzv_endpoint: str | None) -> "RunDirectory":
        """The launcher of `disttrain train --nproc-per-node`: it checks and holds the run for its workers (and
        their restarts), which find its key in their environment."""
        return cls(cfg, resolved, lease.launch_key(rdzv_id, rdzv_endpoint), claims=True)

    @classmethod
    def for_rank(cls, cfg, resolved, rank: int) -> "RunDirectory":
        """A worker: under disttrain's launcher it holds nothing; else every rank checks and rank 0 claims."""
        under_launcher = bool(os.environ.get(lease.KEY_ENV))
        return cls(cfg, resolved, lease.process_key(), claims=not under_launcher and rank == 0)

    # ------------------------------------------------------------------ claim and release
    def __enter__(self) -> "RunDirectory":
        earlier = None
        if self.claims or not os.environ.get(lease.KEY_ENV):
            check_run_dir(self.cfg, self.resolved, self.key)  # reads only
            earlier = self._earlier_run()
        if self.claims:
            self._claim()
            os.environ[lease.KEY_ENV] = self.key  # the workers (and their restarts) write under this claim
            if earlier == "unresumable":
                self._move_aside()
        return self

    def _earlier_run(self) -> str | None:
        """What this directory holds from an earlier launch (not this one's restarts): raises AlreadyFinished when
        that run ended at the step this command trains to; "unresumable" when it has metrics but no checkpoint
        that `checkpoint.resume=auto` would continue (it starts over, _move_aside)."""
        from disttrain.checkpoint.run_identity import newest_state
        from disttrain.observe.run_report import load_records

        last = lease.read(self.path)
        if (last is not None and last.key == self.key) or not (self.path / "metrics.jsonl").is_file():
            return None
        _, events = load_records(self.path)
        ends = [e for e in events if e.get("event") in ("started", "finished")]
        steps = self.cfg.train.steps
        if ends and ends[-1]["event"] == "finished" and ends[-1].get("step") == steps:
            raise AlreadyFinished(f"{self.path} already finished at step {steps}: nothing to train (to train it "
                                  f"again, give it another run.name or remove {self.path})")
        auto = self.cfg.checkpoint.resume == "auto"
        return "unresumable" if auto and newest_state(self.cfg.checkpoint_dir)[0] is None else None

    def _move_aside(self) -> None:
        """An earlier run here left metrics but no checkpoint: this one starts over, and the earlier one's files
        (metrics, logs, its config and sample) go to previous/<time>/ so that the two never mix in one
        metrics.jsonl. Chosen over refusing: a run without checkpoints (a debug run) is one people repeat."""
        keep = {lease.LEASE, EARLIER, "checkpoints"}
        aside = self.path / EARLIER / time.strftime("%Y%m%d-%H%M%S")
        aside.mkdir(parents=True, exist_ok=True)
        for p in self.path.iterdir():
            if p.name not in keep and not p.name.startswith(f".{lease.LEASE}"):
                p.rename(aside / p.name)
        print(f"{self.path} holds an earlier run with no checkpoint to resume: starting over (its files are now in "
              f"{aside})", flush=True)

    def _claim(self) -> None:
        """Hold the run directory (and a remote checkpoint location) for this key, renewed from a thread; UserError,
        leaving nothing new, if another launch won either."""
        where = [self.path] + ([self.cfg.checkpoint_dir] if storage.is_url(self.cfg.checkpoint_dir) else [])
        for place in where:
            held, holder = lease.acquire(place, self.key)
            if held is None:
                self.release()
                what = self.path if place == self.path else f"checkpoint.dir={place}"
                raise UserError(held_by(self.cfg, holder, None if place == self.path else place) if holder else
                                f"{f'run.name={self.cfg.run.name}: ' if place == self.path else ''}{what} could not "
                                "be claimed (another launch is starting there)")
            self._held.append(held.start())

    def release(self) -> None:
        """Release the claims (kept as a record of the last holder), and remove a directory this command created
        only to claim it."""
        for held in reversed(self._held):
            held.release()
        self._held.clear()
        if self.claims and os.environ.get(lease.KEY_ENV) == self.key:
            del os.environ[lease.KEY_ENV]
        if not self.existed and self.path.exists() and unused(self.path):
            for p in self.path.iterdir():
                p.unlink(missing_ok=True)
            try:
                self.path.rmdir()
            except OSError:  # something arrived meanwhile
                pass

    def __exit__(self, *exc) -> None:
        self.release()

    def forget_if_fresh(self, rank: int) -> None:
        """The run could not be assembled (weights that do not fit, say): a directory that held no run before
        goes again, log files included, so that nothing half-written is left behind."""
        if not self.fresh or rank != 0:
            return
        self.release()
        for handler in logging.getLogger("disttrain").handlers:
            handler.close()
        shutil.rmtree(self.path, ignore_errors=True)

    # ------------------------------------------------------------------ how the run ended
    def ending(self) -> str | None:
        """How this command's workers ended the run, from what they recorded in metrics.jsonl since it started:
        DONE, PREEMPTED (emergency checkpoint saved), STORAGE_FAILED (the last save failed), or None."""
        from disttrain.observe.run_report import load_records

        try:
            _, events = load_records(self.path)
        except FileNotFoundError:  # stopped before the run directory had metrics
            return None
        mine = [e for e in events if e.get("time", 0) >= self.started]
        if any(e["event"] == "preempted" for e in mine):
            return PREEMPTED
        if any(e["event"] == "checkpoint_failed" and e.get("last") for e in mine):
            return STORAGE_FAILED
        return DONE if any(e["event"] == "finished" for e in mine) else None

    def exit_code(self, workers_code: int) -> int:
        """The launcher's exit status: the workers' own when they succeeded; the preemption or storage status when
        they said so (torchrun's report of their exit would only repeat it)."""
        if workers_code == 0:
            return 0
        return {PREEMPTED: EXIT_PREEMPTED, STORAGE_FAILED: EXIT_STORAGE}.get(self.ending(), workers_code)
