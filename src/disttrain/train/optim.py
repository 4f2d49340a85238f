"""AdamW with decay on matrices only, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from disttrain.core.dtypes import at_least_fp32
from disttrain.parallel.expert_shards import hold_expert_states, shard_of
from disttrain.train.state_dtype import adamw_class


def build_optimizer(model: nn.Module, optim_cfg, replicas=None, shard_states: bool = False) -> torch.optim.Optimizer:
    """optim.name's optimizer over `model`'s trainable parameters. `replicas`: the process group the plain
    parameters are replicated over (DDP's), whose ranks share Muon's work; `shard_states`: ZeRO-1 with Muon
    (each matrix's momentum on its owner only; ZeRO-1 with AdamW is parallel/zero1.py's).

    torch's foreach kernels (AdamW's default on GPUs) refuse a list mixing DTensors and plain tensors, as
    plain expert shards are beside FSDP's or tensor parallel's DTensors: those take the per-tensor loop.
    Expert shards' states show whole in the optimizer's state dicts (parallel/expert_shards.py)."""
    if optim_cfg.name == "muon":
        from disttrain.train.muon import build_muon

        optimizer = build_muon(model, optim_cfg, replicas, shard_states)
        hold_expert_states(optimizer)
        return optimizer
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)  # norms and biases are vectors
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    mixed = len({isinstance(p, DTensor) for p in decay + no_decay}) > 1
    optimizer = adamw_class(optim_cfg)(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                                       **({"foreach": False} if mixed else {}))
    hold_expert_states(optimizer)
    return optimizer


class LRSchedule:
    """Warmup, then `schedule` down to `min_ratio` at `total`; `wsd` holds the peak and decays over the last
    `decay_steps` (or `decay_fraction` of `total`) in `decay_shape`. After a resume that moved `total`
    (train.steps extended or shortened) the decay restarts from the factor reached (`from_factor` at
    `from_step`) and ends at `min_ratio` at the new total, in the same shape: the rate never jumps, and a wsd
    run still in its stable phase decays at the new end. Its attributes are the state LambdaLR saves with a
    checkpoint."""

    def __init__(self, warmup: int, total: int, schedule: str, min_ratio: float, decay_steps: int | None = None,
                 decay_fraction: float = 0.2, decay_shape: str = "linear"):
        self.warmup, self.total, self.schedule, self.min_ratio = warmup, total, schedule, min_ratio
        self.decay_steps, self.decay_fraction, self.decay_shape = decay_steps, decay_fraction, decay_shape
        self.from_step, self.from_factor = warmup, 1.0

    def __call__(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        if self.total <= self.from_step:
            return self.from_factor
        start, shape = self.from_step, self.schedule
        if shape == "wsd":  # (a run resumed inside its decay goes on decaying, to the new end)
            decay = self.decay_steps or round(self.decay_fraction * self.total)
            start = start if self.from_factor < 1.0 else max(start, self.total - decay)
            shape = self.decay_shape
            if step < start:
                return self.from_factor
        progress = min(1.0, (step - start) / max(1, self.total - start))
        if shape == "cosine":
            left = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            left = 1.0 - (math.sqrt(progress) if shape == "sqrt" else progress)
        return self.min_ratio + (self.from_factor - self.min_ratio) * left

    def settings(self) -> tuple:
        wsd = (self.decay_steps, self.decay_fraction, self.decay_shape) if self.schedule == "wsd" else ()
        return self.warmup, self.schedule, self.min_ratio, *wsd

    def like(self, total: int) -> "LRSchedule":
        """A fresh schedule with these settings ending at `total`."""
        return LRSchedule(self.warmup, total, self.schedule, self.min_ratio, self.decay_steps, self.decay_fraction,
                          self.decay_shape)


class RunSchedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR over an LRSchedule that, on loading a checkpoint's state, reconciles it with this run's
    config: the same settings with another `train.steps` continue from the rate reached (LRSchedule);
    changed optim settings (lr, min_lr, warmup, schedule; resumed with run.allow_changes) apply as
    configured from the resume step."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule):
        self.configured = schedule
        super().__init__(optimizer, schedule)
        self.peak_lrs = list(self.base_lrs)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("configured", None)
        state.pop("peak_lrs", None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = {k: v for k, v in state_dict.items() if k not in ("configured", "peak_lrs")}
        saved = (state.pop("lr_lambdas", None) or [None])[0] or {}
        super().load_state_dict({**state, "lr_lambdas": [None] * len(self.lr_lambdas)})
        step, new = self.last_epoch, self.configured
        old = new.like(new.total)
        old.__dict__.update(saved)  # the schedule that saved it (checkpoints before this class: the config's)
        same = old.settings() == new.settings() and list(state.get("base_lrs", self.peak_lrs)) == self.peak_lrs
        fresh = new.like(new.total)
        if same:
            fresh.__dict__.update(old.__dict__)
            if old.total != new.total and step > new.warmup:
                fresh.from_step, fresh.from_factor, fresh.total = step, old(step), new.total
            fresh.total = new.total
        new.__dict__.update(fresh.__dict__)
        self.base_lrs = list(self.peak_lrs)
        self._last_lr = [base * new(step) for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int) -> RunSchedule:
    return RunSchedule(optimizer, LRSchedule(optim_cfg.warmup_steps, total_steps, optim_cfg.schedule,
                                             optim_cfg.min_lr / optim_cfg.lr, getattr(optim_cfg, "decay_steps", None),
                                             getattr(optim_cfg, "decay_fraction", 0.2),
                                             getattr(optim_cfg, "decay_shape", "linear")))


def _grad_groups(params) -> dict:
    """Gradients grouped so that each group is all plain tensors, all DTensors of one mesh, or all expert
    shards of one mesh (foreach kernels and DTensor ops refuse mixtures; placements may differ: one group's
    norm is one all-reduce)."""
    groups: dict = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        shard = shard_of(p)
        if shard is not None:  # this rank's rows of expert tensors split over shard.mesh
            key = ("experts", shard.mesh)
        else:
            key = ("dtensor", id(g.device_mesh)) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(p)
    return groups


def clip_grad_norm_global(params, max_norm: float, pp_group=None, norm_params=None) -> torch.Tensor:
    """Clip by the norm of *all* gradients of the model: over sharded (FSDP), tensor-parallel and
    replicated parameters, and, with `pp_group`, over every pipeline stage. Returns that norm.
    `norm_params`: the parameters the norm counts when some of `params` are copies (tied across stages)."""
    groups = _grad_groups(params)
    squares = []
    for (kind, where), group in (groups if norm_params is None else _grad_groups(norm_params)).items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):  # a norm over shards: reduce to the full tensors' norm
            norm = norm.full_tensor()
        square = at_least_fp32(norm) ** 2  # fp64 runs keep their norm (and so the clip factor) in fp64
        if kind == "experts":  # this rank's experts: the whole tensors' squares are the sum over the ep ranks
            dist.all_reduce(square, group=where.get_group())
        squares.append(square)
    total_sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
