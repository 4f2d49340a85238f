"""transformers' sparse-MoE blocks run through disttrain's dispatch, on transformers' own fused parameters.

Why disttrain's dispatch rather than transformers' expert-parallel plan (`DistributedConfig(ep_size=...)`):
that plan needs the `accelerate` package and builds its own process groups from a checkpoint load, outside
the one DeviceMesh and FSDP composition every other layout here uses; with disttrain's dispatch an HF
MoE model gets the same all-to-all, expert FSDP unit, global routing statistics, balancing loss and DCP
resharding as the built-in family, and transformers' router (its top-k and `norm_topk_prob`) still
chooses the experts. Families whose block is a router (`gate`, gpt-oss's `router`: returning logits, weights,
indices) + `experts` with fused 3-D weights: `gate_up_proj (E, 2I, H)` and `down_proj (E, H, I)` (Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 with its group-limited sigmoid router and shared experts, GLM-4-MoE,
Qwen3-Next), or transposed with biases and gpt-oss's clamped SwiGLU over interleaved gate and up columns. The
layout comes from the flags transformers' `use_experts_implementation` sets on the experts module
(`is_transposed`, `has_bias`) and the gating from its `_apply_gate`, so the arithmetic is transformers' own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.core.dtypes import at_least_fp32
from disttrain.models.moe.experts import AutocastWeights, grouped_gemm_fits, in_autocast_dtype
from disttrain.models.moe.layer import MoERouting, RoutedExperts

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "qwen3_next", "gpt_oss",
             "gemma4_text")
# routers whose first output is already the softmax over experts (Gemma 4), not logits
GIVES_PROBABILITIES = ("gemma4_text",)


def _router(block: nn.Module) -> nn.Module | None:
    return getattr(block, "gate", None) if hasattr(getattr(block, "gate", None), "top_k") else \
        getattr(block, "router", None)


class HFRoutedExperts(RoutedExperts):
    """Replaces the forward of one block's `experts` module (parameter names unchanged)."""

    def __init__(self, block: nn.Module, routing: MoERouting):
        experts, router = block.experts, _router(block)
        top_k = getattr(router, "top_k", None) or router.config.top_k_experts  # Gemma 4's router reads its config
        self.init_routing(experts.num_experts, top_k, routing)
        self.probabilities = getattr(getattr(router, "config", None), "model_type", "") in GIVES_PROBABILITIES
        self.experts = experts
        self.transposed, self.biased = getattr(experts, "is_transposed", False), getattr(experts, "has_bias", False)
        self.logits: torch.Tensor | None = None
        self.autocast_weights = AutocastWeights()
        router.register_forward_hook(self._keep_logits)
        experts.forward = self.forward

    def _keep_logits(self, module, args, output) -> None:
        self.logits = output[0]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        logits, self.logits = self.logits, None
        probs = None if logits is None else at_least_fp32(logits) if self.probabilities else \
            at_least_fp32(logits).softmax(dim=-1)
        return self.routed(hidden_states, top_k_weights, top_k_index, probs, self.experts.training)

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        apply = getattr(self.experts, "_apply_gate", None)
        if apply is not None:
            return apply(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.experts.act_fn(gate) * up

    def compute_experts(self, rows: torch.Tensor, counts: torch.Tensor, counts_list):
        # grouped_mm is on no autocast list (torch 2.13): cast as F.linear is, as the built-in experts do
        e = self.experts
        params = (e.gate_up_proj, e.down_proj) + ((e.gate_up_proj_bias, e.down_proj_bias) if self.biased else ())
        rows, (gate_up, down, *biases) = in_autocast_dtype(self.autocast_weights, rows, params)
        if not self.transposed:  # (E, out, in) as nn.Linear keeps them -> (E, in, out)
            gate_up, down = gate_up.transpose(-2, -1), down.transpose(-2, -1)
        if biases:  # each row gets its expert's bias
            sizes = counts if counts_list is None else torch.tensor(counts_list, device=rows.device)
            biases = [b.repeat_interleave(sizes, dim=0, output_size=rows.shape[0]) for b in biases]
        hidden = _per_expert(rows, gate_up, counts, counts_list)
        out = _per_expert(self._gate(hidden + biases[0] if biases else hidden), down, counts, counts_list)
        return out + biases[1] if biases else out

    def release_compute_copies(self) -> None:
        self.autocast_weights.release()

    def update_bias(self, counts, rate) -> None:  # refused by validation: transformers' routers have no bias
        raise NotImplementedError


def _per_expert(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, counts_list) -> torch.Tensor:
    """Rows sorted by expert times their expert's (in, out) matrix: one grouped GEMM where it fits, else a loop."""
    if rows.shape[0] and grouped_gemm_fits(rows, weight.shape[2]):
        return F.grouped_mm(rows, weight, offs=torch.cumsum(counts, 0).to(torch.int32))
    sizes = counts_list if counts_list is not None else counts.tolist()
    parts = [x @ weight[i] for i, x in enumerate(torch.split(rows, sizes))]
    return torch.cat(parts) if parts else rows.new_zeros(0, weight.shape[2])


def hf_moe_layers(model: nn.Module, routing: MoERouting) -> dict[str, HFRoutedExperts]:
    """Every sparse-MoE block's routing (installed on first call, the same objects after)."""
    layers = {}
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if experts is None or _router(module) is None or not isinstance(getattr(experts, "gate_up_proj", None),
                                                                           torch.Tensor):
            continue
        if "_disttrain_routing" not in experts.__dict__:
            experts.__dict__["_disttrain_routing"] = HFRoutedExperts(module, routing)
        layers[name] = experts.__dict__["_disttrain_routing"]
    return layers
