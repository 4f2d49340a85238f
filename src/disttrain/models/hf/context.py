"""Context parallelism for transformers' decoders, through transformers' own attention registry.

A function registered with `AttentionInterface` under `ATTENTION_NAME` (transformers then builds no mask
for it: the kernel makes its own from global positions and document ids) sends the model's attention to
`ContextParallel.attention`; a forward pre-hook keeps this rank's shard of the token ids and hands the
model their global `position_ids` (restarting per document under document masking) and the global
document index of every token (`cp_documents`, which transformers passes through to the attention
function). Only families whose attention goes through the registry with the usual rotary layout are
taken; the rest are refused by name.
"""

from __future__ import annotations

from torch import nn

ATTENTION_NAME = "disttrain_context_parallel"
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def sliding_window(config) -> int | None:
    """The attention window of any layer (Mistral; Qwen2/3 with use_sliding_window; Gemma 3's local layers),
    else None."""
    types = getattr(config, "layer_types", None) or []
    if getattr(config, "model_type", "") == "mistral" or "sliding_attention" in types:
        return getattr(config, "sliding_window", None)
    return None


def methods(config) -> tuple[tuple[str, ...], str]:
    """The `parallel.cp_method`s this model's attention can take, and why not the others."""
    if sliding_window(config) is not None:
        return ("allgather", "ulysses"), f"sliding-window attention (window {sliding_window(config)}) needs an " \
                                         "explicit mask, which the ring does not build"
    return ("ring", "allgather", "ulysses"), ""


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
               sliding_window=None, cp_documents=None, **kwargs):
    """transformers' attention-function signature -> (output (batch, seq, heads, head_dim), no weights)."""
    out = module.disttrain_context.attention(query, key, value, cp_documents, scale=scaling, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def context_parallel(model: nn.Module, cp) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module, "q_proj"):
            module.disttrain_context = cp
    model.set_attn_implementation(ATTENTION_NAME)

    def shard_inputs(module, args, kwargs):
        kwargs = dict(kwargs)
        tokens = args[0] if args else kwargs.pop("input_ids")
        tokens, positions, documents = cp.inputs(tokens, kwargs.get("position_ids"))
        kwargs.update(position_ids=positions, cp_documents=documents)
        return (tokens,), kwargs

    model.register_forward_pre_hook(shard_inputs, with_kwargs=True)
