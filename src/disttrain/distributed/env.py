"""Where this process sits: torchrun's variables, SLURM's (srun without torchrun), or one process. A Ray Train
worker is told by its launcher (launch/ray_worker.py builds its DistEnv from Ray's context)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # "torchrun", "slurm", "ray" or "single"
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def is_distributed(self) -> bool:
        return self.launcher != "single"


def under_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "WORLD_SIZE" in environ)


def detect_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    if under_torchrun(environ):
        world = int(environ["WORLD_SIZE"])
        return DistEnv(rank=int(environ["RANK"]), world_size=world,
                       local_rank=int(environ.get("LOCAL_RANK", 0)),
                       local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)), launcher="torchrun",
                       master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(environ.get("MASTER_PORT", 29500)))
    # SLURM_STEP_NUM_TASKS is set inside an `srun` step only, not in the batch script itself.
    if "SLURM_STEP_NUM_TASKS" in environ and "SLURM_PROCID" in environ:
        world = int(environ["SLURM_STEP_NUM_TASKS"])
        local_world = int(environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0])
        job = int(environ.get("SLURM_JOB_ID", "0"))
        return DistEnv(rank=int(environ["SLURM_PROCID"]), world_size=world,
                       local_rank=int(environ.get("SLURM_LOCALID", 0)), local_world_size=local_world,
                       launcher="slurm",
                       master_addr=environ.get("MASTER_ADDR") or environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"),
                       master_port=int(environ.get("MASTER_PORT") or 20000 + job % 20000))
    return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")


def device_type() -> str:
    """"cuda" where CUDA devices are visible, else "cpu": the kind of rank this machine runs."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
