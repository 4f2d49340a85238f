"""Loss semantics, in one place (what makes layouts comparable).

The loss of a step is the mean cross-entropy over the *valid* targets of the whole global batch:
targets equal to IGNORE_INDEX (-100, PyTorch's and transformers' ignore index: padding, prompt tokens
in fine-tuning) carry no loss, and the divisor is their count over every data-parallel rank,
micro-batch, pipeline micro-batch and context-parallel shard (a context rank counts as one more
data-parallel rank here: it holds its shard of each sequence's targets, `shard_targets`). Each micro-batch backpropagates the *sum* of its target losses
(the ModelSpec's `loss_sum`) divided by the mean data-parallel rank's share of that count (global
count / dp); data-parallel gradient averaging (DDP, FSDP, DeepSpeed all divide by dp) then gives the
gradient of the global mean, whatever the shares (uneven ones included). The logged loss is that same
mean: local sums added over ranks, divided by the global count.

With `train.loss_chunk_tokens` the model's output head computes the sum itself, chunk by chunk, from the
targets it is handed before the forward (`forward_with_targets`; models/output_head.py), so that the whole
logits never exist; the sum is then what the model returns in place of its logits.

The global count needs one all-reduce of a scalar per step, issued before the first forward and
never read on the host; data that cannot mask targets (token windows) skips it: its count is known.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from disttrain.models.output_head import ChunkedLossHead, chunk_the_head_of, targets_for
from disttrain.models.spec import IGNORE_INDEX


class GlobalMeanLoss:
    """`loss_sum(outputs, targets) / (global valid targets / dp)`: the per-micro-batch loss every engine
    backpropagates (and the pipeline schedule's `loss_fn`). `start_step` sets the divisor for a step."""

    def __init__(self, loss_sum, dp_group, dp: int, masks_targets: bool, targets_per_step: int,
                 shard_targets=None):
        self.dp_group, self.dp = dp_group, dp
        self.shard_targets = shard_targets or (lambda targets: targets)
        self.model_loss_sum = loss_sum
        self.masks_targets = masks_targets  # the data may hold IGNORE_INDEX targets: count them
        self.targets: torch.Tensor | int = targets_per_step  # of the whole global batch, this step
        self.divisor: torch.Tensor | float = targets_per_step / dp
        self.heads: list[ChunkedLossHead] = []  # this rank's chunked output heads (none on a middle stage)
        self.head_sum = None  # the model output -> the loss sum its chunked head returned (the spec's `logits`)
        self.description = "whole logits"

    def chunk_the_head(self, model: nn.Module, spec, chunk_tokens: int) -> None:
        """Make the model's output head compute the loss in chunks of `chunk_tokens` tokens, where its family
        allows (before the model is parallelised: tensor parallelism plans the head by its class)."""
        head, self.description = chunk_the_head_of(model, spec, chunk_tokens)
        if head is not None:
            self.head_sum = spec.logits

    @property
    def chunked(self) -> bool:
        """Whether the model's head computes the loss in chunks (`chunk_the_head` took it)."""
        return self.head_sum is not None

    def find_heads(self, model: nn.Module) -> None:
        """The chunked heads this rank holds once the model is parallelised (a pipeline's last stage only)."""
        self.heads = [m for m in model.modules() if isinstance(m, ChunkedLossHead)]

    def forward_with_targets(self, targets: torch.Tensor, inputs: torch.Tensor | None = None,
                             microbatch: int | None = None):
        """Around the forward of a micro-batch whose outputs go to this loss: hands the heads their targets
        (`inputs`: the micro-batch's, or on a pipeline's last stage `microbatch`, its index, for an objective that
        reads them: train/preference.py)."""
        return targets_for(self.heads, self.shard_targets(targets)) if self.heads else contextlib.nullcontext()

    def start_step(self, targets: list[torch.Tensor]) -> None:
        """Collective over data parallel when the data masks targets: the step's global valid count.
        `targets`: every target tensor this rank computes in the step, already on its device."""
        if not self.masks_targets:
            return
        count = torch.stack([valid_targets(self.shard_targets(y)) for y in targets]).sum()
        dist.all_reduce(count, group=self.dp_group)
        count = count.clamp(min=1)  # a step whose every target is masked: loss 0 and no gradient, not 0/0
        self.targets, self.divisor = count, count / self.dp

    def loss_sum(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        """The target-loss sum of this rank's outputs (its shard of `targets` under context parallelism)."""
        if self.head_sum is not None:
            return self.head_sum(outputs)
        return self.model_loss_sum(outputs, self.shard_targets(targets))

    def valid_targets(self, targets: torch.Tensor) -> torch.Tensor:
        return valid_targets(self.shard_targets(targets))

    def __call__(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        loss_sum = self.loss_sum(outputs, targets)
        divisor = self.divisor
        if isinstance(loss_sum, DTensor) and isinstance(divisor, torch.Tensor):  # loss_parallel's replicated loss
            divisor = DTensor.from_local(divisor, loss_sum.device_mesh, loss_sum.placements)
        return loss_sum / divisor

    def metrics(self) -> dict:
        """What the objective reports on logging steps (nothing beyond the loss)."""
        return {}

    def start_evaluation(self) -> None:
        """Before a validation pass (an objective with its own validation figures resets them)."""

    def evaluation_metrics(self) -> dict:
        """Collective where the objective has any: its own figures of the validation pass."""
        return {}

    def uncounted(self):
        """Around a forward whose loss is not one of the step's (a pipeline's shape inference)."""
        return contextlib.nullcontext()

    def as_sum(self, loss: torch.Tensor) -> torch.Tensor:
        """Back to the micro-batch's target-loss sum, as a plain float64 tensor (for logging)."""
        return replicated_value(loss.detach()).double() * self.divisor


def valid_targets(targets: torch.Tensor) -> torch.Tensor:
    """How many targets carry loss (float64, so sums over many batches stay exact)."""
    return (targets != IGNORE_INDEX).sum().double()


def loss_context(tensor_parallel: bool):
    """Cross-entropy on vocabulary-sharded DTensor logits (forward and backward must be inside)."""
    return loss_parallel() if tensor_parallel else contextlib.nullcontext()


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor result (e.g. a loss under loss_parallel) as a plain tensor; gathers if
    the DTensor were sharded."""
    return t.full_tensor() if isinstance(t, DTensor) else t
