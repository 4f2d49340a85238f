"""Targets of several sequences packed into one row, each valid target tagged with its sequence.

A preference objective needs every sequence's own log-probability (the sum over its completion's targets).
Unpacked, a row is a sequence; packed (`data.packing` on preference pairs, data/preference_samples.py), a row
holds several, so each valid target carries the index of its sequence within the micro-batch in its high bits:
`token + (sequence << SHIFT)`; ignored targets stay IGNORE_INDEX. The tags ride in the one integer tensor the
engines already move: pinned and copied to the device, cut into a pipeline's micro-batches, sharded over context
ranks, counted as valid (anything but IGNORE_INDEX). Only the per-sequence sums read them (`split`); the
micro-batch's number of sequences travels beside them as the tensor's `sequences` attribute, counted on the
host (`count_sequences`), since a context rank's shard may hold none of the last sequence's targets.
"""

from __future__ import annotations

import torch

from disttrain.models.spec import IGNORE_INDEX

SHIFT = 32  # vocabularies stay far below 2**32 tokens


def tag(tokens: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """Targets (int64) whose valid entries carry `sequence` (same shape, >= 0) in their high bits."""
    return torch.where(tokens == IGNORE_INDEX, tokens, tokens + (sequence.to(torch.int64) << SHIFT))


def split(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the targets' tokens, IGNORE_INDEX kept; each position's sequence, 0 where ignored)."""
    valid = targets != IGNORE_INDEX
    sequence = torch.where(valid, targets >> SHIFT, torch.zeros_like(targets))
    return torch.where(valid, targets & ((1 << SHIFT) - 1), targets), sequence


def count_sequences(targets: torch.Tensor) -> int:
    """How many sequences a micro-batch's tagged targets hold (a host read of their largest tag)."""
    largest = int(targets.max()) if targets.numel() else IGNORE_INDEX
    return (largest >> SHIFT) + 1 if largest != IGNORE_INDEX else 0


def sequences_of(targets: torch.Tensor) -> int | None:
    """The number of sequences tagged targets hold (their `sequences` attribute), None for untagged targets."""
    return getattr(targets, "sequences", None)


def with_sequences(targets: torch.Tensor, count: int | None) -> torch.Tensor:
    """`targets` carrying `count` as their number of sequences (None: untagged, left as they are)."""
    if count is not None:
        targets.sequences = count
    return targets
