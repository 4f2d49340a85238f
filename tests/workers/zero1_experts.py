"""ZeRO-1 with expert parallelism on the launch's ranks (tests/test_moe.py): where the optimizer states live.
Parity with one process cannot tell split states from replicated ones; this looks at them."""

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from disttrain.observe.model_bytes import local_bytes, model_state_bytes
from disttrain.parallel.zero1 import ExpertsBeside, build_zero1_optimizer, zero1_state_dict


def check() -> None:
    """Experts split over every rank (ep = the data-parallel degree): each dense parameter's state on exactly
    one rank, each rank's expert shard's state on that rank; the bytes metric counts both."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    experts = nn.Parameter(distribute_tensor(torch.randn(2 * world, 4, 8), mesh, [Shard(0)]))
    experts.expert_parallel = True
    model.register_parameter("experts", experts)
    cfg = SimpleNamespace(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = build_zero1_optimizer(model, cfg, dist.group.WORLD)
    assert isinstance(opt, ExpertsBeside)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = experts.to_local().clone()
    opt.step()
    assert not torch.equal(experts.to_local(), before)
    mine = sorted(zero1_state_dict(model, opt)["state"])
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    assert all("experts" in names for names in everyone), everyone
    dense = sorted(n for names in everyone for n in names if n != "experts")
    assert dense == sorted(n for n, _ in model.named_parameters() if n != "experts"), everyone
    owned = sum(2 * local_bytes(p) for n, p in model.named_parameters() if n in mine)  # exp_avg, exp_avg_sq
    assert model_state_bytes(model, opt)["optimizer"] == owned
