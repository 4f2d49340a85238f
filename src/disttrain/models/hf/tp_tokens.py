"""Modules that run on this tensor-parallel rank's own tokens with whole weights, under sequence parallelism.

Gemma 4's MoE branch sits on the decoder layer itself and flattens the layer's hidden states to tokens
(`residual.reshape(-1, hidden)`) before its router, its norm and its fused experts: under sequence parallelism
that is this rank's slice of the sequence. Routing is per token (no capacity, no balancing statistics), so each
rank routes and runs its own tokens through the same whole experts and the outputs are one process's; each
rank's weight gradients are then those of its tokens only, and one process's are their sum. No torch style says
that for a module whose ops DTensor does not follow (top-k, one-hot dispatch, `index_add_`), so the weights stay
plain tensors and the module sees, during its forward, each one through an identity whose gradient is summed
over the ranks (DTensor's own rule: a `Replicate` tensor whose local gradient is declared `Partial`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate


def gradients_summed_over_ranks(module: nn.Module, tp_mesh) -> None:
    """Every parameter of `module` (and of its children) keeps its name and value; in forward the module reads a
    view of it whose gradient is all-reduced over `tp_mesh`. The view goes in the instance dictionary (found before
    `nn.Module.__getattr__` looks in `_parameters`) by a pre-hook and leaves it in the forward hook, as
    tp_heads.shard_with_heads does."""
    for owner in module.modules():
        names = [n for n, p in owner.named_parameters(recurse=False) if p.requires_grad]
        if not names:
            continue

        def summed_in(mod, args, kwargs, names=names):
            for name in names:
                whole = DTensor.from_local(mod._parameters[name], tp_mesh, [Replicate()], run_check=False)
                mod.__dict__[name] = whole.to_local(grad_placements=[Partial()])

        def summed_out(mod, args, kwargs, output, names=names):
            for name in names:
                mod.__dict__.pop(name, None)

        owner.register_forward_pre_hook(summed_in, with_kwargs=True)
        owner.register_forward_hook(summed_out, with_kwargs=True, always_call=True)
