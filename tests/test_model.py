"""The single-device Llama model: shapes, masking, GQA, and layout-independent initialisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disttrain.models.llama import llama_spec
from disttrain.models.spec import build_model, count_params
from disttrain.models.llama.model import apply_rotary
from disttrain.models.registry import MODEL_SHAPES

DEBUG = MODEL_SHAPES["debug"]


@pytest.mark.parametrize("name", ["debug", "tiny"])
def test_param_count_matches_registry_formula(name):
    shape = MODEL_SHAPES[name]
    assert count_params(build_model(llama_spec(shape), torch.device("cpu"), 0)) == shape.num_params()


def test_public_shapes_have_their_published_sizes():
    # Llama 2 paper / Llama 3.2 model card sizes (rounded there; the exact count is checked below)
    expected = {"7b": 6.74e9, "13b": 13.0e9, "70b": 69.0e9, "1b": 1.24e9}
    for name, params in expected.items():
        assert MODEL_SHAPES[name].num_params() == pytest.approx(params, rel=0.01), name


DENSE = [name for name, shape in MODEL_SHAPES.items() if shape.moe is None]


@pytest.mark.parametrize("name,tied", [*((name, None) for name in DENSE), ("debug", True)])
def test_dense_shapes_count_exactly_as_transformers_builds_them(name, tied):
    """Every dense registry shape (and debug with a tied embedding) against transformers' own LlamaForCausalLM of
    the same dimensions, built on the meta device: the registry formula and the built model hold exactly the
    parameters Hugging Face's model has (its tied embedding and head counted once)."""
    from dataclasses import replace

    import transformers

    shape = MODEL_SHAPES[name] if tied is None else replace(MODEL_SHAPES[name], tie_embeddings=tied)
    config = transformers.LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.dim,
                                      intermediate_size=shape.ffn_hidden_dim, num_hidden_layers=shape.n_layers,
                                      num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
                                      head_dim=shape.head_dim, tie_word_embeddings=shape.tie_embeddings,
                                      max_position_embeddings=shape.max_seq_len, rms_norm_eps=shape.norm_eps,
                                      rope_theta=shape.rope_theta, attention_bias=False, mlp_bias=False)
    with torch.device("meta"):
        theirs = transformers.LlamaForCausalLM(config)
        ours = llama_spec(shape).build()
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == shape.tie_embeddings
    expected = sum(p.numel() for p in theirs.parameters())  # shared tensors once
    assert shape.num_params() == expected, (name, shape.num_params() - expected)
    assert count_params(ours) == expected


def test_tied_embeddings_share_one_tensor():
    from dataclasses import replace

    model = build_model(llama_spec(replace(DEBUG, tie_embeddings=True)), torch.device("cpu"), 0)
    assert model.output.weight is model.tok_embeddings.weight
    assert count_params(model) == replace(DEBUG, tie_embeddings=True).num_params()


def test_init_is_deterministic_and_per_parameter():
    a = build_model(llama_spec(DEBUG), torch.device("cpu"), seed=3)
    b = build_model(llama_spec(DEBUG), torch.device("cpu"), seed=3)
    c = build_model(llama_spec(DEBUG), torch.device("cpu"), seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    # A model that lost its first block (as a pipeline stage would) still initialises block 1 identically.
    with torch.device("meta"):
        from disttrain.models.llama.model import Transformer

        stage = Transformer(DEBUG)
    del stage.layers["0"]
    stage.to_empty(device="cpu")
    from disttrain.models.llama.init import init_weights

    init_weights(stage, seed=3)
    assert torch.equal(stage.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_forward_is_causal():
    model = build_model(llama_spec(DEBUG), torch.device("cpu"), 0)
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])
        assert not torch.allclose(model(x)[:, 10:], model(y)[:, 10:])


def test_gqa_attention_matches_explicit_head_repetition():
    model = build_model(llama_spec(DEBUG), torch.device("cpu"), 0)
    attn = model.layers["0"].attention
    x = torch.randn(2, 8, DEBUG.dim)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    hd = DEBUG.head_dim
    q = apply_rotary(attn.wq(x).view(2, 8, DEBUG.n_heads, hd), cos, sin).transpose(1, 2)
    k = apply_rotary(attn.wk(x).view(2, 8, DEBUG.n_kv_heads, hd), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(2, 8, DEBUG.n_kv_heads, hd).transpose(1, 2)
    rep = DEBUG.n_heads // DEBUG.n_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    ref = attn.wo((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 8, -1))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), ref, rtol=1e-5, atol=1e-6)


def test_rotary_preserves_norm_and_relative_position():
    from disttrain.models.llama.model import rotary_tables

    cos, sin = rotary_tables(16, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def dot(i, j):
        qi = apply_rotary(q, cos[i:i + 1], sin[i:i + 1])
        kj = apply_rotary(k, cos[j:j + 1], sin[j:j + 1])
        return float((qi * kj).sum())

    torch.testing.assert_close(apply_rotary(q, cos[5:6], sin[5:6]).norm(), q.norm())
    assert dot(3, 1) == pytest.approx(dot(12, 10), rel=1e-4)  # depends on i - j only


def test_the_sample_is_greedy_at_temperature_0_and_reads_its_settings_from_the_config():
    """train.sample_temperature / train.sample_top_k (the end-of-training sample's settings, once hidden constants):
    temperature 0 takes the most likely token each time, whatever the seed; top-k 1 is the same at any temperature."""
    from disttrain.config.load import load_config
    from disttrain.models.generate import generate

    cfg = load_config(None, ["train.sample_temperature=0", "train.sample_top_k=0"])
    assert (cfg.train.sample_temperature, cfg.train.sample_top_k) == (0.0, 0)
    model = build_model(llama_spec(DEBUG), torch.device("cpu"), 0).eval()
    prompt, expected = [72, 105, 32], [72, 105, 32]
    with torch.no_grad():
        for _ in range(6):
            expected.append(int(model(torch.tensor([expected]))[0, -1].argmax()))
    for seed in (0, 1):
        assert generate(model, prompt, 6, DEBUG.max_seq_len, temperature=0, top_k=0, seed=seed) == expected[3:]
        assert generate(model, prompt, 6, DEBUG.max_seq_len, temperature=5.0, top_k=1, seed=seed) == expected[3:]
