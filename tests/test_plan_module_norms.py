"""transformers' Llama-style RMSNorm modules, as the planner counts them (`ModelShape.norm_kind` "module"): Python ops that
keep the input upcast to fp32 and the normalised tensor cast back to the input's dtype, where a fused kernel keeps
its input alone; listed with saved-tensor hooks on transformers' own module (the dry run of a tiny DeepSeek-V3
whose norms tip its peak: tests/test_plan_published.py's "latent attention" case)."""

from __future__ import annotations

import pytest
import torch

from hf_models import family_config, tiny_config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_transformers_rms_norm_keeps_what_the_planner_counts(dtype):
    """bf16 input (FSDP's compute dtype): 4 + 2 bytes an element (the fused kernel's 2); fp32 input (autocast over fp32
    weights): 4 + 4 (the fused kernel's 4). And the fp32 reciprocal RMS a row."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    from disttrain.plan.norms import norm_bytes

    tokens, hidden = 64, 48
    norm = DeepseekV3RMSNorm(hidden).to(dtype)
    x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    held: dict[int, int] = {}

    def pack(t):
        if t is not norm.weight:
            held.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    er = torch.finfo(dtype).bits // 8
    assert sum(held.values()) == norm_bytes(er, tokens, hidden, 1, fused=True, kind="module")
    assert norm_bytes(er, tokens, hidden, 1, fused=True, kind="module") - norm_bytes(er, tokens, hidden, 1, True) \
        == 4 * tokens * hidden


def test_hugging_face_shapes_say_which_norms_they_run():
    from disttrain.models.hf.shape import config_shape
    from disttrain.models.registry import MODEL_SHAPES

    def shape(config):
        return config_shape(config.to_dict(), "test")

    for kind in ("llama", "qwen2", "qwen3_moe", "mixtral"):
        assert shape(tiny_config(kind)).norm_kind == "module", kind
    for kind in ("deepseek_v3", "glm4_moe", "qwen3"):
        assert shape(family_config(kind)).norm_kind == "module", kind
    # GPT-2's LayerNorm (torch's kernel); the norms that multiply their weight in fp32: counted otherwise
    assert shape(tiny_config("gpt2")).norm_kind == "fused"
    assert shape(family_config("gpt_oss")).norm_kind == "fp32_product"
    for kind in ("gemma3_text", "qwen3_next", "qwen3_5_text", "gemma4_text"):
        assert shape(family_config(kind)).norm_kind == "fused", kind
    assert MODEL_SHAPES["7b"].norm_kind == "fused"  # the built-in models' fused norms
    assert MODEL_SHAPES["deepseek-v3"].norm_kind == "module"
    assert MODEL_SHAPES["gpt-oss-120b"].norm_kind == "fp32_product"
