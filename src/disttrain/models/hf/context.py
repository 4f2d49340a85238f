"""Context parallelism for transformers' decoders, through transformers' own attention registry.

A function registered with `AttentionInterface` under `ATTENTION_NAME` (transformers then builds no mask
for it: the kernel makes its own from global positions and document ids) sends the model's attention to
`ContextParallel.attention`; a forward pre-hook keeps this rank's shard of the token ids and hands the
model their global `position_ids` (restarting per document under document masking) and the global
document index of every token (`cp_documents`, which transformers passes through to the attention
function). Every input a layer computes from the token ids alone (Gemma 4's per-layer input embeddings)
is computed from this rank's tokens. The kernel takes each layer's window, gpt-oss's attention sinks
(`s_aux`) and a value head dim other than the keys' (DeepSeek's latent attention).

Gated DeltaNet layers (Qwen3-Next, Qwen3.5) run transformers' own forward with the two functions that carry
state along the sequence, the causal convolution `causal_conv1d_fn` and the recurrence
`torch_chunk_gated_delta_rule` (module globals of the modeling file, which the forward calls by name), swapped
for the duration of the call for `ContextParallel.causal_conv` / `.gated_delta_rule` around the layer's kernels
(linear_kernels.py): those bring in the previous chunk's last inputs and recurrent state, and under document
masking hand each chunk its tokens' positions in their documents (parallel/linear_attention.py). Other families whose
layers carry state along the sequence outside attention are refused by name (`refusal`).
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

from disttrain.models.hf import linear_kernels
from disttrain.models.hf.float64 import keeping_float64

ATTENTION_NAME = "disttrain_context_parallel"
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma4_text", "gpt_oss", "glm4_moe",
               "deepseek_v3", "qwen3_next", "qwen3_5_text")


def refusal(config) -> str:
    """Why this model cannot shard its sequence ("" when it can)."""
    kind = getattr(config, "model_type", "")
    if kind in MODEL_TYPES:
        return ""
    if "linear_attention" in (getattr(config, "layer_types", None) or []):
        return ("its linear-attention layers carry a recurrent state and a causal convolution along the sequence, "
                "which context parallelism passes across the shards for qwen3_next and qwen3_5_text only")
    return f"context parallelism needs the built-in model or a transformers model of type {', '.join(MODEL_TYPES)}"


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
               sliding_window=None, cp_documents=None, s_aux=None, **kwargs):
    """transformers' attention-function signature -> (output (batch, seq, heads, v head_dim), no weights);
    `s_aux`: gpt-oss's attention sinks."""
    out = module.disttrain_context.attention(query, key, value, cp_documents, scale=scaling, window=sliding_window,
                                             sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=None)
def _calls_the_attention_interface(cls: type) -> bool:
    """A module whose forward calls transformers' registered attention function (whatever its projections:
    q_proj, or DeepSeek's q_a_proj/q_b_proj)."""
    if cls.forward is nn.Module.forward:
        return False
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _across_shards(module: nn.Module, cp) -> None:
    """`module` (a Gated DeltaNet layer) runs its own forward with its sequence kernels (transformers', or the
    document-aware ones under document masking: linear_kernels.py) wrapped by context-parallel ones (module doc); a
    float64 recurrence stays float64 when computed again in backward (float64.py)."""
    conv, rule = linear_kernels.kernels(module)
    linear_kernels.replace(module, functools.partial(cp.causal_conv, conv),
                           functools.partial(cp.gated_delta_rule, keeping_float64(rule)))


def context_parallel(model: nn.Module, cp) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    attending = [m for m in model.modules() if _calls_the_attention_interface(type(m))]
    if not attending:
        raise ValueError(f"{type(model).__name__} has no module calling transformers' attention interface")
    for module in attending:
        module.disttrain_context = cp
    for module in linear_kernels.layers(model):
        _across_shards(module, cp)
    model.set_attn_implementation(ATTENTION_NAME)

    def shard_inputs(module, args, kwargs):
        kwargs = dict(kwargs)
        tokens = args[0] if args else kwargs.pop("input_ids")
        tokens, positions, documents = cp.inputs(tokens, kwargs.get("position_ids"))
        kwargs.update(position_ids=positions, cp_documents=documents)
        return (tokens,), kwargs

    model.register_forward_pre_hook(shard_inputs, with_kwargs=True)
