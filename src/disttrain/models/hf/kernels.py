"""Which attention and expert kernels a transformers model runs with, chosen by rule from what it needs.

Attention: PyTorch's `scaled_dot_product_attention` (transformers' `sdpa`) where the model supports it; the
explicit `eager` softmax where it needs what sdpa cannot take: gpt-oss's attention sinks (a learned logit in
each head's softmax denominator, declared by the model class as no sdpa support) and Gemma 2's logit
soft-capping (`attn_logit_softcapping`). `model.attn_implementation` overrides the rule; a choice the
model cannot run is refused in one line before anything is built.

Experts: transformers runs fused 3-D expert weights through `torch._grouped_mm`, which refuses float64, so
the double-precision runs that prove layouts exact could not train DeepSeek-V3 or Qwen3-Next. The
`disttrain` experts function registered here takes grouped_mm for every other dtype and transformers' own
per-expert loop (the class's original forward) for float64.
"""

from __future__ import annotations

import torch

from disttrain.core.errors import UserError

EXPERTS_NAME = "disttrain"


def _model_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def _softcap(config) -> float | None:
    return getattr(config, "attn_logit_softcapping", None)


def _sdpa_refusal(config) -> str:
    """What in this model sdpa cannot compute ('' when it can)."""
    cls = _model_class(config)
    if cls is not None and not getattr(cls, "_supports_sdpa", True):
        if config.model_type == "gpt_oss":
            return f"{cls.__name__}'s attention sinks, a learned logit in each head's softmax denominator"
        return f"{cls.__name__}'s attention, which the model declares sdpa cannot run"
    if _softcap(config) is not None:
        return f"attention-logit soft-capping (attn_logit_softcapping={_softcap(config)})"
    return ""


def choose_attention(config, requested: str, source: str) -> tuple[str, str]:
    """(transformers' attn_implementation, why) for `model.attn_implementation=requested`."""
    refusal = _sdpa_refusal(config)
    if requested == "auto":
        return ("eager", f"sdpa cannot take {refusal}") if refusal else ("sdpa", "")
    if requested == "sdpa" and refusal:
        raise UserError(f"model.attn_implementation=sdpa with {source}: sdpa cannot take {refusal} "
                        "(allowed for this model: auto, eager, flex_attention)")
    cls = _model_class(config)
    if requested == "flex_attention" and cls is not None and not getattr(cls, "_supports_flex_attn", False):
        raise UserError(f"model.attn_implementation=flex_attention with {source}: {cls.__name__} does "
                        "not support flex attention (allowed: auto, sdpa, eager)")
    return requested, "model.attn_implementation"


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    if any(p.dtype == torch.float64 for p in self.parameters(recurse=False)):
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def experts_implementation(config) -> dict:
    """`from_config` keyword arguments that route fused experts through `_experts_forward` ({} for a dense model
    or one whose experts transformers cannot dispatch)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model_class = _model_class(config)
    if model_class is None or not model_class._can_set_experts_implementation():
        return {}
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, _experts_forward)
    return {"experts_implementation": EXPERTS_NAME}
