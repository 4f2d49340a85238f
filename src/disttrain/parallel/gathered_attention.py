"""Context-parallel attention by gathering: all-gather of K/V, and Ulysses (all-to-all to head shards).

Both are torch's functional collectives with autograd (`all_gather_single_autograd`, whose backward is a
reduce-scatter of dK/dV; `all_to_all_single_autograd`) around one `scaled_dot_product_attention` call with
an explicit mask built from the tokens' global positions (and document index), so that head-tail
shards and packed documents need no reordering: the mask says who sees whom.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import (all_gather_single_autograd, all_to_all_single_autograd,
                                                       wait_tensor)

from disttrain.parallel.context_shards import visible


def allgather_attention(q, k, v, documents, cp, scale=None, window=None):
    """Every rank gathers the whole sequence's K/V once per layer; its own queries attend to them."""
    seq_len = q.shape[2] * cp.size
    k_all, v_all = (wait_tensor(all_gather_single_autograd(x.contiguous(), gather_dim=2, group=cp.group))
                    for x in (k, v))
    mask = visible(cp.index(seq_len, q.device), cp.gathered_index(seq_len, q.device), documents, window)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


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


def ulysses_attention(q, k, v, documents, cp, scale=None, window=None):
    """Each rank attends for heads / W of the heads over the whole sequence (heads divisible by W)."""
    seq_len = q.shape[2] * cp.size
    qh, kh, vh = (_to_head_shards(x, cp) for x in (q, k, v))
    index = cp.gathered_index(seq_len, q.device)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible(index, index, documents, window),
                                         scale=scale, enable_gqa=qh.shape[1] != kh.shape[1])
    return _to_sequence_shards(out, cp)
