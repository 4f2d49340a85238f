"""Conversations of a chat shard directory as training sequences, read by sample id like token windows.

A sequence holds seq_len + 1 tokens (inputs plus the shifted targets). Targets carry loss only where the
shard's mask says so (assistant turns, completions); every other target is IGNORE_INDEX (-100), padding
included. With packing off each sequence holds one conversation, padded with the end-of-document token;
with `data.packing` conversations are packed first-fit in file order, each ended by that token, and the
model's document masking (models/documents.py) keeps them from attending across and restarts positions.

With `data.padding=none` (padding-free) a sample is still one conversation (or one pack), but each micro-batch's
conversations are laid first-fit into as few rows of seq_len + 1 tokens as hold them, kept apart by the same
document masking: the micro-batch trains on the same conversations with the same targets as padded to its
longest, on fewer positions (the loader packs each micro-batch alone: `packs_micro_batches`).
"""

from __future__ import annotations

import numpy as np
import torch

from disttrain.models.spec import IGNORE_INDEX


def first_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Items in order, each into the first bin with room (a max-tree over bins: O(n log n))."""
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size *= 2
    room = [capacity] * (2 * size)  # leaves: bins (unopened ones are empty); inner nodes: max of children
    bins: list[list[int]] = []
    for item, length in enumerate(int(x) for x in lengths):
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class ChatSamples:
    """Sequences of whole conversations with masked targets (`masks_targets`: the loss counts valid ones)."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, ends: np.ndarray, seq_len: int, pad_id: int,
                 packing: bool, padding_free: bool = False):
        self.tokens, self.mask, self.seq_len, self.pad_id = tokens, mask, seq_len, pad_id
        self.packs_micro_batches = padding_free
        self.targets_per_sample = seq_len
        self.masks_targets = True
        self.pads_sequences = True  # padding after each conversation (or pack): a micro-batch can be cut short
        ends = np.asarray(ends, dtype=np.int64)
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        lengths = ends - self.starts
        capacity = seq_len + 1
        self.truncated = int((lengths > capacity).sum())  # cut to one whole sequence (it fills it alone)
        self.lengths = np.minimum(lengths, capacity)
        self.rows = first_fit(self.lengths, capacity) if packing else [[i] for i in range(len(ends))]
        self.num_samples = len(self.rows)
        # input positions each row fills before its padding: its conversations (end tokens included), <= seq_len
        self.row_tokens = np.minimum(seq_len, np.array([int(self.lengths[r].sum()) for r in self.rows], np.int64))

    def __len__(self) -> int:
        return self.num_samples

    def held_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Input positions each sequence fills before its padding: its conversations' tokens (end tokens
        included), at most seq_len."""
        return self.row_tokens[np.asarray(ids, dtype=np.int64)]

    def sample_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Tokens each sample lays into a padding-free micro-batch (end tokens included)."""
        return self.held_tokens(ids)

    def packed_batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(inputs, targets, held) of one padding-free micro-batch: the conversations of samples `ids`, in order,
        first-fit into rows of seq_len + 1 tokens; `held`: the input positions its fullest row fills."""
        docs = np.array([doc for i in ids for doc in self.rows[int(i)]], dtype=np.int64)
        layout = [[int(docs[j]) for j in row] for row in first_fit(self.lengths[docs], self.seq_len + 1)]
        inputs, targets = self._rows(layout)
        return inputs, targets, min(self.seq_len, max(int(self.lengths[row].sum()) for row in layout))

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.packs_micro_batches:
            return self.packed_batch(ids)[:2]
        return self._rows([self.rows[int(i)] for i in ids])

    def _rows(self, layout: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per entry of `layout` (conversation indices), padded with the end token to seq_len + 1."""
        width = self.seq_len + 1
        rows = np.full((len(layout), width), self.pad_id, dtype=np.int64)
        loss = np.zeros((len(layout), width), dtype=bool)
        for r, members in enumerate(layout):
            at = 0
            for doc in members:
                s, n = int(self.starts[doc]), int(self.lengths[doc])
                rows[r, at:at + n] = self.tokens[s:s + n]
                loss[r, at + 1:at + n] = self.mask[s + 1:s + n]  # a conversation's first token is no target
                at += n
        rows_t = torch.from_numpy(rows)
        targets = rows_t[:, 1:].clone()
        targets[~torch.from_numpy(loss[:, 1:])] = IGNORE_INDEX
        return rows_t[:, :-1], targets
