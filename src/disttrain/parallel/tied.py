"""A parameter shared by the first and the last pipeline stage (tied input embedding and output
layer), kept tied the way Megatron-LM does it.

Each of the two stages holds its own copy, initialised identically (the whole model is built, tied,
on every rank before it is pruned). After backward the copies' gradients are summed over the pair
of ranks that hold them, so both take exactly the update one shared matrix would take; the global
gradient norm counts the matrix once (the last stage's copy is left out of it).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from disttrain.parallel.param_names import clean_fqn


class TiedAcrossStages:
    def __init__(self, model: nn.Module, tied_parameters, layout, meshes):
        self.params: list[nn.Parameter] = []
        self.duplicates: set[int] = set()  # ids of copies left out of the gradient norm
        self.group = None
        if layout.pp == 1 or not tied_parameters:
            return
        mesh = meshes.world.mesh.flatten(1)  # global ranks, (pp, every other dim)
        pairs = [[int(mesh[0, i]), int(mesh[-1, i])] for i in range(mesh.shape[1])]
        self.group, _ = dist.new_subgroups_by_enumeration(pairs)  # collective: every rank creates every pair
        held = {clean_fqn(n): p for n, p in model.named_parameters()}
        for names in tied_parameters:
            present = [n for n in names if n in held]
            if len(present) == 1:  # split across stages: this rank holds one copy
                self.params.append(held[present[0]])
                if present[0] != names[0]:
                    self.duplicates.add(id(held[present[0]]))

    def sync_grads(self) -> None:
        """Collective over the first/last stage pair: sum the copies' gradients."""
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=self.group)

    def norm_params(self, params) -> list:
        return [p for p in params if id(p) not in self.duplicates]
