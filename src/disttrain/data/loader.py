"""Samples read by id, and the loader that gives each data-parallel rank its slice of a step.

Which ids a step reads is data/sampling.py's job; everything here follows that order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from disttrain.data.padding import cut_padding
from disttrain.data.token_balance import balanced_order


class TokenWindows:
    """Non-overlapping windows of seq_len+1 tokens (inputs plus the shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.targets_per_sample = seq_len
        self.pads_sequences = False  # every window is full
        self.masks_targets = False  # every target is a real next token
        self.num_samples = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [np.asarray(self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1], dtype=np.int64)
                for i in ids]
        rows = torch.from_numpy(np.stack(rows))
        return rows[:, :-1], rows[:, 1:]


class DatasetSamples:
    """A user's map-style Dataset of (input, target) pairs, read by sample id like the token windows."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.num_samples = len(dataset) if dataset is not None else 0
        first = dataset[0][1] if self.num_samples else torch.zeros(())
        self.targets_per_sample = max(1, torch.as_tensor(first).numel())
        self.masks_targets = True  # a user's targets may hold the ignore index (-100)
        self.pads_sequences = False  # what a user's samples hold is theirs

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate

        x, y = default_collate([self.dataset[int(i)] for i in ids])
        return x, y


class MixtureSamples:
    """Several sources read by (source, id) rows, e.g. a weighted mixture of shard directories."""

    def __init__(self, names: list[str], parts: list):
        self.names, self.parts = names, parts
        self.targets_per_sample = parts[0].targets_per_sample
        self.masks_targets = any(p.masks_targets for p in parts)
        self.pads_sequences = all(p.pads_sequences for p in parts)
        self.packs_micro_batches = all(getattr(p, "packs_micro_batches", False) for p in parts)
        self.num_samples = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x = y = None
        for i, part in enumerate(self.parts):
            at = np.flatnonzero(rows[:, 0] == i)
            if len(at) == 0:
                continue
            xi, yi = part.batch(rows[at, 1])
            if x is None:
                x, y = xi.new_empty((len(rows), *xi.shape[1:])), yi.new_empty((len(rows), *yi.shape[1:]))
            x[at], y[at] = xi, yi
        return x, y

    def packed_batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A padding-free micro-batch (data.padding=none): each source lays its own conversations into rows."""
        packed = [part.packed_batch(rows[rows[:, 0] == i, 1]) for i, part in enumerate(self.parts)
                  if (rows[:, 0] == i).any()]
        return (torch.cat([x for x, _, _ in packed]), torch.cat([y for _, y, _ in packed]),
                max(held for _, _, held in packed))

    def sample_tokens(self, rows: np.ndarray) -> np.ndarray:
        return self._per_row(rows, "sample_tokens")

    def held_tokens(self, rows: np.ndarray) -> np.ndarray:
        return self._per_row(rows, "held_tokens")

    def _per_row(self, rows: np.ndarray, method: str) -> np.ndarray:
        """Each (source, id) row's count, asked of its source's `method`."""
        counts = np.zeros(len(rows), dtype=np.int64)
        for i, part in enumerate(self.parts):
            at = np.flatnonzero(rows[:, 0] == i)
            if len(at):
                counts[at] = getattr(part, method)(rows[at, 1])
        return counts


class DistributedBatchLoader:
    """Yields this rank's micro-batches for successive steps; its position is checkpointed.

    `shares` (micro-batches per data-parallel rank, summing to the global batch's micro-batches)
    gives ranks uneven slices of the same global batch, in rank order; None: equal slices."""

    def __init__(self, windows, sampler, dp_rank: int, dp_size: int,
                 micro_batch_size: int, shares: list[int] | None = None, prefetch: bool = False,
                 pin_memory: bool = False, pad_multiple: int = 0):
        self.windows, self.sampler, self.dp_rank = windows, sampler, dp_rank
        self.pad_multiple = pad_multiple  # > 0: each micro-batch cut to what it holds (data/padding.py)
        self.micro_batch_size = micro_batch_size or sampler.global_batch_size // dp_size
        # Prefetch: the next step's batches are read (and pinned, for a GPU's non-blocking copy) on a
        # background thread while this step computes; reading order and content are unchanged.
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="disttrain-prefetch") if prefetch else None
        self._ahead: tuple[int, Future] | None = None
        self.set_shares(shares or [sampler.global_batch_size // dp_size // self.micro_batch_size] * dp_size)
        self.next_step = 1
        self.on_step: Callable[[np.ndarray], None] | None = None  # told each step's sample ids as it is handed out

    def set_shares(self, shares: list[int]) -> None:
        """From the next step on, rank r reads micro-batches sum(shares[:r]) .. sum(shares[:r+1])."""
        self._drop_ahead()
        self.shares = list(shares)
        m = self.micro_batch_size
        self.lo = sum(self.shares[:self.dp_rank]) * m
        self.hi = self.lo + self.shares[self.dp_rank] * m

    def sample_ids(self, step: int) -> np.ndarray:
        """The samples of this rank's micro-batches of `step`, in their order. Padding-free micro-batches on
        several ranks with equal shares are dealt equal tokens (data/token_balance.py)."""
        ids = self.sampler.indices(step)
        if getattr(self.windows, "packs_micro_batches", False) and len(self.shares) > 1 and \
                len(set(self.shares)) == 1:
            ids = balanced_order(ids, self.windows.sample_tokens(ids), self.micro_batch_size)
        return ids[self.lo:self.hi]

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = self.sample_ids(step)
        if getattr(self.windows, "packs_micro_batches", False):  # packed per micro-batch: rows per micro-batch vary
            parts = np.split(ids, max(1, len(ids) // self.micro_batch_size))
            packed = [self.windows.packed_batch(part) for part in parts]
            if self.pad_multiple:
                return [cut_padding(x, y, held, self.pad_multiple) for x, y, held in packed]
            return [(x, y) for x, y, _ in packed]
        x, y = self.windows.batch(ids)
        rows = self.micro_batch_size * getattr(self.windows, "rows_per_sample", 1)  # preference data: 2 a pair
        batches = list(zip(x.split(rows), y.split(rows)))
        if self.pad_multiple:
            held = torch.from_numpy(self.windows.held_tokens(ids)).split(self.micro_batch_size)
            batches = [cut_padding(x, y, int(h.max()), self.pad_multiple) for (x, y), h in zip(batches, held)]
        return batches

    def _read(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = self.micro_batches(step)
        return [(x.pin_memory(), y.pin_memory()) for x, y in batches] if self.pin_memory else batches

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        step = self.next_step
        ahead, self._ahead = self._ahead, None
        batches = ahead[1].result() if ahead is not None and ahead[0] == step else self._read(step)
        if self.on_step is not None:
            self.on_step(self.sample_ids(step))
        self.next_step += 1
        if self._pool is not None:
            self._ahead = (self.next_step, self._pool.submit(self._read, self.next_step))
        return batches

    def _drop_ahead(self) -> None:
        """Forget a prefetched step (its slice or position changed); waits for it so nothing races."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].result()

    def close(self) -> None:
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def state_dict(self) -> dict:
        """The next step to be consumed (not one prefetched ahead of it)."""
        return {"next_step": self.next_step, "global_batch_size": self.sampler.global_batch_size, "seed": self.sampler.seed,
                "sampler": self.sampler.state_dict(self.next_step)}

    def load_state_dict(self, state: dict) -> None:
        """Raises ValueError when the saved position cannot continue this loader's stream."""
        self._drop_ahead()
        self.next_step = int(state["next_step"])
        self.sampler.load_state_dict(state.get("sampler", {}), self.next_step)
