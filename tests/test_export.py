"""`disttrain convert` and `model.init_from`: consolidated weights that give the run's logits."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain.checkpoint.export import init_from
from disttrain.models.llama import llama_spec
from disttrain.models.spec import build_model
from disttrain.models.registry import MODEL_SHAPES
from helpers import load_model_params, losses, run_cli, run_main, train
from dataclasses import replace

SHAPE = replace(MODEL_SHAPES["debug"], tie_embeddings=True)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A ZeRO-3 run on 2 ranks: its checkpoint is sharded, so export must consolidate."""
    return train(tmp_path_factory.mktemp("exp") / "run", "train.steps=6", "model.tie_embeddings=true",
                 "parallel.zero_stage=3", "checkpoint.save_final=true", nproc=2)


def _reference_model(run):
    model = build_model(llama_spec(SHAPE), torch.device("cpu"), seed=123)
    params = load_model_params(run / "checkpoints" / "step_00000006")
    model.load_state_dict({k: v for k, v in params.items() if k != "output.weight"}, strict=False)
    return model


@pytest.mark.parametrize("fmt,name", [("torch", "model.pt"), ("safetensors", "model.safetensors"), ("hf", "hf")])
def test_exported_weights_reproduce_the_checkpoint_logits(sharded_run, fmt, name, tmp_path):
    code, out, err = run_main("convert", str(sharded_run), "--to", fmt, "--out", str(tmp_path / name))  # no process
    assert code == 0 and "step_00000006" in out, err
    model = build_model(llama_spec(SHAPE), torch.device("cpu"), seed=999)  # different init: every weight must be overwritten
    init_from(model, tmp_path / name, llama_spec(SHAPE))
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), _reference_model(sharded_run)(x), rtol=0, atol=0)


def test_hf_export_loads_in_transformers_with_the_same_logits(sharded_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert run_main("convert", str(sharded_run), "--to", "hf", "--out", str(out))[0] == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), attn_implementation="sdpa").eval()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = _reference_model(sharded_run)(x)
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)  # two implementations, fp32


def test_init_from_starts_a_run_from_exported_weights(sharded_run, tmp_path):
    assert run_main("convert", str(sharded_run), "--to", "safetensors", "--out", str(tmp_path / "w.safetensors"))[0] == 0
    fresh = losses(train(tmp_path / "fresh", "train.steps=2", "model.tie_embeddings=true"))
    warm = losses(train(tmp_path / "warm", "train.steps=2", "model.tie_embeddings=true",
                        f"model.init_from={tmp_path / 'w.safetensors'}"))
    assert warm[1] < fresh[1] - 0.5  # starts from the trained weights, not from scratch
    bad = run_cli("train", "configs/debug.yaml", f"run.dir={tmp_path}", f"model.init_from={tmp_path / 'w.safetensors'}",
                  "model.dim=32", "model.n_heads=2", "model.n_kv_heads=1", "model.tie_embeddings=true", check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [f"disttrain: error: model.init_from={tmp_path / 'w.safetensors'}: "
                                               "tok_embeddings.weight has shape (256, 64) in the weights, (256, 32) "
                                               "in the model"]
    (tmp_path / "garbage.safetensors").write_bytes(b"not weights at all")
    bad = run_cli("train", "configs/debug.yaml", f"run.dir={tmp_path}", f"model.init_from={tmp_path / 'garbage.safetensors'}",
                  check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert f"model.init_from={tmp_path / 'garbage.safetensors'}: not a weights file written by `disttrain convert`" \
        in bad.stderr


def test_convert_refuses_a_directory_without_checkpoints(tmp_path):
    code, _, err = run_main("convert", str(tmp_path))
    assert code == 2 and "neither a committed checkpoint nor a run directory" in err
