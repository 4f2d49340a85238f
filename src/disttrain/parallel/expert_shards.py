"""Expert shards held as plain tensors in the step, and seen whole (as DTensors) only where the whole matters.

With expert parallelism each rank holds its experts' rows of every fused expert weight. Held as DTensors,
every use of them in the step goes through DTensor's dispatch: the forward's `to_local` and its backward,
gradient accumulation over micro-batches, each parameter's optimizer update. On CPU that was a tenth of a
`tiny`-sized MoE's step at ep=2 on 2 ranks (benchmarks/moe_vs_handwritten.py). So where no FSDP unit holds
the experts (parallel/expert.py: DDP, ZeRO-1, or a one-rank expert mesh under ZeRO-2/3), they are plain
parameters that carry an `ExpertShard`, their place in the whole tensor, and become DTensors only:
- in state dicts, model and optimizer: post-hooks show each shard whole (a DTensor over the same storage, no
  copy), so that DCP reshards it to any layout and a full state dict gathers it; load pre-hooks take this
  rank's rows back;
- in the global gradient norm (train/optim.py), where each shard's squares are summed over the `ep` ranks.
Experts that FSDP holds stay DTensors: FSDP builds on the `ep` placement.
torch has no parameter that is plain in the step and sharded in its state dict; these hooks are that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True, eq=False)
class ExpertShard:
    """This rank's rows of a whole expert tensor split on dim 0 over `mesh` (the ep mesh)."""

    mesh: DeviceMesh
    shape: torch.Size  # the whole tensor's

    def whole(self, local: torch.Tensor) -> DTensor:
        """`local` (this rank's rows) as the whole tensor, over the same storage."""
        stride = torch.empty(self.shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=self.shape, stride=stride)

    def mine(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `value`: a whole DTensor (from `whole`, or another placement on this mesh), a
        whole plain tensor, or already this rank's rows."""
        if isinstance(value, DTensor):
            if tuple(value.placements) != (Shard(0),):
                value = value.redistribute(self.mesh, [Shard(0)])
            return value.to_local()
        if value.shape != self.shape:
            return value
        rows = self.shape[0] // self.mesh.size()
        return value.narrow(0, self.mesh.get_local_rank() * rows, rows)


def shard_of(param: torch.Tensor) -> ExpertShard | None:
    return getattr(param, "expert_shard", None)


def hold_locally(module: nn.Module) -> None:
    """The experts module's DTensor parameters (split over the ep mesh by apply_expert_parallel) as plain
    parameters over the same storage, each with its ExpertShard, and the state-dict hooks that show them whole."""
    for name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            continue
        local = nn.Parameter(param.detach().to_local(), requires_grad=param.requires_grad)
        local.expert_shard = ExpertShard(param.device_mesh, param.shape)
        local.expert_parallel = True  # each data-parallel rank holds other experts: no replica to compare
        module.register_parameter(name, local)
    module.register_state_dict_post_hook(_whole_in_state_dict)
    module.register_load_state_dict_pre_hook(_mine_from_state_dict)


def _whole_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    for name, param in module._parameters.items():
        shard, key = shard_of(param), prefix + name
        if shard is not None and key in state_dict and not isinstance(state_dict[key], DTensor):
            state_dict[key] = shard.whole(state_dict[key].detach())


def _mine_from_state_dict(module, state_dict, prefix, *args) -> None:
    for name, param in module._parameters.items():
        shard, key = shard_of(param), prefix + name
        if shard is not None and key in state_dict:
            state_dict[key] = shard.mine(state_dict[key])


def whole_state(param: torch.Tensor, entry: dict) -> dict:
    """An optimizer state entry of an expert shard with its parameter-shaped tensors whole (no copies)."""
    shard = shard_of(param)
    return {k: shard.whole(v) if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == param.shape
            else v for k, v in entry.items()}


def mine_state(param: torch.Tensor, entry: dict) -> dict:
    shard = shard_of(param)
    return {k: shard.mine(v) if isinstance(v, DTensor) or (isinstance(v, torch.Tensor) and v.shape == shard.shape)
            else v for k, v in entry.items()}


def hold_expert_states(optimizer: torch.optim.Optimizer) -> None:
    """Show `optimizer`'s expert-shard states whole in its state dicts (nothing to do without shards)."""
    if any(shard_of(p) is not None for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(lambda opt, state_dict: _map_states(opt, state_dict, whole_state))
        optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: _map_states(opt, state_dict, mine_state))


def _map_states(optimizer, state_dict: dict, convert) -> dict:
    """`state_dict` with `convert(param, entry)` applied to each expert shard's state entry. The saved groups
    list their keys (indices, or names under DCP) in the order of the optimizer's groups."""
    state = dict(state_dict["state"])
    for saved, group in zip(state_dict["param_groups"], optimizer.param_groups):
        for key, param in zip(saved["params"], group["params"]):
            if shard_of(param) is not None and key in state:
                state[key] = convert(param, state[key])
    return {**state_dict, "state": state}
