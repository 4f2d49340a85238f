"""A Hugging Face model directory's config.json as a ModelShape. Pure Python: config validation and
the planner read it without torch or transformers, and never touch the network."""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.core.errors import UserError
from disttrain.core.hub import local_directory
from disttrain.models.shape import BlockExtras, LinearAttentionShape, MLAShape, ModelShape, MoEShape


def read_config(directory: str) -> dict:
    """`model.hf`'s config.json: a local directory's, or a Hub id's from its cached snapshot (core/hub.py)."""
    path = Path(local_directory(directory))
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
    return config_shape(read_config(directory), f"model.hf={directory}")


def config_shape(c: dict, source: str) -> ModelShape:
    """A config.json's contents as a ModelShape; `source` (`model.hf=DIR`) starts each error line."""
    try:
        dim, heads = int(_get(c, "hidden_size")), int(_get(c, "num_attention_heads"))
        rope = c.get("rope_parameters") or {}
        mla = _mla(c)
        if mla is not None:  # every head has its own key and value: n_kv_heads = n_heads
            c = {**c, "num_key_value_heads": heads, "head_dim": mla.qk_head_dim}
        return ModelShape(
            dim=dim, n_layers=int(_get(c, "num_hidden_layers")), n_heads=heads,
            n_kv_heads=int(c.get("num_key_value_heads") or heads), vocab_size=int(c["vocab_size"]),
            ffn_hidden_dim=int(c.get("intermediate_size") or c.get("n_inner") or 4 * dim),
            max_seq_len=int(_get(c, "max_position_embeddings", 2048)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            qkv_bias=c["model_type"] == "qwen2" or bool(c.get("qkv_bias", c.get("attention_bias", False))),
            head_size=int(c.get("head_dim") or 0) if int(c.get("head_dim") or 0) != dim // heads else 0,
            moe=_moe(c, source), mla=mla, rotary_tables=False, extras=_extras(c), norm_kind=_norm_kind(c))
    except KeyError as exc:
        raise UserError(f"{source}: config.json lacks {exc.args[0]} (a causal LM's config has "
                        "hidden_size, num_hidden_layers, num_attention_heads and vocab_size)") from None


def _moe(c: dict, source: str) -> MoEShape | None:
    """transformers' MoE keys as MoEShape: the routed experts are `num_experts` (Qwen, OLMoE), `n_routed_experts`
    (DeepSeek) or `num_local_experts` (Mixtral, gpt-oss); each expert's width is `moe_intermediate_size`, or
    `intermediate_size` where a family has no dense MLP beside its experts (Mixtral, OLMoE, gpt-oss)."""
    experts = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    if not experts:
        return None
    width = int(c.get("moe_intermediate_size") or c["intermediate_size"])
    shared = int(c.get("n_shared_experts") or 0)
    shared_width = int(c.get("shared_expert_intermediate_size") or 0)  # Qwen2-MoE: one shared expert this wide
    if shared_width:
        if shared_width % width:
            raise UserError(f"{source}: shared_expert_intermediate_size={shared_width} is not a multiple "
                            f"of moe_intermediate_size={width} (allowed: shared experts as wide as k routed ones)")
        shared = shared_width // width
    dense = c.get("first_k_dense_replace") or 0
    only = sorted(c.get("mlp_only_layers") or [])
    if only:
        if only != list(range(len(only))) or dense:
            raise UserError(f"{source}: mlp_only_layers={only} (allowed: the leading layers 0..k-1, "
                            "which become first_k_dense_replace)")
        dense = len(only)
    if int(c.get("decoder_sparse_step") or 1) != 1:
        raise UserError(f"{source}: decoder_sparse_step={c['decoder_sparse_step']} (allowed: 1; MoE "
                        "blocks after first_k_dense_replace leading dense ones, not interleaved)")
    scoring = c.get("scoring_func") or ("sigmoid" if c["model_type"].startswith("deepseek_v3") else "softmax")
    top_k = int(c.get("num_experts_per_tok") or c.get("top_k_experts") or 0)  # Gemma 4: top_k_experts
    if not 0 < top_k <= int(experts):
        raise UserError(f"{source}: num_experts_per_tok={top_k} (allowed: 1 to the {experts} experts)")
    return MoEShape(num_experts=int(experts), num_experts_per_tok=top_k, moe_intermediate_size=width,
                    n_shared_experts=shared, first_k_dense_replace=int(dense), scoring_func=scoring)


def _mla(c: dict) -> MLAShape | None:
    if not c.get("kv_lora_rank"):
        return None
    return MLAShape(kv_lora_rank=int(c["kv_lora_rank"]), q_lora_rank=int(c.get("q_lora_rank") or 0),
                    qk_nope_head_dim=int(c["qk_nope_head_dim"]), qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                    v_head_dim=int(c["v_head_dim"]))


# RMSNorms that multiply their weight into the fp32 normalised tensor (`1 + weight` ones, gpt-oss's, OLMo 2's), where
# the Llama-style ones cast it back to the input's dtype first
FP32_PRODUCT_NORMS = ("gpt_oss", "gemma", "gemma2", "gemma3_text", "gemma4_text", "qwen3_next", "qwen3_5_text", "olmo2")
# Of those, the ones counted as such (listed tensor by tensor: a tiny gpt-oss's peak, plan/norms.py); the others are
# counted as a fused kernel until theirs are (Gemma 4's are, with its layers: plan/per_layer_inputs.py)
COUNTED_FP32_PRODUCT_NORMS = ("gpt_oss",)
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "gemma3_text", "gemma4_text")  # per head_dim


def _norm_kind(c: dict) -> str:
    """`ModelShape.norm_kind` of a config.json: GPT-2's LayerNorm is torch's kernel (no `rms_norm_eps`)."""
    kind = c["model_type"]
    if kind in COUNTED_FP32_PRODUCT_NORMS:
        return "fp32_product"
    return "module" if "rms_norm_eps" in c and kind not in FP32_PRODUCT_NORMS else "fused"


def _global_attention(c: dict, kinds: list[str]) -> dict:
    """Gemma 4's full-attention layers' own head size and key-value heads, from transformers' `per_layer_config`
    (layer index -> what differs from the model's), and whether their values are their keys (`attention_k_eq_v`)."""
    if c["model_type"] != "gemma4_text":
        return {}
    overrides = [v for k, v in (c.get("per_layer_config") or {}).items()
                 if str(k).isdigit() and int(k) < len(kinds) and kinds[int(k)] == "full_attention"]
    first = overrides[0] if overrides else {}
    head_dim, heads = int(first.get("head_dim") or 0), int(first.get("num_key_value_heads") or 0)
    return dict(global_head_dim=head_dim if head_dim != int(c.get("head_dim") or 0) else 0,
                global_kv_heads=heads if heads != int(c.get("num_key_value_heads") or 0) else 0,
                global_values_from_keys=bool(c.get("attention_k_eq_v")))


def _extras(c: dict) -> BlockExtras | None:
    """What the newer families add to the Llama-style block (None: nothing)."""
    kind, kinds = c["model_type"], list(c.get("layer_types") or [])
    gpt_oss = kind == "gpt_oss"
    linear = None
    if "linear_attention" in kinds:
        linear = LinearAttentionShape(
            layers=kinds.count("linear_attention"), num_key_heads=int(c["linear_num_key_heads"]),
            num_value_heads=int(c["linear_num_value_heads"]), key_head_dim=int(c["linear_key_head_dim"]),
            value_head_dim=int(c["linear_value_head_dim"]), conv_kernel=int(c.get("linear_conv_kernel_dim") or 4))
    extras = BlockExtras(
        qk_norm=kind in QK_NORM_TYPES or bool(c.get("use_qk_norm")),  # GLM-4-MoE's are optional
        o_bias=gpt_oss and bool(c.get("attention_bias", True)), attention_sinks=gpt_oss,
        attn_output_gate=kind in ("qwen3_next", "qwen3_5_text") and bool(c.get("attn_output_gate", True)),
        norms_per_block=4 if kind in ("gemma2", "gemma3_text", "gemma4_text") else 2,
        sliding_window=int(c.get("sliding_window") or 0) if "sliding_attention" in kinds else 0,
        sliding_layers=kinds.count("sliding_attention"), linear=linear, expert_bias=gpt_oss, router_bias=gpt_oss,
        shared_expert_gate=kind in ("qwen2_moe", "qwen3_next") and bool(c.get("shared_expert_intermediate_size")),
        per_layer_input=int(c.get("hidden_size_per_layer_input") or 0),
        per_layer_vocab=int(c.get("vocab_size_per_layer_input") or 0),
        kv_shared_layers=int(c.get("num_kv_shared_layers") or 0),
        dense_mlp_beside_experts=kind == "gemma4_text" and bool(c.get("enable_moe_block")),
        layer_types=tuple(kinds) if kind == "gemma4_text" else (), **_global_attention(c, kinds))
    return None if extras == BlockExtras() else extras
