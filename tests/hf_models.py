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


def save_tiny(kind: str, directory: Path, weights_seed: int | None = None) -> Path:
    """config.json only, or (with `weights_seed`) a model with transformers' own random init saved too."""
    config = tiny_config(kind)
    if weights_seed is None:
        config.save_pretrained(directory)
        return directory
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(weights_seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory
