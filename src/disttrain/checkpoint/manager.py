"""Sharded checkpoints with torch.distributed.checkpoint (DCP), made visible by a COMMIT marker.

Layout of one checkpoint:
    step_00000100/
        *.distcp, .metadata     model + optimizer, sharded by DCP (reloadable on another layout),
                                or another format the step engine writes (DeepSpeed's folder)
        train_state.pt          step, tokens, LR schedule, grad scaler, loader position, config fingerprint
        rank_00000.pt ...       each rank's RNG states
        COMMIT                  written last by rank 0, after every rank finished writing; names the format
                                and records every file's size and CRC-32 (checked before a resume)

The step engine writes and reads model + optimizer state (`engine.save`/`engine.load`); this
module owns directories, commit, retention, RNG and the choice of what to resume.

The directory is a local path or an fsspec URL (s3://bucket/prefix, ...): every operation goes through
storage.py. On an object store the same protocol holds: data objects first, COMMIT (one PUT) last, and a
checkpoint is deleted only after a newer one committed.

A save that fails (no space, a lost connection, a throttled store that stays so) is agreed by every rank,
its partial directory removed, and raised as SaveFailed with one line naming the location, what failed and
the newest complete checkpoint; the loop decides what follows (train/loop.py: the next interval retries, a
failed final or emergency save fails the run).
"""

from __future__ import annotations

import json
import logging
import random
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from disttrain.checkpoint import integrity
from disttrain.core import interrupts, storage
from disttrain.core.errors import UserError

log = logging.getLogger(__name__)

COMMIT = storage.COMMIT
# What a failed save raises: an OS or store error, or DCP's gathered CheckpointException (a BaseException).
SAVE_ERRORS = (Exception, CheckpointException)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def leaving(exc: BaseException) -> BaseException | None:
    """The SystemExit or KeyboardInterrupt that DCP wrapped, with the other ranks' failures, into a
    CheckpointException (every rank gets the same one), or None: the process is leaving, the storage did not fail."""
    if isinstance(exc, CheckpointException):
        for wrapped, _ in exc.failures.values():
            if isinstance(wrapped, (SystemExit, KeyboardInterrupt)):
                return wrapped
    return None


class SaveFailed(Exception):
    """A checkpoint save that failed on some rank, agreed by all; str() is the one line for people."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class CheckpointManager:
    """Synchronous saves commit before returning. Async saves (`async_save=True`) return once the
    state is staged in host memory; `poll_done`/`commit_pending` commit them after every rank's
    writes finished, and a new save first waits for the previous one."""

    def __init__(self, directory, rank: int, keep_last: int = 0, async_save: bool = False):
        self.dir = str(directory)
        self.rank = rank
        self.keep_last = keep_last
        self.async_save = async_save
        # DCP's async writer runs collectives while training runs its own: it needs its own group.
        self._async_group = dist.new_group(backend="gloo") if async_save else None
        self._pending: tuple[int, str, object, float] | None = None
        self._format = "dcp"
        self.newest: str | None = None  # the newest complete checkpoint known (resumed from or committed)

    def step_dir(self, step: int) -> str:
        return storage.join(self.dir, f"step_{step:08d}")

    @staticmethod
    def step_of(path) -> int:
        return int(storage.name_of(path).split("_")[1])

    def _candidates(self) -> list[str]:
        names = [n for n in storage.listdir(self.dir) if n.startswith("step_") and n[5:].isdigit()]
        return sorted((storage.join(self.dir, n) for n in names), key=self.step_of)

    def committed(self) -> list[str]:
        """Committed checkpoints, oldest first."""
        return [p for p in self._candidates() if storage.isfile(storage.join(p, COMMIT))]

    def latest(self) -> str | None:
        done = self.committed()
        return done[-1] if done else None

    def remove_uncommitted(self) -> None:
        """Rank 0: delete directories a crashed save left without COMMIT."""
        if self.rank != 0:
            return
        for path in self._candidates():
            if not storage.isfile(storage.join(path, COMMIT)):
                log.warning("removing uncommitted checkpoint %s", path)
                storage.rmtree(path)

    def verify(self, path) -> str | None:
        """Cheap integrity check without touching any model: None if loadable, else what is wrong
        (naming the file). Catches missing or truncated shards and unreadable metadata."""
        try:
            self.read_train_state(path)
        except Exception as exc:  # truncated or foreign pickle: torch raises several types
            return f"{storage.join(path, 'train_state.pt')} is unreadable ({type(exc).__name__})"
        if self.format_of(path) != "dcp":
            return None
        try:
            metadata = storage.dcp_reader(path).read_metadata()
            present = storage.files_under(path)
        except Exception as exc:
            return f"{storage.join(path, '.metadata')} is unreadable ({type(exc).__name__})"
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            file = storage.join(path, name)
            if name not in present:
                return f"{file} is missing"
            if present[name] < size:
                return f"{file} is truncated ({present[name]} of {size} bytes)"
        return None

    def verify_checksums(self, path) -> str | None:
        """Collective: every file against the size and CRC-32 its COMMIT records (checkpoints written
        before checksums existed pass)."""
        try:
            files = json.loads(storage.read_text(storage.join(path, COMMIT))).get("files")
        except (OSError, ValueError):
            files = None
        return integrity.check(path, files) if files else None

    def choose_resume(self) -> tuple[str | None, list[str]]:
        """Collective: the newest committed checkpoint that verifies (rank 0 checks the structure, all
        ranks share the checksums; the directory is shared storage), and why newer ones were skipped."""
        box: list = [list(reversed(self.committed())) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        skipped = []
        for path in box[0]:
            problem = [self.verify(path) if self.rank == 0 else None]
            dist.broadcast_object_list(problem, src=0)
            reason = problem[0] or self.verify_checksums(path)
            if reason is None:
                return path, skipped
            if self.rank == 0:
                log.info("checkpoint %s cannot be loaded: %s; trying an older one", storage.name_of(path), reason)
            skipped.append(reason)
        return None, skipped

    @staticmethod
    def format_of(path) -> str:
        """The state format the engine that saved `path` wrote (from its COMMIT record)."""
        try:
            return json.loads(storage.read_text(storage.join(path, COMMIT))).get("format", "dcp")
        except (OSError, ValueError):
            return "dcp"

    # ---------------------------------------------------------------- saving
    def save(self, step: int, engine, train_state: dict) -> str:
        """Collective: every rank calls it. Returns the step directory (committed unless async).
        Raises SaveFailed (on every rank) when this save or a pending async one failed; KeyboardInterrupt,
        the partial directory removed, when Ctrl-C arrived during it (DCP reports that as a failed write)."""
        self.commit_pending()
        path = self.step_dir(step)
        try:
            return self._save(step, path, engine, train_state)
        except BaseException as exc:
            stopping = interrupts.interrupted() or isinstance(exc, (SystemExit, KeyboardInterrupt))
            if not stopping:
                raise
            self._abandon(path)
            if interrupts.interrupted():
                raise KeyboardInterrupt from None
            raise

    def _save(self, step: int, path: str, engine, train_state: dict) -> str:
        if self.rank == 0 and storage.exists(path):
            storage.rmtree(path)  # a stale save of the same step (e.g. after a crash and resume)
        dist.barrier()
        future, failure = None, None
        try:
            storage.makedirs(path)  # an async writer creates it only in the background
            self._format = engine.checkpoint_format
            future = engine.save(path, self._async_group if self.async_save else None)
            storage.torch_save(rng_state(), storage.join(path, f"rank_{self.rank:05d}.pt"))
            if self.rank == 0:
                storage.torch_save(train_state, storage.join(path, "train_state.pt"))
        except SAVE_ERRORS as exc:
            stop = leaving(exc)
            if stop is not None:  # DCP gathered an exit or an interrupt with the failures: not a storage fault
                raise stop from None
            failure = f"writing {path} ({storage.describe(exc, path)})"
        if interrupts.interrupted():  # Ctrl-C that torch.save's writer swallowed (it runs Python writes from C++)
            raise KeyboardInterrupt
        self._settle(step, path, failure)  # every rank's files are written (or the save is abandoned)
        if future is not None:
            self._pending = (step, path, future, time.perf_counter())
            return path
        self._commit(step, path)
        return path

    def _settle(self, step: int, path: str, failure: str | None, group=None) -> None:
        """Collective: agree whether any rank failed; if so, remove the partial checkpoint and raise."""
        shares: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(shares, failure, group=group)
        failures = [f for f in shares if f]
        if not failures:
            return
        kept = "removed the partial checkpoint"
        if self.rank == 0 and not storage.rmtree(path):
            kept = "the partial checkpoint is removed at the next start"
        newest_text = self.newest or "none"  # known without asking a store that may be gone
        raise SaveFailed(step, f"checkpoint save of step {step} in {self.dir} failed: {failures[0]}; {kept}; "
                               f"newest complete checkpoint: {newest_text}")

    def _commit(self, step: int, path: str, group=None) -> None:
        """Collective: checksum every file (spread over the ranks), then rank 0 writes the marker."""
        files, failure = integrity.record(path, group)
        if failure is None and self.rank == 0:
            try:
                storage.write_text(storage.join(path, COMMIT), json.dumps(
                    {"step": step, "world_size": dist.get_world_size(), "time": time.time(),
                     "format": self._format, "files": files}))
            except Exception as exc:
                failure = f"writing {storage.join(path, COMMIT)} ({storage.describe(exc, path)})"
        self._settle(step, path, failure, group)
        self.newest = path
        if self.rank == 0:
            self._apply_retention()

    @property
    def pending_step(self) -> int | None:
        return self._pending[0] if self._pending else None

    def local_write_done(self) -> bool:
        return self._pending is None or self._pending[2].done()

    def commit_pending(self) -> tuple[int, float] | None:
        """Collective when a save is pending: wait for every rank's writes, then commit.
        Returns (step, seconds from save start to commit) or None; raises SaveFailed."""
        if self._pending is None:
            return None
        step, path, future, t0 = self._pending
        self._pending = None
        try:
            return self._commit_async(step, path, future, t0)
        except BaseException:
            if not interrupts.interrupted():
                raise
            self._abandon(path)
            raise KeyboardInterrupt from None

    def abandon_pending(self) -> None:
        """After Ctrl-C: an async save still being written is not committed; its directory goes."""
        if self._pending is not None:
            path, self._pending = self._pending[1], None
            self._abandon(path)

    def _abandon(self, path: str) -> None:
        """This rank's part of dropping an interrupted save: no collective (the other ranks may be gone), the
        directory removed unless its COMMIT was already written (then it is the newest checkpoint)."""
        try:
            if storage.isfile(storage.join(path, COMMIT)):
                self.newest = path
            elif self.rank == 0:
                storage.rmtree(path)
        except Exception as exc:  # the next start removes what is left (remove_uncommitted)
            log.warning("could not remove the interrupted checkpoint %s: %s", path, exc)

    def _commit_async(self, step: int, path: str, future, t0: float) -> tuple[int, float]:
        failure = None
        try:
            future.result()  # re-raises a failed write
        except SAVE_ERRORS as exc:
            failure = f"writing {path} ({storage.describe(exc, path)})"
        self._settle(step, path, failure, self._async_group)
        self._commit(step, path, self._async_group)
        return step, time.perf_counter() - t0

    def _apply_retention(self) -> None:
        """Rank 0, after a commit: only older committed checkpoints go (never the newest, never one in progress)."""
        if self.keep_last <= 0:
            return
        for old in self.committed()[:-self.keep_last]:
            storage.rmtree(old)

    def load(self, path, engine) -> dict:
        """Collective: restore model and optimizer in place, this rank's RNG; return the train state."""
        saved = self.format_of(path)
        if saved != engine.checkpoint_format:
            raise UserError(f"checkpoint.resume: {path} holds {saved} state, and this run's engine reads "
                            f"{engine.checkpoint_format} (resume with the engine that saved it: "
                            f"engine={'deepspeed' if saved == 'deepspeed' else 'torch'})")
        engine.load(path)
        self.newest = path
        rank_file = storage.join(path, f"rank_{self.rank:05d}.pt")
        if storage.isfile(rank_file):
            set_rng_state(storage.torch_load(rank_file))
        else:
            log.warning("%s has no RNG state for rank %d (saved on a smaller world); keeping fresh RNG",
                        path, self.rank)
        return self.read_train_state(path)

    @staticmethod
    def read_train_state(path) -> dict:
        return storage.torch_load(storage.join(path, "train_state.pt"))
