"""Per-block activation checkpointing (non-reentrant).

full:      keep only each block's input; recompute the whole block in backward.
selective: keep what is dear to redo or must not be redone, recompute the rest in backward:
           - the outputs of matrix multiplies (mm, addmm, bmm, the experts' grouped GEMM, scaled matmuls) and
             of attention kernels: the block's FLOPs;
           - the results of functional all-to-alls (the experts' dispatch and combine, Ulysses' exchanges) and
             what waits on them: a collective redone in backward costs a network round trip on every rank;
           - random ops (dropout): without a saved RNG state a rerun would draw other numbers.
           Element-wise ops (norms, SiLU, the SwiGLU product, rotary embeddings, residual adds, the router's
           softmax and sort) and data movement (the dispatch's gathers and scatters) are recomputed.
           tests/test_activation_checkpoint.py counts what backward redoes with FlopCounterMode.
"""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _overloads(namespace, names: tuple[str, ...]) -> set:
    """Every overload of the named ops this torch build has (kernels differ by device and version)."""
    ops = set()
    for name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return ops


_SAVE = _overloads(torch.ops.aten, (
    "mm", "addmm", "bmm", "baddbmm", "linear", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math",
    "_flash_attention_forward", "_efficient_attention_forward"))
# Collectives whose results are kept; all-gathers are recomputed (the gathered K/V is cp times a shard).
_SAVED_COLLECTIVES = _overloads(torch.ops._c10d_functional, ("all_to_all_single",))
_FUNCTIONAL_COLLECTIVES = "_c10d_functional"


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


def _policy():
    """A policy for one checkpointed call. A functional collective is waited on (`wait_tensor`, autograd's
    wrapper) after it is issued: those follow-up ops are kept exactly when the collective's result was, so
    that the recomputation neither waits on work it never issued nor leaves issued work unwaited. Kept
    results live in the checkpoint's cache until backward, so their storages identify them meanwhile (an
    empty one, or a wrapper subclass without storage, is identified by the object itself, held here). Random
    ops are kept only where they make a new tensor: a cached in-place op would leave the recomputation's buffer
    unwritten."""
    kept: set[int] = set()
    held: list[torch.Tensor] = []

    def key(t: torch.Tensor) -> int:
        try:
            return t.untyped_storage().data_ptr() or id(t)
        except RuntimeError:  # a wrapper without storage (AsyncCollectiveTensor): the object, held
            return id(t)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _SAVE or (torch.Tag.nondeterministic_seeded in op.tags and not op._schema.is_mutable):
            return CheckpointPolicy.MUST_SAVE
        follows = op.namespace == _FUNCTIONAL_COLLECTIVES and any(
            isinstance(a, torch.Tensor) and key(a) in kept for a in args)
        if op in _SAVED_COLLECTIVES or follows:
            if isinstance(ctx.op_output, torch.Tensor):
                kept.add(key(ctx.op_output))
                if key(ctx.op_output) == id(ctx.op_output):
                    held.append(ctx.op_output)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context():
    return create_selective_checkpoint_contexts(_policy())


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
