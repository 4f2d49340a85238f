"""The step-engine protocol, and the optimizer step the torch and pipeline engines share.

An engine owns one optimizer step end to end: forward and backward of this rank's micro-batches,
gradient reduction, loss scaling, clipping, the optimizer and LR schedule, and whatever it saves or
loads differently. The loop (train/loop.py) sees only this protocol, so it never asks which engine
it drives.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from disttrain.observe.health import NonFiniteError
from disttrain.train.optim import clip_grad_norm_global
from disttrain.train.phases import Phases


class StepResult(NamedTuple):
    loss_sum: torch.Tensor  # this rank's sum of target losses (float64; on a pipeline's last stage only)
    targets: torch.Tensor | int  # the global number of valid targets of the step (the loss's divisor)
    grad_norm: torch.Tensor  # the global gradient norm, before clipping


class StepEngine(Protocol):
    """`train_step` is the training math; where it is (forward, backward, reduce, optimizer, checkpoint)
    it announces through `phases`, which the loop's observers subscribe to (train/phases.py)."""

    mean_loss: object  # the objective (train/loss.py's GlobalMeanLoss or train/preference.py's PreferenceLoss)
    model: nn.Module  # every parameter this rank holds, under checkpoint names (a pipeline's pruned model)
    loss_groups: list  # process groups a local loss sum is added over to make the global sum
    skipped_steps: list[int]  # steps whose update a non-finite gradient norm skipped
    checkpoint_format: str  # what `save` writes ("dcp", "deepspeed"): recorded in COMMIT, checked on resume
    phases: Phases

    def train_step(self, micro_batches: list, step: int) -> StepResult: ...

    def check_finite(self) -> None:
        """Raise NonFiniteError if a step's gradient norm was not finite and the run stops on that (the check is
        deferred to logging steps and saves: no host sync per step)."""

    def eval_loss_sum(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's target-loss sum, its valid targets), both float64; the loop adds them over loss_groups."""

    def lr(self) -> float: ...

    def state_dict(self) -> dict:
        """Small engine state for train_state.pt (LR schedule, loss scaler)."""

    def load_state_dict(self, state: dict) -> None: ...

    def save(self, path: Path, async_group=None):
        """Write model and optimizer state into `path` (collective). Returns a future when async."""

    def load(self, path: Path) -> None: ...

    def extra_metrics(self) -> dict:
        """Engine-specific numbers for a logging step (loss scale, pipeline bubble, ...)."""


class OptimizerStep:
    """Unscale, clip over every shard and stage, skip non-finite steps, step, schedule."""

    def __init__(self, optimizer, scheduler, precision, grad_clip: float, nonfinite: str, pp_group=None,
                 control_group=None, keep_gradients: bool = False):
        self.optimizer, self.scheduler, self.precision = optimizer, scheduler, precision
        self.control_group = control_group  # a CPU (gloo) group over the world, for host-side scalars
        self.clip = grad_clip or float("inf")
        self.nonfinite, self.pp_group = nonfinite, pp_group
        self.skipped_steps: list[int] = []
        # DDP: gradients are views into its buckets. Zeroed in place they stay views, so the micro-batches
        # before the synchronising one accumulate into the buckets; set to None, those micro-batches
        # would allocate a second copy of every gradient beside the buckets (measured by the dry run).
        self.set_to_none = not keep_gradients
        self.fp16_overflows = 0.0
        # metrics.nonfinite=stop: the first step whose gradient norm was not finite, kept on the device and read
        # by `check_finite` (logging steps, before a save): no host sync in any other step
        self.first_nonfinite: torch.Tensor | None = None
        self.before_clip: list = []  # gradient reductions no wrapper does (expert parallelism under DDP)
        self.after_step: list = []  # called with whether the parameters were updated (MoE routing statistics)

    def __call__(self, params, step: int, norm_params=None) -> torch.Tensor:
        scaler = self.precision.scaler
        scaler.unscale_(self.optimizer)
        if scaler.is_enabled():  # overflow count stays on the device until a logging step reads it
            found = sum(v.float() for v in scaler._found_inf_per_device(self.optimizer).values())
            self.fp16_overflows = self.fp16_overflows + found
        for reduce in self.before_clip:
            reduce()
        grad_norm = clip_grad_norm_global(params, self.clip, self.pp_group, norm_params)
        # fp16 leaves non-finite steps to the GradScaler. A fake tensor (the dry run) has no value to read: it
        # counts as finite. `stop` notes the step on the device (the run stops at the next check: a NaN update
        # taken meanwhile is never saved); `skip_step` must know before the update: one scalar to the host.
        if not scaler.is_enabled() and not is_fake(grad_norm) and self.nonfinite == "stop":
            self._note_nonfinite(grad_norm, step)
        elif not scaler.is_enabled() and not is_fake(grad_norm) and not bool(torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=self.set_to_none)
            self.scheduler.step()
            self.skipped_steps.append(step)
            for hook in self.after_step:
                hook(False)
            return grad_norm
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        self.scheduler.step()
        for hook in self.after_step:
            hook(True)
        return grad_norm

    def _note_nonfinite(self, grad_norm: torch.Tensor, step: int) -> None:
        bad = ~torch.isfinite(grad_norm)
        if self.first_nonfinite is None:
            self.first_nonfinite = torch.full((), -1, dtype=torch.int64, device=grad_norm.device)
        first = self.first_nonfinite
        self.first_nonfinite = torch.where(bad & (first < 0), step, first)

    def check_finite(self) -> None:
        """One host read: NonFiniteError if a step since the run began had a non-finite gradient norm."""
        if self.first_nonfinite is not None and (step := int(self.first_nonfinite)) >= 0:
            raise NonFiniteError(f"non-finite gradient norm at step {step}; metrics.nonfinite=skip_step would drop "
                                 "such steps")

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])  # a CPU tensor under 8-bit states (torchao's)

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.precision.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.precision.scaler.load_state_dict(state["scaler"])

    def metrics(self) -> dict:
        """Collective when fp16 loss scaling is on: the scale on every rank (min and max over ranks,
        which agree unless a rank skipped a step the others took); and the optimizer's own numbers, if any."""
        scaler = self.precision.scaler
        own = self.optimizer.metrics() if hasattr(self.optimizer, "metrics") else {}  # Muon's (train/muon.py)
        if not scaler.is_enabled():
            return own
        import torch.distributed as dist

        scale = float(scaler.get_scale())
        spread = torch.tensor([scale, -scale], dtype=torch.float64)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self.control_group)
        return {**own, "loss_scale": scale, "loss_scale_max": float(spread[0]), "loss_scale_min": -float(spread[1]),
                "fp16_overflows_total": int(float(self.fp16_overflows))}


class SteppedByOptimizerStep:
    """A base for the engines whose update is an `OptimizerStep` (torch, pipeline): what they delegate to it."""

    optimizer_step: OptimizerStep

    @property
    def skipped_steps(self) -> list[int]:
        return self.optimizer_step.skipped_steps

    def check_finite(self) -> None:
        self.optimizer_step.check_finite()

    def lr(self) -> float:
        return self.optimizer_step.lr()

    def state_dict(self) -> dict:
        return self.optimizer_step.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer_step.load_state_dict(state)
