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
COLLAPSED = 0.9  # a layer's load imbalance above this share of its maximum (E / k) counts as collapsed ...
COLLAPSED_FOR = 3  # ... once it stays there this many logged steps in a row: one warning per layer


class RoutingMonitor:
    def __init__(self, layers: dict, pp_group=None):
        self.layers = {clean_fqn(name): layer for name, layer in layers.items()}
        self.pp_group = pp_group
        self.streaks: dict[str, int] = {}
        self.warned: set[str] = set()
        self.warnings: list[str] = []  # collapse warnings of the last record (rank 0 prints them)

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
        self.warnings = self._collapses(summaries)
        return record

    def _collapses(self, summaries: dict) -> list[str]:
        """A line for each layer whose routing newly stayed collapsed COLLAPSED_FOR logged steps: which experts
        take the tokens, and the keys that balance it (silent before: only metrics.jsonl showed it)."""
        lines = []
        for name, s in summaries.items():
            collapsed = s["load_imbalance"] > COLLAPSED * s["max_imbalance"]
            self.streaks[name] = self.streaks.get(name, 0) + 1 if collapsed else 0
            if self.streaks[name] < COLLAPSED_FOR or name in self.warned:
                continue
            self.warned.add(name)
            counts = s["tokens_per_expert"]
            busy = sorted(range(len(counts)), key=lambda e: -counts[e])[:max(1, sum(c > 0 for c in counts))]
            taken, share = [], 0
            for e in busy:  # the fewest experts that hold 90% of the assignments
                taken.append(e)
                share += counts[e]
                if share >= COLLAPSED * sum(counts):
                    break
            routing = getattr(self.layers.get(name), "routing", None)  # None: a layer of another stage
            lines.append(f"MoE layer {_layer_index(name)}: routing collapsed for {self.streaks[name]} logged steps: "
                         f"experts {sorted(taken)} of {len(counts)} take {share / max(sum(counts), 1):.0%} of the "
                         f"tokens (load imbalance {s['load_imbalance']:.2f}, at most {s['max_imbalance']:.2f}); "
                         + _remedy(routing))
        return lines


def _remedy(routing) -> str:
    """The keys to change, given the balancing in force (unknown for a layer on another pipeline stage)."""
    if routing is not None and routing.bias_update_rate:
        return f"raise model.moe.bias_update_rate (now {routing.bias_update_rate:g}) or add model.moe.aux_loss_coef"
    if routing is not None and routing.aux_loss_coef:
        return f"raise model.moe.aux_loss_coef (now {routing.aux_loss_coef:g}) or add model.moe.bias_update_rate"
    return "balance it with model.moe.aux_loss_coef=0.001 or (built-in MoE) model.moe.bias_update_rate=0.001"


def _layer_index(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else -1
