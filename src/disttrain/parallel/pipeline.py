"""Pipeline parallelism with `torch.distributed.pipelining`: split first, then parallelize each stage.

The full model is built (and initialised by parameter name) on every rank, then the ModelSpec
prunes it to the layers this pipeline rank owns and returns one module per owned stage (ranges
from the Layout: balanced by count unless `parallel.pp_layers` says otherwise). Each stage module
goes through `parallelize` - the same composition order as without a pipeline - and becomes a
`PipelineStage`. The pruned model keeps every parameter this rank holds under its original
name: it is what the optimizer, gradient clipping and checkpoints see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining._backward import stage_backward

from disttrain.distributed.mesh import Meshes
from disttrain.core.errors import UserError
from disttrain.layout.layout import Layout
from disttrain.parallel.parallelize import parallelize

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


class ReducingStage(PipelineStage):
    """A stage whose FSDP2 module reduce-scatters every micro-batch's gradients (parallel.gradient_accumulation=
    sharded). torch's stage switches FSDP's gradient sync off and keeps the stage gathered for every backward, then
    reduces once after the last (`perform_reduce_grad`): the stage's whole gradients and parameters live through
    the step. Here each full backward runs with sync and resharding on, as outside a pipeline, so the gradients
    add up in the shards; `perform_reduce_grad` then finds nothing left to reduce (FSDP's post-backward is a no-op
    without unsharded gradients). Zero-bubble's split backward is refused by the layout rules."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


@dataclass
class PipelineParts:
    model: nn.Module  # the pruned model: every parameter this rank holds, under its original name
    stages: list[PipelineStage]
    schedule: object
    group: object  # the pipeline process group
    is_last: bool  # this rank runs the last stage (where the loss is)
    microbatches: int = 1  # the schedule's micro-batches a step


def build_pipeline(model: nn.Module, spec, layout: Layout, meshes: Meshes, device: torch.device, options,
                   loss_fn, n_microbatches: int, materialize=None, stage_io=None, frozen: bool = False) -> PipelineParts:
    """`materialize(module)` and `stage_io(stage, module) -> (example inputs, example outputs)`: the dry run's
    meta-to-fake step after parallelisation, and stage shapes given up front (a fake process group
    cannot carry the shape exchange of the first step); `frozen`: a model that only runs forward (DPO's
    reference), parallelised without a gradient wrapper."""
    if spec.pipeline_split is None:
        raise UserError(f"parallel.pp={layout.pp}: model {spec.name} has no pipeline split (allowed for it: "
                        "parallel.pp=1)")
    pp_rank = meshes.pp.get_local_rank()
    ranges = layout.stage_layer_ranges(spec.shape.n_layers)
    owned = layout.owned_stages(pp_rank)
    modules = [parallelize(m, spec, layout, meshes, device, options, frozen=frozen)
               for m in spec.pipeline_split(model, ranges, owned)]
    if materialize is not None:  # the stages hold every parameter of the pruned model (and share buffers)
        materialize(nn.ModuleList(modules))
    group = meshes.pp.get_group()
    n_stages = layout.n_stages
    io = [stage_io(s, m) if stage_io is not None else (None, None) for s, m in zip(owned, modules)]
    stage_class = ReducingStage if layout.reduces_every_microbatch and not frozen else PipelineStage
    stages = [stage_class(m, s, n_stages, device, input_args=i, output_args=o, group=group)
              for m, s, (i, o) in zip(modules, owned, io)]
    cls = SCHEDULES[layout.pp_schedule]
    schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn,
                   scale_grads=False)
    return PipelineParts(model, stages, schedule, group, is_last=(n_stages - 1) in owned, microbatches=n_microbatches)
