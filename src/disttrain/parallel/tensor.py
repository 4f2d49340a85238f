"""Tensor and sequence parallelism: the model's own plan (from its ModelSpec), applied through
DTensor, plus what every vocabulary-parallel model needs from outside.

The loss then runs on vocabulary-sharded logits under `loss_parallel` (train/loss.py), so full
logits are never gathered in training.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from disttrain.core.errors import UserError


def apply_tensor_parallel(model: nn.Module, spec, tp_mesh, sequence_parallel: bool) -> None:
    if spec.tensor_parallel is None:
        raise UserError(f"parallel.tp={tp_mesh.size()}: model {spec.name} has no tensor-parallel plan "
                        "(allowed for it: parallel.tp=1)")
    from disttrain.models.lora import has_adapters

    if has_adapters(model):  # the plan names nn.Linear layers, which peft wrapped
        from disttrain.parallel.lora_tp import bases_in_place, parallelize_adapters

        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        with bases_in_place(model) as wrappers:
            spec.tensor_parallel(model, tp_mesh, sequence_parallel)
        parallelize_adapters(wrappers, tp_mesh, sequence_parallel)
        for name, param in model.named_parameters():  # SequenceParallel remakes the norms' weights trainable
            if name in frozen:
                param.requires_grad_(False)
    else:
        spec.tensor_parallel(model, tp_mesh, sequence_parallel)
    for module in model.modules():  # vocabulary-parallel embeddings, whatever the model calls them
        if isinstance(module, nn.Embedding) and isinstance(module.weight, DTensor) and module.weight.requires_grad:
            keep_grad_sharded(module.weight)


def keep_grad_sharded(param: nn.Parameter) -> None:
    """DTensor's embedding backward returns a *replicated* (full-size) gradient for a
    vocabulary-sharded table; slice it back to the parameter's placement as it is accumulated,
    so each rank holds 1/tp of it (a local slice, no communication)."""
    def hook(p: torch.Tensor) -> None:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)

    param.register_post_accumulate_grad_hook(hook)
