"""A step's samples dealt to its micro-batches so that each holds about as many tokens as the others.

With padding-free micro-batches (`data.padding=none`, packed preference pairs) a micro-batch costs about what
its tokens cost, not its row count times its longest sequence. Data-parallel ranks wait for each other at every
gradient reduction, so the rank whose micro-batches drew the longest conversations sets the step's pace: with 8
conversations a micro-batch of a length spread like chat data's, one rank holds about 15% more tokens than the
other. Dealing the step's samples longest first, each to the micro-batch with the fewest tokens that still has
room, evens that out. The step trains on the same samples with the same global loss (a sum over every rank's
targets), so only the order of the sums changes; each micro-batch keeps `micro_batch_size` samples, in their
order in the step. The deal depends on the step's ids alone: every rank computes the same one, and a resumed
run (on any world size) the same as the first.
"""

from __future__ import annotations

import heapq

import numpy as np


def balanced_order(ids: np.ndarray, tokens: np.ndarray, micro_batch_size: int) -> np.ndarray:
    """`ids` (one step's samples: rows of an id array) reordered into micro-batches of `micro_batch_size` whose
    token counts (`tokens[i]` for `ids[i]`) differ as little as a greedy deal makes them."""
    groups = len(ids) // micro_batch_size
    if groups <= 1:
        return ids
    members: list[list[int]] = [[] for _ in range(groups)]
    heap = [(0, g) for g in range(groups)]  # (tokens so far, micro-batch): the lightest with room first
    for i in np.argsort(-np.asarray(tokens), kind="stable"):
        load, g = heapq.heappop(heap)
        members[g].append(int(i))
        if len(members[g]) < micro_batch_size:
            heapq.heappush(heap, (load + int(tokens[i]), g))
    return ids[np.concatenate([sorted(m) for m in members])]
