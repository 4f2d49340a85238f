"""AdamW with decay on matrices only, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn


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
