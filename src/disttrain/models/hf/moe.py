"""transformers' sparse-MoE blocks run through disttrain's dispatch, on transformers' own fused parameters.

Why disttrain's dispatch rather than transformers' expert-parallel plan (`DistributedConfig(ep_size=...)`):
that plan needs the `accelerate` package and builds its own process groups from a checkpoint load, outside
the one DeviceMesh and FSDP composition every other layout here uses; with disttrain's dispatch an HF
MoE model gets the same all-to-all, expert FSDP unit, global routing statistics, balancing loss and DCP
resharding as the built-in family, and transformers' router (its top-k and `norm_topk_prob`) still
chooses the experts. Families whose block is `gate` (returning logits, weights, indices) + `experts`
with `gate_up_proj (E, 2I, H)` and `down_proj (E, H, I)`: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.core.dtypes import at_least_fp32
from disttrain.models.moe.experts import AutocastWeights, grouped_gemm_fits, in_autocast_dtype
from disttrain.models.moe.layer import MoERouting, RoutedExperts

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


class HFRoutedExperts(RoutedExperts):
    """Replaces the forward of one block's `experts` module (parameter names unchanged)."""

    def __init__(self, block: nn.Module, routing: MoERouting):
        experts = block.experts
        self.init_routing(experts.num_experts, block.gate.top_k, routing)
        self.experts, self.act = experts, experts.act_fn
        self.logits: torch.Tensor | None = None
        self.autocast_weights = AutocastWeights()
        block.gate.register_forward_hook(self._keep_logits)
        experts.forward = self.forward

    def _keep_logits(self, module, args, output) -> None:
        self.logits = output[0]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        logits, self.logits = self.logits, None
        probs = at_least_fp32(logits).softmax(dim=-1) if logits is not None else None
        return self.routed(hidden_states, top_k_weights, top_k_index, probs, self.experts.training)

    def compute_experts(self, rows: torch.Tensor, counts: torch.Tensor, counts_list):
        # grouped_mm is on no autocast list (torch 2.13): cast as F.linear is, as the built-in experts do
        rows, (gate_up, down) = in_autocast_dtype(self.autocast_weights, rows,
                                                  (self.experts.gate_up_proj, self.experts.down_proj))
        if rows.shape[0] and grouped_gemm_fits(rows, gate_up.shape[1]) and grouped_gemm_fits(rows, down.shape[2]):
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            gate, up = F.grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
            return F.grouped_mm(self.act(gate) * up, down.transpose(-2, -1), offs=offsets)
        sizes = counts_list if counts_list is not None else counts.tolist()
        outs = []
        for e, x in enumerate(torch.split(rows, sizes)):
            gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act(gate) * up, down[e]))
        return torch.cat(outs) if outs else rows.new_zeros(0, down.shape[1])

    def release_compute_copies(self) -> None:
        self.autocast_weights.release()

    def update_bias(self, counts, rate) -> None:  # refused by validation: transformers' routers have no bias
        raise NotImplementedError


def hf_moe_layers(model: nn.Module, routing: MoERouting) -> dict[str, HFRoutedExperts]:
    """Every sparse-MoE block's routing (installed on first call, the same objects after)."""
    layers = {}
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if experts is None or not hasattr(module, "gate") or not isinstance(getattr(experts, "gate_up_proj", None),
                                                                           torch.Tensor):
            continue
        if "_disttrain_routing" not in experts.__dict__:
            experts.__dict__["_disttrain_routing"] = HFRoutedExperts(module, routing)
        layers[name] = experts.__dict__["_disttrain_routing"]
    return layers
