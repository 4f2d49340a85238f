"""Data parallel with torch's DistributedDataParallel, configured from `parallel.ddp_*` keys."""

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP


def _bf16_allreduce_hook(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bf16-compressed all-reduce for any backend (torch's own bf16 hook refuses non-NCCL groups)."""
    # No `from __future__ import annotations` here: DDP inspects these annotations at registration.
    world = dist.get_world_size(group)
    compressed = bucket.buffer().to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        out = bucket.buffer()
        out.copy_(f.value()[0])
        return out

    return fut.then(decompress)


def register_comm_hook(model: DDP, hook: str, group, powersgd_rank: int = 1, powersgd_start_iter: int = 2):
    if hook == "none":
        return
    if hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        if dist.get_backend(group) == "nccl":
            model.register_comm_hook(group, default_hooks.bf16_compress_hook)
        else:
            model.register_comm_hook(group, _bf16_allreduce_hook)
    elif hook == "powersgd":
        # `batched_powerSGD_hook` asserts in torch 2.13; the per-tensor hook works on every backend.
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=powersgd_start_iter)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"unknown DDP communication hook {hook!r}")


def _buffer_sync_kwargs(sync: bool) -> dict:
    """torch 2.13 renamed `broadcast_buffers` to `forward_sync_buffers`; 2.11 knows only the old name."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}


def apply_ddp(model: nn.Module, group, device: torch.device, parallel) -> DDP:
    ddp = DDP(
        model,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=parallel.ddp_bucket_cap_mb,
        **_buffer_sync_kwargs(parallel.ddp_broadcast_buffers),
        find_unused_parameters=parallel.ddp_find_unused_parameters,
        static_graph=parallel.ddp_static_graph,
        gradient_as_bucket_view=parallel.ddp_gradient_as_bucket_view,
    )
    register_comm_hook(ddp, parallel.ddp_comm_hook, group, parallel.powersgd_rank, parallel.powersgd_start_iter)
    return ddp
