"""What one layer's routing and routed experts keep (plan/moe.py's activation terms, and Gemma 4's MoE branch in
plan/per_layer_inputs.py): a leaf, so that both count the same tensors. Routing is assumed (plan/moe.py's module
doc): `skew` times a balanced share of the rows reaches the busiest expert-parallel rank."""

from __future__ import annotations

from disttrain.layout.layout import Layout
from disttrain.models.shape import ModelShape

FP32, INDEX = 4, 8
ROUTING_SKEW = 1.0  # balanced


def received(layout: Layout, skew: float) -> float:
    """Rows the busiest expert-parallel rank receives per routed row it sends: 1 when balanced, at most ep."""
    return min(max(skew, 1.0), float(layout.ep))


def routed_bytes(shape: ModelShape, layout: Layout, tokens: float, ec: int, er: int,
                 skew: float = ROUTING_SKEW) -> float:
    """What one layer's routing and routed experts keep for the backward, for `tokens` routed to k experts each
    (`moe_layer_bytes` lists them)."""
    moe = shape.moe
    k, h, width, e = moe.num_experts_per_tok, shape.dim, moe.moe_intermediate_size, moe.num_experts
    rows = tokens * k * received(layout, skew)
    routing = (FP32 + INDEX) * tokens * e + (2 * INDEX + ec) * tokens * k + 4 * e / layout.ep  # + int32 offsets
    return routing + ec * rows * (h + 4 * width) + (ec + er) * tokens * k * h


def routed_kept_bytes(shape: ModelShape, layout: Layout, tokens: float, ec: int,
                      skew: float = ROUTING_SKEW) -> float:
    """Of `routed_bytes`, what selective checkpointing keeps: the router's logits, the grouped expert matmuls'
    outputs and, across expert-parallel ranks, the all-to-alls' results (counts, rows received, rows combined)."""
    moe = shape.moe
    k, h, width, e = moe.num_experts_per_tok, shape.dim, moe.moe_intermediate_size, moe.num_experts
    rows = tokens * k * received(layout, skew)
    kept = ec * tokens * e + ec * rows * (2 * width + h)
    if layout.ep > 1:
        kept += INDEX * e + ec * (rows + tokens * k) * h
    return kept


def routed_buffer_bytes(shape: ModelShape, layout: Layout, tokens: float, ec: int, er: int,
                        skew: float = ROUTING_SKEW) -> float:
    """Transient while a routed layer runs: the all-to-all's send and receive buffers and, under autocast over
    fp32 weights, an expert tensor's compute-dtype copy and its gradient cast to fp32."""
    moe = shape.moe
    k, h, width, e = moe.num_experts_per_tok, shape.dim, moe.moe_intermediate_size, moe.num_experts
    buffers = ec * (tokens * k + tokens * k * received(layout, skew)) * h
    return buffers + ((ec + FP32) * e // layout.ep * width * h if ec != er else 0.0)


def skew_change(shape: ModelShape, layout: Layout, tokens: float, ec: int, er: int, skew: float) -> tuple[float, float]:
    """(kept, transient) bytes one routed layer adds under `skew` over balanced routing, for a layer counted at
    balanced routing (Gemma 4's MoE branch, plan/per_layer_inputs.py): its kept rows without checkpointing, its
    matmuls' under selective checkpointing (the rest recomputed in its backward), all of them recomputed under full."""
    if received(layout, skew) == 1.0:
        return 0.0, 0.0
    rows = routed_bytes(shape, layout, tokens, ec, er, skew) - routed_bytes(shape, layout, tokens, ec, er)
    kept = routed_kept_bytes(shape, layout, tokens, ec, skew) - routed_kept_bytes(shape, layout, tokens, ec)
    buffers = routed_buffer_bytes(shape, layout, tokens, ec, er, skew) - \
        routed_buffer_bytes(shape, layout, tokens, ec, er)
    mode = layout.activation_checkpointing
    if mode == "full":
        return 0.0, rows + buffers
    if mode == "selective":
        return kept, rows - kept + buffers
    return rows, buffers
