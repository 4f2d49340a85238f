"""ZeRO stages 2 and 3 and HSDP through FSDP2 (`fully_shard`).

Each repeated block is its own FSDP unit (one all-gather / reduce-scatter per block, so
communication overlaps with the neighbouring block's compute), and the root wraps what is
left (embeddings, final norm, output layer).
  stage 3: reshard_after_forward=True  - parameters are freed after each block's forward
           and gathered again for backward.
  stage 2: reshard_after_forward=False - parameters stay gathered from forward to the end of
           backward; gradients are reduce-scattered; at rest (between steps) parameters are
           sharded, which the ZeRO paper's stage 2 does not do.
HSDP: with parallel.dp_replicate > 1 the mesh is 2-D (replicate, shard): shards within a
group of dp_shard ranks, gradients all-reduced across the dp_replicate groups.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from disttrain.core.dtypes import DTYPES
from disttrain.layout.layout import Layout


def mixed_precision(model: nn.Module, layout: Layout) -> MixedPrecisionPolicy:
    """FSDP's policy, with a dtype the parameters already have left unset: a set parameter dtype makes every
    unit cast its forward inputs (a walk over them per unit and micro-batch) even when nothing changes."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    stored = dtypes.pop() if len(dtypes) == 1 else None
    param, reduce = DTYPES[layout.param_dtype], DTYPES[layout.reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=None if param == stored else param,
                                reduce_dtype=None if reduce == param == stored else reduce)


def apply_fsdp(model: nn.Module, blocks: nn.Module, mesh, layout: Layout, experts=(), meshes=None) -> nn.Module:
    """`experts`: expert-parallel experts modules, sharded first on their own mesh (parallel/expert.py)."""
    mp = mixed_precision(model, layout)
    # Pinned host memory needs an accelerator; on CPU-only machines pinning raises.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if layout.cpu_offload else OffloadPolicy()
    from disttrain.parallel.expert import shard_experts, split_experts_evenly

    ignored = set()  # expert parameters no FSDP unit holds (parallel/expert.py experts_need_fsdp)
    if experts:
        ignored = shard_experts(list(experts), layout, meshes, dict(
            reshard_after_forward=layout.reshard_after_forward, mp_policy=mp, offload_policy=offload))
    extra = {"ignored_params": ignored} if ignored else {}
    extra["shard_placement_fn"] = split_experts_evenly(mesh)
    for block in blocks.children():
        fully_shard(block, mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=mp,
                    offload_policy=offload, **extra)
    # The root's parameters (embeddings, norm, output) are needed first in backward: keep them gathered.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload, **extra)
    return model
