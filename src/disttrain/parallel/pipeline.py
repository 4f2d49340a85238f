"""Pipeline parallelism with `torch.distributed.pipelining`.

The full model is built (and initialised by parameter name) on every rank, then pruned to the
layers this pipeline rank owns. Stages are contiguous layer ranges, balanced by count unless
`parallel.pp_layers` says otherwise; the embedding goes to the first stage, the final norm and
output layer to the last. Interleaved and zero-bubble schedules give each rank `v = 2` virtual
stages, rank r owning stages r and r + pp (the "looped" placement those schedules expect).

Each stage is a thin view over the pruned model (`StageModule`): the parameters live once, in the
pruned model, which is what the optimizer, gradient clipping and checkpoints see — with the same
names as the unsplit model, so checkpoints reshard across layouts. Tensor parallelism, activation
checkpointing and FSDP/DDP are applied to the pruned model and its stages before the schedule is
built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from disttrain.plan.layout import MULTI_STAGE_SCHEDULES, split_layers

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
VIRTUAL_STAGES = 2


def stages_per_rank(schedule: str) -> int:
    return VIRTUAL_STAGES if schedule in MULTI_STAGE_SCHEDULES else 1


def stage_layer_ranges(n_layers: int, n_stages: int, pp_layers: list[int] | None = None) -> list[range]:
    counts = list(pp_layers) if pp_layers else split_layers(n_layers, n_stages)
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


class StageModule(nn.Module):
    """One pipeline stage: some blocks of the pruned model, plus its embedding (first stage) or
    final norm and output layer (last stage). Runs `Transformer.forward` on those parts."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.shape = model.shape
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from disttrain.models.llama import Transformer

        return Transformer.forward(self, h)


def prune_to_rank(model: nn.Module, ranges: list[range], owned: list[int]) -> None:
    """Drop what this rank's stages do not use (names of what stays are unchanged)."""
    keep = {str(i) for s in owned for i in ranges[s]}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if 0 not in owned:
        model.tok_embeddings = None
    if len(ranges) - 1 not in owned:
        model.norm = None
        model.output = None


class PipelineLoss:
    """Per micro-batch loss for the schedule: the token-loss sum divided by this data-parallel
    rank's tokens per step, so gradients add up to the same global-batch mean as without a
    pipeline (the schedule's own 1/m scaling is off)."""

    def __init__(self, local_tokens: int):
        self.local_tokens = local_tokens

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / self.local_tokens


@dataclass
class Pipeline:
    model: nn.Module  # the pruned model: every parameter this rank holds, under its original name
    stages: list[PipelineStage]
    schedule: object
    loss: PipelineLoss
    group: object
    is_last: bool
    forward_s: float = 0.0  # compute time inside the stages (forward, backward) since `take_bubble`
    backward_s: float = 0.0
    step_s: float = 0.0  # wall time of the schedule over the same steps

    def __post_init__(self):
        # Time the stages' own compute (receives happen before, sends after these calls), so
        # 1 - busy/step is the measured bubble plus exposed transfer time.
        for stage in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name), "forward_s" if "forward" in name else "backward_s"))

    def _timed(self, fn, counter: str):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)
        return wrapper

    def take_bubble(self) -> float | None:
        """This rank's idle share of schedule time since the last call (None before any step)."""
        if self.step_s <= 0:
            return None
        bubble = max(0.0, 1.0 - (self.forward_s + self.backward_s) / self.step_s)
        self.forward_s = self.backward_s = self.step_s = 0.0
        return bubble

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
        losses: list[torch.Tensor] = []  # one per micro-batch, from the last stage (the schedule's own count)
        args = (inputs,) if self.stages[0].is_first else ()
        target = targets if self.is_last else None
        if train:
            t0 = time.perf_counter()
            self.schedule.step(*args, target=target, losses=losses)
            self.step_s += time.perf_counter() - t0
        else:
            busy = self.forward_s, self.backward_s
            self.schedule.eval(*args, target=target, losses=losses)
            self.forward_s, self.backward_s = busy  # evaluation is not training time
        if losses:
            from disttrain.parallel.tensor import local_value

            local = torch.stack([local_value(x.detach()) for x in losses]).sum() * self.loss.local_tokens
        else:
            local = torch.zeros((), device=inputs.device)
        return local  # non-zero on the last stage only; summed over `group` when it is logged

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the whole per-rank batch; returns the loss sum this stage saw."""
        return self._run(inputs, targets, train=True)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only, same micro-batching (evaluation batches have the training batch's shape)."""
        return self._run(inputs, targets, train=False)


def build_pipeline(model: nn.Module, cfg, dims, meshes, device: torch.device, local_tokens: int,
                   n_microbatches: int) -> Pipeline:
    parallel = cfg.parallel
    pp_mesh = meshes.world["pp"]
    pp_rank, pp = pp_mesh.get_local_rank(), dims.pp
    v = stages_per_rank(parallel.pp_schedule)
    n_stages = pp * v
    ranges = stage_layer_ranges(model.shape.n_layers, n_stages, parallel.pp_layers or None)
    owned = [pp_rank + k * pp for k in range(v)]
    prune_to_rank(model, ranges, owned)

    if dims.tp > 1:
        from disttrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, meshes.world["tp"], parallel.sequence_parallel)
    from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing

    apply_activation_checkpointing(model, parallel.activation_checkpointing)
    if parallel.compile:
        from disttrain.parallel.apply import apply_compile

        apply_compile(model)
    modules = [StageModule(model, ranges[s], s == 0, s == n_stages - 1) for s in owned]
    if parallel.zero_stage >= 2:
        from disttrain.parallel.fsdp import apply_fsdp, fsdp_mesh

        modules = [apply_fsdp(m, fsdp_mesh(meshes, dims), zero_stage=parallel.zero_stage,
                              param_dtype=cfg.precision.fsdp_param_dtype(device.type),
                              reduce_dtype=cfg.precision.reduce_dtype, cpu_offload=parallel.cpu_offload)
                   for m in modules]
    elif dims.dp > 1:
        from disttrain.parallel.ddp import apply_ddp

        modules = [apply_ddp(m, meshes.dp.get_group(), device, parallel) for m in modules]
    group = pp_mesh.get_group()
    stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(modules, owned)]
    loss = PipelineLoss(local_tokens)
    cls = SCHEDULES[parallel.pp_schedule]
    schedule = cls(stages if v > 1 else stages[0], n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    return Pipeline(model, stages, schedule, loss, group, is_last=(n_stages - 1) in owned)
