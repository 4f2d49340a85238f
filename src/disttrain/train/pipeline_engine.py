"""The pipeline engine: one `torch.distributed.pipelining` schedule step per optimizer step.

The schedule splits this rank's batch into its micro-batches and runs forward and backward itself;
its `loss_fn` is the same GlobalMeanLoss the torch engine uses, with the schedule's own 1/m scaling
off. The loss exists on the last stage only; it is summed along the pipeline when it is logged.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from disttrain.checkpoint import dcp_io
from disttrain.parallel.pipeline import PipelineParts
from disttrain.train.engine import OptimizerStep, SteppedByOptimizerStep, StepResult
from disttrain.train.loss import GlobalMeanLoss, loss_context
from disttrain.train.phases import PhaseEvent, Phases, Subscriber


class PipelineEngine(SteppedByOptimizerStep):
    checkpoint_format = "dcp"

    def __init__(self, parts: PipelineParts, mean_loss: GlobalMeanLoss, optimizer, step: OptimizerStep, precision,
                 device, tensor_parallel: bool, dp_group, phases: Phases, tied):
        self.parts, self.mean_loss, self.tied = parts, mean_loss, tied
        self.model, self.optimizer, self.optimizer_step = parts.model, optimizer, step
        self.precision, self.device, self.tensor_parallel = precision, device, tensor_parallel
        self.loss_groups = [dp_group, parts.group]
        self.phases = phases
        self.params = list(self.model.parameters())  # fixed after the split: not rebuilt every step
        self.norm_params = tied.norm_params(self.params)
        self.bubble = PipelineBubble()
        phases.subscribe(self.bubble)
        # DPO's reference or a teacher: (its pipeline, the LoRA layers switched off for it: the policy's own)
        self.reference: tuple[PipelineParts, list] | None = None
        self._step: int | None = None  # the step the schedule is running (None: evaluation)
        self._targets: tuple[torch.Tensor, ...] = ()  # this step's micro-batches' targets (last stage)
        for stage in parts.stages:  # each chunk announces itself (receives happen before it, sends after)
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                phase = "forward" if "forward" in name else "backward"
                setattr(stage, name, self._announced(getattr(stage, name), phase, stage.submod,
                                                     stage.is_last and name == "forward_one_chunk"))
            if stage.is_last and hasattr(stage, "_forward_metadata_inference"):
                # the schedule's first step runs the stages once to learn their shapes (torch >= 2.12), the loss
                # on the first micro-batch's targets included: the chunked head gets those targets too
                stage._forward_metadata_inference = self._with_first_targets(stage._forward_metadata_inference)
            if stage.is_last and hasattr(stage, "_backward_metadata_inference"):  # it calls the loss, on meta values
                stage._backward_metadata_inference = self._uncounted(stage._backward_metadata_inference)

    def _with_first_targets(self, infer):
        def run(*args, **kwargs):  # a forward the step's metrics must not count
            with self.mean_loss.forward_with_targets(self._targets[0]), self.mean_loss.uncounted():
                return infer(*args, **kwargs)
        return run

    def _uncounted(self, infer):
        def run(*args, **kwargs):
            with self.mean_loss.uncounted():
                return infer(*args, **kwargs)
        return run

    def _announced(self, chunk, phase: str, module, last: bool = False):
        """`last`: the last stage's forward, whose chunked output head is handed its micro-batch's targets
        (the schedule's first argument is the micro-batch's index)."""
        def run(*args, **kwargs):
            with self.phases(phase, self._step, module=module):
                if not last:
                    return chunk(*args, **kwargs)
                with self.mean_loss.forward_with_targets(self._targets[args[0]], microbatch=args[0]):
                    return chunk(*args, **kwargs)
        return run

    def _batch(self, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's whole batch, on the device: the loader hands it over in one piece (train/builder.py) and
        the schedule cuts it into its micro-batches, once."""
        (inputs, targets), = batches
        return self.precision.inputs(inputs, self.device), targets.to(self.device)

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, step: int | None) -> torch.Tensor:
        """The loss sum of this rank's micro-batches (non-zero on the last stage only)."""
        losses: list[torch.Tensor] = []  # one per micro-batch, from the last stage (the schedule's own count)
        args = (inputs,) if self.parts.stages[0].is_first else ()
        target = targets if self.parts.is_last else None
        self._step = step
        # the schedule's own cut of the targets (torch.tensor_split along the batch), for the output head
        self._targets = torch.tensor_split(targets, self.parts.microbatches) if target is not None else ()
        with self.precision.autocast(), loss_context(self.tensor_parallel):
            # return_outputs=False: the last stage would otherwise keep every micro-batch's logits until the
            # step ends (found by the dry run: 8 GiB on the 1b's last stage at 8 x 4096 tokens); the loss is all we use.
            run = self.parts.schedule.step if step is not None else self.parts.schedule.eval
            run(*args, target=target, losses=losses, return_outputs=False)
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([self.mean_loss.as_sum(x) for x in losses]).sum()

    def _run_reference(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """DPO's reference or distillation's teacher: its forward of this rank's micro-batches through a pipeline
        (the policy's own with its adapters off under LoRA, else the frozen model's), before the policy's; the loss
        keeps what each micro-batch gave on the last stage."""
        if self.reference is None:
            return
        parts, lora_layers = self.reference
        from disttrain.train.preference_reference import adapters_off

        self._targets = torch.tensor_split(targets, parts.microbatches) if parts.is_last else ()
        args = (inputs,) if parts.stages[0].is_first else ()
        with torch.no_grad(), adapters_off(lora_layers), self.mean_loss.collecting_reference(), self.precision.autocast(), \
                loss_context(self.tensor_parallel):
            parts.schedule.eval(*args, target=targets if parts.is_last else None, losses=[], return_outputs=False)
        # torch's stages keep every micro-batch's inputs and outputs for a backward (`fwd_cache`) until their next
        # step begins: a forward-only pass has none, so they go now, before the policy's pass (a reference's whole
        # logits on the last stage, a hidden state per micro-batch on the others; the loss kept what it needs)
        for stage in parts.stages:
            stage.clear_runtime_states()

    def train_step(self, micro_batches: list, step: int) -> StepResult:
        inputs, targets = self._batch(micro_batches)
        self.mean_loss.start_step([targets])
        self._run_reference(inputs, targets)
        with self.phases("pipeline", step) as schedule:
            schedule.loss = self._run(inputs, targets, step)
        with self.phases("reduce", step):
            self.tied.sync_grads()
        with self.phases("optimizer", step):
            grad_norm = self.optimizer_step(self.params, step, self.norm_params)
        return StepResult(schedule.loss, self.mean_loss.targets, grad_norm)

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only, same micro-batching (evaluation batches have the training batch's shape); the
        targets are counted where the loss is, on the last stage."""
        inputs, targets = self._batch(micro_batches)
        self._run_reference(inputs, targets)
        total = self._run(inputs, targets, None)
        count = self.mean_loss.valid_targets(targets) if self.parts.is_last else torch.zeros((), dtype=torch.float64)
        return total, count.to(self.device)

    def save(self, path: Path, async_group=None):
        with self.phases("checkpoint"):
            return dcp_io.save(path, self.model, self.optimizer, async_group)

    def load(self, path: Path) -> None:
        dcp_io.load(path, self.model, self.optimizer)

    def extra_metrics(self) -> dict:
        """Collective: the measured bubble, mean over ranks."""
        import torch.distributed as dist

        bubble = torch.tensor([self.bubble.take() or 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(bubble)
        return {**self.optimizer_step.metrics(), "pp_bubble": float(bubble) / dist.get_world_size()}


class PipelineBubble(Subscriber):
    """This rank's idle share of its training schedules: 1 - (time in its chunks) / (schedule time). The
    schedule blocks on its transfers, so idle time is the bubble plus exposed transfer time."""

    def __init__(self):
        self.busy = self.schedule_s = 0.0
        self._started = self._chunk = 0.0

    def enter(self, event: PhaseEvent) -> None:
        if event.step is None:
            return
        if event.name == "pipeline":
            self._started = time.perf_counter()
        elif event.depth == 1:
            self._chunk = time.perf_counter()

    def exit(self, event: PhaseEvent) -> None:
        if event.step is None:
            return
        if event.name == "pipeline":
            self.schedule_s += time.perf_counter() - self._started
        elif event.depth == 1:
            self.busy += time.perf_counter() - self._chunk

    def take(self) -> float | None:
        """The idle share since the last call (None before any step)."""
        if self.schedule_s <= 0:
            return None
        bubble = max(0.0, 1.0 - self.busy / self.schedule_s)
        self.busy = self.schedule_s = 0.0
        return bubble
