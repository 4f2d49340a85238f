"""DeepSpeed as a second engine: the same RunConfig, trained through `deepspeed.initialize`.

DeepSpeed is an optional extra. `deepspeed_config` is pure Python (used by
`disttrain config export-deepspeed` without DeepSpeed installed); the rest imports it lazily.

What maps onto what:
  parallel.zero_stage           -> zero_optimization.stage (0-3, DeepSpeed's own partitioning)
  parallel.cpu_offload          -> offload_optimizer (stages 1-3) and offload_param (stage 3) to CPU
  precision.compute_dtype       -> bf16.enabled / fp16.enabled (dynamic loss scaling) - DeepSpeed keeps
                                   bf16/fp16 parameters with fp32 master weights in the optimizer
  optim.grad_clip               -> gradient_clipping
  train.micro_batch_size etc.   -> train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size
  optim.* / schedule            -> disttrain's own AdamW (decay on matrices only) and LambdaLR, passed
                                   to deepspeed.initialize, so both engines follow the same update rule
Checkpoints use DeepSpeed's own format inside disttrain's committed step directories; they resume
only under engine=deepspeed with the same ZeRO stage (DeepSpeed's loader unpickles, unlike DCP).
This engine is the only module that knows a DeepSpeed engine object exists.
"""

from __future__ import annotations

from pathlib import Path

import torch

from disttrain.core.errors import UserError
from disttrain.train.engine import StepResult
from disttrain.train.loss import GlobalMeanLoss, valid_targets
from disttrain.train.phases import Phases


def deepspeed_config(layout, grad_clip: float, cuda: bool = False) -> dict:
    """The DeepSpeed JSON a resolved Layout maps to: its data parallel spans the world (tp = pp = 1 here)."""
    dp, micro = layout.world_size, layout.micro_batch_size
    zero: dict = {"stage": layout.zero_stage}
    if layout.zero_stage >= 1:
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_scatter=True)
    if layout.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        if layout.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    out = {
        "train_batch_size": layout.global_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": layout.global_batch_size // (dp * micro),
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": layout.compute_dtype == "bf16"},
        "fp16": {"enabled": layout.compute_dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return out


TAG = "deepspeed"  # DeepSpeed's own checkpoint folder inside a committed step directory


def written_by_deepspeed(path: Path) -> bool:
    return (Path(path) / TAG).is_dir()


class DeepSpeedEngine:
    """DeepSpeed owns accumulation (it divides each micro-batch loss by the step count), gradient
    averaging, clipping, loss scaling, the optimizer and the LR schedule step."""

    checkpoint_format = TAG

    def __init__(self, model, optimizer, scheduler, layout, grad_clip: float, device, mean_loss: GlobalMeanLoss,
                 dp_group, phases: Phases):
        from disttrain.config.checks import INSTALL_HINT

        try:
            import deepspeed
        except ImportError:
            raise UserError(INSTALL_HINT) from None
        # DeepSpeed insists on launcher variables; a single process or an `srun` step has its own names.
        import os

        import torch.distributed as dist

        os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=deepspeed_config(layout, grad_clip, device.type == "cuda"),
                                                    dist_init_required=False)
        self.model = self.engine  # DCP-free: saves and loads go through DeepSpeed's own format
        self.scheduler, self.mean_loss, self.device = scheduler, mean_loss, device
        self.loss_groups = [dp_group]
        self.phases = phases
        self.skipped_steps: list[int] = []  # DeepSpeed skips overflowing fp16 steps itself

    def check_finite(self) -> None:
        """DeepSpeed checks its own steps (fp16 overflow skips); nothing deferred here."""

    def train_step(self, micro_batches: list, step: int) -> StepResult:
        phases, mean_loss, last = self.phases, self.mean_loss, len(micro_batches) - 1
        batches = [(x.to(self.device), y.to(self.device)) for x, y in micro_batches]
        mean_loss.start_step([y for _, y in batches])
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (x, y) in enumerate(batches):
            with phases("forward", step, i == last) as forward:
                with mean_loss.forward_with_targets(y, x):
                    out = self.engine(x)
                forward.loss = mean_loss(out, y)
                del out  # whole logits, unless the head chunks the loss: not kept through the backward
            with phases("backward", step, i == last):
                self.engine.backward(forward.loss * len(batches))  # undo DeepSpeed's 1/accumulation
            with phases("optimizer", step, i == last):  # a real update at the last micro-batch only
                self.engine.step()
            loss_sum += mean_loss.as_sum(forward.loss)
        norm = self.engine.get_global_grad_norm()
        return StepResult(loss_sum, mean_loss.targets, torch.as_tensor(norm if norm is not None else float("nan")))

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        targets = torch.zeros((), dtype=torch.float64, device=self.device)
        for x, y in micro_batches:
            x, y = x.to(self.device), y.to(self.device)
            with self.mean_loss.forward_with_targets(y, x):
                out = self.engine(x)
            total += self.mean_loss.loss_sum(out, y).detach().double()
            targets += valid_targets(y)
        return total, targets

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "scaler": {}}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])

    def save(self, path: Path, async_group=None):
        with self.phases("checkpoint"):
            self.engine.save_checkpoint(str(path), tag=TAG, save_latest=False)
        return None

    def load(self, path: Path) -> None:
        self.engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True)

    def extra_metrics(self) -> dict:
        return {}
