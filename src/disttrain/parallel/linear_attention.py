"""Linear attention (Gated DeltaNet: Qwen3-Next, Qwen3.5) across the context-parallel shards.

A Gated DeltaNet layer carries two things along the sequence: a causal depthwise convolution (each position reads
the `kernel - 1` positions before it) and a recurrent state (heads x key dim x value dim) that the gated delta rule
updates token by token. Both are cut at the 2 x cp chunks of the head-tail layout (context_shards.py): rank r holds
chunks r and 2W - 1 - r, each a contiguous run of the sequence, so each chunk is computed with the model's own
single-device kernels given what the chunk before it left:
  convolution  the last `kernel - 1` inputs of every chunk, all-gathered once (torch's `all_gather_single_autograd`,
               whose backward reduce-scatters their gradients back to their owners); each chunk is convolved with
               its predecessor's tail in front and the outputs of that tail dropped;
  recurrence   the chunks run in sequence order, each starting from the state its predecessor ended with
               (`initial_state` / `output_final_state` of the kernel): the state goes from rank to rank with
               send/recv along the chain 0 -> 1 -> ... -> W-1 -> W-1 -> ... -> 0, and its gradient back along it.
The recurrence is sequential over the ranks (a rank waits for the state of the chunk before its own); the
projections, the convolution, the norms and the rest of the model stay parallel.

Why by hand: torch has no context parallelism for recurrences, and the chain cannot be plain autograd around
send/recv: each rank both sends and receives states in one layer, and autograd would run a rank's "receive the
gradient" node in whatever order it likes, which deadlocks against a peer waiting for the gradient this rank has
yet to send. `_StateChain` runs the chain in a fixed order both ways; its backward computes each chunk again (one
more kernel forward per layer) and takes the chunk's gradients with `torch.autograd.grad`, so the model's kernel
is used unchanged.

Document masking: the model's kernels are then the document-aware ones (models/hf/linear_documents.py), which take
each token's position in its document. Each chunk is given its own tokens' positions (global, as one process sees
them), so a chunk that starts a document neither reads the tail nor the state of the chunk before it, and a document
that starts inside a chunk restarts there, as in one process; the chain itself runs as without documents.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

from disttrain.parallel.context_shards import shard_chunks


def _places(size: int) -> dict[int, tuple[int, int]]:
    """chunk -> (the rank holding it, its place among that rank's chunks), for the 2 x size chunks."""
    return {c: (r, i) for r in range(size) for i, c in enumerate(shard_chunks(r, size))}


def _chunks(cp, t: int) -> tuple[tuple[int, ...], int, dict]:
    """(the chunks this rank holds, in its local order; their length for `t` local tokens; `_places`)."""
    order = shard_chunks(cp.rank, cp.size)
    return order, t // len(order), _places(cp.size)


def _positions(document_positions, window: slice) -> dict:
    """The keyword a document-aware kernel takes for the tokens in `window` (none without document masking)."""
    return {} if document_positions is None else {"document_positions": document_positions[:, window]}


def causal_conv(conv, x: torch.Tensor, weight: torch.Tensor, bias, cp, activation=None, document_positions=None,
                **kwargs) -> torch.Tensor:
    """`conv(x, weight, bias, activation)` (the model's causal depthwise convolution of (batch, channels, tokens))
    over this rank's shard as over the whole sequence: each chunk sees the last `kernel - 1` inputs before it.
    `document_positions` (batch, local tokens): each token's position in its document, under document masking."""
    halo = weight.shape[-1] - 1
    order, length, places = _chunks(cp, x.shape[-1])
    if halo == 0:
        return conv(x, weight, bias, activation=activation, **_positions(document_positions, slice(None)))
    if length < halo:
        raise ValueError(f"a context-parallel chunk of {length} tokens is shorter than the convolution's "
                         f"{halo}-token reach: data.seq_len must be at least {2 * cp.size * halo}")
    pieces = x.split(length, dim=-1)
    tails = torch.stack([p[..., -halo:] for p in pieces]).contiguous()  # (chunks, batch, channels, halo)
    every = wait_tensor(all_gather_single_autograd(tails, gather_dim=0, group=cp.group))  # rank-major
    out = []
    for j, (chunk, piece) in enumerate(zip(order, pieces)):
        positions = _positions(document_positions, slice(j * length, (j + 1) * length))  # the piece's, not the tail's
        if chunk == 0:  # the sequence's start: the kernel's own zero padding
            out.append(conv(piece, weight, bias, activation=activation, **positions))
            continue
        rank, place = places[chunk - 1]
        before = every[rank * len(order) + place]
        out.append(conv(torch.cat([before, piece], dim=-1), weight, bias, activation=activation,
                        **positions)[..., halo:])
    return torch.cat(out, dim=-1)


def chunk_gated_delta_rule(rule, query, key, value, g, beta, cp, initial_state=None, output_final_state=False,
                           document_positions=None, **kwargs):
    """`rule(query, key, value, g=, beta=, initial_state=, output_final_state=, **kwargs)` -> (out, state): the
    model's chunked gated-delta-rule kernel over this rank's shard (tokens on dim 1) as over the whole sequence.
    Training only: no state comes in (a generation cache) and none goes out. `document_positions`: as for
    `causal_conv`."""
    if initial_state is not None or output_final_state:
        raise ValueError("context parallelism trains from each sequence's start: no recurrent state in or out")

    def run(window, q, k, v, g_, b, state):
        return rule(q, k, v, g=g_, beta=b, initial_state=state, output_final_state=True, **kwargs,
                    **_positions(document_positions, window))

    return _StateChain.apply(run, cp, query, key, value, g, beta), None


def _state_buffer(query, key, value) -> torch.Tensor:
    """An empty (batch, value heads, key dim, value dim) state as it travels: at least float32, as the kernel
    keeps it."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    return torch.empty((query.shape[0], value.shape[2], key.shape[-1], value.shape[-1]), dtype=dtype,
                       device=query.device)


def _send(t: torch.Tensor, like: torch.Tensor, cp, to: int) -> None:
    dist.send(t.to(like.dtype).contiguous(), group=cp.group, group_dst=to)


def _recv(buf: torch.Tensor, cp, src: int) -> torch.Tensor:
    dist.recv(buf, group=cp.group, group_src=src)
    return buf


class _StateChain(torch.autograd.Function):
    """This rank's chunks of the recurrence in sequence order, the state passed along the chain (module doc):
    the output of this rank's tokens."""

    @staticmethod
    def forward(ctx, run, cp, query, key, value, g, beta):
        order, length, places = _chunks(cp, query.shape[1])
        wire = _state_buffer(query, key, value)
        outs, starts, state = [], [], None
        for j, chunk in enumerate(order):
            if chunk > 0 and places[chunk - 1][0] != cp.rank:
                state = _recv(torch.empty_like(wire), cp, places[chunk - 1][0])
            starts.append(state)  # None for the sequence's first chunk
            window = slice(j * length, (j + 1) * length)
            out, state = run(window, *[t[:, window] for t in (query, key, value, g, beta)], state)
            outs.append(out)
            if chunk + 1 in places and places[chunk + 1][0] != cp.rank:
                _send(state, wire, cp, places[chunk + 1][0])
        ctx.run, ctx.cp = run, cp
        ctx.starts = [None if s is None else s.detach() for s in starts]
        ctx.save_for_backward(query, key, value, g, beta)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        cp, run, inputs = ctx.cp, ctx.run, ctx.saved_tensors
        order, length, places = _chunks(cp, inputs[0].shape[1])
        wire = _state_buffer(*inputs[:3])
        grads = [torch.zeros_like(t) for t in inputs]
        carried = None  # the gradient of the state the chunk after this one started from, when it is this rank's
        for j in reversed(range(len(order))):
            chunk = order[j]
            if chunk + 1 in places and places[chunk + 1][0] != cp.rank:
                carried = _recv(torch.empty_like(wire), cp, places[chunk + 1][0])
            window = slice(j * length, (j + 1) * length)
            with torch.enable_grad():
                part = [t[:, window].detach().requires_grad_() for t in inputs]
                start = ctx.starts[j]
                start = None if start is None else start.clone().requires_grad_()
                out, state = run(window, *part, start)
                outputs, given = [out], [grad_out[:, window]]
                if carried is not None:  # None after the sequence's last chunk
                    outputs.append(state)
                    given.append(carried.to(state.dtype))
                found = torch.autograd.grad(outputs, part + ([start] if start is not None else []), given)
            for grad, d in zip(grads, found[:5]):
                grad[:, window] = d
            carried = found[5] if start is not None else None
            if chunk > 0 and places[chunk - 1][0] != cp.rank:
                _send(carried, wire, cp, places[chunk - 1][0])
                carried = None
        return None, None, *grads
