"""ZeRO stages 2 and 3 and HSDP through FSDP2 (`fully_shard`).

Each transformer block is its own FSDP unit (one all-gather / reduce-scatter per block, so
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

from disttrain.train.precision import DTYPES


def fsdp_mesh(meshes, dims):
    """1-D over dp_shard for plain sharding, 2-D (dp_replicate, dp_shard) for HSDP."""
    if dims.dp_replicate > 1:
        return meshes.world["dp_replicate", "dp_shard"]
    return meshes.world["dp_shard"]


def apply_fsdp(model: nn.Module, mesh, *, zero_stage: int, param_dtype: str, reduce_dtype: str,
               cpu_offload: bool) -> nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    # Pinned host memory needs an accelerator; on CPU-only machines pinning raises.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    reshard = zero_stage == 3
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    # The root's parameters (embeddings, norm, output) are needed first in backward: keep them gathered.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    return model
