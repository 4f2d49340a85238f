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


def _ignore_profiler_ranges() -> None:
    """torch 2.13 trap: FSDP2's hooks open profiler ranges (`record_function`, dispatched as profiler ops), and
    an FSDP unit inside a selectively checkpointed block (expert parallelism's experts under ZeRO-2/3) opens
    them a different number of times in the recompute than in the forward; selective checkpointing replays
    ops by their count and fails ("profiler._record_function_enter_new ... not found in storage"). The ranges
    compute nothing, so they join the ops it passes through (`SAC_IGNORED_OPS`, public), as the fix proposed
    to torch does (pytorch/pytorch#185178, reported as torchtitan#3427)."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    profiler = torch.ops.profiler
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(profiler, name, None)
        if packet is not None:
            SAC_IGNORED_OPS.update(getattr(packet, overload) for overload in packet.overloads())


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
        _ignore_profiler_ranges()
        kwargs["context_fn"] = selective_context
    for key, block in list(blocks.named_children()):
        setattr(blocks, key, checkpoint_wrapper(block, **kwargs))
