"""Pairs of a preference shard directory as training samples: sample i is pair i, two sequences (chosen, then
rejected) that always travel together.

A batch of n pairs is 2n rows, each pair's chosen row followed by its rejected row, so that any cut of the rows
into micro-batches of whole pairs (the loader's, a pipeline schedule's) keeps every pair in one micro-batch.
Each row is one completion after its prompt, padded with the end token like an unpacked conversation
(data/chat_samples.py); its targets carry loss on the completion only.
"""

from __future__ import annotations

import numpy as np
import torch

from disttrain.models.spec import IGNORE_INDEX


class PreferenceSamples:
    rows_per_sample = 2  # the loader cuts micro-batches of whole pairs
    masks_targets = True
    pads_sequences = True  # a micro-batch can be cut after its longest row (data/padding.py)
    pairs = True

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, ends: np.ndarray, seq_len: int, pad_id: int):
        self.tokens, self.mask, self.seq_len, self.pad_id = tokens, mask, seq_len, pad_id
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

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.seq_len + 1
        docs = (2 * np.asarray(ids, dtype=np.int64)[:, None] + np.arange(2)).reshape(-1)
        rows = np.full((len(docs), width), self.pad_id, dtype=np.int64)
        loss = np.zeros((len(docs), width), dtype=bool)
        for r, doc in enumerate(docs):
            s, n = int(self.starts[doc]), int(self.lengths[doc])
            rows[r, :n] = self.tokens[s:s + n]
            loss[r, 1:n] = self.mask[s + 1:s + n]
        rows_t = torch.from_numpy(rows)
        targets = rows_t[:, 1:].clone()
        targets[~torch.from_numpy(loss[:, 1:])] = IGNORE_INDEX
        return rows_t[:, :-1], targets
