"""Registry names for published models whose blocks are not Llama's (sinks and windows, latent attention,
linear attention): each is its model card's config.json hyper-parameters, so `model.name=gpt-oss-20b` plans
and trains the architecture transformers builds from that config, with no download. Pure Python: the shape
comes from the same reading of a config.json as `model.hf` (models/hf/shape.py)."""

from __future__ import annotations

from functools import lru_cache

from disttrain.models.shape import ModelShape

_GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4, "vocab_size": 201088,
            "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
            "attention_bias": True, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}


def _gpt_oss(layers: int, experts: int) -> dict:
    return {**_GPT_OSS, "num_hidden_layers": layers, "num_local_experts": experts,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}


# config.json of openai/gpt-oss-120b and -20b, deepseek-ai/DeepSeek-V3 (its multi-token-prediction layer,
# `num_nextn_predict_layers`, is not part of the causal LM transformers builds) and Qwen/Qwen3-Next-80B-A3B
# (every fourth layer full attention, `full_attention_interval`, the others Gated DeltaNet).
PUBLISHED_CONFIGS: dict[str, dict] = {
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "vocab_size": 129280,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096}},
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151936,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]},
}


def search_limits(name: str, hf: str | None = None) -> dict:
    """What the layout search may not propose for this registry model, or for the transformers model in the
    directory `hf` (`plan --hf DIR`: the family its config.json names decides, as for a registry name of that
    family), as `SearchSpace` fields: a transformers model takes sequence or context parallelism or a pipeline, not both
    (models/rules.py), and shards its sequence only where the runtime says it can (models/hf/context.py's
    `refusal`: the three published families do, Qwen3-Next's recurrent state passed from shard to shard), so the
    search follows the runtime. Tensor parallelism is searched for every name (fused experts whole on each rank).
    Loads torch for these models only: the built-in ones have no limits."""
    if hf:
        from disttrain.models.hf.shape import read_config

        config = read_config(hf)
    else:
        config = PUBLISHED_CONFIGS.get(name)
    if config is None:
        return {}
    from types import SimpleNamespace

    from disttrain.models.hf.context import refusal

    return {"context_parallel": not refusal(SimpleNamespace(**config)),
            "pipeline_sequence_parallel": False, "pipeline_context_parallel": False}


@lru_cache(maxsize=None)
def published_shape(name: str) -> ModelShape:
    from disttrain.models.hf.shape import config_shape

    return config_shape(PUBLISHED_CONFIGS[name], f"model.name={name}")


def published_shapes() -> dict[str, ModelShape]:
    return {name: published_shape(name) for name in PUBLISHED_CONFIGS}
