"""ZeRO stage 1: DDP for gradients (replicated) + `ZeroRedundancyOptimizer` (optimizer state sharded).

FSDP2 has no mode that shards only the optimizer state (its gradients are always
reduce-scattered), so stage 1 is torch's ZeroRedundancyOptimizer: each data-parallel rank owns
the AdamW state of a subset of parameters, steps them, and broadcasts the updated values.

For checkpoints the owned states are exposed under parameter names in the same nested form
`get_state_dict` gives for any other layout, so a stage-1 checkpoint reloads into DDP, FSDP or
another world size, and the other way round.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from disttrain.parallel.names import clean_fqn


def build_zero1_optimizer(model: nn.Module, optim_cfg, group) -> ZeroRedundancyOptimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    opt = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, process_group=group,
                                  lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                                  weight_decay=optim_cfg.weight_decay)
    opt.add_param_group({"params": no_decay, "weight_decay": 0.0})
    return opt


def _names(model: nn.Module) -> dict[int, str]:
    """Parameter id -> name as checkpoints spell it (no DDP/compile/checkpoint-wrapper prefixes)."""
    return {id(p): clean_fqn(name) for name, p in model.named_parameters()}


def _group_meta(opt: ZeroRedundancyOptimizer, names: dict[int, str]) -> list[dict]:
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in opt.param_groups]


def zero1_state_dict(model: nn.Module, opt: ZeroRedundancyOptimizer) -> dict:
    """This rank's owned states keyed by parameter name (each name on exactly one rank)."""
    names = _names(model)
    state = {names[id(p)]: dict(s) for p, s in opt.optim.state.items()}
    return {"state": state, "param_groups": _group_meta(opt, names)}


def zero1_load_template(model: nn.Module, opt: ZeroRedundancyOptimizer) -> dict:
    """Tensors to load into: this rank's owned parameters' AdamW state, shaped like the parameters."""
    names = _names(model)
    state = {}
    for group in opt.optim.param_groups:
        for p in group["params"]:
            state[names[id(p)]] = {"step": torch.zeros((), dtype=torch.float32),
                                   "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return {"state": state, "param_groups": _group_meta(opt, names)}


def zero1_load_state_dict(model: nn.Module, opt: ZeroRedundancyOptimizer, loaded: dict) -> None:
    by_name = {clean_fqn(name): p for name, p in model.named_parameters()}
    for name, s in loaded["state"].items():
        opt.optim.state[by_name[name]] = {k: v.clone() for k, v in s.items()}
    for groups in (opt.param_groups, opt.optim.param_groups):
        for group, meta in zip(groups, loaded["param_groups"]):
            group.update({k: v for k, v in meta.items() if k != "params"})
