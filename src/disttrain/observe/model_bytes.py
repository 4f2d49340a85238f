"""Bytes this rank actually holds for model states: parameters, gradients, optimizer states.

Sharded tensors (DTensor) count their local shard only; ZeroRedundancyOptimizer counts the
states this rank owns. These are the quantities the ZeRO formulas predict.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded) tensor this rank stores."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = local_shard(t)
    return t.numel() * t.element_size()


def iter_tensors(tree):
    """Every tensor in nested dicts, lists and tuples (state dicts, optimizer states), and in
    objects that wrap one as `.val` (selective activation checkpointing's cache entries)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from iter_tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from iter_tensors(value)
    elif hasattr(tree, "val"):
        yield from iter_tensors(tree.val)


def optimizer_states(optimizer: torch.optim.Optimizer) -> dict:
    """Parameter -> this rank's state (ZeRO-1 with expert parallelism: the dense and the expert states it
    owns, parallel/zero1.py)."""
    from disttrain.parallel.zero1 import ExpertsBeside

    if isinstance(optimizer, ExpertsBeside):
        return {**optimizer_states(optimizer.dense), **optimizer_states(optimizer.experts)}
    return (optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer).state


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    params = list(model.parameters())
    out = {"params": sum(local_bytes(p) for p in params), "grads": sum(local_bytes(p.grad) for p in params)}
    if optimizer is not None:
        out["optimizer"] = sum(local_bytes(v) for s in optimizer_states(optimizer).values()
                               for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    return out


def unsharded_grads(model: nn.Module):
    """The unsharded gradients FSDP2 holds between micro-batches while gradient sync is off
    (`set_requires_gradient_sync(False)`): in `reduce_dtype` when it differs from the parameters'
    dtype, else the unsharded parameters' own `.grad`. Reads FSDP2's per-parameter state (private)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None:
                grad = getattr(fsdp_param, "_unsharded_param", None)
                grad = grad.grad if grad is not None else None
            if grad is not None:
                yield grad


def unsharded_grad_bytes(model: nn.Module) -> int:
    return sum(local_bytes(g) for g in unsharded_grads(model))


def memory_stats(device: torch.device) -> dict[str, int]:
    """This rank's memory now: CUDA allocated / reserved / peak allocated, or the process's resident
    set size on CPU (from /proc; peak RSS is `mem_peak_bytes`)."""
    if device.type == "cuda":
        return {"mem_allocated_bytes": int(torch.cuda.memory_allocated(device)),
                "mem_reserved_bytes": int(torch.cuda.memory_reserved(device)),
                "mem_rank_peak_bytes": int(torch.cuda.max_memory_allocated(device))}
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        return {"mem_rss_bytes": pages * os.sysconf("SC_PAGE_SIZE")}
    except (OSError, ValueError, IndexError):
        return {}
