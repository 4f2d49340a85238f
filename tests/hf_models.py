"""Tiny Hugging Face causal LMs written with transformers' own save_pretrained, for tests."""

from __future__ import annotations

from pathlib import Path

SIZES = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def tiny_config(kind: str):
    """Llama (untied, no biases), Qwen2 (q/k/v biases, tied input/output embeddings), GPT-2 (another
    structure: `transformer.h` blocks, learned positions, no tensor-parallel plan), or two mixtures of
    experts with fused 3-D experts: Qwen3-MoE (8 experts, top-2, renormalised) and Mixtral (4 experts, top-2)."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3MoeConfig

    moe = {**SIZES, "num_hidden_layers": 2, "tie_word_embeddings": False}
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**moe, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=True)
    if kind == "mixtral":
        return MixtralConfig(**{**moe, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2)

    if kind == "gpt2":
        return GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=256, bos_token_id=0,
                          eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: exact parity
    if kind == "llama":
        return LlamaConfig(**SIZES, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2Config(**SIZES, tie_word_embeddings=True)
    raise ValueError(kind)


FAMILY_SIZES = {**SIZES, "intermediate_size": 96, "tie_word_embeddings": False}


def family_config(kind: str):
    """The 2026 families, tiny, with what each asks of the layouts: gpt-oss (attention sinks, sliding and full
    attention alternating, biased experts), DeepSeek-V3 (latent attention, group-limited routing, a shared
    expert, a dense first layer), Qwen3-Next (three GatedDeltaNet linear-attention layers to one gated full one,
    experts with a gated shared expert), Gemma 3 (scaled embeddings, `1 + weight` norms, sliding windows with
    their own rotary base, tied embeddings), Qwen3.5 (Gated DeltaNet without experts), GLM-4-MoE (query/key
    norms, a router, shared experts, a dense first layer) and Gemma 4 (per-layer input embeddings; its last two
    layers reuse the keys and values of the two before, one of each kind, which a two-stage pipeline passes on;
    `gemma4_moe`: with its MoE branch too; `gemma4_global`: with full-attention layers of their own head size, one
    key-value head and values that are their keys, as gemma-4-31B's)."""
    from transformers import AutoConfig

    # gemma4_moe: Gemma 4 with its MoE branch beside each layer's dense MLP (as gemma-4-26B-A4B)
    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32) \
        if kind == "gemma4_moe" else {}
    # gemma4_global: transformers writes the full-attention layers' own shape into `per_layer_config`
    moe |= dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True) \
        if kind == "gemma4_global" else {}
    kind = "gemma4_text" if moe else kind
    alternating = ["sliding_attention", "full_attention"] * 2
    local_global = ["sliding_attention"] * 3 + ["full_attention"]
    linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  layer_types=["linear_attention"] * 3 + ["full_attention"])
    experts = dict(moe_intermediate_size=32, num_experts_per_tok=2)
    extra = {
        "gpt_oss": dict(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=8, layer_types=alternating),
        "deepseek_v3": dict(num_key_value_heads=4, **experts, n_routed_experts=4, n_group=2, topk_group=1,
                            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
        "qwen3_next": dict(head_dim=16, **experts, shared_expert_intermediate_size=32, num_experts=4, **linear),
        "gemma3_text": dict(head_dim=16, sliding_window=8, layer_types=local_global, tie_word_embeddings=True),
        "qwen3_5_text": dict(head_dim=16, **linear),
        "qwen3": dict(head_dim=16),  # query/key norms, replicated over tensor-parallel ranks
        "gemma4_text": dict(head_dim=16, global_head_dim=16, sliding_window=8, layer_types=alternating,
                            num_kv_shared_layers=2, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
                            tie_word_embeddings=True),
        "glm4_moe": dict(head_dim=16, **experts, n_routed_experts=4, n_group=1, topk_group=1, n_shared_experts=1,
                         first_k_dense_replace=1, use_qk_norm=True),
    }[kind]
    return AutoConfig.for_model(kind, **{**FAMILY_SIZES, **extra, **moe})


def saved_family(tmp_path_factory, kind: str, **shape) -> Path:
    """A directory holding `family_config(kind)`'s config.json with `shape` set over it (a module fixture's model)."""
    config = family_config(kind)
    for key, value in shape.items():
        setattr(config, key, value)
    directory = tmp_path_factory.mktemp(kind) / kind
    config.save_pretrained(directory)
    return directory


def save_tiny(kind: str, directory: Path, weights_seed: int | None = None) -> Path:
    """config.json only, or (with `weights_seed`) a model with transformers' own random init saved too."""
    config = tiny_config(kind) if kind in ("llama", "qwen2", "gpt2", "qwen3_moe", "mixtral") else family_config(kind)
    if weights_seed is None:
        config.save_pretrained(directory)
        return directory
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(weights_seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def fp64_norms(model):
    """transformers' RMSNorms of `model` normalised in float64 throughout, as disttrain's fp64 runs do
    (transformers rounds through float32 on purpose, for bf16; in fp64 that moves a loss by ~1e-9): a reference
    in double precision for them. Returns the model."""
    import torch

    for norm in (m for m in model.modules() if type(m).__name__.endswith("RMSNorm")):
        norm.forward = lambda x, n=norm: n.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                                                     n.variance_epsilon))
    return model
