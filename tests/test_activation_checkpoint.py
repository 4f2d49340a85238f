"""What selective activation checkpointing recomputes, counted with torch's FlopCounterMode on one block.

Recomputed FLOPs = the backward's FLOPs with the block checkpointed minus its backward's FLOPs without
checkpointing. The difference is exact: the gradient ops are the same in both, and under selective
checkpointing an op whose output the policy kept is answered from the cache without being dispatched, so
only ops that really run again are counted. FlopCounterMode counts matmul-like ops (mm, bmm, attention and,
here, the grouped expert GEMM and the CPU attention kernel, which torch 2.13 has no formula for); element-wise
work counts zero, which is what selective checkpointing is meant to redo.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from disttrain.models.llama.model import Transformer, rotary_tables
from disttrain.models.llama.shapes import MODEL_SHAPES
from disttrain.parallel import activation_checkpoint as ac

aten = torch.ops.aten


def grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2·M·K·N over every group: (M, K) rows split by offsets against (E, K, N) weights, or two 2-D operands whose
    shared dimension is split (the weights' gradient, (E, K, N) out)."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    raise NotImplementedError(f"grouped_mm {a_shape} x {b_shape}")


def cpu_attention_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def cpu_attention_backward_flop(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


FORMULAS = {aten._grouped_mm: grouped_mm_flop,
            aten._scaled_dot_product_flash_attention_for_cpu: cpu_attention_flop,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_attention_backward_flop}


def build_block(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Layer 1 of the named model (an MoE layer on `debug-moe`), in fp32, and the whole model."""
    shape = MODEL_SHAPES[name]
    torch.manual_seed(0)
    if shape.moe is not None:
        import disttrain.models.moe as moe_family
        model = moe_family.moe_spec(shape).build()
    else:
        model = Transformer(shape)
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    return model.layers["1"], model


def block_flops(name: str, mode: str, batch: int = 2, seq: int = 64) -> tuple[int, int, dict]:
    """(forward FLOPs, backward FLOPs, backward FLOPs by op) of one block run under `mode`."""
    block, _ = build_block(name)
    shape = MODEL_SHAPES[name]
    cos, sin = rotary_tables(shape.head_dim, shape.max_seq_len, shape.rope_theta)
    torch.manual_seed(1)
    x = torch.randn(batch, seq, shape.dim, requires_grad=True)
    grad = torch.randn(batch, seq, shape.dim)
    kwargs = {"use_reentrant": False, "preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = ac.selective_context
    forward, backward = FlopCounterMode(display=False, custom_mapping=FORMULAS), \
        FlopCounterMode(display=False, custom_mapping=FORMULAS)
    with forward:
        y = block(x, cos, sin) if mode == "none" else checkpoint(block, x, cos, sin, **kwargs)
    with backward:
        y.backward(grad)
    by_op = {str(op): n for op, n in backward.get_flop_counts()["Global"].items()}
    return forward.get_total_flops(), backward.get_total_flops(), by_op


def recomputed_share(name: str, mode: str) -> float:
    forward, plain, _ = block_flops(name, "none")
    _, checkpointed, _ = block_flops(name, mode)
    return (checkpointed - plain) / forward


@pytest.mark.parametrize("name", ["tiny", "debug-moe"])
def test_selective_recomputes_at_most_five_percent_of_a_blocks_forward(name):
    """The policy keeps every matmul, attention and expert GEMM output: what backward redoes is element-wise."""
    forward, plain, by_op = block_flops(name, "none")
    assert forward > 0 and plain > forward  # the formulas see the block's matmuls and attention
    assert any("attention" in op for op in by_op)
    if MODEL_SHAPES[name].moe is not None:
        assert "aten._grouped_mm" in by_op
    # Full recomputation redoes the forward (all but the last projection, whose output backward never reads:
    # non-reentrant checkpointing stops early): the counting sees recomputation.
    assert recomputed_share(name, "full") > 0.5
    assert recomputed_share(name, "selective") <= 0.05
