"""The dry run's attention is CUDA's: a call this CPU's SDPA would serve with its math path (keeping the attention
probabilities) runs as the memory-efficient kernel a GPU gives it (dryrun/cuda_attention.py), as DeepSeek-V3's
latent attention does with value heads narrower than its query and key heads."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_models import family_config

# latent attention whose value heads (16) are narrower than its query and key heads (16 + 8), as DeepSeek-V3's
# (128 against 192); four dense layers, 16 heads: the attention decides the peak
SHAPE = dict(first_k_dense_replace=4, max_position_embeddings=512, num_attention_heads=16, num_key_value_heads=16,
             v_head_dim=16)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _attend(q_dim: int, v_dim: int, kv_heads: int = 4, dtype=torch.bfloat16, **kwargs):
    """The SDPA ops one call dispatches (forward and backward) on fake tensors under the dry run's GPU defaults."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from disttrain.dryrun.fake_world import gpu_defaults

    with FakeTensorMode(allow_non_fake_inputs=True), gpu_defaults():  # as the dry run's (a mask may be real)
        q = torch.randn(2, 4, 64, q_dim, dtype=dtype, requires_grad=True)
        k = torch.randn(2, kv_heads, 64, q_dim, dtype=dtype, requires_grad=True)
        v = torch.randn(2, kv_heads, 64, v_dim, dtype=dtype, requires_grad=True)
        ops = _Ops()
        with ops:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
            out.sum().backward()
        assert out.shape == (2, 4, 64, v_dim) and q.grad.shape == q.shape and v.grad.shape == v.shape
    return {name for name in ops.names if "attention" in name or "softmax" in name}


def test_calls_the_cpu_would_serve_with_the_math_path_take_cudas_efficient_kernel():
    efficient = {"_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"}
    assert _attend(24, 16, is_causal=True) == efficient  # value heads narrower than query and key heads
    assert _attend(24, 16, dtype=torch.float32, is_causal=True) == efficient
    assert _attend(24, 16, attn_mask=torch.ones(64, 64, dtype=torch.bool).tril()) == efficient
    assert _attend(16, 16, dropout_p=0.1) == efficient  # dropout: flash on a GPU, the same memory
    # the CPU's flash kernel already keeps no probabilities: left as it is
    assert _attend(16, 16, is_causal=True) == {"_scaled_dot_product_flash_attention_for_cpu",
                                               "_scaled_dot_product_flash_attention_for_cpu_backward"}
    # what the efficient kernel refuses takes the math path on a GPU too: fewer key/value heads with their own
    # head dim, head dims not a multiple of 8 in bf16
    assert "_scaled_dot_product_efficient_attention" not in _attend(24, 16, kv_heads=2, enable_gqa=True, is_causal=True)
    assert "_scaled_dot_product_efficient_attention" not in _attend(20, 12, is_causal=True)


def test_real_tensors_keep_torchs_own_attention():
    from disttrain.dryrun.fake_world import gpu_defaults

    original = torch.nn.functional.scaled_dot_product_attention
    q, k, v = torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 8)
    expected = original(q, k, v, is_causal=True)
    with gpu_defaults():
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.nn.functional.scaled_dot_product_attention is original  # put back on leaving


@pytest.fixture(scope="module")
def narrow_values(tmp_path_factory):
    config = family_config("deepseek_v3")
    for key, value in SHAPE.items():
        setattr(config, key, value)
    assert config.qk_nope_head_dim + config.qk_rope_head_dim != config.v_head_dim
    directory = tmp_path_factory.mktemp("deepseek_narrow_values")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_latent_attention_with_narrow_values_follows_the_planner(checkpointing, narrow_values, monkeypatch):
    """Rank 0 of 2 (ZeRO-2, bf16, 512 tokens): with this CPU's math path the dry run kept every layer's attention
    probabilities (7.5x the peak a GPU has without checkpointing, 9x with full checkpointing); as CUDA runs it, the
    planner's peak (a kernel that keeps no probabilities) is within 5% of the dry run's."""
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config
    from disttrain.dryrun import cuda_attention

    cfg = load_config(None, [f"model.hf={narrow_values}", "data.seq_len=512", "precision.compute_dtype=bf16",
                             "train.global_batch_size=2", "train.micro_batch_size=1", "parallel.zero_stage=2",
                             f"parallel.activation_checkpointing={checkpointing}"])
    now = dry_run(cfg, 2, [0])["ranks"][0]
    assert abs(now["error"]["peak_bytes"]) <= 0.05, (now["error"], now["bytes"], now["planner"])
    monkeypatch.setattr(cuda_attention, "sdpa_as_on_cuda", lambda original: original)  # the CPU's own choice
    before = dry_run(cfg, 2, [0])["ranks"][0]
    assert before["peak_bytes"] > 3 * now["peak_bytes"], (before["bytes"], now["bytes"])
