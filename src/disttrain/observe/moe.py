"""Routing of each MoE layer on logging steps: the tokens each expert was chosen for over the global
batch, their max/mean imbalance, dropped tokens, the balancing loss and the router's entropy.

The layers' statistics are summed over the data-parallel ranks here, when a logging step reads them (one
all-reduce; models/moe/layer.py), unless a balancing loss or bias summed them already; under a
pipeline each stage holds some layers, so the summaries are gathered over the pipeline ranks
(a collective, on logging steps only). Record keys: `moe_tokens_per_expert` ({layer: counts}, the
TensorBoard histogram), and per layer `moe_<n>_load_imbalance`, `_dropped_tokens`, `_aux_loss`,
`_router_entropy` (scalars every sink takes), plus totals `moe_dropped_tokens` and `moe_aux_loss`.
"""

from __future__ import annotations

import re

import torch.distributed as dist

from disttrain.models.moe.layer import reduce_routing_statistics
from disttrain.parallel.param_names import clean_fqn

SCALARS = ("load_imbalance", "dropped_tokens", "aux_loss", "router_entropy")


class RoutingMonitor:
    def __init__(self, layers: dict, pp_group=None):
        self.layers = {clean_fqn(name): layer for name, layer in layers.items()}
        self.pp_group = pp_group

    def record(self) -> dict:
        reduce_routing_statistics(self.layers.values())  # summed over data-parallel ranks only when read
        summaries = {name: s for name, layer in self.layers.items() if (s := layer.step_summary()) is not None}
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            gathered: list = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, summaries, group=self.pp_group)
            summaries = {k: v for part in gathered for k, v in part.items()}
        if not summaries:
            return {}
        summaries = dict(sorted(summaries.items(), key=lambda kv: _layer_index(kv[0])))
        record = {"moe_tokens_per_expert": {name: s["tokens_per_expert"] for name, s in summaries.items()},
                  "moe_dropped_tokens": sum(s["dropped_tokens"] for s in summaries.values()),
                  "moe_aux_loss": sum(s["aux_loss"] for s in summaries.values())}
        for name, s in summaries.items():
            record.update({f"moe_{_layer_index(name)}_{key}": s[key] for key in SCALARS})
        return record


def _layer_index(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else -1
