"""The 2026 families' settings that cannot work, each refused in one line before anything starts (exit status 2,
nothing written): an attention kernel the model cannot take, LoRA on a layer tensor parallelism splits by hand,
linear-attention layouts that cannot split; and a model that cannot learn, said once in a warning."""

from __future__ import annotations

import math

import pytest

from hf_models import family_config, save_tiny
from helpers import DEBUG_CONFIG, events, losses, run_main, train


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("refused_families")
    return {kind: save_tiny(kind, root / kind) for kind in ("gpt_oss", "deepseek_v3", "llama")}


BAD = {
    "sdpa for sinks": ("gpt_oss", ["model.attn_implementation=sdpa"],
                       "model.attn_implementation=sdpa with model.hf="),
    "no hf": (None, ["model.attn_implementation=eager"], "model.attn_implementation=eager without model.hf"),
    "unknown kernel": ("llama", ["model.attn_implementation=flash"], "model.attn_implementation"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_an_attention_the_model_cannot_take_is_one_line(name, family_dirs, tmp_path):
    kind, overrides, expected = BAD[name]
    model = [f"model.hf={family_dirs[kind]}"] if kind else []
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path / 'runs'}", *model, *overrides)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert not (tmp_path / "runs").exists()


SILENT_SPEC = '''
import torch
from torch import nn
from disttrain.models.spec import ModelSpec


class Silent(nn.Module):
    """Token embeddings scaled by a zero buffer, as Gemma's were when their scale was left uninitialised: the
    output is the same for every input and no gradient reaches a weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.register_buffer("scale", torch.zeros(()), persistent=False)
        self.layers = nn.ModuleList([nn.Linear(16, 16, bias=False)])
        self.head = nn.Linear(16, 256, bias=False)

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def init(model, seed):
    torch.manual_seed(seed)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.scale.zero_()


def spec():
    return ModelSpec(name="silent", build=Silent, init_weights=init, blocks=lambda m: m.layers)
'''


def test_a_model_that_cannot_learn_is_said_once(tmp_path):
    (tmp_path / "silent.py").write_text(SILENT_SPEC)
    run = train(tmp_path / "runs" / "silent", f"model.spec={tmp_path / 'silent.py'}:spec", "train.steps=12",
                nproc=1)
    warnings = [e["message"] for e in events(run, "warning") if "not learning" in e["message"]]
    assert len(warnings) == 1 and "over steps 1-10" in warnings[0], warnings
    assert all(abs(loss - math.log(256)) < 1e-5 for loss in losses(run).values())  # uniform over 256 ids


def test_lora_on_a_layer_tensor_parallelism_splits_by_hand_is_refused(family_dirs, tmp_path):
    """DeepSeek-V3's `kv_a_proj_with_mqa` (its rotary key's gradient summed over heads) takes no adapter under
    tensor parallelism: the default targets include it, so LoRA there names its targets."""
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path / 'runs'}", "parallel.tp=2",
                            f"model.hf={family_dirs['deepseek_v3']}", "model.lora.rank=4", "--nproc-per-node", "2")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "kv_a_proj_with_mqa with parallel.tp=2" in lines[0], err
    assert not (tmp_path / "runs").exists()




LINEAR_REFUSALS = {  # Gated DeltaNet: split by key heads under TP; under CP each of the 2 x cp chunks takes its
    # convolution's reach (3 tokens) from the chunk before it alone
    "one key head over tp=2": ({"linear_num_key_heads": 1}, ("parallel.tp=2",),
                               "parallel.tp=2 does not divide the linear-attention heads (linear_num_key_heads=1)"),
    "chunks of 2 tokens": ({}, ("parallel.cp=2", "data.seq_len=8"),
                           "convolution reaches 3 tokens back, more than each of the 2 x cp chunks holds (allowed: "
                           "data.seq_len >= 12)")}


@pytest.mark.parametrize("name", list(LINEAR_REFUSALS))
def test_linear_attention_layouts_that_cannot_split_are_refused(name, tmp_path):
    changes, overrides, expected = LINEAR_REFUSALS[name]
    config = family_config("qwen3_5_text")
    for key, value in changes.items():
        setattr(config, key, value)
    config.save_pretrained(tmp_path / "model")
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path / 'runs'}", *overrides,
                            f"model.hf={tmp_path / 'model'}", "--nproc-per-node", "2")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert not (tmp_path / "runs").exists()
