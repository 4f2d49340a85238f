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
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from disttrain.checkpoint import integrity
from disttrain.errors import UserError

log = logging.getLogger(__name__)

COMMIT = "COMMIT"


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


class CheckpointManager:
    """Synchronous saves commit before returning. Async saves (`async_save=True`) return once the
    state is staged in host memory; `poll_done`/`commit_pending` commit them after every rank's
    writes finished, and a new save first waits for the previous one."""

    def __init__(self, directory: str | Path, rank: int, keep_last: int = 0, async_save: bool = False):
        self.dir = Path(directory)
        self.rank = rank
        self.keep_last = keep_last
        self.async_save = async_save
        # DCP's async writer runs collectives while training runs its own: it needs its own group.
        self._async_group = dist.new_group(backend="gloo") if async_save else None
        self._pending: tuple[int, Path, object, float] | None = None
        self._format = "dcp"

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}"

    @staticmethod
    def step_of(path: Path) -> int:
        return int(path.name.split("_")[1])

    def _candidates(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                      key=self.step_of)

    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        return [p for p in self._candidates() if (p / COMMIT).is_file()]

    def latest(self) -> Path | None:
        done = self.committed()
        return done[-1] if done else None

    def remove_uncommitted(self) -> None:
        """Rank 0: delete directories a crashed save left without COMMIT."""
        if self.rank != 0:
            return
        for path in self._candidates():
            if not (path / COMMIT).is_file():
                log.warning("removing uncommitted checkpoint %s", path)
                shutil.rmtree(path, ignore_errors=True)

    def verify(self, path: Path) -> str | None:
        """Cheap integrity check without touching any model: None if loadable, else what is wrong
        (naming the file). Catches missing or truncated shards and unreadable metadata."""
        try:
            self.read_train_state(path)
        except Exception as exc:  # truncated or foreign pickle: torch raises several types
            return f"{path / 'train_state.pt'} is unreadable ({type(exc).__name__})"
        if self.format_of(path) != "dcp":
            return None
        try:
            metadata = FileSystemReader(str(path)).read_metadata()
        except Exception as exc:
            return f"{path / '.metadata'} is unreadable ({type(exc).__name__})"
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            file = path / name
            if not file.is_file():
                return f"{file} is missing"
            if file.stat().st_size < size:
                return f"{file} is truncated ({file.stat().st_size} of {size} bytes)"
        return None

    def verify_checksums(self, path: Path) -> str | None:
        """Collective: every file against the size and CRC-32 its COMMIT records (checkpoints written
        before checksums existed pass)."""
        try:
            files = json.loads((path / COMMIT).read_text()).get("files")
        except (OSError, ValueError):
            files = None
        return integrity.check(path, files) if files else None

    def choose_resume(self) -> tuple[Path | None, list[str]]:
        """Collective: the newest committed checkpoint that verifies (rank 0 checks the structure, all
        ranks share the checksums; the directory is shared storage), and why newer ones were skipped."""
        box: list = [[str(p) for p in reversed(self.committed())] if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        skipped = []
        for name in box[0]:
            path = Path(name)
            problem = [self.verify(path) if self.rank == 0 else None]
            dist.broadcast_object_list(problem, src=0)
            reason = problem[0] or self.verify_checksums(path)
            if reason is None:
                return path, skipped
            if self.rank == 0:
                log.warning("checkpoint %s cannot be loaded: %s; trying an older one", path.name, reason)
            skipped.append(reason)
        return None, skipped

    @staticmethod
    def format_of(path: Path) -> str:
        """The state format the engine that saved `path` wrote (from its COMMIT record)."""
        try:
            return json.loads((path / COMMIT).read_text()).get("format", "dcp")
        except (OSError, ValueError):
            return "dcp"

    def save(self, step: int, engine, train_state: dict) -> Path:
        """Collective: every rank calls it. Returns the step directory (committed unless async)."""
        self.commit_pending()
        path = self.step_dir(step)
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)  # a stale save of the same step (e.g. after a crash and resume)
        dist.barrier()
        path.mkdir(parents=True, exist_ok=True)  # an async writer creates it only in the background
        self._format = engine.checkpoint_format
        future = engine.save(path, self._async_group if self.async_save else None)
        torch.save(rng_state(), path / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            torch.save(train_state, path / "train_state.pt")
        if future is not None:
            self._pending = (step, path, future, time.perf_counter())
            return path
        dist.barrier()  # every rank's files are on disk before the marker
        self._commit(step, path)
        return path

    def _commit(self, step: int, path: Path, group=None) -> None:
        """Collective: checksum every file (spread over the ranks), then rank 0 writes the marker."""
        files = integrity.record(path, group)
        if self.rank == 0:
            tmp = path / (COMMIT + ".tmp")
            tmp.write_text(json.dumps({"step": step, "world_size": dist.get_world_size(), "time": time.time(),
                                       "format": self._format, "files": files}))
            tmp.replace(path / COMMIT)
            self._apply_retention()

    @property
    def pending_step(self) -> int | None:
        return self._pending[0] if self._pending else None

    def local_write_done(self) -> bool:
        return self._pending is None or self._pending[2].done()

    def commit_pending(self) -> tuple[int, float] | None:
        """Collective when a save is pending: wait for every rank's writes, then commit.
        Returns (step, seconds from save start to commit) or None."""
        if self._pending is None:
            return None
        step, path, future, t0 = self._pending
        self._pending = None
        future.result()  # re-raises a failed write
        dist.barrier(group=self._async_group)
        self._commit(step, path, self._async_group)
        return step, time.perf_counter() - t0

    def _apply_retention(self) -> None:
        if self.keep_last <= 0:
            return
        for old in self.committed()[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, engine) -> dict:
        """Collective: restore model and optimizer in place, this rank's RNG; return the train state."""
        saved = self.format_of(path)
        if saved != engine.checkpoint_format:
            raise UserError(f"checkpoint.resume: {path} holds {saved} state, and this run's engine reads "
                            f"{engine.checkpoint_format} (resume with the engine that saved it: "
                            f"engine={'deepspeed' if saved == 'deepspeed' else 'torch'})")
        engine.load(path)
        rank_file = path / f"rank_{self.rank:05d}.pt"
        if rank_file.is_file():
            set_rng_state(torch.load(rank_file, weights_only=True))
        else:
            log.warning("%s has no RNG state for rank %d (saved on a smaller world); keeping fresh RNG",
                        path, self.rank)
        return self.read_train_state(path)

    @staticmethod
    def read_train_state(path: Path) -> dict:
        return torch.load(path / "train_state.pt", weights_only=True)
