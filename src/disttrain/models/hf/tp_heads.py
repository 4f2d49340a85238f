"""Parameters that belong to attention heads, under tensor parallelism (the heads split over the ranks)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ReplicatedOverHeads(ParallelStyle):
    """A small module applied to each head on its own (Qwen3's and Gemma's query/key norms over `head_dim`): its
    weight is replicated over the tensor-parallel ranks, its input (batch, seq, this rank's heads, head_dim) is
    declared sharded over the heads, so DTensor sums the weight's gradient over every rank's heads, as one
    process sums it over all of them. transformers' name for it: `replicated_with_grad_allreduce`."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def replicate(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                         requires_grad=param.requires_grad))

        def heads_in(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(x.ndim - 2)], run_check=False) for x in inputs)

        return distribute_module(module, device_mesh, replicate, heads_in, lambda mod, out, mesh: out.to_local())


def shard_with_heads(module: nn.Module, name: str, tp_mesh) -> None:
    """A parameter with one entry per attention head along dimension 0 (gpt-oss's attention sinks, a logit per
    head in the softmax denominator) split as the heads are: `Shard(0)` over the tensor-parallel ranks, the same
    contiguous blocks of heads `ColwiseParallel` gives each rank of the query projection. Each rank's softmax then
    takes its own heads' sinks and each sink's gradient is its head's, as in one process.

    Written here because no torch style does it: the module's attention function (transformers' eager
    `eager_attention_forward`) reads `module.sinks` and concatenates it with plain tensors of this rank's heads, so
    during the module's forward the attribute must be this rank's local slice. A pre-hook puts `to_local()` of the
    DTensor parameter in the instance dictionary (found before `nn.Module.__getattr__` looks in `_parameters`;
    `to_local` carries the gradient back to the DTensor as `Shard(0)`), the forward hook removes it; the parameter
    itself, its name and what state dicts and checkpoints see stay the DTensor."""
    param = module._parameters[name]
    module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, tp_mesh, [Shard(0)]),
                                                 requires_grad=param.requires_grad))

    def local_in(mod, args, kwargs):
        mod.__dict__[name] = mod._parameters[name].to_local()

    def local_out(mod, args, kwargs, output):
        mod.__dict__.pop(name, None)

    module.register_forward_pre_hook(local_in, with_kwargs=True)
    module.register_forward_hook(local_out, with_kwargs=True, always_call=True)


class SharedByAllHeads(ParallelStyle):
    """The last `width` output columns of a replicated projection feed every attention head (DeepSeek-V3's
    `kv_a_proj_with_mqa`: its rotary key part, one key shared by all heads, beside the latent that `kv_b_proj`
    expands per head). Each rank's heads give those columns a part of their gradient; one process sums every
    head's. Forward is the identity; backward all-reduces the gradient of those columns over the tensor-parallel
    ranks (DTensor's own rule: a `Replicate` tensor whose local gradient is declared `Partial`). The other columns'
    gradient is whole already (the colwise projection they feed all-reduces its input's)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def summed_over_heads(mod, args, out):
            split = out.shape[-1] - self.width
            shared = DTensor.from_local(out[..., split:], device_mesh, [Replicate()], run_check=False)
            return torch.cat((out[..., :split], shared.to_local(grad_placements=[Partial()])), dim=-1)

        module.register_forward_hook(summed_over_heads)
        return module
