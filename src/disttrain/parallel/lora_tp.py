"""Tensor parallelism for a model with LoRA adapters (models/lora.py).

torch's ColwiseParallel and RowwiseParallel take only `nn.Linear`, and peft's `lora.Linear` wraps one. So
the model's own plan is applied with each wrapper's base layer standing in its place, the wrappers go
back, and each adapter pair gets the placement that matches its base:

  column-parallel base (output split over the TP ranks): lora_A whole on every rank, lora_B column-
      parallel, so the adapter's output is split exactly like the base's;
  row-parallel base (input split): lora_A row-parallel, its rank-r output all-reduced, lora_B whole.

Whole adapters are Replicate DTensors (one mesh for every parameter: FSDP2 and gradient clipping take
them as they take the base). Dropout on the adapters' input would draw differently on each TP rank, so
models/lora.py refuses it with TP; sequence parallelism with adapters is refused there too (its adapter
gradients do not yet match one process's).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from disttrain.models.lora import ADAPTER


class WholeOnEveryRank(ParallelStyle):
    """An adapter matrix replicated over the TP ranks, fed local tensors of layout `input_layout`."""

    def __init__(self, input_layout):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        layout = self.input_layout

        def as_layout(mod, inputs, mesh):  # a DTensor input (a plan that hands them on) is redistributed
            x = inputs[0]
            x = x.redistribute(mesh, (layout,)) if isinstance(x, DTensor) else \
                DTensor.from_local(x, mesh, (layout,), run_check=False)
            return (x, *inputs[1:])

        return distribute_module(  # no partition_fn: every parameter becomes a Replicate DTensor
            module, mesh, input_fn=as_layout, output_fn=lambda mod, out, mesh: out.to_local())


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


def parallelize_adapters(wrappers: dict, mesh) -> None:
    """Place each adapter pair after its (already parallelised) base layer's placement. Without sequence
    parallelism (resolve.py refuses it with LoRA) a row-parallel base's output is replicated."""
    residual = Replicate()
    for wrapper in wrappers.values():
        weight = wrapper.get_base_layer().weight
        if not isinstance(weight, DTensor):
            continue  # the plan left this layer whole: so are its adapters
        lora_a, lora_b = wrapper.lora_A[ADAPTER], wrapper.lora_B[ADAPTER]
        if weight.placements[0] == Shard(0):  # column-parallel
            parallelize_module(lora_a, mesh, WholeOnEveryRank(Replicate()))
            parallelize_module(lora_b, mesh, ColwiseParallel())
        elif weight.placements[0] == Shard(1):  # row-parallel
            parallelize_module(lora_a, mesh, RowwiseParallel(output_layouts=residual))
            parallelize_module(lora_b, mesh, WholeOnEveryRank(residual))
        else:
            raise ValueError(f"a LoRA base layer placed {weight.placements} (allowed: column or row parallel)")
