"""Which samples each optimizer step reads: a seeded order computed on the fly, in O(batch) memory.

The sequences of optimizer step k depend only on (seed, k, global_batch_size): global sample slot
s = (k-1)*G + j maps to epoch s // N and position s % N of that epoch's permutation. World size,
layout and micro-batching only decide which part of that batch a rank computes.

The permutation is a keyed Feistel network evaluated per position, so no rank ever holds an array
of every window (3.9 GB at 1T tokens and seq 2048 with an explicit permutation).
"""

from __future__ import annotations

import hashlib
import logging
import math

import numpy as np

log = logging.getLogger(__name__)
_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def derive_key(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, ("disttrain-data", *parts))).encode()).digest()[:8],
                          "little")


class FeistelPermutation:
    """A bijection of [0, n) picked by `key`: a balanced Feistel network on the smallest even number of
    bits covering n; values that land at or beyond n are encrypted again (cycle walking), which keeps
    it a bijection of [0, n). The domain is under 4n, so a position takes under 4 passes on average."""

    def __init__(self, n: int, key: int):
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [np.uint64(derive_key(key, r)) for r in range(_ROUNDS)]

    def _mix(self, x: np.ndarray, key: np.uint64) -> np.ndarray:
        x = (x ^ key) * _M1
        x ^= x >> np.uint64(31)
        x *= _M2
        x ^= x >> np.uint64(29)
        return x & self.mask

    def _encrypt(self, v: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = v >> half, v & self.mask
        for key in self.keys:
            left, right = right, left ^ self._mix(right, key)
        return (left << half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            v = self._encrypt(np.asarray(positions, dtype=np.uint64))
            outside = v >= self.n
            while outside.any():
                v[outside] = self._encrypt(v[outside])
                outside = v >= self.n
        return v.astype(np.int64)


class GlobalBatchSampler:
    """Sample ids of each step from one source of `num_samples` samples."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True, stream: int = 0):
        if num_samples == 0:
            raise ValueError("the data split is shorter than one sequence")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.shuffle, self.stream = seed, shuffle, stream

    def ids(self, slots: np.ndarray) -> np.ndarray:
        """Sample ids at global positions `slots` of this source's stream (epoch after epoch)."""
        slots = np.asarray(slots, dtype=np.int64)
        if not self.shuffle:
            return slots % self.num_samples
        out = np.empty_like(slots)
        epochs = slots // self.num_samples
        for epoch in np.unique(epochs):
            at = epochs == epoch
            permutation = FeistelPermutation(self.num_samples, derive_key(self.seed, self.stream, int(epoch)))
            out[at] = permutation(slots[at] % self.num_samples)
        return out

    def indices(self, step: int) -> np.ndarray:
        """Sample ids of 1-based optimizer step `step`, in global-batch order."""
        return self.ids(np.arange((step - 1) * self.global_batch_size, step * self.global_batch_size))

    def state_dict(self, next_step: int) -> dict:
        return {"order": "feistel-v1"}

    def load_state_dict(self, state: dict, next_step: int) -> None:
        if state.get("order") != "feistel-v1":  # saved before the order was computed on the fly
            log.warning("the checkpoint's loader used another sample order: steps from %d on read a different "
                        "(still seeded, world-size-independent) stream", next_step)


def _suffix_shares(weights: list[float]) -> list[float]:
    """Level i of the split gives source i this fraction of the slots the earlier levels left."""
    return [w / math.fsum(weights[i:]) for i, w in enumerate(weights[:-1])]


class SourceSchedule:
    """Which source each global slot reads, and the how-manieth sample of that source it is.

    Slots are dealt level by level: source 0 takes slot r of the stream exactly when floor(p0*(r+1))
    > floor(p0*r) (a Sturmian sequence: of the first R slots it has floor(p0*R)); the slots it leaves are
    renumbered and dealt the same way to source 1, and so on. Both a slot's source and each source's
    count before any slot are closed forms of the slot number, so a step's composition is within one
    sample per level of its weights, cumulatively exact, and independent of the world size."""

    def __init__(self, weights: list[float]):
        self.weights = [float(w) for w in weights]
        self.levels = _suffix_shares(self.weights)

    def assign(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rank = np.asarray(slots, dtype=np.int64).copy()
        source = np.full(len(rank), len(self.weights) - 1, dtype=np.int64)
        open_ = np.arange(len(rank))
        for i, p in enumerate(self.levels):
            r = rank[open_].astype(np.float64)
            before = np.floor(p * r).astype(np.int64)
            take = np.floor(p * (r + 1)).astype(np.int64) > before
            source[open_[take]] = i
            rank[open_] = np.where(take, before, rank[open_] - before)
            open_ = open_[~take]
        return source, rank

    def consumed(self, num_slots: int) -> list[int]:
        """Samples each source has given in the first `num_slots` slots."""
        counts, left = [], num_slots
        for p in self.levels:
            c = int(np.floor(p * np.float64(left)))
            counts.append(c)
            left -= c
        return counts + [left]


class MixtureSampler:
    """(source, sample id) of each step of a weighted mixture; every source has its own shuffled stream.

    The stream of source i is read in order, so its position is a count that is checkpointed; a resumed
    run whose weights changed continues every source from where it stopped (`load_state_dict`)."""

    def __init__(self, sizes: list[int], weights: list[float], global_batch_size: int, seed: int,
                 shuffle: bool = True):
        self.sources = [GlobalBatchSampler(n, global_batch_size, seed, shuffle, stream=i) for i, n in enumerate(sizes)]
        self.schedule = SourceSchedule(weights)
        self.global_batch_size, self.seed = global_batch_size, seed
        self.base_slot, self.base_consumed = 0, [0] * len(sizes)

    def indices(self, step: int) -> np.ndarray:
        """(G, 2) int64 rows of (source, sample id) for 1-based step `step`, in global-batch order."""
        slots = np.arange((step - 1) * self.global_batch_size, step * self.global_batch_size) - self.base_slot
        source, rank = self.schedule.assign(slots)
        ids = np.empty_like(rank)
        for i, sampler in enumerate(self.sources):
            at = source == i
            ids[at] = sampler.ids(rank[at] + self.base_consumed[i])
        return np.stack([source, ids], axis=1)

    def consumed(self, next_step: int) -> list[int]:
        """Samples each source gave in the steps before `next_step`."""
        counts = self.schedule.consumed((next_step - 1) * self.global_batch_size - self.base_slot)
        return [b + c for b, c in zip(self.base_consumed, counts)]

    def state_dict(self, next_step: int) -> dict:
        return {"order": "feistel-v1", "weights": self.schedule.weights, "consumed": self.consumed(next_step),
                "base_slot": self.base_slot, "base_consumed": list(self.base_consumed)}

    def load_state_dict(self, state: dict, next_step: int) -> None:
        if len(state.get("consumed", [])) != len(self.sources):
            raise ValueError(f"the checkpoint's data mixture has {len(state.get('consumed', []))} sources, "
                             f"data.source has {len(self.sources)}")
        if [float(w) for w in state["weights"]] == self.schedule.weights:
            self.base_slot, self.base_consumed = int(state["base_slot"]), list(state["base_consumed"])
        else:  # new weights from here on; every source continues from its saved position
            self.base_slot, self.base_consumed = (next_step - 1) * self.global_batch_size, list(state["consumed"])
