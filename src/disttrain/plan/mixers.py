"""What a layer's token mixer holds when it is not grouped-query softmax attention (its parameters on a
tensor-parallel rank, what it keeps for its backward): DeepSeek's multi-head latent attention, and the Gated
DeltaNet layers of Qwen3-Next and Qwen3.5 beside their (output-gated) full-attention layers. A separate module because each is a family's own list of tensors, counted from
transformers' code as the dry run runs it; plan/activations.py adds them to the block's norms and MLP.

Each function returns (without checkpointing, under selective checkpointing) bytes per layer and micro-batch,
averaged over the model's layer kinds (a pipeline stage's share follows its layer count, not which kinds it
holds). Selective checkpointing keeps what its policy keeps (parallel/activation_checkpoint.py): matmul and
attention-kernel outputs. Head-split tensors divide by tp; the latents stay whole on every tensor-parallel rank.
Pure Python.
"""

from __future__ import annotations

from disttrain.models.shape import ModelShape

FP32 = 4
CHUNK = 64  # transformers' chunked gated delta rule (torch_chunk_gated_delta_rule's chunk_size)


def _latent_norm(ec: int, tokens: int, width: int) -> float:
    """transformers' RMSNorm of a latent: its input upcast to fp32, the reciprocal RMS, the normalised input cast
    back (for the weight's gradient) and the weighted output the next projection keeps."""
    return FP32 * tokens * (width + 1) + 2 * ec * tokens * width


def latent_attention_bytes(shape: ModelShape, micro_batch: int, seq_len: int, tp: int,
                           ec: int) -> tuple[float, float]:
    """Multi-head latent attention: the query latent (`q_a_proj`'s output, its norm, the norm's output `q_b_proj`
    keeps) and the key/value latent (`kv_a_proj_with_mqa`'s, the same), both whole on every tensor-parallel rank;
    the kernel's queries and keys of `qk_nope_head_dim + qk_rope_head_dim` (the rotary products keep only their
    cos and sin tables), its values (a view of `kv_b_proj`'s output, which stays whole), its output of `v_head_dim` and fp32
    log-sum-exp (a flash-style kernel: no probabilities), and the output projection's input, a copy of that output
    in the other layout. Value heads narrower than the query and key heads (DeepSeek's 128 against 192) run CUDA's
    memory-efficient kernel (dryrun/cuda_attention.py), which writes its output as (batch, seq, heads, dim): the
    output projection reads it as it is, no copy. Selective keeps the four projections' outputs and the kernel's
    output and log-sum-exp."""
    mla, tokens, heads = shape.mla, micro_batch * seq_len, shape.n_heads / tp
    lse = FP32 * tokens * heads
    values = mla.qk_nope_head_dim + mla.v_head_dim  # the values are a view of kv_b_proj's output, kept whole
    outputs = 2 if mla.v_head_dim == mla.qk_head_dim else 1  # the kernel's, and o_proj's copy of it
    kernel = ec * tokens * heads * (2 * mla.qk_head_dim + values + outputs * mla.v_head_dim) + lse
    latents = _latent_norm(ec, tokens, mla.kv_lora_rank) + ec * tokens * mla.qk_rope_head_dim  # + cos and sin
    if mla.q_lora_rank:
        latents += _latent_norm(ec, tokens, mla.q_lora_rank)
    kept = ec * tokens * (mla.q_lora_rank + heads * mla.qk_head_dim + mla.kv_lora_rank + mla.qk_rope_head_dim
                          + heads * (mla.qk_nope_head_dim + mla.v_head_dim) + heads * mla.v_head_dim) + lse
    return kernel + latents, kept


def delta_rule_bytes(shape: ModelShape, micro_batch: int, seq_len: int, tp: int) -> tuple[float, float]:
    """(saved, kept under selective checkpointing) of the chunked gated delta rule itself (fp32, chunks of 64
    tokens) over `seq_len` tokens: per token and value head the fp32 queries and keys with their norms and the
    betas, and over the sequence padded to whole chunks 6 key-sized and 3 value-sized tensors (queries and keys
    normalised, scaled, decayed; values, the corrected values), 5 scalars (gates, decays) and 5 chunk-wide rows
    (the pairwise decays, the triangular system, the intra-chunk attention); the recurrent state (key x value)
    once per chunk, which the scan keeps for its backward. Selective keeps the two chunk-wide products, the three
    value-sized products of the scan and its state updates."""
    lin = shape.extras.linear
    tokens, chunks = micro_batch * seq_len, micro_batch * -(-seq_len // CHUNK)
    hv, dk, dv = lin.num_value_heads / tp, lin.key_head_dim, lin.value_head_dim
    states = FP32 * chunks * hv * dk * dv
    saved = (FP32 * tokens * hv * (2 * dk + 3) + FP32 * chunks * CHUNK * hv * (6 * dk + 3 * dv + 5 + 5 * CHUNK)
             + states)
    return saved, FP32 * tokens * hv * (2 * CHUNK + 3 * dv) + states


def delta_net_bytes(shape: ModelShape, micro_batch: int, seq_len: int, tp: int, ec: int,
                    cp: int = 1) -> tuple[float, float]:
    """One Gated DeltaNet layer as transformers' torch implementation runs it, listed tensor by tensor with
    saved-tensor hooks: the causal convolution's input and its padded output (q, k and v channels), the beta
    projection, the chunked delta rule's own tensors (`delta_rule_bytes`), the gated output norm (its fp32 input,
    gate and product, reciprocal RMS, two compute-dtype copies) and the output projection's input. Selective keeps
    the projections' outputs and what the rule keeps. Under context parallelism the rule runs inside the chain
    that passes its state between ranks (parallel/linear_attention.py), whose forward keeps none of its tensors:
    its backward computes them again, one chunk of the chain at a time (plan/mixer_backward.py)."""
    lin = shape.extras.linear
    tokens = micro_batch * seq_len
    hv, hk = lin.num_value_heads / tp, lin.num_key_heads / tp
    dk, dv = lin.key_head_dim, lin.value_head_dim
    conv = 2 * hk * dk + hv * dv
    rule, rule_kept = delta_rule_bytes(shape, micro_batch, seq_len, tp) if cp == 1 else (0.0, 0.0)
    full = (ec * conv * (tokens + micro_batch * (lin.conv_kernel - 1)) + ec * tokens * conv + ec * tokens * hv + rule
            + FP32 * tokens * hv * (3 * dv + 1) + 2 * ec * tokens * hv * dv + ec * tokens * hv * dv)
    kept = ec * tokens * (conv + hv * dv + 2 * hv) + rule_kept
    return full, kept


def gated_attention_bytes(shape: ModelShape, micro_batch: int, seq_len: int, tp: int, ec: int) -> float:
    """Qwen3-Next's output gate on full attention: `q_proj` also gives a per-head gate, kept with its sigmoid
    for the gated product (two query-sized tensors beyond the attention's own)."""
    return 2 * ec * micro_batch * seq_len * shape.n_heads * shape.head_dim / tp


def mixer_params(shape: ModelShape, tp: int = 1, layer: int | None = None) -> int:
    """One layer's attention (or linear-attention) parameters on one tensor-parallel rank, averaged over the layer
    kinds (`layer`'s where its attention has its own shape: Gemma 4's full-attention layers): heads split tp ways,
    but what the runtime keeps whole on every rank (DeepSeek's latent projections and their norms; Gated DeltaNet's
    causal convolution and gated norm, docs/models.md)."""
    if shape.mla is not None:
        mla = shape.mla
        whole = (shape.dim * (mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.q_lora_rank
                 + mla.kv_lora_rank)
        return (shape.attention_params() - whole) // tp + whole
    attention = shape.attention_params(layer) // tp
    lin = shape.extras.linear if shape.extras is not None else None
    if lin is None:
        return attention
    whole = (2 * lin.num_key_heads * lin.key_head_dim + lin.num_value_heads * lin.value_head_dim) * lin.conv_kernel \
        + lin.value_head_dim
    linear = (lin.params(shape.dim) - whole) // tp + whole
    return (attention * (shape.n_layers - lin.layers) + linear * lin.layers) // shape.n_layers


def mixer_bytes(shape: ModelShape, micro_batch: int, seq_len: int, tp: int, ec: int, attention: float,
                cp: int = 1) -> tuple[float, float] | None:
    """(saved, kept under selective checkpointing) of the average layer's mixer, or None for grouped-query
    softmax attention alone (`attention`: what plan/activations.py counts for one such layer; `cp`: the context
    parallel degree, `seq_len` a context rank's tokens)."""
    if shape.mla is not None:
        return latent_attention_bytes(shape, micro_batch, seq_len, tp, ec)
    x = shape.extras
    if x is None or (x.linear is None and not x.attn_output_gate):
        return None
    full_layers = shape.n_layers - shape.linear_layers
    softmax = attention + (gated_attention_bytes(shape, micro_batch, seq_len, tp, ec) if x.attn_output_gate else 0.0)
    full, kept = softmax * full_layers, attention * full_layers
    if x.linear is not None:
        linear, linear_kept = delta_net_bytes(shape, micro_batch, seq_len, tp, ec, cp)
        full, kept = full + linear * x.linear.layers, kept + linear_kept * x.linear.layers
    return full / shape.n_layers, kept / shape.n_layers
