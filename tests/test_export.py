"""`disttrain convert` and `model.init_from`: consolidated weights that give the run's logits."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain.checkpoint.export import init_from
from disttrain.models.llama import llama_spec
from disttrain.models.spec import build_model
from disttrain.models.registry import MODEL_SHAPES
from helpers import DEBUG_CONFIG, EXACT, FP64, load_model_params, losses, run_cli, run_main, train
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
    import transformers

    out = tmp_path / "hf"
    assert run_main("convert", str(sharded_run), "--to", "hf", "--out", str(out))[0] == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), attn_implementation="sdpa").eval()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = _reference_model(sharded_run)(x)
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)  # two implementations, fp32
    # the byte-level run's tokenizer comes along: AutoTokenizer encodes as the run did (id = UTF-8 byte), decodes
    # back, and ends documents with the run's end id (before, the export had no tokenizer at all)
    from disttrain.data.tokenizer import ByteTokenizer

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "Ünïcode text,\twith tabs\nand lines 😀"
    assert tok.encode(text) == ByteTokenizer().encode_batch([text])[0] and tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == ByteTokenizer.eos_id


def _step_one_loss(state: dict, seed: int) -> float:
    """The fp64 loss of `state` (by parameter name) on step 1's global batch of configs/debug.yaml (4 windows of
    64 byte tokens of the built-in corpus), computed here: the weights put into a single-device model by
    load_state_dict, the mean cross-entropy over the batch's 4 x 64 targets by torch."""
    import torch.nn.functional as F

    from disttrain.config.load import load_config
    from disttrain.config.resolve import resolve_run
    from disttrain.data.source import load_samples, make_sampler

    cfg = load_config(DEBUG_CONFIG, ["model.tie_embeddings=true"])
    _, samples, _ = load_samples(cfg.data.source, resolve_run(cfg, 1, "cpu").tokenizer, cfg.data.seq_len)
    x, y = samples.batch(make_sampler(samples, cfg.data.source, cfg.train.global_batch_size, cfg.train.seed).indices(1))
    model = build_model(llama_spec(SHAPE), torch.device("cpu"), seed=seed).double()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"output.weight", "rope_cos", "rope_sin"}  # tied head; rotary tables
    with torch.no_grad():
        logits = model(x)
    assert logits.dtype == torch.float64 and x.shape == y.shape == (4, 64)
    return float(F.cross_entropy(logits.flatten(0, 1), y.flatten()))


def test_init_from_starts_a_run_from_exported_weights(sharded_run, tmp_path):
    """A run started from exported weights (in fp64) logs as its step-1 loss exactly the loss of those weights,
    computed here on the same batch; a freshly initialised model's is far higher (the weights were used, not
    an initialisation)."""
    from safetensors.torch import load_file

    weights = tmp_path / "w.safetensors"
    assert run_main("convert", str(sharded_run), "--to", "safetensors", "--out", str(weights))[0] == 0
    warm = losses(train(tmp_path / "warm", "train.steps=2", "model.tie_embeddings=true", FP64,
                        f"model.init_from={weights}"))
    exported = load_file(str(weights))
    assert exported.keys() == _reference_model(sharded_run).state_dict().keys() - {"output.weight", "rope_cos",
                                                                                     "rope_sin"}
    expected = _step_one_loss(exported, seed=999)  # another init than the run's: every weight must come from the file
    assert abs(warm[1] - expected) <= EXACT * expected, (warm[1], expected)
    fresh = build_model(llama_spec(SHAPE), torch.device("cpu"), seed=0).state_dict()  # the run's seed (debug.yaml)
    assert expected < _step_one_loss(fresh, seed=0) - 0.5  # starts from the trained weights, not from scratch
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
