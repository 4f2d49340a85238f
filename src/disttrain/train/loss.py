"""Loss semantics, in one place (what makes layouts comparable).

Each micro-batch contributes the *sum* of its token losses (the ModelSpec's `loss_sum`) divided by
the mean data-parallel rank's token count for the step (global tokens / dp: with equal shares, this
rank's own count; with uneven shares, train/balance.py, the same divisor on every rank); gradient
averaging over data-parallel ranks then gives the gradient of the mean token loss over the whole
global batch. The logged loss is that same mean: local sums added over ranks, divided by the
global token count.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


class RankMeanLoss:
    """`loss_sum(outputs, targets) / rank_tokens`: the per-micro-batch loss every engine
    backpropagates (and the pipeline schedule's `loss_fn`)."""

    def __init__(self, loss_sum, rank_tokens: int):
        self.loss_sum, self.rank_tokens = loss_sum, rank_tokens

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(outputs, targets) / self.rank_tokens

    def as_sum(self, loss: torch.Tensor) -> torch.Tensor:
        """Back to this micro-batch's token-loss sum, as a plain tensor (for logging)."""
        return replicated_value(loss.detach()) * self.rank_tokens


def loss_context(tensor_parallel: bool):
    """Cross-entropy on vocabulary-sharded DTensor logits (forward and backward must be inside)."""
    return loss_parallel() if tensor_parallel else contextlib.nullcontext()


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor result (e.g. a loss under loss_parallel) as a plain tensor; gathers if
    the DTensor were sharded."""
    return t.full_tensor() if isinstance(t, DTensor) else t
