"""Tensor parallelism for a model with LoRA adapters (models/lora.py).

torch's ColwiseParallel and RowwiseParallel take only `nn.Linear`, and peft's `lora.Linear` wraps one. So
the model's own plan is applied with each wrapper's base layer standing in its place, the wrappers go
back, and each adapter pair gets the placement that matches its base:

  column-parallel base (output split over the TP ranks): lora_A whole on every rank, lora_B column-
      parallel, so the adapter's output is split exactly like the base's;
  row-parallel base (input split): lora_A row-parallel, its rank-r output all-reduced, lora_B whole on
      the whole sequence; under sequence parallelism its output is then cut to this rank's slice (the
      base's output layout), so lora_B's gradient comes out whole. Fed the slice instead, lora_B's
      gradient would be a partial sum, and reducing it from a gradient hook runs collectives in autograd's
      order, which differs between ranks.

Whole adapters are Replicate DTensors (one mesh for every parameter: FSDP2 and gradient clipping take
them as they take the base). Dropout on the adapters' input would draw differently on each TP rank, so
models/lora.py refuses it with TP.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from disttrain.models.lora import ADAPTER


class WholeOnEveryRank(ParallelStyle):
    """An adapter matrix replicated over the TP ranks, fed local tensors of layout `input_layout`; its
    output is handed on as `output_layout` (Shard(1): this rank's sequence slice, taken locally)."""

    def __init__(self, input_layout, output_layout=Replicate()):
        super().__init__()
        self.input_layout, self.output_layout = input_layout, output_layout

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        layout = self.input_layout

        def as_layout(mod, inputs, mesh):  # a DTensor input (a plan that hands them on) is redistributed
            x = inputs[0]
            x = x.redistribute(mesh, (layout,)) if isinstance(x, DTensor) else \
                DTensor.from_local(x, mesh, (layout,), run_check=False)
            return (x, *inputs[1:])

        def handed_on(mod, out, mesh):
            return out.redistribute(mesh, (self.output_layout,)).to_local()

        return distribute_module(  # no partition_fn: every parameter becomes a Replicate DTensor
            module, mesh, input_fn=as_layout, output_fn=handed_on)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@contextlib.contextmanager
def bases_in_place(model: nn.Module):
    """Within the block, each peft wrapper is replaced by its base layer; yields the wrappers by name."""
    from peft.tuners.lora import LoraLayer

    wrappers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, wrapper in wrappers.items():
        _set(model, name, wrapper.get_base_layer())
    try:
        yield wrappers
    finally:
        for name, wrapper in wrappers.items():
            _set(model, name, wrapper)


def parallelize_adapters(wrappers: dict, mesh, sequence_parallel: bool) -> None:
    """Place each adapter pair after its (already parallelised) base layer's placement."""
    residual = Shard(1) if sequence_parallel else Replicate()  # a row-parallel base's output (the plans' rule)
    for wrapper in wrappers.values():
        weight = wrapper.get_base_layer().weight
        if not isinstance(weight, DTensor):
            continue  # the plan left this layer whole: so are its adapters
        lora_a, lora_b = wrapper.lora_A[ADAPTER], wrapper.lora_B[ADAPTER]
        if weight.placements[0] == Shard(0):  # column-parallel
            parallelize_module(lora_a, mesh, WholeOnEveryRank(Replicate()))
            parallelize_module(lora_b, mesh, ColwiseParallel())
        elif weight.placements[0] == Shard(1):  # row-parallel
            parallelize_module(lora_a, mesh, RowwiseParallel(output_layouts=Replicate()))
            parallelize_module(lora_b, mesh, WholeOnEveryRank(Replicate(), residual))
        else:
            raise ValueError(f"a LoRA base layer placed {weight.placements} (allowed: column or row parallel)")
