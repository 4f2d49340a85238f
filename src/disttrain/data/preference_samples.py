"""Pairs of a preference shard directory as training samples: sample i is pair i, two sequences (chosen, then
rejected) that always travel together.

A batch of n pairs is 2n rows, each pair's chosen row followed by its rejected row, so that any cut of the rows
into micro-batches of whole pairs (the loader's, a pipeline schedule's) keeps every pair in one micro-batch.
Each row is one completion after its prompt, padded with the end token like an unpacked conversation
(data/chat_samples.py); its targets carry loss on the completion only.

With `data.packing` each micro-batch's sequences (its pairs' chosen and rejected, in order) are packed first-fit
into rows of `data.seq_len` + 1 tokens, each ended by its end token (the model's document masking keeps them
apart), and every valid target is tagged with its sequence's index in the micro-batch
(models/packed_targets.py): the loss sums each sequence's log-probability as it sums each row's unpacked, so
the pairs, the losses and the step's number of pairs stay those of the unpacked batch. The loader packs each
micro-batch alone (`packs_micro_batches`), so a pair never straddles two.
"""

from __future__ import annotations

import numpy as np
import torch

from disttrain.data.chat_samples import first_fit
from disttrain.models.packed_targets import tag
from disttrain.models.spec import IGNORE_INDEX


class PreferenceSamples:
    rows_per_sample = 2  # the loader cuts micro-batches of whole pairs
    masks_targets = True
    pads_sequences = True  # a micro-batch can be cut after its longest row (data/padding.py)
    pairs = True

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, ends: np.ndarray, seq_len: int, pad_id: int,
                 packing: bool = False):
        self.tokens, self.mask, self.seq_len, self.pad_id = tokens, mask, seq_len, pad_id
        self.packs_micro_batches = packing
        self.targets_per_sample = 2 * seq_len  # tokens a pair occupies at full width (throughput, MFU)
        ends = np.asarray(ends, dtype=np.int64)
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        lengths = ends - self.starts
        self.num_samples = len(ends) // 2
        # prepare-data cut sequences to its --seq-len; a shorter data.seq_len cuts them again here (said at start)
        self.truncated = int((lengths[:2 * self.num_samples].reshape(-1, 2) > seq_len + 1).any(axis=1).sum())
        self.lengths = np.minimum(lengths, seq_len + 1)
        held = np.minimum(seq_len, self.lengths[:2 * self.num_samples].reshape(-1, 2).max(axis=1))
        self.pair_tokens = held.astype(np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def held_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Input positions the longer row of each pair fills before its padding."""
        return self.pair_tokens[np.asarray(ids, dtype=np.int64)]

    def sample_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Tokens each pair lays into a packed micro-batch: both sequences'."""
        return self.lengths[self._sequences(ids)].reshape(-1, 2).sum(axis=1)

    def _sequences(self, ids: np.ndarray) -> np.ndarray:
        """The sequences of pairs `ids`: each pair's chosen, then its rejected."""
        return (2 * np.asarray(ids, dtype=np.int64)[:, None] + np.arange(2)).reshape(-1)

    def packed_batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(inputs, targets, held) of one packed micro-batch of pairs `ids`: its sequences first-fit into rows of
        seq_len + 1 tokens, targets tagged; `held`: the input positions its fullest row fills, at most seq_len."""
        lengths = self.lengths[self._sequences(ids)]
        layout = first_fit(lengths, self.seq_len + 1)
        inputs, targets = self._rows(ids, layout)
        return inputs, targets, min(self.seq_len, max(int(lengths[row].sum()) for row in layout))

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.packs_micro_batches:
            return self.packed_batch(ids)[:2]
        return self._rows(ids, [[i] for i in range(2 * len(ids))])

    def _rows(self, ids: np.ndarray, layout: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per entry of `layout` (indices into the pairs' sequences, chosen then rejected each)."""
        docs = self._sequences(ids)
        width = self.seq_len + 1
        rows = np.full((len(layout), width), self.pad_id, dtype=np.int64)
        loss = np.zeros((len(layout), width), dtype=bool)
        sequence = np.zeros((len(layout), width), dtype=np.int64)
        for r, members in enumerate(layout):
            at = 0
            for i in members:
                s, n = int(self.starts[docs[i]]), int(self.lengths[docs[i]])
                rows[r, at:at + n] = self.tokens[s:s + n]
                loss[r, at + 1:at + n] = self.mask[s + 1:s + n]  # a sequence's first token is no target
                sequence[r, at:at + n] = i
                at += n
        rows_t = torch.from_numpy(rows)
        targets = rows_t[:, 1:].clone()
        targets[~torch.from_numpy(loss[:, 1:])] = IGNORE_INDEX
        if self.packs_micro_batches:
            targets = tag(targets, torch.from_numpy(sequence[:, 1:]))
        return rows_t[:, :-1], targets
