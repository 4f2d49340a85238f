"""Process-group start-up: backend and device choice, timeouts, and a uniform single-process path.

A single process still gets a (one-rank, in-memory) process group, so the trainer, DeviceMesh
and DCP code paths are the same for 1 and N processes.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from disttrain.distributed.env import DistEnv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    env: DistEnv
    device: torch.device
    backend: str

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def pick_device(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _job_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The job's key-value store, with keys private to this restart attempt.

    Under torchrun the agent may host one store for the whole job and keep it across restarts; without a
    per-attempt prefix, a restarted worker can read the previous attempt's gloo addresses and fail with
    "connectFullMesh ... Connection refused" (seen with torch 2.13 when the lowest rank died first). The
    restart count is per agent, so this needs every agent to have restarted alike (one node). Multi-node
    launches by disttrain turn the shared store off (launch/self_launch.py): each rendezvous round then publishes a fresh
    store that rank 0 hosts, and nodes that restarted a different number of times (a replacement, a node
    rejoining) still agree on the keys.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                          is_master=not agent_hosts and env.rank == 0, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_hosts else "fresh"
    return dist.PrefixStore(f"disttrain/attempt_{attempt}", store)


def init_distributed(env: DistEnv, backend: str = "auto", timeout_s: float = 600.0) -> Runtime:
    device = pick_device(env)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise RuntimeError("distributed.backend=nccl needs CUDA devices; none are visible")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if env.launcher == "single":
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, store=_job_store(env, timeout), rank=env.rank,
                                    world_size=env.world_size, timeout=timeout, **kwargs)
    log.info("rank %d/%d on %s (%s, launcher %s)", env.rank, env.world_size, device, backend, env.launcher)
    return Runtime(env=env, device=device, backend=backend)


def shutdown() -> None:
    # DDP reducers kept alive by reference cycles abort the process if they outlive the group.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
