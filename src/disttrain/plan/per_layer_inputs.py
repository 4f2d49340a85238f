"""Gemma 4's terms (transformers `gemma4_text`): the parameters of its per-layer inputs, what one of its layers keeps
for the backward, and what its pipeline stages pass on besides the hidden states.

A Gemma 4 layer differs from the Llama-style block the rest of the planner counts: five RMSNorms on the hidden
size and per-head norms of queries, keys and values, each run by transformers in fp32 (the input upcast, the
normalised tensor kept in fp32 for its scale's product, two fp32 statistics a row); a per-layer input (a gate, a
GELU, a product with the layer's slice of the per-layer inputs, a projection back and a norm); the last
`num_kv_shared_layers` layers reuse the keys and values an earlier layer of their kind stored, with no key and
value projections or norms of their own. The pipeline split (models/hf/stages.py) sends the per-layer inputs of
the layers still to come and the stored keys and values a later stage reuses. Listed tensor by tensor with
saved-tensor hooks on transformers' layers and checked against the dry run (tests/test_plan_published.py). Under
activation checkpointing, what crosses each layer's checkpoint and what its backward holds: plan/per_layer_recompute.py.
"""

from __future__ import annotations

from disttrain.layout.layout import Layout
from disttrain.layout.splits import split_layers
from disttrain.models.shape import ModelShape
from disttrain.plan.dtypes import autocast, dtype_bytes
from disttrain.plan.routed import routed_bytes

FP32 = 4


def has_per_layer_inputs(shape: ModelShape) -> bool:
    return shape.extras is not None and shape.extras.per_layer_input > 0


def counts_layers(shape: ModelShape, layout: Layout) -> bool:
    """Whether the layers are counted tensor by tensor (here and in plan/per_layer_recompute.py): Gemma 4's, in every
    checkpointing mode and context-parallel method (plan/context.py adds all-gather's and Ulysses' extras)."""
    return has_per_layer_inputs(shape)


def _kinds(shape: ModelShape) -> list[str]:
    return list(shape.extras.layer_types) or ["full_attention"] * shape.n_layers


def shares_kv(shape: ModelShape, layer: int) -> bool:
    """Whether `layer` reuses an earlier layer's keys and values (the model's last `kv_shared_layers`)."""
    return shape.extras is not None and layer >= shape.n_layers - shape.extras.kv_shared_layers


def root_params(shape: ModelShape, first: bool) -> int:
    """The first stage's per-layer input modules: the embedding table, the projection of the embedded tokens
    onto every layer's input, and its norm."""
    if not first or not has_per_layer_inputs(shape):
        return 0
    w, n = shape.extras.per_layer_input, shape.n_layers
    return shape.extras.per_layer_vocab * n * w + shape.dim * n * w + w


def layer_params_change(shape: ModelShape, layer: int, tp: int = 1) -> int:
    """What `layer` holds beyond the planner's Llama-style block with its family's norms: the per-layer input's gate,
    projection and norm (whole on every tensor-parallel rank), less the key and value projections and key norm
    of a layer that reuses another's."""
    x = shape.extras
    if x is None:
        return 0
    extra = 2 * shape.dim * x.per_layer_input + shape.dim if x.per_layer_input else 0
    if shares_kv(shape, layer):
        s, kvs = shape.at_layer(layer), shape.key_value_projections(layer)
        kv = s.n_kv_heads * s.head_dim
        extra -= kvs * shape.dim * kv // tp + (kvs * kv // tp if shape.qkv_bias else 0) + \
            (s.head_dim if x.qk_norm else 0)
    return extra


def _stage_bounds(shape: ModelShape, layout: Layout, stage: int) -> tuple[int, int]:
    counts = split_layers(shape.n_layers, layout.n_stages)
    start = sum(counts[:stage])
    return start, start + counts[stage]


def carried_bytes(shape: ModelShape, layout: Layout, stage: int) -> float:
    """One micro-batch of what `stage` sends the next one besides its hidden states (the residual dtype, as the
    schedule's buffers): the per-layer inputs of the layers from the next stage's first on, and the keys and values
    of each kind stored on this stage or before and reused after it. 0 for the last stage and other families."""
    if not has_per_layer_inputs(shape) and not (shape.extras and shape.extras.kv_shared_layers):
        return 0.0
    if stage >= layout.n_stages - 1:
        return 0.0
    _, er = dtype_bytes(layout)
    tokens = layout.micro_batch * (layout.seq_len // layout.cp)
    _, end = _stage_bounds(shape, layout, stage)
    elements = (shape.n_layers - end) * shape.extras.per_layer_input
    kinds, first_shared = _kinds(shape), shape.n_layers - shape.extras.kv_shared_layers
    if shape.extras.kv_shared_layers:
        for kind in set(kinds):
            store = max((i for i in range(first_shared) if kinds[i] == kind), default=None)
            reuse = max((i for i in range(first_shared, shape.n_layers) if kinds[i] == kind), default=-1)
            if store is not None and store < end <= reuse:
                s = shape.at_layer(store)
                elements += 2 * s.n_kv_heads // layout.tp * s.head_dim
    return er * tokens * elements


def _norm(tokens: float, width: float, rows: float, scaled: bool = True) -> float:
    """transformers' Gemma RMSNorm: the fp32 input (the input itself, or its upcast copy), two fp32 statistics a
    row (the mean square and its power) and, with a scale, the fp32 normalised tensor its product keeps."""
    return tokens * (FP32 * width * (2 if scaled else 1) + 2 * FP32 * rows)


def layer_saved_bytes(shape: ModelShape, layer: int, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """What one Gemma 4 layer keeps for its backward without checkpointing, its input included (one micro-batch).
    Under autocast each projection keeps its own compute-dtype copy of its input (the fp32 norm outputs and
    residual); SDPA keeps q, k, v, its output and the log-sum-exp, and on a sliding-window layer its own copy of the
    mask in the compute dtype with k and v repeated to every query head (an explicit mask, no grouped kernel); under
    context parallelism the ring keeps q, k, v, its output and log-sum-exp on every layer (no mask, k and v as they
    are). A full-attention layer's own head size and key-value heads (Gemma 4's `per_layer_config`) are its."""
    projections = shape.key_value_projections(layer)
    shape = shape.at_layer(layer)
    ec, er = dtype_bytes(layout)
    t, tokens = layout.tp, micro_batch * seq_len
    r = t if layout.sequence_parallel else 1
    h, f, w = shape.dim, shape.ffn_hidden_dim / t, shape.extras.per_layer_input
    heads, kv_heads = shape.n_heads // t, shape.n_kv_heads // t
    q, kv = heads * shape.head_dim, kv_heads * shape.head_dim
    cast = autocast(layout)
    shared = shares_kv(shape, layer)
    sliding = _kinds(shape)[layer] == "sliding_attention" and layout.cp == 1
    # five norms on the hidden size (the layer's input is the first one's); the projections' inputs
    saved = 5 * _norm(tokens / r, h, 1)
    inputs = (1 if shared else 1 + projections) if cast else 1  # q (k, v) from the input norm
    inputs += 2 if cast else 1  # gate and up from the norm before the MLP
    saved += ec * tokens * h * (inputs + 1)  # + the per-layer gate's input
    # per-head norms: queries; keys and values (no scale) where the layer makes its own
    saved += _norm(tokens, q, heads) + (0 if shared else _norm(tokens, kv, kv_heads) + _norm(tokens, kv, kv_heads, False))
    # attention: q, output, the log-sum-exp; k and v repeated on a sliding layer, which keeps its mask too; a layer
    # reusing another's keys and values keeps that layer's (or the received ones) unless autocast casts them
    saved += ec * tokens * 2 * q + FP32 * tokens * heads
    if sliding:
        saved += ec * tokens * 2 * q + ec * micro_batch * seq_len * seq_len
    elif cast or not shared:
        saved += ec * tokens * 2 * kv
    # MLP: the gate's output, its GELU's, the up projection's, the down projection's input
    saved += 4 * ec * tokens * f
    # per-layer input: the gate's output, its GELU's, the projection's input
    saved += 3 * ec * tokens * w
    return saved + moe_branch_bytes(shape, layout, tokens)


def has_moe_branch(shape: ModelShape) -> bool:
    return shape.moe is not None and shape.extras is not None and shape.extras.dense_mlp_beside_experts


def moe_branch_bytes(shape: ModelShape, layout: Layout, tokens: float) -> float:
    """What Gemma 4's MoE branch (`enable_moe_block`, beside the dense MLP) keeps without checkpointing: three more
    norms on the hidden size (after the MLP, before and after the experts); the router's norm without a scale, its
    output (kept by the product with the router's scale) and the projection's input (that product scaled, or its
    compute-dtype copy under autocast); the routing and routed experts as plan/moe.py counts them. Two of these
    norms read the residual, an fp32 input they keep as it is where the residual is fp32 (counted with it)."""
    if not has_moe_branch(shape):
        return 0.0
    ec, er = dtype_bytes(layout)
    h = shape.dim
    router = _norm(tokens, h, 1, False) + (er + ec) * tokens * h
    shared_input = 2 * FP32 * tokens * h if er == FP32 else 0.0
    return 3 * _norm(tokens, h, 1) + router - shared_input + routed_bytes(shape, layout, tokens, ec, er)


def stage_once_bytes(shape: ModelShape, layout: Layout, stage: int, micro_batch: int, seq_len: int) -> float:
    """What a stage's layers share, kept once a micro-batch: the per-layer inputs from its first layer on, whose
    slices the layers keep; the rotary tables of each attention kind (cos and sin, the residual dtype); the boolean
    sliding-window mask transformers makes for SDPA (none under context parallelism); on the first stage the
    per-layer inputs' projection input and its norm over every layer's slice."""
    ec, er = dtype_bytes(layout)
    tokens, w = micro_batch * seq_len, shape.extras.per_layer_input
    start, end = _stage_bounds(shape, layout, stage)
    head_dims = {_kinds(shape)[i]: shape.at_layer(i).head_dim for i in range(start, end)}  # each kind's tables
    kinds = set(head_dims)
    once = er * tokens * (shape.n_layers - start) * w + 2 * er * seq_len * sum(head_dims.values())
    if "sliding_attention" in kinds and layout.cp == 1:
        once += micro_batch * seq_len * seq_len
    if stage == 0:
        once += ec * tokens * shape.dim + _norm(tokens, shape.n_layers * w, shape.n_layers)
    return once
