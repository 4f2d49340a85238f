"""The torch engine: micro-batch accumulation under DDP, ZeRO-1 (DDP + sharded optimizer),
FSDP2 (ZeRO-2/3, HSDP) or one rank, with autocast and fp16 loss scaling."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from torch import nn

from disttrain.checkpoint import dcp_io
from disttrain.parallel.parallelize import gather, gradient_sync_disabled, reshard
from disttrain.train.engine import OptimizerStep, OwnOptimizerStep
from disttrain.train.loss import RankMeanLoss, loss_context


class TorchEngine(OwnOptimizerStep):
    checkpoint_format = "dcp"
    measures_phases = True  # whether it feeds the step breakdown (forward, backward, ...)
    on_phase = staticmethod(lambda name: None)  # the loop sets the watchdog's

    def __init__(self, model: nn.Module, optimizer, step: OptimizerStep, spec, precision, device,
                 tensor_parallel: bool, dp_group, breakdown, faults, sharded_optimizer: bool = False,
                 balance=None):
        self.model, self.optimizer, self.optimizer_step = model, optimizer, step
        self.spec, self.precision, self.device = spec, precision, device
        self.tensor_parallel = tensor_parallel
        self.sharded_optimizer = sharded_optimizer  # ZeRO-1: each rank saves and loads the states it owns
        self.loss_groups = [dp_group]
        self.breakdown, self.faults = breakdown, faults
        self.forward_seconds = 0.0  # host time in forward this step (straggler statistics)
        # Uneven shares (train/balance.py): normalise by the mean rank's tokens, so the gradient
        # average over ranks is still the mean token loss of the global batch; keep FSDP's
        # parameters gathered between a rank's micro-batches; time forward passes for `auto`.
        self.balance = balance or NoBalance()

    def _loss(self, mean_loss: RankMeanLoss, x, y, step: int | None) -> torch.Tensor:
        with self.precision.autocast():
            out = self.model(x)
        loss = mean_loss(out, y)
        return self.faults.corrupt_loss(step, loss) if step is not None else loss

    def train_step(self, micro_batches: list, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The only host sync is the finiteness test of the norm (one scalar), which decides whether to step."""
        balance = self.balance
        mean_loss = RankMeanLoss(self.spec.loss_sum, balance.tokens_per_rank or sum(y.numel() for _, y in micro_batches))
        loss_sum = torch.zeros((), device=self.device)
        scaler, bd = self.precision.scaler, self.breakdown
        last = len(micro_batches) - 1
        self.forward_seconds = 0.0
        if balance.keep_gathered:  # every rank gathers once, whatever its number of micro-batches
            gather(self.model)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            sync = contextlib.nullcontext() if i == last else gradient_sync_disabled(self.model, balance.keep_gathered)
            with sync, loss_context(self.tensor_parallel):
                self.on_phase("forward")
                t0, h0 = bd.now(), time.perf_counter()
                self.faults.before_forward()
                loss = self._loss(mean_loss, x, y, step)
                self.faults.after_forward()
                t1 = bd.now()
                self.forward_seconds += time.perf_counter() - h0
                if balance.timer is not None:
                    balance.timer.add(t0, t1)
                self.on_phase("backward")
                scaler.scale(loss).backward()
                self.faults.after_backward(step)
                t2 = bd.now()
            compute_end = bd.take_compute_end()
            bd.add("forward", t0, t1)
            if i == last and compute_end is not None:  # what follows the last gradient is reduction wait
                bd.add("backward", t1, compute_end)
                bd.add("comm_exposed", compute_end, t2)
            else:
                bd.add("backward", t1, t2)
            loss_sum += mean_loss.as_sum(loss)
        self.on_phase("optimizer")
        t_opt = bd.now()
        try:
            return loss_sum, self.optimizer_step(self.model.parameters(), loss_sum, step)
        finally:
            bd.add("optimizer", t_opt, bd.now())

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: list) -> torch.Tensor:
        mean_loss = RankMeanLoss(self.spec.loss_sum, 1)
        total = torch.zeros((), device=self.device)
        if self.balance.keep_gathered:
            gather(self.model)
        for x, y in micro_batches:
            with loss_context(self.tensor_parallel):
                total += mean_loss.as_sum(self._loss(mean_loss, x.to(self.device), y.to(self.device), None))
        if self.balance.keep_gathered:  # forward-only passes left parameters gathered
            reshard(self.model)
        return total

    def save(self, path: Path, async_group=None):
        optim_state = None
        if self.sharded_optimizer:  # each rank contributes the states it owns
            from disttrain.parallel import zero1

            optim_state = zero1.zero1_state_dict(self.model, self.optimizer)
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


class NoBalance:
    """Equal shares: each rank normalises by its own tokens, FSDP reshards as configured, nothing is timed."""

    tokens_per_rank = None
    keep_gathered = False
    timer = None
