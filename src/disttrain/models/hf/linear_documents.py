"""Gated DeltaNet kernels (Qwen3-Next, Qwen3.5) that restart at document starts (`data.document_masking`).

A Gated DeltaNet layer carries two things along the sequence: a causal depthwise convolution (each token reads the
`kernel - 1` tokens before it) and a recurrent state that the gated delta rule updates token by token. In a packed
sequence both would carry one document into the next. These two kernels take each token's position in its document
(`document_positions`: the restarting `position_ids` the model receives, 0 at a document's first token) and compute
every document as if it were alone: the convolution reads no token before the document's first (zeros there, as
before a sequence's start), and the recurrent state starts from zero at each document's first token.

Why by hand: transformers' torch kernels (`causal_conv1d_fn`, `torch_chunk_gated_delta_rule`) take no document
boundaries (they ignore `cu_seqlens`), and the kernels that do (flash-linear-attention, causal-conv1d) are Triton
and CUDA kernels, for GPUs only. The recurrence is the same chunked algorithm as transformers' (a UT transform inside chunks of 64
tokens, then a scan over the chunks), with each chunk's token pairs of different documents masked out, a token
reading the state that enters its chunk only while its document is the one that state belongs to, and the state
leaving a chunk holding only the chunk's last document. So the work is transformers' (one Python step per chunk,
none per token) and the numbers equal each document's alone up to rounding (the chunks fall elsewhere).

Both keep transformers' signatures, and with `document_positions=None` compute one document: the convolution
starts at the sequence's start and every token reads `initial_state`. Context parallelism calls them on each chunk
of a rank's shard with the chunk's positions (parallel/linear_attention.py): a chunk that continues a document
reads the tail and the state of the chunk before it, one that starts a document does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str | None = None, document_positions: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
    """transformers' `causal_conv1d_fn` (x: (batch, channels, tokens), weight: (channels, kernel)) where a token
    reads `j` tokens back only if its document started at least `j` tokens before it. `document_positions`
    (batch, n) are the positions of the last n tokens of x; the tokens before them are context (they read
    everything; the caller drops their outputs)."""
    tokens, taps = x.shape[-1], weight.shape[-1]
    xw = x.to(weight.dtype)
    if document_positions is None:
        reach = torch.full((1, tokens), taps, dtype=torch.long, device=x.device)
    else:
        reach = F.pad(document_positions, (tokens - document_positions.shape[-1], 0), value=taps)
    out = xw * weight[:, -1:]
    for back in range(1, taps):  # one step per tap of the kernel, none per token
        before = F.pad(xw, (back, 0))[..., :tokens]  # x[t - back], zeros before the sequence
        out = out + before.masked_fill((reach < back)[:, None, :], 0) * weight[:, taps - 1 - back:taps - back]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           document_positions: torch.Tensor | None = None, **kwargs):
    """transformers' `torch_chunk_gated_delta_rule` (query/key (batch, tokens, key heads, key dim), value (batch,
    tokens, value heads, value dim), g/beta (batch, tokens, value heads)) -> (out, final state or None), the state
    restarting from zero at each token whose `document_positions` is 0. Computes in float32, float64 in float64."""
    dtype, (batch, tokens, key_heads, key_dim) = query.dtype, key.shape
    heads, value_dim = value.shape[-2:]
    if key_heads != heads:
        query, key = (t.repeat_interleave(heads // key_heads, dim=2) for t in (query, key))
    work = torch.promote_types(dtype, torch.float32)
    q, k, v, beta, g = (t.transpose(1, 2).to(work) for t in (query, key, value, beta, g))  # heads before tokens
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * key_dim ** -0.5
    # each token's document, counted from the one the incoming state belongs to (0)
    starts = torch.zeros(batch, tokens, dtype=torch.long, device=q.device) if document_positions is None else \
        (document_positions == 0).long().expand(batch, tokens)
    document = starts.cumsum(-1)
    pad = (-tokens) % chunk_size  # zeros after the end: they change nothing before them
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    document = torch.cat([document, document[:, -1:].expand(batch, pad)], dim=-1)
    chunks = (tokens + pad) // chunk_size
    q, k, v = (t.reshape(batch, heads, chunks, chunk_size, -1) for t in (q, k, v))
    beta, g = (t.reshape(batch, heads, chunks, chunk_size) for t in (beta, g))
    document = document.reshape(batch, 1, chunks, chunk_size)

    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    same = (document[..., :, None] == document[..., None, :]) & causal  # token pairs of one document, j <= i
    pairs = (decay[..., :, None] - decay[..., None, :]).masked_fill(~same, float("-inf")).exp()
    entering = F.pad(document[..., :-1, -1], (1, 0))  # the document of the state each chunk starts from
    reads = (document == entering[..., None]).to(work)  # tokens whose document that state belongs to
    last = (document == document[..., -1:]).to(work)  # tokens of the chunk's last document: what its state holds
    carried = decay[..., -1].exp() * (document[..., -1] == entering)  # the entering state's share of the leaving
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pairs  # the UT transform, within each document
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * (decay.exp() * reads)[..., None], upper=False,
                                              unitriangular=True)
    attention = (q @ k.transpose(-1, -2)) * pairs
    q_state = q * (decay.exp() * reads)[..., None]
    k_state = k * ((decay[..., -1:] - decay).exp() * last)[..., None]

    state = torch.zeros(batch, heads, key_dim, value_dim, dtype=work, device=q.device) if initial_state is None \
        else initial_state.to(work)
    outs = []
    for i in range(chunks):  # the scan over chunks
        fresh = new_values[:, :, i] - k_decayed[:, :, i] @ state
        outs.append(q_state[:, :, i] @ state + attention[:, :, i] @ fresh)
        state = state * carried[:, :, i, None, None] + k_state[:, :, i].transpose(-1, -2) @ fresh
    out = torch.stack(outs, dim=2).reshape(batch, heads, -1, value_dim)[:, :, :tokens]
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None
