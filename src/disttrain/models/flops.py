"""FLOP counts: the PaLM per-token formula for this framework's models, and the published
per-iteration formulas (Megatron-LM 2021, Korthikanti et al. 2022) they are checked against.

Conventions (see docs/planning.md):
- Model FLOPs count one forward (2 per multiply-add) and a backward of twice that, so 6 per
  matmul parameter per token, plus attention scores and their weighted sum: 12·L·H·Q·T per token
  (PaLM appendix B), counted over the full T×T matrix even though causal masking makes half of
  it zero; flash kernels skip the masked blocks, so real work is lower and MFU keeps PaLM's
  convention, as published MFU figures do.
- Recomputation is not model FLOPs: it shows in hardware FLOPs (HFU) only.
- The input embedding is a lookup, not a matmul; the output projection is a matmul (a tied
  embedding counts once, as the output layer).
- A mixture of experts counts its active parameters: the router, the shared experts and the top-k routed
  experts a token runs through (`ModelShape.num_params(active=True)`), as DeepSeek-V3 and Qwen3 report them.
"""

from __future__ import annotations

from disttrain.models.shape import ModelShape


def matmul_params(shape: ModelShape) -> int:
    """N in 6N: parameters that take part in a matmul per token (norm weights included; negligible); of a
    mixture of experts, the active ones."""
    output = shape.vocab_size * shape.dim if shape.tie_embeddings else 0
    return shape.num_params(include_embedding=False, active=True) + output


def block_params(shape: ModelShape) -> int:
    if shape.moe is not None or shape.mla is not None or shape.extras is not None:  # the blocks' active parameters
        return matmul_params(shape) - shape.vocab_size * shape.dim - shape.dim
    kv_dim = shape.n_kv_heads * shape.head_dim
    per_layer = 2 * shape.dim * shape.dim + 2 * shape.dim * kv_dim + 3 * shape.dim * shape.ffn_hidden_dim + 2 * shape.dim
    return shape.n_layers * per_layer


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """12·L·H·Q·T: QKᵀ and attention·V, forward and backward, full (unmasked) score matrix. Multi-head latent
    attention's scores use the query/key head width and its weighted sum the value width: 6·L·H·(Qk + Qv)·T.
    A sliding-window layer attends to at most its window (min(W, T) keys a query), a full-attention layer with
    its own head size (Gemma 4's `global_head_dim`) at that size; a linear-attention layer
    (Gated DeltaNet) updates and reads a state instead, at a cost per token that does not grow with T."""
    if shape.mla is not None:
        return 6.0 * shape.n_layers * shape.n_heads * (shape.mla.qk_head_dim + shape.mla.v_head_dim) * seq_len
    x = shape.extras
    if x is None:
        return 12.0 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len
    per_key = 12.0 * shape.n_heads * shape.head_dim
    per_full_key = 12.0 * shape.n_heads * (x.global_head_dim or shape.head_dim)  # Gemma 4's own full-layer heads
    full = shape.n_layers - shape.linear_layers - x.sliding_layers
    window = min(x.sliding_window, seq_len) if x.sliding_window else seq_len
    linear = x.linear.layers * x.linear.flops_per_token() if x.linear else 0.0
    return per_full_key * full * seq_len + per_key * x.sliding_layers * window + linear


def model_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """PaLM appendix B: 6N + 12·L·H·Q·T."""
    return 6.0 * matmul_params(shape) + attention_flops_per_token(shape, seq_len)


def recompute_flops_per_token(shape: ModelShape, seq_len: int, recompute: str) -> float:
    """Matmul FLOPs redone in backward. Full: one more forward of every block. Selective: none (this
    framework's policy keeps every matmul's, attention's and expert GEMM's output: only element-wise ops run
    again; tests/test_activation_checkpoint.py counts it)."""
    if recompute == "full":
        return 2.0 * block_params(shape) + attention_flops_per_token(shape, seq_len) / 3.0
    return 0.0


def hardware_flops_per_token(shape: ModelShape, seq_len: int, recompute: str = "none") -> float:
    return model_flops_per_token(shape, seq_len) + recompute_flops_per_token(shape, seq_len, recompute)


def megatron_flops_per_iteration(batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                                 recompute: bool = True) -> float:
    """Narayanan et al. 2021 (Megatron-LM on GPU clusters), eq. 3: with full recomputation
    96·B·s·l·h²·(1 + s/6h + V/16lh); without it 72·B·s·l·h²·(1 + s/6h + V/12lh)."""
    if recompute:
        return 96.0 * batch * seq_len * layers * hidden ** 2 * (
            1 + seq_len / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72.0 * batch * seq_len * layers * hidden ** 2 * (
        1 + seq_len / (6 * hidden) + vocab / (12 * layers * hidden))


def korthikanti_hardware_flops_per_iteration(batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                                             recompute: str) -> float:
    """Korthikanti et al. 2022, section 6: model FLOPs 72·B·s·l·h²(1 + s/6h + V/12lh); selective
    recomputation of the attention core raises s/6h to s/3h; full recomputation is Megatron's 96 form."""
    if recompute == "full":
        return megatron_flops_per_iteration(batch, seq_len, layers, hidden, vocab, recompute=True)
    attention = seq_len / (3 * hidden) if recompute == "selective" else seq_len / (6 * hidden)
    return 72.0 * batch * seq_len * layers * hidden ** 2 * (1 + attention + vocab / (12 * layers * hidden))


def megatron_params(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021, eq. 2: P = 12·l·h²(1 + 13/12h + (V + s)/12lh) for a GPT model."""
    return 12.0 * layers * hidden ** 2 * (1 + 13 / (12 * hidden) + (vocab + seq_len) / (12 * layers * hidden))


def training_days(tokens: float, flops_per_token: float, gpus: int, achieved_flops_per_gpu: float) -> float:
    """Tokens × FLOPs per token / (GPUs × achieved FLOP/s), in days (Megatron 2021's 8TP/nX with
    flops_per_token = 8P)."""
    return tokens * flops_per_token / (gpus * achieved_flops_per_gpu) / 86400.0


def mfu(flops_per_token: float, tokens_per_second_per_gpu: float, peak_flops_per_gpu: float) -> float:
    return flops_per_token * tokens_per_second_per_gpu / peak_flops_per_gpu


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> float:
    """FLOPs of `steps` Newton-Schulz iterations (Muon's orthogonalisation, torch.optim.Muon's quintic) on one
    rows x cols matrix: per iteration the Gram matrix of the short side, its square, and the product back."""
    short, long = min(rows, cols), max(rows, cols)
    return steps * (4 * short * short * long + 2 * short ** 3)
