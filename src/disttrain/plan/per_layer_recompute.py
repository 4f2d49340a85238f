"""Gemma 4's layers (transformers `gemma4_text`) under activation checkpointing and context parallelism: what each
layer keeps from its forward to its backward, and what one layer's backward holds at its fullest moment.

What crosses a layer's checkpoint: its input (the residual dtype); under selective checkpointing also every matmul's
output and the attention kernel's output and log-sum-exp (parallel/activation_checkpoint.py); and, for a layer that
stores keys and values a later layer reuses, those keys and values, which transformers keeps in a dictionary
outside the layers until the step's backward is done. The per-layer inputs, their projection's norm, the rotary
tables and the sliding-window mask are made outside the layers and kept whatever the checkpointing
(per_layer_inputs.stage_once_bytes).

A layer's backward starts by recomputing it (non-reentrant checkpointing): its saved tensors as without
checkpointing (per_layer_inputs.layer_saved_bytes), less what selective checkpointing kept, at the first op of its
backward (the last norm's): the gradient arriving and five fp32 hidden-size temporaries of transformers' RMSNorm
backward, the norm's normalised tensor freed by then. Three things come on top there. The gradient of the per-layer
inputs, made whole by the stage's last layer's backward. The gradients of the stored keys and values, made by the
layers reusing them and held until the storing layer's attention backward. And a storing layer's recomputation
writes its keys and values into transformers' dictionary again: those new tensors keep the recomputation's graph
of them alive (its input norm, the key and value norms, the keys and values themselves) until the step's backward
ends, so every layer before a storing one holds them. Under context parallelism the ring
(parallel/ring_attention.py) takes sliding windows by its blocks: a sliding layer keeps q, k, v, its output and
log-sum-exp as a global one does, with no mask and no keys and values repeated to every query head; all-gather and
Ulysses keep that and their own extras (plan/context.py), which checkpointing remakes with the layer's other
recomputed tensors, held from its backward's first op.

Found on the tiny family config (tests/hf_models.py) with the dry run's memory tracker: the live tensors at its peak,
labelled by the op and the layer that made them (tests/test_plan_gemma4.py).
"""

from __future__ import annotations

from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.models.shape import ModelShape
from disttrain.plan.dtypes import autocast, dtype_bytes
from disttrain.plan.routed import routed_kept_bytes
from disttrain.plan.per_layer_inputs import (FP32, _kinds, _norm, _stage_bounds, has_moe_branch, layer_saved_bytes,
                                             moe_branch_bytes, shares_kv, stage_once_bytes)


def _sizes(shape: ModelShape, layout: Layout, micro_batch: int, seq_len: int):
    t = layout.tp
    tokens = micro_batch * seq_len
    heads, kv_heads = shape.n_heads // t, shape.n_kv_heads // t
    return tokens, heads, kv_heads, heads * shape.head_dim, kv_heads * shape.head_dim, shape.ffn_hidden_dim / t


def reuses(shape: ModelShape) -> dict[int, int]:
    """Each layer storing keys and values for later ones -> the last layer reusing them (per attention kind)."""
    x = shape.extras
    if x is None or not x.kv_shared_layers:
        return {}
    kinds, first = _kinds(shape), shape.n_layers - x.kv_shared_layers
    out = {}
    for kind in set(kinds):
        store = max((i for i in range(first) if kinds[i] == kind), default=None)
        last = max((i for i in range(first, shape.n_layers) if kinds[i] == kind), default=None)
        if store is not None and last is not None:
            out[store] = last
    return out


def _ring(layout: Layout) -> bool:
    return layout.cp > 1 and layout.cp_method == "ring"


def _sliding_mask(shape: ModelShape, layer: int, layout: Layout) -> bool:
    """SDPA on a sliding layer: an explicit mask and keys and values repeated (the ring has neither)."""
    return _kinds(shape)[layer] == "sliding_attention" and layout.cp == 1


def kept_bytes(shape: ModelShape, layer: int, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """What `layer` keeps from its forward to its backward (one micro-batch) in the layout's checkpointing mode."""
    mode = layout.activation_checkpointing
    if mode == "none":
        return layer_saved_bytes(shape, layer, micro_batch, seq_len, layout)
    shape = shape.at_layer(layer)  # a full-attention layer's own head size and key-value heads
    ec, er = dtype_bytes(layout)
    tokens, heads, _, q, kv, f = _sizes(shape, layout, micro_batch, seq_len)
    h, w = shape.dim, shape.extras.per_layer_input
    r = layout.tp if layout.sequence_parallel else 1
    kept = er * tokens * h / r + (2 * ec * tokens * kv if layer in reuses(shape) else 0.0)
    if mode == "selective":  # the matmuls' outputs: q (k, v), o; gate, up, down; the per-layer gate and projection
        kept += ec * tokens * (q + (0 if shares_kv(shape, layer) else 2 * kv) + 3 * h + 2 * f + w)
        if not _ring(layout):  # SDPA's output and log-sum-exp (the ring's blocks: plan/context.py)
            kept += ec * tokens * q + FP32 * tokens * heads
        kept += _branch_kept_bytes(shape, layout, tokens)
    return kept


def _branch_kept_bytes(shape: ModelShape, layout: Layout, tokens: float) -> float:
    """What selective checkpointing keeps of Gemma 4's MoE branch: the router's and the experts' matmul outputs."""
    if not has_moe_branch(shape):
        return 0.0
    return routed_kept_bytes(shape, layout, tokens, dtype_bytes(layout)[0])


def _recomputed_bytes(shape: ModelShape, layer: int, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """What `layer`'s recomputation holds beyond its kept tensors once it is done: its saved tensors, less the input
    (when the norm's fp32 copy is the input itself) and what selective checkpointing kept and recomputation only
    reads, with the kept matmul outputs no backward reads freed. A storing layer's new keys and values take the
    place of its first ones (they are among the saved tensors but on an SDPA sliding layer, which saves them
    repeated)."""
    ec, er = dtype_bytes(layout)
    tokens, heads, _, q, kv, f = _sizes(shape, layout, micro_batch, seq_len)
    h, w = shape.dim, shape.extras.per_layer_input
    held = layer_saved_bytes(shape, layer, micro_batch, seq_len, layout)
    shape = shape.at_layer(layer)
    held -= FP32 * tokens * h if er == FP32 else 0.0
    if layer in reuses(shape) and not _sliding_mask(shape, layer, layout):
        held -= 2 * ec * tokens * kv
    if layout.activation_checkpointing == "selective":
        held -= ec * tokens * (2 * f + w) + (0.0 if _ring(layout) else ec * tokens * q + FP32 * tokens * heads)
        held -= ec * tokens * (q + (0 if shares_kv(shape, layer) else 2 * kv) + 3 * h)
        held -= _branch_kept_bytes(shape, layout, tokens)
    return held


def _stored_graph_bytes(shape: ModelShape, layer: int, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """A storing layer's recomputed keys and values with what their graph keeps: the input norm (and its output,
    one cast copy per projection under autocast), the key norm, the value norm (no scale), keys and values."""
    ec, _ = dtype_bytes(layout)
    copies = shape.key_value_projections(layer) if autocast(layout) else 1
    shape = shape.at_layer(layer)
    tokens, _, kv_heads, _, kv, _ = _sizes(shape, layout, micro_batch, seq_len)
    return (_norm(tokens, shape.dim, 1) + ec * tokens * shape.dim * copies + _norm(tokens, kv, kv_heads)
            + _norm(tokens, kv, kv_heads, False) + 2 * ec * tokens * kv)


def _backward_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """The first op of a layer's backward, its last norm's: the gradient arriving and transformers' RMSNorm backward
    in fp32 (five hidden-size temporaries, the normalised tensor freed); or the MLP's, its two FFN-sized gradients,
    where those are more."""
    ec, er = dtype_bytes(layout)
    tokens, *_, f = _sizes(shape, layout, micro_batch, seq_len)
    return er * tokens * shape.dim + max(4 * FP32 * tokens * shape.dim, 2 * ec * tokens * f)


def after_attention_bytes(shape: ModelShape, layout: Layout, micro_batch: int, seq_len: int) -> float:
    """A recomputed layer's tensors after its attention, which its backward frees before the attention's (and its
    recomputation has not made yet while the attention's forward runs again): four norms on the hidden size, the
    MLP's input copies and its tensors, the per-layer input's."""
    ec, _ = dtype_bytes(layout)
    tokens, *_, f = _sizes(shape, layout, micro_batch, seq_len)
    h, w = shape.dim, shape.extras.per_layer_input
    copies = 2 if autocast(layout) else 1
    return 4 * _norm(tokens, h, 1) + ec * tokens * (h * (copies + 1) + 4 * f + 3 * w) + \
        moe_branch_bytes(shape, layout, tokens)


def finished_layer_bytes(shape: ModelShape, layout: Layout, accumulating: bool) -> float:
    """What a layer's finished backward releases of the model states the planner counts at the first layer's: ZeRO-2's
    gathered parameters (resharded after the backward) and, accumulating over micro-batches, the unsharded gradients
    (their sharded share made in their place)."""
    if layout.zero_stage < 2 or layout.engine != "torch":
        return 0.0
    from disttrain.plan.params import layer_params

    unit = layer_params(shape, layout.tp)
    gathered = DTYPE_BYTES[layout.param_dtype] * unit if not layout.reshard_after_forward else 0.0
    grads = DTYPE_BYTES[layout.reduce_dtype] * unit if accumulating else 0.0
    return gathered + grads - FP32 * unit / layout.shard_ranks


def stage_transient_bytes(shape: ModelShape, layout: Layout, stage: int, micro_batch: int, seq_len: int,
                          finished: float = 0.0) -> float:
    """The most one layer's backward of `stage` holds beyond every layer's kept tensors (one micro-batch): its
    recomputation and backward, the per-layer inputs' gradient, the stored keys' and values' gradients waiting for
    their layer, and the recomputed stored ones of the layers after it, less the kept tensors of those layers,
    whose backward is done, and what each of them released of the model states (`finished`). The layers before a
    storing one hold the most activations, the last layer (the first backward) the most model states."""
    ec, er = dtype_bytes(layout)
    tokens = micro_batch * seq_len
    start, end = _stage_bounds(shape, layout, stage)
    stores = reuses(shape)
    ple = er * tokens * (shape.n_layers - start) * shape.extras.per_layer_input
    extra = _backward_bytes(shape, micro_batch, seq_len, layout)
    graph = {s: _stored_graph_bytes(shape, s, micro_batch, seq_len, layout) for s in stores}
    kv = {s: _sizes(shape.at_layer(s), layout, micro_batch, seq_len)[4] for s in stores}  # each store's keys' width
    worst, later = 0.0, 0.0
    for i in reversed(range(start, end)):
        pending = sum(2 * ec * tokens * kv[s] for s, last in stores.items() if s <= i < last)
        left = sum(graph[s] for s in stores if i < s < end)
        held = _recomputed_bytes(shape, i, micro_batch, seq_len, layout) + extra + ple + pending + left - later
        worst = max(worst, held)
        later += kept_bytes(shape, i, micro_batch, seq_len, layout) + finished
    return worst


def layer_transient_bytes(shape: ModelShape, layout: Layout, micro_batch: int, seq_len: int,
                          accumulating: bool = False) -> float:
    """Under checkpointing, the fullest layer backward of any stage (0 without: the planner's block terms)."""
    if layout.activation_checkpointing == "none":
        return 0.0
    finished = finished_layer_bytes(shape, layout, accumulating)
    return max(stage_transient_bytes(shape, layout, stage, micro_batch, seq_len, finished)
               for stage in range(layout.n_stages))


def stage_saved_bytes(shape: ModelShape, layout: Layout, pp_rank: int) -> float:
    """One micro-batch's kept tensors of every Gemma 4 layer this pipeline rank holds, with what each stage's layers
    share."""
    mb, s = layout.micro_batch, layout.seq_len // layout.cp
    total = 0.0
    for stage in layout.owned_stages(pp_rank):
        start, end = _stage_bounds(shape, layout, stage)
        total += sum(kept_bytes(shape, i, mb, s, layout) for i in range(start, end))
        total += stage_once_bytes(shape, layout, stage, mb, s)
    return total


def average_layer_bytes(shape: ModelShape, layout: Layout, micro_batch: int, seq_len: int) -> float:
    """The model's average layer, what the planner's per-layer terms scale by."""
    return sum(kept_bytes(shape, i, micro_batch, seq_len, layout) for i in range(shape.n_layers)) / shape.n_layers

