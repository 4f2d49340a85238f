"""The dimensions of a decoder-only transformer: what the planner, FLOP counts and layout rules
need to know about a model, in pure Python (no torch), whatever family it comes from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts part of a decoder: blocks whose MLP is a router over SwiGLU experts.
    Field names follow transformers' MoE configs (Qwen3-MoE, DeepSeek-V3) so that an HF config maps one to one."""
    num_experts: int
    num_experts_per_tok: int  # top-k experts each token runs through
    moe_intermediate_size: int  # each expert's SwiGLU width
    n_shared_experts: int = 0  # experts every token runs through, each moe_intermediate_size wide
    first_k_dense_replace: int = 0  # leading blocks that keep a dense MLP of ffn_hidden_dim
    scoring_func: str = "softmax"  # router scores: "softmax", or "sigmoid" with the top-k renormalised (DeepSeek-V3)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def layer_params(self, dim: int, active: bool = False) -> int:
        """One MoE layer's MLP parameters: the router, the routed experts (all, or the top-k a token uses when
        `active`) and the shared experts."""
        experts = self.num_experts_per_tok if active else self.num_experts
        return dim * self.num_experts + (experts + self.n_shared_experts) * 3 * dim * self.moe_intermediate_size


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through low-rank
    latents with their own RMSNorms; each head's query/key is a no-position part and a rotary part, values
    have their own width. Names follow transformers' DeepseekV3Config."""
    kv_lora_rank: int
    q_lora_rank: int  # 0: queries projected from the hidden state directly (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, dim: int, n_heads: int) -> int:
        """q_a, its norm and q_b (or one q projection); kv_a with the shared rotary key, its norm, kv_b; o."""
        q_out = n_heads * self.qk_head_dim
        q = dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else dim * q_out
        kv = (dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + n_heads * self.v_head_dim * dim


@dataclass(frozen=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden_dim: int
    max_seq_len: int
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2)
    head_size: int = 0  # 0: dim / n_heads; set when a family decouples the two (Qwen3, Gemma)
    moe: MoEShape | None = None  # None: every block has a dense SwiGLU MLP
    mla: MLAShape | None = None  # None: grouped-query attention of n_heads / n_kv_heads x head_dim
    # Precomputed cos/sin buffers, as the built-in models hold (transformers' compute theirs per forward); the
    # planner's to count, not the model's identity (models/llama shape_fingerprint leaves it out).
    rotary_tables: bool = True

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def attention_params(self) -> int:
        """One block's attention projections (and their biases; MLA: its latent norms too)."""
        if self.mla is not None:
            return self.mla.params(self.dim, self.n_heads)
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.dim * q_dim * 2 + self.dim * kv_dim * 2 + (q_dim + 2 * kv_dim if self.qkv_bias else 0)

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Exact parameter count of a Llama-style decoder (SwiGLU MLP, GQA, RMSNorm, no biases). With `active`,
        an MoE model's count holds only the experts one token runs through (what its FLOPs per token follow)."""
        attn = self.attention_params()
        dense_mlp = 3 * self.dim * self.ffn_hidden_dim
        mlps = sum(self.moe.layer_params(self.dim, active) if self.moe and self.moe.is_moe_layer(layer)
                   else dense_mlp for layer in range(self.n_layers))
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = self.n_layers * (attn + 2 * self.dim) + mlps + self.dim + output
        return total + (embedding if include_embedding else 0)

