"""A Hugging Face model directory's config.json as a ModelShape. Pure Python: config validation and
the planner read it without torch or transformers, and never touch the network."""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.errors import UserError
from disttrain.models.shape import ModelShape, MoEShape

# Decoder-only families whose config.json maps onto ModelShape (SwiGLU MLP, RMSNorm, rotary, GQA).
DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")


def read_config(directory: str) -> dict:
    path = Path(directory)
    if not path.is_dir():
        raise UserError(f"model.hf={directory}: no such directory (allowed: a local folder written by "
                        "transformers' save_pretrained)")
    file = path / "config.json"
    if not file.is_file():
        raise UserError(f"model.hf={directory}: no config.json inside (allowed: a local folder written by "
                        "transformers' save_pretrained)")
    try:
        config = json.loads(file.read_text())
    except ValueError:
        raise UserError(f"model.hf={directory}: config.json is not valid JSON") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"model.hf={directory}: config.json has no model_type")
    return config


# The same quantity under the names different families' config.json use (GPT-2: n_embd, n_layer, ...).
ALIASES = {"hidden_size": ("hidden_size", "n_embd", "d_model"), "num_hidden_layers": ("num_hidden_layers", "n_layer"),
           "num_attention_heads": ("num_attention_heads", "n_head"),
           "max_position_embeddings": ("max_position_embeddings", "n_positions")}


def _get(c: dict, key: str, default=None):
    for name in ALIASES.get(key, (key,)):
        if c.get(name) is not None:
            return c[name]
    if default is None:
        raise KeyError(key)
    return default


def hf_shape(directory: str) -> ModelShape:
    """Llama-like families map exactly; others (GPT-2) approximately: the planner's parameter count is then
    an estimate, while training uses the real module."""
    c = read_config(directory)
    try:
        dim, heads = int(_get(c, "hidden_size")), int(_get(c, "num_attention_heads"))
        rope = c.get("rope_parameters") or {}
        return ModelShape(
            dim=dim, n_layers=int(_get(c, "num_hidden_layers")), n_heads=heads,
            n_kv_heads=int(c.get("num_key_value_heads") or heads), vocab_size=int(c["vocab_size"]),
            ffn_hidden_dim=int(c.get("intermediate_size") or c.get("n_inner") or 4 * dim),
            max_seq_len=int(_get(c, "max_position_embeddings", 2048)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            qkv_bias=c["model_type"] == "qwen2" or bool(c.get("attention_bias", False)),
            head_size=int(c.get("head_dim") or 0) if int(c.get("head_dim") or 0) != dim // heads else 0,
            moe=moe_shape(c))
    except KeyError as exc:
        raise UserError(f"model.hf={directory}: config.json lacks {exc.args[0]} (a causal LM's config has "
                        "hidden_size, num_hidden_layers, num_attention_heads and vocab_size)") from None


def moe_shape(c: dict) -> MoEShape | None:
    """The experts of a transformers MoE config (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 names);
    None for a dense one. A shared expert of another width (Qwen2-MoE) counts as that many expert widths."""
    experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    if not experts:
        return None
    width = int(c.get("moe_intermediate_size") or c["intermediate_size"])
    shared = c.get("n_shared_experts") or round((c.get("shared_expert_intermediate_size") or 0) / width)
    return MoEShape(num_experts=int(experts), num_experts_per_tok=int(c["num_experts_per_tok"]),
                    moe_intermediate_size=width, n_shared_experts=int(shared),
                    first_k_dense_replace=int(c.get("first_k_dense_replace") or 0),
                    scoring_func=c.get("scoring_func") or "softmax")
