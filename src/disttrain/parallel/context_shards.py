"""Which tokens a context-parallel rank holds (head-tail chunks), and who may see whom across shards.

Rank r of W holds chunks r and 2W - 1 - r of the 2W equal chunks of each sequence: under a causal mask
the early chunk has little to attend to and the late one much, so every rank does the same work.
"""

from __future__ import annotations

import torch


def shard_chunks(rank: int, size: int) -> tuple[int, int]:
    """The chunks (of 2 size) rank `rank` of `size` holds, in its local order (plain ints: no tensor to read)."""
    return rank, 2 * size - 1 - rank


def shard_index(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """The global positions rank `rank` of `size` holds: its `shard_chunks`, in that order."""
    chunk = seq_len // (2 * size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in shard_chunks(rank, size)])


def shard_sequence(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s tokens of a (batch, seq, ...) tensor."""
    return t[:, shard_index(t.shape[1], rank, size, t.device)]


def visible(q_index: torch.Tensor, k_index: torch.Tensor, documents: torch.Tensor | None,
            window: int | None = None) -> torch.Tensor:
    """(batch or 1, 1, q, k) bool: query at global position i may see key at j (j <= i, same document;
    i - j < window for sliding-window attention)."""
    mask = k_index[None, :] <= q_index[:, None]
    if window is not None:
        mask &= k_index[None, :] > q_index[:, None] - window
    mask = mask[None, None]
    if documents is None:
        return mask
    same = documents[:, q_index][:, :, None] == documents[:, k_index][:, None, :]
    return mask & same[:, None]
