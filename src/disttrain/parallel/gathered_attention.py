"""Context-parallel attention by gathering: all-gather of K/V, and Ulysses (all-to-all to head shards).

Both are torch's functional collectives with autograd (`all_gather_single_autograd`, whose backward is a
reduce-scatter of dK/dV; `all_to_all_single_autograd`) around one `scaled_dot_product_attention` call with
an explicit mask built from the tokens' global positions (and document index), so that head-tail
shards and packed documents need no reordering: the mask says who sees whom. Values may have another head
dim than queries and keys (DeepSeek's latent attention).

Attention sinks (gpt-oss: a learned logit per head in each query's softmax denominator) go to the fused kernel
with the sink folded into its log-sum-exp (sink_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import (all_gather_single_autograd, all_to_all_single_autograd,
                                                       wait_tensor)

from disttrain.parallel.context_shards import visible


def _attend(q, k, v, mask, scale, sinks):
    """SDPA of q over k/v under the bool `mask`; `sinks` (q's heads,): gpt-oss's attention sinks."""
    if sinks is not None:
        from disttrain.parallel.sink_attention import sink_attention

        return sink_attention(q, k, v, mask, sinks, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def allgather_attention(q, k, v, documents, cp, scale=None, window=None, sinks=None):
    """Every rank gathers the whole sequence's K/V once per layer; its own queries attend to them."""
    seq_len = q.shape[2] * cp.size
    k_all, v_all = (wait_tensor(all_gather_single_autograd(x.contiguous(), gather_dim=2, group=cp.group))
                    for x in (k, v))
    mask = visible(cp.index(seq_len, q.device), cp.gathered_index(seq_len, q.device), documents, window)
    return _attend(q, k_all, v_all, mask, scale, sinks)


def _to_head_shards(x: torch.Tensor, cp) -> torch.Tensor:
    """(batch, heads, local tokens, d) -> (batch, heads / W, W x local tokens, d), tokens in rank order."""
    b, h, t, d = x.shape
    w = cp.size
    # Outputs of c10d collectives must be contiguous (a non-contiguous buffer silently scrambles rows).
    send = x.reshape(b, w, h // w, t, d).transpose(0, 1).contiguous()
    got = wait_tensor(all_to_all_single_autograd(send, None, None, cp.group))  # (W: source rank, b, h/W, t, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // w, w * t, d)


def _to_sequence_shards(y: torch.Tensor, cp) -> torch.Tensor:
    """The inverse of `_to_head_shards`."""
    b, hw, s, d = y.shape
    w = cp.size
    send = y.reshape(b, hw, w, s // w, d).permute(2, 0, 1, 3, 4).contiguous()  # (W: destination rank, ...)
    got = wait_tensor(all_to_all_single_autograd(send, None, None, cp.group))  # (W: head group, b, h/W, t, d)
    return got.transpose(0, 1).reshape(b, w * hw, s // w, d)


def ulysses_attention(q, k, v, documents, cp, scale=None, window=None, sinks=None):
    """Each rank attends for heads / W of the heads over the whole sequence (heads divisible by W): rank r holds
    heads r h/W ... (r + 1) h/W - 1, and takes those heads' sinks (their gradient is then this rank's alone; the
    data-parallel reduction over the context ranks sums it with the other ranks' zeros)."""
    seq_len = q.shape[2] * cp.size
    qh, kh, vh = (_to_head_shards(x, cp) for x in (q, k, v))
    if sinks is not None:
        per_rank = qh.shape[1]
        sinks = sinks[cp.rank * per_rank:(cp.rank + 1) * per_rank]
    index = cp.gathered_index(seq_len, q.device)
    out = _attend(qh, kh, vh, visible(index, index, documents, window), scale, sinks)
    return _to_sequence_shards(out, cp)
