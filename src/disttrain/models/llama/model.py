"""A Llama-style decoder written for one device; parallelism is applied from outside.

Blocks live in an `nn.ModuleDict` keyed by layer index so a pipeline split can drop blocks
while every remaining parameter keeps its name; embeddings, norm and output may be None
on stages that do not own them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.core.dtypes import at_least_fp32
from disttrain.models.documents import block_causal_mask, document_positions
from disttrain.models.shape import ModelShape


def rotary_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos/sin (seq, head_dim), or (batch, seq, head_dim) when positions
    differ per sequence; the rotate-half convention used by HF Llama checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None], sin[:, :, None])
    return (at_least_fp32(x) * cos + at_least_fp32(rotated) * sin).type_as(x)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q (batch, heads, seq, head_dim), k/v with as many or fewer (grouped) heads; `mask` None: causal."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        hd = shape.head_dim
        self.head_dim = hd
        # The attention kernel (q, k, v, mask) -> out; context parallelism swaps in one that sees the
        # other ranks' shards of the sequence (parallel/context.py), as transformers' registry does.
        self.attend = local_attention
        self.wq = nn.Linear(shape.dim, shape.n_heads * hd, bias=False)
        self.wk = nn.Linear(shape.dim, shape.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(shape.dim, shape.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(shape.n_heads * hd, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts and length come from the tensors: a tensor-parallel shard sees its local heads,
        # and under sequence parallelism only attention sees the whole sequence.
        cos, sin = cos[..., :t, :], sin[..., :t, :]
        q = apply_rotary(self.wq(x).view(b, t, -1, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(b, t, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        out = self.attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, shape: ModelShape, feed_forward: nn.Module | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(shape.dim, shape.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """`feed_forward(layer)`: the MLP of block `layer` when not the dense SwiGLU (the MoE family's)."""

    def __init__(self, shape: ModelShape, feed_forward: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.shape = shape
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(shape, feed_forward(i) if feed_forward else None)
                                     for i in range(shape.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.output: nn.Linear | None = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rotary_tables(shape.head_dim, shape.max_seq_len, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.document_eos: int | None = None  # set by `mask_documents`
        # documents (batch, seq) -> what blocks hand the attention kernel as its mask (see `forward`)
        self.attention_mask = block_causal_mask

    def tie_weights(self) -> None:
        """Share the output matrix with the embedding; redo after `to_empty`, which unties them."""
        if self.shape.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def reset_buffers(self) -> None:
        """Recompute the rotary tables (needed after `to_empty` from the meta device)."""
        cos, sin = rotary_tables(self.shape.head_dim, self.shape.max_seq_len, self.shape.rope_theta,
                                 device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for module in self.modules():  # e.g. an MoE router's balancing bias
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab); on a middle pipeline stage, hidden states.
        `positions` (batch, seq): the tokens' rotary positions (default 0, 1, ...); `documents`: the document
        index of each token, turned into the attention mask by `attention_mask` (default: from the end
        tokens under document masking, else none: causal)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin, mask = self.rope_cos, self.rope_sin, None
        if self.document_eos is not None and documents is None:  # whole-model only (a stage never sees ids)
            positions, documents = document_positions(tokens, self.document_eos)
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        if documents is not None:
            mask = self.attention_mask(documents)
        for block in self.layers.values():
            h = block(h, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def mask_documents(model: Transformer, eos_id: int) -> None:
    """Attention stops at `eos_id` and rotary positions restart after it (data.document_masking)."""
    model.document_eos = eos_id
