"""The built-in Llama family's named shapes. Pure Python: the planner and config validation use it
without torch."""

from __future__ import annotations

from dataclasses import replace

from disttrain.models.shape import ModelShape, MoEShape


# Llama-family shapes: 7b/13b/70b are Llama 2's, 1b is Llama 3.2 1B; 125m is a GPT-3-Small-sized Llama.
MODEL_SHAPES: dict[str, ModelShape] = {
    "debug": ModelShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                        ffn_hidden_dim=192, max_seq_len=256),
    "tiny": ModelShape(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256,
                       ffn_hidden_dim=768, max_seq_len=512),
    "125m": ModelShape(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000,
                       ffn_hidden_dim=2048, max_seq_len=2048),
    "1b": ModelShape(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                     ffn_hidden_dim=8192, max_seq_len=8192, tie_embeddings=True, rope_theta=500000.0),
    "7b": ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                     ffn_hidden_dim=11008, max_seq_len=4096),
    "13b": ModelShape(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000,
                      ffn_hidden_dim=13824, max_seq_len=4096),
    "70b": ModelShape(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                      ffn_hidden_dim=28672, max_seq_len=4096),
    # Mixture-of-experts shapes: Llama blocks whose MLP routes each token to top-k SwiGLU experts.
    # debug-moe is for tests; the others are the published models' shapes (Mixtral 8x7B, Qwen3-30B-A3B and
    # Qwen3-235B-A22B; Qwen3's per-head q/k norms, 256 parameters a layer, are left out).
    "debug-moe": ModelShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=192,
                            max_seq_len=256,
                            moe=MoEShape(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         n_shared_experts=1)),
    "mixtral-8x7b": ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                               ffn_hidden_dim=14336, max_seq_len=32768, rope_theta=1000000.0,
                               moe=MoEShape(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336)),
    "qwen3-30b-a3b": ModelShape(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, vocab_size=151936,
                                ffn_hidden_dim=6144, max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0,
                                head_size=128,
                                moe=MoEShape(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)),
    "qwen3-235b-a22b": ModelShape(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, vocab_size=151936,
                                  ffn_hidden_dim=12288, max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0,
                                  head_size=128,
                                  moe=MoEShape(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536)),
}


def resolve_shape(name: str, overrides: dict, moe: dict) -> ModelShape:
    """The registry shape `name` with shape `overrides` (ModelShape's keys) and `moe` (MoEShape's keys) over it;
    on a dense shape the MoE keys make an MoEShape, given the three keys an MoE layer needs."""
    from disttrain.core.errors import UserError

    base = MODEL_SHAPES[name]
    overrides = dict(overrides)
    if moe and base.moe is not None:
        overrides["moe"] = replace(base.moe, **moe)
    elif moe:
        needed = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") if k not in moe]
        if needed:
            raise UserError(f"model.moe.{next(iter(moe))}={moe[next(iter(moe))]}: model.name={name} is "
                            f"dense; an MoE needs model.moe.{', model.moe.'.join(needed)} too (or an MoE shape: "
                            f"{', '.join(n for n, s in MODEL_SHAPES.items() if s.moe)})")
        overrides["moe"] = MoEShape(**moe)
    return replace(base, **overrides)
