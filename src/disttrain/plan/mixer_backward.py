"""What a latent-attention or Gated DeltaNet layer holds at the fullest moment of its own backward, beyond the
tensors it saved (or recomputed): the moment a block's peak falls at when its token mixer, not its MLP, is the
widest part (DeepSeek-V3's heads, Qwen3-Next's and Qwen3.5's chunked delta rule). plan/mixers.py counts what
these layers keep; plan/activations.py adds this moment to a layer's transient beyond what its MLP's backward frees
first, as it does for context parallelism's temporaries. Listed with a live-tensor tracker on transformers' layers
and checked against the dry run of tiny models (tests/test_plan_published.py). Pure Python.
"""

from __future__ import annotations

from disttrain.layout.layout import Layout
from disttrain.models.shape import ModelShape
from disttrain.plan.mixers import CHUNK, FP32, delta_net_bytes, delta_rule_bytes, gated_attention_bytes


def latent_attention_backward_bytes(shape: ModelShape, micro_batch: int, seq_len: int, tp: int, ec: int) -> float:
    """The flash kernel's backward: the gradients of its queries, keys (`qk_head_dim` a head) and values
    (`v_head_dim`) at once, beside the gradient of its output, while the output projection's input is freed."""
    mla = shape.mla
    return ec * micro_batch * seq_len * shape.n_heads / tp * (2 * mla.qk_head_dim + mla.v_head_dim)


def delta_net_backward_bytes(shape: ModelShape, micro_batch: int, seq_len: int, tp: int, ec: int,
                             cp: int = 1) -> float:
    """The chunked delta rule's scan, run backward chunk by chunk: each chunk's slice of the queries, keys, decayed
    keys (key-sized), corrected values (value-sized) and intra-chunk attention (chunk-wide) gets a gradient as large
    as the whole tensor (torch's `select_backward`), accumulated over the chunks; at the fullest moment the five
    gradients, a new slice's and their sum for the chunk-wide one, and the core output's gradient (value-sized; all
    fp32 over the sequence padded to whole chunks), while the gated output norm's tensors and the output projection's
    input are freed (their backward has run).

    Under context parallelism (`cp` > 1, `seq_len` a rank's tokens) the chain's backward (parallel/
    linear_attention.py) computes the rule again for each of the rank's two chunks, one after the other, and takes
    its gradients there: the scan's gradients and the rule's own tensors (plan/mixers.py `delta_rule_bytes`) span
    one chunk, beside the gradients of the rule's inputs the chain fills in for the rank's tokens (queries, keys,
    values and betas in the compute dtype, the fp32 gates), those the chunk before it gave (the chunk's), and the
    gradient of the chain's output it holds throughout (the rank's, compute dtype)."""
    lin = shape.extras.linear
    tokens = micro_batch * seq_len
    scan = seq_len if cp == 1 else seq_len // 2
    padded = micro_batch * -(-scan // CHUNK) * CHUNK
    hv, hk, dk, dv = lin.num_value_heads / tp, lin.num_key_heads / tp, lin.key_head_dim, lin.value_head_dim
    gradients = FP32 * padded * hv * (3 * CHUNK + 3 * dk + 2 * dv)
    freed = FP32 * tokens * hv * (3 * dv + 1) + 2 * ec * tokens * hv * dv
    if cp == 1:
        return gradients - freed
    inputs = ec * (2 * hk * dk + hv * dv + hv) + FP32 * hv  # a token's query, key, value, beta and gate
    rule, _ = delta_rule_bytes(shape, micro_batch, scan, tp)
    return gradients + rule + inputs * (tokens + micro_batch * scan) + ec * tokens * hv * dv - freed


def mixer_backward_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout, ec: int,
                         er: int) -> float:
    """The most one of the model's token-mixer kinds holds at its backward's fullest moment beyond what plan/mixers.py
    gives the average layer (per micro-batch, `seq_len` this rank's tokens): its held gradients, the gradient
    arriving at the block (residual dtype), and under full checkpointing what its recomputation exceeds the average
    layer's by (the peak falls at the layer of the widest kind, not at an average one). 0 for models without these
    mixers. Not added under selective checkpointing: there the dry run of a tiny Qwen3.5 holds less than the planner
    keeps (the cached chunk products in the compute dtype), the two within 2% of its peak; this term on top put the
    planner 18% over."""
    mode, tp = layout.activation_checkpointing, layout.tp
    if mode == "selective":
        return 0.0
    arriving = er * micro_batch * seq_len * shape.dim / (tp if layout.sequence_parallel else 1)
    if shape.mla is not None:
        return arriving + latent_attention_backward_bytes(shape, micro_batch, seq_len, tp, ec)
    x = shape.extras
    if x is None or x.linear is None:
        return 0.0
    linear, _ = delta_net_bytes(shape, micro_batch, seq_len, tp, ec, layout.cp)
    held = delta_net_backward_bytes(shape, micro_batch, seq_len, tp, ec, layout.cp)
    if mode != "full":
        return arriving + held
    # grouped-query attention's queries, keys, values, output and log-sum-exp (flash), and its output gate
    tokens, q, kv = micro_batch * seq_len, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    softmax = ec * tokens * (2 * q + 2 * kv) / tp + FP32 * tokens * shape.n_heads / tp
    softmax += gated_attention_bytes(shape, micro_batch, seq_len, tp, ec) if x.attn_output_gate else 0.0
    n, k = shape.n_layers, x.linear.layers
    average = (softmax * (n - k) + linear * k) / n
    return arriving + max(linear - average + held, softmax - average)
