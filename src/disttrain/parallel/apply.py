"""Compose the parallelisms onto a single-device model, always in the same order:
pipeline split -> tensor parallel -> activation checkpointing -> compile -> FSDP/DDP.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from disttrain.distributed.dims import Meshes, ParallelDims
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing


def apply_compile(model: nn.Module) -> None:
    """Compile each block separately: repeated blocks share one compiled graph and compile fast."""
    for block in model.layers.values():
        block.compile()


def apply_parallelism(model: nn.Module, cfg, dims: ParallelDims, meshes: Meshes, device: torch.device) -> nn.Module:
    parallel = cfg.parallel
    if dims.tp > 1:
        from disttrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, meshes.world["tp"], parallel.sequence_parallel)
    apply_activation_checkpointing(model, parallel.activation_checkpointing)
    if parallel.compile:
        apply_compile(model)
    if parallel.zero_stage >= 2:
        from disttrain.parallel.fsdp import apply_fsdp, fsdp_mesh

        return apply_fsdp(model, fsdp_mesh(meshes, dims), zero_stage=parallel.zero_stage,
                          param_dtype=cfg.precision.fsdp_param_dtype(device.type), reduce_dtype=cfg.precision.reduce_dtype,
                          cpu_offload=parallel.cpu_offload)
    if dims.dp > 1:
        from disttrain.parallel.ddp import apply_ddp

        return apply_ddp(model, meshes.dp.get_group(), device, parallel)
    return model


@contextlib.contextmanager
def gradient_sync_disabled(model: nn.Module):
    """Accumulate gradients locally (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`)."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
