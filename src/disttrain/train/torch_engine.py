"""The torch engine: micro-batch accumulation under DDP, ZeRO-1 (DDP + sharded optimizer),
FSDP2 (ZeRO-2/3, HSDP) or one rank, with autocast and fp16 loss scaling."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from disttrain.checkpoint import dcp_io
from disttrain.parallel.parallelize import gather, gradient_sync_disabled, reshard
from disttrain.train.engine import OptimizerStep, SteppedByOptimizerStep, StepResult
from disttrain.train.loss import GlobalMeanLoss, loss_context, replicated_value
from disttrain.train.phases import Phases


class TorchEngine(SteppedByOptimizerStep):
    checkpoint_format = "dcp"

    def __init__(self, model: nn.Module, optimizer, step: OptimizerStep, mean_loss: GlobalMeanLoss, precision,
                 device, tensor_parallel: bool, dp_group, phases: Phases, sharded_optimizer: bool = False,
                 keep_gathered: bool = False, reduce_every_microbatch: bool = False):
        self.model, self.optimizer, self.optimizer_step = model, optimizer, step
        self.mean_loss, self.precision, self.device = mean_loss, precision, device
        self.tensor_parallel = tensor_parallel
        self.sharded_optimizer = sharded_optimizer  # ZeRO-1: each rank saves and loads the states it owns
        self.loss_groups = [dp_group]
        self.phases = phases
        # Uneven shares (train/balance.py): FSDP's parameters stay gathered between a rank's micro-batches,
        # so every rank issues the same all-gathers whatever its number of micro-batches.
        self.keep_gathered = keep_gathered
        # parallel.gradient_accumulation=sharded: FSDP2 reduce-scatters every micro-batch's gradients into the
        # sharded ones (gradient sync never switched off), so no whole gradient outlives its micro-batch.
        self.reduce_every_microbatch = reduce_every_microbatch

    def train_step(self, micro_batches: list, step: int) -> StepResult:
        """The only host sync is the finiteness test of the norm (one scalar), which decides whether to step."""
        phases, mean_loss, last = self.phases, self.mean_loss, len(micro_batches) - 1
        tagged = getattr(mean_loss, "packed", False)  # packed preference pairs: their targets tag their sequences
        batches = [(self.precision.inputs(x, self.device), on_device_counted(y, self.device, tagged))
                   for x, y in micro_batches]
        mean_loss.start_step([y for _, y in batches])
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.keep_gathered:
            gather(self.model)
        for i, (x, y) in enumerate(batches):
            synced = i == last or self.reduce_every_microbatch
            sync = contextlib.nullcontext() if synced else gradient_sync_disabled(self.model, self.keep_gathered)
            with sync, loss_context(self.tensor_parallel):
                with phases("forward", step, i == last) as forward:
                    with self.precision.autocast():
                        with mean_loss.forward_with_targets(y, x):
                            out = self.model(x)
                        forward.loss = mean_loss(out, y)
                        del out  # whole logits, unless the head chunks the loss: not kept through the backward
                with phases("backward", step, i == last):
                    self.precision.scaler.scale(forward.loss).backward()
            loss_sum += mean_loss.as_sum(forward.loss)
        with phases("optimizer", step):
            grad_norm = self.optimizer_step(self.model.parameters(), step)
        return StepResult(loss_sum, mean_loss.targets, grad_norm)

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        targets = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.keep_gathered:
            gather(self.model)
        for x, y in micro_batches:
            x, y = self.precision.inputs(x, self.device), on_device_counted(y, self.device,
                                                                             getattr(self.mean_loss, "packed", False))
            with loss_context(self.tensor_parallel):
                with self.precision.autocast():
                    with self.mean_loss.forward_with_targets(y, x):
                        out = self.model(x)
                total += replicated_value(self.mean_loss.loss_sum(out, y)).double()
            targets += self.mean_loss.valid_targets(y)
        if self.keep_gathered:  # forward-only passes left parameters gathered
            reshard(self.model)
        return total, targets

    def save(self, path: Path, async_group=None):
        optim_state = None
        if self.sharded_optimizer:  # each rank contributes the states it owns
            from disttrain.parallel import zero1

            optim_state = zero1.zero1_state_dict(self.model, self.optimizer)
        with self.phases("checkpoint"):
            return dcp_io.save(path, self.model, self.optimizer, async_group, optim_state)

    def load(self, path: Path) -> None:
        if self.sharded_optimizer:
            from disttrain.parallel import zero1

            loaded = dcp_io.load(path, self.model, self.optimizer, zero1.zero1_load_template(self.model, self.optimizer))
            zero1.zero1_load_state_dict(self.model, self.optimizer, loaded)
        else:
            dcp_io.load(path, self.model, self.optimizer)

    def extra_metrics(self) -> dict:
        return self.optimizer_step.metrics()


def on_device_counted(targets: torch.Tensor, device: torch.device, tagged: bool = False) -> torch.Tensor:
    """The targets on the device, carrying how many of them count (`valid_count`), counted here on the host
    copy: a chunked output head then computes only those positions' logits with no host synchronisation
    (models/output_head.py positions_with_targets); `tagged` (packed preference pairs): the targets also carry
    how many sequences they tag (`sequences`, models/packed_targets.py)."""
    from torch._subclasses.fake_tensor import is_fake

    from disttrain.models.packed_targets import count_sequences, with_sequences
    from disttrain.models.spec import IGNORE_INDEX

    host = targets.device.type == "cpu" and not is_fake(targets)  # the dry run's fake batch: no values to count
    count = int((targets != IGNORE_INDEX).sum()) if host else None
    sequences = count_sequences(targets) if host and tagged else 0
    moved = targets.to(device, non_blocking=True)
    if count is not None:
        moved.valid_count = count
    return with_sequences(moved, sequences if sequences > 1 else None)
