"""transformers' Llama-style RMSNorm modules, as the planner counts them (`ModelShape.module_norms`): Python ops that
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
    assert sum(held.values()) == norm_bytes(er, tokens, hidden, 1, fused=True, module=True)
    assert norm_bytes(er, tokens, hidden, 1, fused=True, module=True) - norm_bytes(er, tokens, hidden, 1, True) \
        == 4 * tokens * hidden


def test_hugging_face_shapes_say_which_norms_they_run():
    from disttrain.models.hf.shape import config_shape
    from disttrain.models.registry import MODEL_SHAPES

    def shape(config):
        return config_shape(config.to_dict(), "test")

    for kind in ("llama", "qwen2", "qwen3_moe", "mixtral"):
        assert shape(tiny_config(kind)).module_norms, kind
    for kind in ("deepseek_v3", "glm4_moe", "qwen3"):
        assert shape(family_config(kind)).module_norms, kind
    # GPT-2's LayerNorm (torch's kernel); the norms that multiply their weight in fp32: counted otherwise
    assert not shape(tiny_config("gpt2")).module_norms
    for kind in ("gpt_oss", "gemma3_text", "qwen3_next", "qwen3_5_text", "gemma4_text"):
        assert not shape(family_config(kind)).module_norms, kind
    assert not MODEL_SHAPES["7b"].module_norms  # the built-in models' fused norms
    assert MODEL_SHAPES["deepseek-v3"].module_norms
