"""Compose the parallelisms onto a single-device model (or one pipeline stage of it), always in
the same order: (SyncBatchNorm) -> tensor parallel -> activation checkpointing -> compile -> FSDP/DDP.

The pipeline split comes first, in parallel/pipeline.py, which calls `parallelize` per stage.
What each step does is decided by the Layout; which modules it touches, by the ModelSpec.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from disttrain.distributed.mesh import Meshes
from disttrain.layout import Layout
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
from disttrain.parallel.compile import apply_compile


def parallelize(model: nn.Module, spec, layout: Layout, meshes: Meshes, device: torch.device,
                options) -> nn.Module:
    """`options`: the config's `parallel` section (compile, DDP knobs). Returns the module to call
    (a DDP wrapper, or the same module sharded in place)."""
    if spec.sync_batchnorm and layout.dp > 1:
        from disttrain.parallel.sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, meshes.dp.get_group(), device)
    if layout.tp > 1:
        from disttrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, spec, meshes.tp, layout.sequence_parallel)
    blocks = spec.blocks(model)
    apply_activation_checkpointing(blocks, layout.activation_checkpointing)
    if options.compile:
        apply_compile(blocks)
    wrapper = layout.gradient_wrapper
    if wrapper == "fsdp":
        from disttrain.parallel.fsdp import apply_fsdp

        return apply_fsdp(model, blocks, meshes.fsdp(layout), layout)
    if wrapper == "ddp":
        from disttrain.parallel.ddp import apply_ddp

        return apply_ddp(model, meshes.dp.get_group(), device, options)
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
