"""The dimensions of a decoder-only transformer: what the planner, FLOP counts and layout rules
need to know about a model, in pure Python (no torch), whatever family it comes from."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of a Llama-style decoder (SwiGLU MLP, GQA, RMSNorm, no biases)."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q_dim * 2 + self.dim * kv_dim * 2 + (q_dim + 2 * kv_dim if self.qkv_bias else 0)
        mlp = 3 * self.dim * self.ffn_hidden_dim
        per_layer = attn + mlp + 2 * self.dim
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = self.n_layers * per_layer + self.dim + output
        return total + (embedding if include_embedding else 0)

