"""The pipeline engine: one `torch.distributed.pipelining` schedule step per optimizer step.

The schedule splits this rank's batch into its micro-batches and runs forward and backward itself;
its `loss_fn` is the same RankMeanLoss the torch engine uses, with the schedule's own 1/m scaling
off. The loss exists on the last stage only; it is summed along the pipeline when it is logged.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from disttrain.checkpoint import dcp_io
from disttrain.parallel.pipeline import PipelineParts
from disttrain.train.engine import OptimizerStep, OwnOptimizerStep
from disttrain.train.loss import RankMeanLoss, loss_context


class PipelineEngine(OwnOptimizerStep):
    checkpoint_format = "dcp"
    measures_phases = True  # whether it feeds the step breakdown (forward, backward, ...)

    def __init__(self, parts: PipelineParts, mean_loss: RankMeanLoss, optimizer, step: OptimizerStep, precision,
                 device, tensor_parallel: bool, dp_group, breakdown, faults, tied):
        self.parts, self.mean_loss, self.tied = parts, mean_loss, tied
        self.model, self.optimizer, self.optimizer_step = parts.model, optimizer, step
        self.precision, self.device, self.tensor_parallel = precision, device, tensor_parallel
        self.loss_groups = [dp_group, parts.group]
        self.breakdown, self.faults = breakdown, faults
        self.forward_seconds = 0.0
        self.params = list(self.model.parameters())  # fixed after the split: not rebuilt every step
        self.norm_params = tied.norm_params(self.params)
        # Time the stages' own compute (receives happen before, sends after these calls), so
        # 1 - busy/step is the measured bubble plus exposed transfer time.
        self.busy = {"forward": 0.0, "backward": 0.0}
        self.schedule_s = 0.0
        for stage in parts.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name), "forward" if "forward" in name else "backward"))

    def _timed(self, fn, phase: str):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy[phase] += time.perf_counter() - t0
        return wrapper

    def _run(self, micro_batches: list, train: bool) -> torch.Tensor:
        inputs = torch.cat([x for x, _ in micro_batches]).to(self.device)
        targets = torch.cat([y for _, y in micro_batches]).to(self.device)
        losses: list[torch.Tensor] = []  # one per micro-batch, from the last stage (the schedule's own count)
        args = (inputs,) if self.parts.stages[0].is_first else ()
        target = targets if self.parts.is_last else None
        with self.precision.autocast(), loss_context(self.tensor_parallel):
            # return_outputs=False: the last stage would otherwise keep every micro-batch's logits until the
            # step ends (found by the dry run: 8 GiB on the 1b's last stage at 8 x 4096 tokens); the loss is all we use.
            if train:
                self.parts.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                self.parts.schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        if not losses:
            return torch.zeros((), device=self.device)  # non-zero on the last stage only
        return torch.stack([self.mean_loss.as_sum(x) for x in losses]).sum()

    on_phase = staticmethod(lambda name: None)  # the loop sets the watchdog's

    def train_step(self, micro_batches: list, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.on_phase("pipeline schedule (forward and backward)")
        busy_f, busy_b, t0 = self.busy["forward"], self.busy["backward"], time.perf_counter()
        self.faults.before_forward()
        loss_sum = self.faults.corrupt_loss(step, self._run(micro_batches, train=True))
        self.forward_seconds = elapsed = time.perf_counter() - t0
        self.schedule_s += elapsed
        forward, backward = self.busy["forward"] - busy_f, self.busy["backward"] - busy_b
        # Host clocks: the schedule blocks on its transfers, so idle time here is bubble + transfers.
        bd = self.breakdown
        bd.add_seconds("forward", forward)
        bd.add_seconds("backward", backward)
        bd.add_seconds("comm_exposed", max(0.0, elapsed - forward - backward))
        t_opt = bd.now()
        try:
            self.tied.sync_grads()
            return loss_sum, self.optimizer_step(self.params, loss_sum, step, self.norm_params)
        finally:
            bd.add("optimizer", t_opt, bd.now())

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: list) -> torch.Tensor:
        """Forward only, same micro-batching (evaluation batches have the training batch's shape)."""
        busy = dict(self.busy)
        total = self._run(micro_batches, train=False)
        self.busy = busy  # evaluation is not training time
        return total

    def take_bubble(self) -> float | None:
        """This rank's idle share of schedule time since the last call (None before any step)."""
        if self.schedule_s <= 0:
            return None
        bubble = max(0.0, 1.0 - (self.busy["forward"] + self.busy["backward"]) / self.schedule_s)
        self.busy = {"forward": 0.0, "backward": 0.0}
        self.schedule_s = 0.0
        return bubble

    def save(self, path: Path, async_group=None):
        return dcp_io.save(path, self.model, self.optimizer, async_group)

    def load(self, path: Path) -> None:
        dcp_io.load(path, self.model, self.optimizer)

    def extra_metrics(self) -> dict:
        """Collective: the measured bubble, mean over ranks."""
        import torch.distributed as dist

        bubble = torch.tensor([self.take_bubble() or 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(bubble)
        return {**self.optimizer_step.metrics(), "pp_bubble": float(bubble) / dist.get_world_size()}
