"""The built-in Llama's parameter names to and from Hugging Face `LlamaForCausalLM`'s, and the
config.json that describes the same shape. disttrain's rotary embedding uses HF Llama's
rotate-half convention, so no weight permutation is needed."""

from __future__ import annotations

import re

from disttrain.models.shape import ModelShape

_HF_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def to_hf(state: dict, shape: ModelShape) -> dict:
    out = {}
    for name, tensor in state.items():
        if name == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = tensor
        elif name == "norm.weight":
            out["model.norm.weight"] = tensor
        elif name == "output.weight":
            if not shape.tie_embeddings:
                out["lm_head.weight"] = tensor
        else:
            m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
            out[f"model.layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}.weight"] = tensor
    return out


def from_hf(state: dict) -> dict:
    back = {v: k for k, v in _HF_LAYER.items()}
    out = {}
    for name, tensor in state.items():
        if name == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = tensor
        elif name == "model.norm.weight":
            out["norm.weight"] = tensor
        elif name == "lm_head.weight":
            out["output.weight"] = tensor
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
            out[f"layers.{m.group(1)}.{back[m.group(2)]}.weight"] = tensor
    return out


def hf_config(shape: ModelShape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_hidden_dim, "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads, "num_key_value_heads": shape.n_kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size, "max_position_embeddings": shape.max_seq_len, "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta, "tie_word_embeddings": shape.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }
