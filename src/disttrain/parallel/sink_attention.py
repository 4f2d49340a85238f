"""Attention with sinks (gpt-oss: a learned logit per head in each query's softmax denominator only) on the
fused kernel, for all-gather and Ulysses context parallelism (gathered_attention.py).

Why by hand: `scaled_dot_product_attention` takes no sinks. Given as one more key per head (logit = the sink,
value zero) through a float mask, it is exact, but a mask that needs a gradient sends SDPA to its math kernel,
which keeps every head's (queries x keys) attention weights for backward. This calls the fused kernel the ring
calls (`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp) and folds the sink
in afterwards: lse' = logaddexp(lse, sink), out' = out exp(lse - lse'). Its backward op, given out' and lse',
computes the true probabilities exp(s - lse') and rowsum(dO out'), so dQ/dK/dV are exact, and
d sink = -sum over rows of exp(sink - lse') rowsum(dO out'). Kept for backward: q, k, v, out', lse' and one
(queries x keys) mask shared by the heads.
"""

from __future__ import annotations

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def sink_attention(q, k, v, allowed: torch.Tensor, sinks: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q (batch, heads, queries, d), k/v (batch, kv heads, keys, d / dv), `allowed` bool (batch or 1, 1,
    queries, keys), `sinks` (heads,) -> (batch, heads, queries, dv)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return one_head_dim(lambda q, k, v: _SinkAttention.apply(q, k, v, sinks, allowed, scale), q, k, v)


def one_head_dim(attend, q, k, v) -> torch.Tensor:
    """`attend(q, k, v)` through the flash kernel, which takes one head dim, for values of another head dim than
    the keys (DeepSeek's latent attention): the narrower of q/k and v padded with zeros (zero query/key columns
    add nothing to q . k; zero value columns give zero output columns, cut off again). Callers fix the scale
    from the true query head dim first."""
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv:
        return attend(q, k, v)
    width = max(d, dv)
    return attend(*(torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (q, k, v)))[..., :dv]


def expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query K/V repeated to the query heads (the CPU flash kernel takes equal head counts)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks joined to a finished attention (every row saw one key at least: lse is finite): `out` rescaled
    in place (its memory layout stays), the new log-sum-exp returned."""
    final = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    out.mul_(torch.exp(lse - final)[..., None].to(out.dtype))
    return final


def sink_gradient(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks, from the final output and log-sum-exp: -sum over rows of exp(sink - lse) rowsum(dO out)."""
    rowsum = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(torch.exp(sinks.to(lse.dtype)[None, :, None] - lse) * rowsum).sum((0, 2)).to(sinks.dtype)


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, allowed, scale):
        groups = q.shape[1] // k.shape[1]
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        out, lse = _FLASH(q, expand_heads(k, groups), expand_heads(v, groups), 0.0, False, attn_mask=mask,
                          scale=scale)
        final = fold_sinks(out, lse, sinks)
        ctx.scale, ctx.groups = scale, groups
        ctx.save_for_backward(q, k, v, out, final, mask, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask, sinks = ctx.saved_tensors
        groups = ctx.groups
        grad_out = grad_out.contiguous()
        dq, dk, dv = _FLASH_BACKWARD(grad_out, q, expand_heads(k, groups), expand_heads(v, groups), out, lse, 0.0,
                                     False, attn_mask=mask, scale=ctx.scale)
        if groups > 1:
            dk, dv = (x.unflatten(1, (-1, groups)).sum(2) for x in (dk, dv))
        return dq, dk, dv, sink_gradient(grad_out, out, lse, sinks), None, None
