"""Per-block activation checkpointing (non-reentrant).

full:      keep only each block's input; recompute the whole block in backward.
selective: keep the outputs of matrix multiplies and attention (expensive to redo, and what
           backward needs most), recompute the cheap element-wise ops (norms, SiLU, the
           SwiGLU product, rotary embeddings, residual adds) in backward.
"""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _SAVE.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_activation_checkpointing(blocks: nn.Module, mode: str) -> None:
    """Wrap each block of the container (ModuleDict or ModuleList) in place; parameter names gain a
    wrapper prefix that DCP's state-dict helpers strip."""
    if mode == "none":
        return
    kwargs = {"preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_context
    for key, block in list(blocks.named_children()):
        setattr(blocks, key, checkpoint_wrapper(block, **kwargs))
