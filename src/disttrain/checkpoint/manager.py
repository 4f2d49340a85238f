"""Sharded checkpoints with torch.distributed.checkpoint (DCP), made visible by a COMMIT marker.

Layout of one checkpoint:
    step_00000100/
        *.distcp, .metadata     model + optimizer, sharded by DCP (reloadable on another layout)
        train_state.pt          step, tokens, LR schedule, grad scaler, loader position, config fingerprint
        rank_00000.pt ...       each rank's RNG states
        COMMIT                  written last by rank 0, after every rank finished writing
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from disttrain.parallel import zero1
from disttrain.train import deepspeed_engine

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
    def __init__(self, directory: str | Path, rank: int, keep_last: int = 0):
        self.dir = Path(directory)
        self.rank = rank
        self.keep_last = keep_last

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

    def save(self, step: int, model, optimizer, train_state: dict) -> Path:
        """Collective: every rank calls it. Returns the committed directory."""
        path = self.step_dir(step)
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)  # a stale save of the same step (e.g. after a crash and resume)
        dist.barrier()
        if deepspeed_engine.is_engine(model):
            deepspeed_engine.save(model, path)
        else:
            if isinstance(optimizer, ZeroRedundancyOptimizer):  # each rank contributes the states it owns
                model_sd, optim_sd = get_model_state_dict(model), zero1.zero1_state_dict(model, optimizer)
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        torch.save(rng_state(), path / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            torch.save(train_state, path / "train_state.pt")
        dist.barrier()  # every rank's files are on disk before the marker
        if self.rank == 0:
            tmp = path / (COMMIT + ".tmp")
            tmp.write_text(json.dumps({"step": step, "world_size": dist.get_world_size(), "time": time.time()}))
            tmp.replace(path / COMMIT)
            self._apply_retention()
        return path

    def _apply_retention(self) -> None:
        if self.keep_last <= 0:
            return
        for old in self.committed()[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model, optimizer) -> dict:
        """Collective: restore model and optimizer in place, this rank's RNG; return the train state."""
        if deepspeed_engine.is_engine(model):
            if not (path / deepspeed_engine.TAG).is_dir():
                raise RuntimeError(f"{path} was not written by engine=deepspeed; DeepSpeed resumes only its own checkpoints")
            deepspeed_engine.load(model, path)
        elif (path / deepspeed_engine.TAG).is_dir():
            raise RuntimeError(f"{path} was written by engine=deepspeed; resume it with engine=deepspeed")
        elif isinstance(optimizer, ZeroRedundancyOptimizer):
            state = {"model": get_model_state_dict(model), "optim": zero1.zero1_load_template(model, optimizer)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"])
            zero1.zero1_load_state_dict(model, optimizer, state["optim"])
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rank_file = path / f"rank_{self.rank:05d}.pt"
        if rank_file.is_file():
            set_rng_state(torch.load(rank_file, weights_only=True))
        else:
            log.warning("%s has no RNG state for rank %d (saved on a smaller world); keeping fresh RNG",
                        path, self.rank)
        return torch.load(path / "train_state.pt", weights_only=True)
