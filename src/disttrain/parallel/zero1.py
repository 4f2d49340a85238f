"""ZeRO stage 1: DDP for gradients (replicated) + `ZeroRedundancyOptimizer` (optimizer state sharded).

FSDP2 has no mode that shards only the optimizer state (its gradients are always
reduce-scattered), so stage 1 is torch's ZeroRedundancyOptimizer: each data-parallel rank owns
the AdamW state of a subset of parameters, steps them, and broadcasts the updated values.

Expert parallelism (`parallel.ep` > 1): the data-parallel ranks hold different experts, so the expert
shards cannot join the dense parameters' ZeroRedundancyOptimizer (it would broadcast one rank's update of
a parameter that every rank holds differently). They are stepped beside it (`ExpertsBeside`) by a second
ZeroRedundancyOptimizer over the ranks holding the same experts (dp_replicate x efsdp; a plain AdamW where
that is one rank, ep equal to the data-parallel degree): each expert state lives on one rank of its group,
as ZeRO-1 splits every other state. Their gradients are reduced as under DDP (ExpertGradients).

For checkpoints the owned states are exposed under parameter names in the same nested form
`get_state_dict` gives for any other layout (expert states as DTensors, which DCP reshards), so a
stage-1 checkpoint reloads into DDP, FSDP or another world size, and the other way round.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from disttrain.parallel.expert import is_expert_shard
from disttrain.parallel.expert_shards import mine_state, whole_state
from disttrain.parallel.param_names import clean_fqn


class ExpertsBeside(torch.optim.Optimizer):
    """One optimizer to the step, scheduler and scaler: ZeroRedundancyOptimizer over the dense parameters
    and one over this rank's expert shards (an AdamW when no other rank holds them). Its param groups are
    theirs (the same dicts, dense first), so the schedule's learning rate reaches both. torch has no
    optimizer that chains two."""

    def __init__(self, dense: ZeroRedundancyOptimizer, experts: torch.optim.Optimizer):
        self.dense, self.experts = dense, experts
        super().__init__(dense.param_groups + experts.param_groups, dense.defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.dense.step(closure)
        self.experts.step()
        return loss


class LocalShardsZero(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose owner broadcasts each updated parameter's local tensor. Under tensor
    parallelism parameters are DTensors, and torch's broadcast of one has no sharding rule (it raised at the first
    step); the data-parallel group is the ranks of one tensor-parallel coordinate, which hold the same shard, so
    its local tensor is the whole of what to send."""

    def _broadcast_params_from_rank(self, rank: int):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        source = dist.distributed_c10d.get_global_rank(self.process_group, rank)
        return [dist.broadcast((p.to_local() if isinstance(p, DTensor) else p).detach(), src=source,
                               group=self.process_group, async_op=True)
                for group in self._partition_parameters()[rank] for p in group["params"]]


def build_zero1_optimizer(model: nn.Module, optim_cfg, group, expert_group=None,
                          adamw=torch.optim.AdamW) -> torch.optim.Optimizer:
    """`group`: the data-parallel ranks; `expert_group`: the ranks holding the same experts (None: one rank);
    `adamw`: the AdamW class each rank steps its share with (the optimizer's package gives it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _split_states([p for p in params if not is_expert_shard(p)], optim_cfg, group, adamw, two_groups=True)
    experts = [p for p in params if is_expert_shard(p)]
    if not experts:
        return opt
    return ExpertsBeside(opt, _split_states(experts, optim_cfg, expert_group, adamw))


def _split_states(params: list, optim_cfg, group, adamw, two_groups: bool = False) -> torch.optim.Optimizer:
    """AdamW over `params` (matrices decay, vectors do not), its states split over `group` (None: kept).
    `two_groups`: both groups even when one is empty (the dense parameters: checkpoints name two)."""
    kwargs = {"lr": optim_cfg.lr, "betas": tuple(optim_cfg.betas), "eps": optim_cfg.eps}
    matrices, vectors = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    if group is None:
        groups = [{"params": matrices, "weight_decay": optim_cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        return adamw([g for g in groups if g["params"]], **kwargs)
    opt = LocalShardsZero(matrices, optimizer_class=adamw, process_group=group,
                                  weight_decay=optim_cfg.weight_decay, **kwargs)
    if vectors or two_groups:
        opt.add_param_group({"params": vectors, "weight_decay": 0.0})
    return opt


def _parts(opt) -> tuple[ZeroRedundancyOptimizer, torch.optim.Optimizer | None]:
    return (opt.dense, opt.experts) if isinstance(opt, ExpertsBeside) else (opt, None)


def _names(model: nn.Module) -> dict[int, str]:
    """Parameter id -> name as checkpoints spell it (no DDP/compile/checkpoint-wrapper prefixes)."""
    return {id(p): clean_fqn(name) for name, p in model.named_parameters()}


def _group_meta(model: nn.Module, opt, names: dict[int, str]) -> list[dict]:
    """The dense groups' settings over every parameter split as build_optimizer splits them (matrices
    decay, vectors do not), so that the groups name the same parameters in every layout."""
    params = [p for p in model.parameters() if p.requires_grad]
    split = ([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2])
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in ps]}
            for g, ps in zip(_parts(opt)[0].param_groups, split)]


def _local(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states (ZeroRedundancyOptimizer's: those it owns)."""
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def _owned(opt) -> list[tuple[torch.optim.Optimizer, nn.Parameter]]:
    dense, experts = _parts(opt)
    owners = [dense.optim] + ([_local(experts)] if experts is not None else [])
    return [(o, p) for o in owners for g in o.param_groups for p in g["params"]]


def zero1_state_dict(model: nn.Module, opt) -> dict:
    """This rank's owned states keyed by parameter name (each dense name on exactly one rank; each expert
    shard's on one of the ranks holding that shard: the same position in every expert group, so the ep
    shards of one name are all written)."""
    names = _names(model)
    state = {names[id(p)]: _whole(p, dict(o.state[p])) for o, p in _owned(opt) if p in o.state}
    return {"state": state, "param_groups": _group_meta(model, opt, names)}


def _whole(param, entry: dict) -> dict:
    """Expert shards' states as whole DTensors (parallel/expert_shards.py), so DCP reshards them."""
    return whole_state(param, entry) if is_expert_shard(param) else entry


def zero1_load_template(model: nn.Module, opt) -> dict:
    """Tensors to load into: this rank's owned parameters' AdamW state, shaped like the parameters
    (whole DTensors for expert shards: DCP reads this rank's experts from any saved layout)."""
    names = _names(model)
    state = {names[id(p)]: _whole(p, {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p, dtype=getattr(o, "state_dtype", None)),
                                      "exp_avg_sq": torch.zeros_like(p, dtype=getattr(o, "state_dtype", None))})
             for o, p in _owned(opt)}
    return {"state": state, "param_groups": _group_meta(model, opt, names)}


def zero1_load_state_dict(model: nn.Module, opt, loaded: dict) -> None:
    owner = {id(p): o for o, p in _owned(opt)}
    by_name = {clean_fqn(name): p for name, p in model.named_parameters()}
    for name, s in loaded["state"].items():
        p = by_name[name]
        s = mine_state(p, s) if is_expert_shard(p) else s
        owner[id(p)].state[p] = {k: v.clone() for k, v in s.items()}
    dense, experts = _parts(opt)
    for groups in (dense.param_groups, dense.optim.param_groups):
        for group, meta in zip(groups, loaded["param_groups"]):
            group.update({k: v for k, v in meta.items() if k != "params"})
    expert_groups = [] if experts is None else experts.param_groups + (
        _local(experts).param_groups if isinstance(experts, ZeroRedundancyOptimizer) else [])
    for group in expert_groups:  # decay, or none for vectors only (a rank may own no expert of a group)
        if group["params"]:
            meta = loaded["param_groups"][0 if group["params"][0].ndim >= 2 else 1]
            group.update({k: v for k, v in meta.items() if k != "params"})
