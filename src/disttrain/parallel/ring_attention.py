"""Ring attention over the context-parallel group, written by hand.

Why not torch's: `torch.distributed.tensor.experimental.context_parallel` refuses CPU attention (SDPA's
CPU flash kernel, `aten._scaled_dot_product_flash_attention_for_cpu`, has no DTensor sharding rule, and
Flex attention has no CPU backward), it shards buffers in place with `resize_` (refused on tensors that
need grad), and its ring (`_templated_ring_attention`) is private. This one calls the same fused kernels
on every device: the CPU flash op and its backward op here, which accept a merged output and
log-sum-exp, so each block's backward is one kernel call.

Forward: K/V (one packed tensor) travel round the ring with `batch_isend_irecv`, the next block in
flight while this one is computed; each block's (out, lse) is merged with the online-softmax rule.
With head-tail chunks (rank r holds chunks r and 2W-1-r), the block from rank s is causal when s == r,
all of the local queries against s's first chunk when s < r, and the local second chunk against all of
s's keys when s > r: every rank computes the same amount. Document masking and a sliding window add an
explicit mask; a block the window leaves wholly out is not computed (it still travels on).
Backward: K/V go round again with their dK/dV accumulators, which arrive home after a full circle.

Attention sinks (gpt-oss: a learned logit per head in each query's softmax denominator only) join after the
merge: lse' = logaddexp(lse, sink) and out' = out exp(lse - lse'). The flash backward kernel given out' and
lse' then computes the true probabilities exp(s - lse') and rowsum(dO out'), so dQ/dK/dV are exact, and
d sink = -sum over rows of exp(sink - lse') rowsum(dO out').
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.core.dtypes import at_least_fp32
from disttrain.parallel.context_shards import visible
from disttrain.parallel.sink_attention import expand_heads, fold_sinks, one_head_dim, sink_gradient

_KV_TAG, _GRAD_TAG = 71, 72
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def ring_attention(q, k, v, documents, cp, scale: float | None = None, window: int | None = None, sinks=None):
    """Values of another head dim than the keys (DeepSeek's latent attention) travel with the keys in one tensor,
    padded to one head dim (sink_attention.one_head_dim), the scale taken from the true query head dim."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return one_head_dim(lambda q, k, v: _RingAttention.apply(q, k, v, sinks, documents, cp, scale, window), q, k, v)


def _shift(t: torch.Tensor, cp, tag: int):
    """Send `t` to the next rank of the ring, receive the previous rank's: (buffer, works to wait on)."""
    buf = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, group=cp.group, group_peer=(cp.rank + 1) % cp.size, tag=tag),
           dist.P2POp(dist.irecv, buf, group=cp.group, group_peer=(cp.rank - 1) % cp.size, tag=tag)]
    return buf, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _block(cp, source: int, t: int, q_dtype, documents, device, window=None):
    """(query rows, key columns, is_causal, additive mask or None) of the block from rank `source`. Under a
    sliding window the rows and columns shrink to the smallest ranges holding every pair the window lets
    through (the far chunk of a neighbour's block drops out), and the block is None when it holds none."""
    half = t // 2
    if source == cp.rank:
        rows, cols, causal = slice(0, t), slice(0, t), documents is None
    elif source < cp.rank:
        rows, cols, causal = slice(0, t), slice(0, half), False
    else:
        rows, cols, causal = slice(half, t), slice(0, t), False
    if documents is None and window is None:
        return rows, cols, causal, None
    seq_len = 2 * cp.size * (t // 2)
    q_index = cp.index(seq_len, device)[rows]
    k_index = cp.index(seq_len, device, source)[cols]
    if window is not None:
        reach = _window_reach(_pieces(cp, cp.rank, t, rows), _pieces(cp, source, t, cols), window)
        if reach is None:
            return None
        rows, cols = reach
        q_index, k_index = cp.index(seq_len, device)[rows], cp.index(seq_len, device, source)[cols]
    if source == cp.rank or window is not None:
        allowed = visible(q_index, k_index, documents, window)
    else:  # off-diagonal blocks lie wholly before the queries: only documents mask
        allowed = documents[:, q_index][:, None, :, None] == documents[:, k_index][:, None, None, :]
    mask = torch.zeros(allowed.shape, dtype=q_dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return rows, cols, False, (mask, allowed.any(-1))


def _pieces(cp, rank: int, t: int, local: slice) -> list[tuple[int, int, int]]:
    """The part `local` of rank `rank`'s t tokens as (local start, global start, length) runs: its two chunks."""
    chunk, out = t // 2, []
    for start, first in ((0, rank * chunk), (chunk, (2 * cp.size - 1 - rank) * chunk)):
        lo, hi = max(local.start, start), min(local.stop, start + chunk)
        if lo < hi:
            out.append((lo, first + lo - start, hi - lo))
    return out


def _window_reach(rows, cols, window: int) -> tuple[slice, slice] | None:
    """The smallest local (rows, cols) ranges holding every query-key pair k <= q < k + window of these runs, or
    None. By arithmetic on the runs: no device sync, and a dry run's fake tensors have no values to look at."""
    r_lo = c_lo = float("inf")
    r_hi = c_hi = -1
    for q_local, qa, qn in rows:
        for k_local, ka, kn in cols:
            q_first, q_last = max(qa, ka), min(qa + qn - 1, ka + kn + window - 2)  # queries that see a key
            if q_first > q_last:
                continue
            k_first, k_last = max(ka, qa - window + 1), min(ka + kn - 1, qa + qn - 1)  # keys a query sees
            r_lo, r_hi = min(r_lo, q_local + q_first - qa), max(r_hi, q_local + q_last - qa)
            c_lo, c_hi = min(c_lo, k_local + k_first - ka), max(c_hi, k_local + k_last - ka)
    return None if r_hi < 0 else (slice(r_lo, r_hi + 1), slice(c_lo, c_hi + 1))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, documents, cp, scale, window):
        b, h, t, d = q.shape
        groups = h // k.shape[1]
        scale = d ** -0.5 if scale is None else scale
        acc = at_least_fp32(torch.empty((), dtype=q.dtype)).dtype
        # (batch, tokens, heads, head_dim) in memory, as the flash kernels write theirs: the model's
        # transpose back to tokens-first is then contiguous and its reshape a view, not a second copy that
        # the output projection would keep beside the one saved here
        out = torch.zeros((b, t, h, d), dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for rows, cols, causal, mask, kb, vb in _ring(torch.stack([k, v]), cp, q, documents, groups, window):
            if rows is None:
                continue
            part, part_lse = _FLASH(q[:, :, rows], kb, vb, 0.0, causal,
                                    attn_mask=None if mask is None else mask[0], scale=scale)
            part_lse = part_lse.to(acc)
            if mask is not None:  # rows that see nothing in this block: the kernel says lse 0, out 0
                part_lse = part_lse.masked_fill(~mask[1], float("-inf"))
            _merge(out, lse, part.to(acc), part_lse, rows)
        if sinks is not None:  # every row saw at least its own key
            lse = fold_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.cp, ctx.scale, ctx.groups, ctx.window = cp, scale, groups, window
        ctx.save_for_backward(q, k, v, out, lse, documents, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, documents, sinks = ctx.saved_tensors
        cp, scale, groups = ctx.cp, ctx.scale, ctx.groups
        acc = lse.dtype
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=q.device)  # the travelling accumulator of K/V's owner
        # the stacked K/V is passed on, not kept: only the block in flight stays alive
        for rows, cols, causal, mask, kb, vb in _ring(torch.stack([k, v]), cp, q, documents, groups, ctx.window):
            if rows is not None:
                dq_part, dk_part, dv_part = _FLASH_BACKWARD(
                    grad_out[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows], lse[:, :, rows].contiguous(),
                    0.0, causal, attn_mask=None if mask is None else mask[0], scale=scale)
                dq[:, :, rows] += dq_part
                for i, part in enumerate((dk_part, dv_part)):
                    if groups > 1:
                        part = part.unflatten(1, (-1, groups)).sum(2)
                    dkv[i][:, :, cols] += part
            sent = dkv
            dkv, grad_works = _shift(sent, cp, _GRAD_TAG)  # on to the next rank; home after a full circle
            _wait(grad_works)
            del sent
        dsinks = None if sinks is None else sink_gradient(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None, None, None, None


def _ring(kv, cp, q, documents, groups, window=None):
    """The ring walk both passes share: for each of the cp blocks of K/V (this rank's first), the next block is
    already on its way while the caller computes with this one, given as (rows, cols, causal, mask, k, v) with
    K/V heads expanded to the query heads; a block the window leaves out is passed on and given as Nones (the
backward's accumulator still moves on). `cp.ring_work`: [blocks left out, query-key pairs computed] so far."""
    t = q.shape[2]
    for step in range(cp.size):
        source = (cp.rank - step) % cp.size
        last = step == cp.size - 1
        if not last:
            incoming, works = _shift(kv, cp, _KV_TAG)
        block = _block(cp, source, t, q.dtype, documents, q.device, window)
        if block is None:
            cp.ring_work[0] += 1
            yield None, None, None, None, None, None
        else:
            rows, cols, causal, mask = block
            cp.ring_work[1] += (rows.stop - rows.start) * (cols.stop - cols.start)
            kb, vb = (expand_heads(x[:, :, cols], groups) for x in kv)
            yield rows, cols, causal, mask, kb, vb
        if not last:
            _wait(works)
            kv = incoming


def _merge(out, lse, part, part_lse, rows) -> None:
    """Online softmax: fold a block's (out, lse) over some query rows into the running ones, in place."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, part_lse)
    keep = torch.exp(old - new).nan_to_num_(0.0)[..., None]  # -inf - -inf: a row nothing has reached yet
    take = torch.exp(part_lse - new).nan_to_num_(0.0)[..., None]
    out[:, :, rows] = out[:, :, rows] * keep + part * take
    lse[:, :, rows] = new
