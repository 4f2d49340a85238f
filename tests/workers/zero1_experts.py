"""ZeRO-1 with expert parallelism on the launch's ranks (tests/test_moe.py): where the optimizer states live.
Parity with one process cannot tell split states from replicated ones; this looks at them."""

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from disttrain.observe.model_bytes import local_bytes, model_state_bytes
from disttrain.parallel.expert_shards import hold_locally
from disttrain.parallel.zero1 import ExpertsBeside, build_zero1_optimizer, zero1_state_dict


def check() -> None:
    """Experts split over every rank (ep = the data-parallel degree), held as plain shards that state dicts
    show whole: each dense parameter's state on exactly one rank, each rank's expert shard's state on that
    rank; the bytes metric counts both."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    whole = torch.randn(2 * world, 4, 8)
    holder = nn.Module()
    holder.register_parameter("w", nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)])))
    hold_locally(holder)  # as parallel/expert.py leaves experts no FSDP unit holds
    model.add_module("experts", holder)
    experts = holder.w
    # plain in the step, whole in state dicts: gathered, and loaded back as this rank's rows
    rank = dist.get_rank()
    assert not isinstance(experts, DTensor) and torch.equal(experts, whole[2 * rank:2 * rank + 2])
    full = StateDictOptions(full_state_dict=True)
    assert torch.equal(get_model_state_dict(model, options=full)["experts.w"], whole)
    set_model_state_dict(model, {**get_model_state_dict(model, options=full), "experts.w": 2 * whole}, options=full)
    assert torch.equal(experts, 2 * whole[2 * rank:2 * rank + 2])
    cfg = SimpleNamespace(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = build_zero1_optimizer(model, cfg, dist.group.WORLD)
    assert isinstance(opt, ExpertsBeside)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = experts.detach().clone()
    opt.step()
    assert not torch.equal(experts, before)
    mine = sorted(zero1_state_dict(model, opt)["state"])
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    assert all("experts.w" in names for names in everyone), everyone
    assert isinstance(zero1_state_dict(model, opt)["state"]["experts.w"]["exp_avg"], DTensor)  # whole, for DCP
    dense = sorted(n for names in everyone for n in names if n != "experts.w")
    assert dense == sorted(n for n, _ in model.named_parameters() if n != "experts.w"), everyone
    owned = sum(2 * local_bytes(p) for n, p in model.named_parameters() if n in mine)  # exp_avg, exp_avg_sq
    assert model_state_bytes(model, opt)["optimizer"] == owned
