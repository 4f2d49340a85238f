"""The registry's published models that are not Llama-shaped (gpt-oss, DeepSeek-V3, Qwen3-Next): their counts
against transformers' own model and the model cards, what a registry name trains, and what `plan` proposes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from helpers import run_main

# The model cards' totals and active parameters in billions, with the digits they round to; active leaves out
# the input embedding (a lookup). Qwen names its activated parameters in whole billions rounded down ("A3B":
# Qwen3-30B-A3B has 3.3 B), so that one is compared rounded down.
CARDS = {
    "gpt-oss-120b": (116.8, 5.1, 1, round),
    "gpt-oss-20b": (20.9, 3.6, 1, round),
    "deepseek-v3": (671, 37, 0, round),
    "qwen3-next-80b-a3b": (80, 3, 0, math.floor),
}


def _theirs(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from disttrain.models.hf.published import PUBLISHED_CONFIGS

    published = dict(PUBLISHED_CONFIGS[name])
    config = AutoConfig.for_model(published.pop("model_type"), **published)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(CARDS))
def test_counts_equal_transformers_and_the_model_card(name):
    from disttrain.models.registry import MODEL_SHAPES

    shape = MODEL_SHAPES[name]
    model = _theirs(name)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    # Active: every parameter but the routed experts a token skips (and the input embedding), from theirs.
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    skipped = experts * (1 - shape.moe.num_experts_per_tok / shape.moe.num_experts)
    embedding = model.get_input_embeddings().weight.numel()
    theirs_active = sum(p.numel() for p in model.parameters()) - skipped - embedding
    assert shape.num_params(include_embedding=False, active=True) == theirs_active
    total, active, digits, rounding = CARDS[name]
    assert round(shape.num_params() / 1e9, digits) == total
    assert (round(theirs_active / 1e9, digits) if rounding is round else rounding(theirs_active / 1e9)) == active


@pytest.mark.parametrize("name", list(CARDS))
def test_the_name_trains_transformers_architecture_and_the_search_takes_its_layouts(name):
    """`model.name=NAME` builds transformers' model of the card's config (its own module names, so `convert --to
    hf` and its checkpoints match the published ones); it has a tensor-parallel plan (run under `parallel.tp`),
    and context parallelism only where its attention can be sharded (gpt-oss, DeepSeek-V3; not Qwen3-Next's linear
    attention): the layout search proposes exactly those (tests/test_plan_published.py)."""
    from types import SimpleNamespace

    from disttrain.models.hf.published import PUBLISHED_CONFIGS, search_limits
    from disttrain.models.registry import model_spec

    section = SimpleNamespace(name=name, spec="", hf="", attn_implementation="auto", lora=None,
                              moe=SimpleNamespace(aux_loss_coef=None, bias_update_rate=None, capacity_factor=0.0))
    spec = model_spec(section)
    assert spec.name == PUBLISHED_CONFIGS[name]["model_type"] and spec.family == f"Hugging Face {spec.name}"
    assert spec.tensor_parallel is not None
    assert spec.context_parallel is not None, spec.context_parallel_note  # Qwen3-Next's state passes between shards
    assert search_limits(name)["context_parallel"] == (spec.context_parallel is not None)
    with torch.device("meta"):
        ours = spec.build()
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in _theirs(name).named_parameters())


def test_a_shape_key_on_a_published_name_is_refused():
    code, _, err = run_main("estimate", "configs/demo.yaml", "model.name=gpt-oss-20b", "model.n_layers=2",
                            "--gpus", "8")
    assert code == 2
    assert err.strip().splitlines()[-1].endswith("model.n_layers=2: model.name=gpt-oss-20b is the published model's "
                                                 "shape and takes no shape keys (allowed: none; or model.hf=DIR with "
                                                 "an edited config.json)")


@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-next-80b-a3b"])
def test_plan_proposes_a_layout_the_model_takes(name, tmp_path):
    """At 4,096 tokens on 64 H100s: the config `plan` writes resolves for the model (every rule, the model's own
    included: no sequence parallelism beside a pipeline for a transformers model)."""
    from disttrain.config.load import load_config
    from disttrain.config.resolve import resolve_run

    out = tmp_path / "plan.yaml"
    code, _, err = run_main("plan", "--model", name, "--gpus", "64", "--gpu", "h100", "--seq-len", "4096", "--out",
                            str(out))
    assert code == 0, err
    layout = resolve_run(load_config(str(out), []), 64, "cuda").layout
    assert layout.world_size == 64 and not (layout.sequence_parallel and layout.pp > 1)


def test_a_model_no_layout_holds_is_refused_in_one_line():
    """DeepSeek-V3's states alone (12 bytes a parameter with AdamW: 7.3 TiB) exceed 8 H100s whatever the layout."""
    code, _, err = run_main("plan", "--model", "deepseek-v3", "--gpus", "8", "--gpu", "h100", "--seq-len", "4096")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("disttrain: error: no layout of deepseek-v3 fits 8 x h100")
