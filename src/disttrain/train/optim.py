"""AdamW with decay on matrices only, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from disttrain.dtypes import at_least_fp32


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)  # norms and biases are vectors
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for 0-based optimizer step `step`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int):
    fn = partial(lr_factor, warmup=optim_cfg.warmup_steps, total=total_steps, schedule=optim_cfg.schedule,
                 min_ratio=optim_cfg.min_lr / optim_cfg.lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def _grad_groups(params) -> dict:
    """Gradients grouped so that each group is all plain tensors or all DTensors of one mesh (foreach
    kernels and DTensor ops refuse mixtures; placements may differ: one group's norm is one all-reduce)."""
    groups: dict = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = ("dtensor", id(g.device_mesh)) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(p)
    return groups


def clip_grad_norm_global(params, max_norm: float, pp_group=None, norm_params=None) -> torch.Tensor:
    """Clip by the norm of *all* gradients of the model: over sharded (FSDP), tensor-parallel and
    replicated parameters, and, with `pp_group`, over every pipeline stage. Returns that norm.
    `norm_params`: the parameters the norm counts when some of `params` are copies (tied across stages)."""
    params = list(params)
    groups = _grad_groups(params)
    squares = []
    for group in _grad_groups(params if norm_params is None else list(norm_params)).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):  # a norm over shards: reduce to the full tensors' norm
            norm = norm.full_tensor()
        squares.append(at_least_fp32(norm) ** 2)  # fp64 runs keep their norm (and so the clip factor) in fp64
    total_sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
