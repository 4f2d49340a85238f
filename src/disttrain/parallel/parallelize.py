"""Compose the parallelisms onto a single-device model (or one pipeline stage of it), always in
the same order: (float8 layers) -> (SyncBatchNorm) -> tensor parallel -> expert parallel -> context parallel ->
activation checkpointing -> compile -> FSDP/DDP (the experts' own FSDP units first).

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
from disttrain.layout.layout import Layout
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
from disttrain.parallel.compile import apply_compile


def parallelize(model: nn.Module, spec, layout: Layout, meshes: Meshes, device: torch.device,
                options, document_eos: int | None = None, frozen: bool = False) -> nn.Module:
    """`options`: the config's `parallel` section (compile, DDP knobs); `document_eos`: the end token under
    document masking (None: off); `frozen`: a model that only runs forward (a reference model): no DDP wrapper.
    Returns the module to call (a DDP wrapper, or the same module sharded in place)."""
    if layout.float8 != "off":
        from disttrain.parallel.float8 import apply_float8

        apply_float8(model, spec, device)
    if spec.sync_batchnorm and layout.dp > 1:
        from disttrain.parallel.sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, meshes.dp.get_group(), device)
    if layout.tp > 1:
        from disttrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, spec, meshes.tp, layout.sequence_parallel)
    experts = []
    if spec.moe_layers is not None:
        from disttrain.parallel.expert import apply_expert_parallel

        experts = apply_expert_parallel(model, spec, layout, meshes)
    if layout.cp > 1:
        from disttrain.parallel.context import apply_context_parallel

        apply_context_parallel(model, spec, meshes.cp, layout.cp_method, layout.seq_len, document_eos)
    blocks = spec.blocks(model)
    apply_activation_checkpointing(blocks, layout.activation_checkpointing)
    if options.compile:
        apply_compile(blocks)
    wrapper = layout.gradient_wrapper
    if wrapper == "fsdp":
        from disttrain.parallel.fsdp import apply_fsdp

        return apply_fsdp(model, blocks, meshes.fsdp(layout), layout, experts, meshes)
    if experts:  # no FSDP unit holds them: plain shards (parallel/expert_shards.py)
        from disttrain.parallel.expert_shards import hold_locally

        for module in experts:
            hold_locally(module)
    if wrapper == "ddp" and not frozen:
        from disttrain.parallel.ddp import apply_ddp

        if experts:  # reduced by parallel/expert.py's ExpertGradients, over the ranks holding the same experts
            from disttrain.parallel.expert import expert_parameter_names

            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))
        return apply_ddp(model, meshes.dp_cp.get_group(), device, options)
    return model


@contextlib.contextmanager
def gradient_sync_disabled(model: nn.Module, keep_gathered: bool = False):
    """Accumulate gradients locally (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`).
    `keep_gathered`: FSDP2 also keeps parameters gathered after backward, so the next micro-batch
    issues no all-gather (uneven shares: ranks run different numbers of micro-batches)."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        if keep_gathered:
            model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            if keep_gathered:
                model.set_reshard_after_backward(True)
    else:
        yield


def gather(model: nn.Module) -> None:
    """All-gather every FSDP2 unit's parameters now (all units at once), so the forward passes that
    follow issue no collective."""
    handles = [m.unshard(async_op=True) for m in model.modules() if isinstance(m, FSDPModule)]
    for handle in handles:
        if handle is not None:
            handle.wait()


def reshard(model: nn.Module) -> None:
    """Free FSDP2's gathered parameters (after forward-only passes that kept them gathered)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
