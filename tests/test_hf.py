"""Hugging Face causal LMs (`model.hf=DIR`): transformers' own modules trained under DDP, ZeRO-3, TP and
PP with the losses and parameters of one process (fp64, to EXACT); weights in (equal logits) and out
(`convert --to hf`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hf_models import save_tiny
from helpers import (DEBUG_CONFIG, EXACT, FP64, SMALL_CHUNKS, WHOLE_LOGITS, assert_losses_close, assert_parity,
                     final_params, losses, run_cli, run_main, train_many)

LR = 3e-3
COMMON_FP32 = ("train.steps=6", "train.global_batch_size=4", "train.micro_batch_size=1", "data.seq_len=64",
               f"optim.lr={LR}", "checkpoint.save_final=true", "checkpoint.every_steps=3",
               "metrics.sync_check_every=3", SMALL_CHUNKS)
COMMON = (*COMMON_FP32, FP64)  # parity runs in double precision (helpers.PARITY)
TP_MB = "train.micro_batch_size=2"  # DTensor on a CPU costs ~0.1 s per micro-batch: 2 of 2 (still accumulating)
LAYOUTS = {"ddp": (), "zero3": ("parallel.zero_stage=3",), "tp2": ("parallel.tp=2", TP_MB), "pp2": ("parallel.pp=2",),
           "tp2-sp": ("parallel.tp=2", "parallel.sequence_parallel=true", TP_MB)}
MORE_LAYOUTS = {  # the other data-parallel layouts, on the Llama directory
    "zero1": ("parallel.zero_stage=1",),
    "zero2-selective-ac": ("parallel.zero_stage=2", "parallel.activation_checkpointing=selective"),
    "hsdp-full-ac": ("parallel.zero_stage=3", "parallel.dp_replicate=2", "parallel.dp_shard=1",
                     "parallel.activation_checkpointing=full"),
    "zero3-offload": ("parallel.zero_stage=3", "parallel.cpu_offload=true"),
    "zero3-compile": ("parallel.zero_stage=3", "parallel.compile=true"),
}
LOW_PRECISION = {  # compute dtype -> bound on the relative loss difference to fp32 (as for the built-in model)
    "bf16": 2e-3,  # half of bf16's unit roundoff (2^-8)
    "fp16": 2.5e-4,  # fp16 autocast with dynamic loss scaling
}
DOCUMENT_LAYOUTS = {"tp2-sp": ("parallel.tp=2", "parallel.sequence_parallel=true", TP_MB)}  # positions under TP + SP
KINDS = ("llama", "qwen2")  # qwen2: q/k/v biases and tied input/output embeddings
# Every layout on Llama; Qwen2 where its biases and tied embeddings meet something new: sharded (ZeRO-3), split
# over pipeline stages (the tie crosses them) and sharded over heads and sequence (TP + SP).
PAIRS = [(kind, layout) for kind in KINDS for layout in LAYOUTS
         if kind == "llama" or layout in ("zero3", "pp2", "tp2-sp")]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny(kind, root / kind) for kind in (*KINDS, "gpt2")}


@pytest.fixture(scope="module")
def references(hf_dirs, two_rank_runs, tmp_path_factory):
    """One process; also Qwen2 resumed from the 2-rank ZeRO-3 checkpoint of step 3 (another world size)."""
    root = tmp_path_factory.mktemp("ref")
    jobs = {k: (root / k, (*COMMON, f"model.hf={d}", WHOLE_LOGITS)) for k, d in hf_dirs.items()}
    jobs["llama documents"] = (root / "llama_documents", (*COMMON, f"model.hf={hf_dirs['llama']}",
                                                          "data.document_masking=true", WHOLE_LOGITS))
    jobs["llama fp32"] = (root / "llama_fp32", (*COMMON_FP32, f"model.hf={hf_dirs['llama']}"))  # for LOW_PRECISION
    step3 = two_rank_runs["qwen2 zero3"] / "checkpoints" / "step_00000003"
    jobs["qwen2 resumed"] = (root / "qwen2_resumed", (*COMMON, f"model.hf={hf_dirs['qwen2']}",
                                                      f"checkpoint.resume={step3}"))
    return train_many(jobs, nproc=1)


@pytest.fixture(scope="module")
def two_rank_runs(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    jobs = {f"{kind} {name}": (root / f"{kind}_{name}", (*COMMON, f"model.hf={hf_dirs[kind]}", *LAYOUTS[name]))
            for kind, name in PAIRS}
    jobs["gpt2 zero3"] = (root / "gpt2_zero3", (*COMMON, f"model.hf={hf_dirs['gpt2']}", "parallel.zero_stage=3"))
    for name, extra in MORE_LAYOUTS.items():
        jobs[f"llama {name}"] = (root / f"llama_{name}", (*COMMON, f"model.hf={hf_dirs['llama']}", *extra))
    for name, extra in DOCUMENT_LAYOUTS.items():
        jobs[f"llama documents {name}"] = (root / f"llama_documents_{name}", (
            *COMMON, f"model.hf={hf_dirs['llama']}", "data.document_masking=true", *extra))
    for dtype in LOW_PRECISION:
        jobs[f"llama {dtype}"] = (root / f"llama_{dtype}", (*COMMON_FP32, f"model.hf={hf_dirs['llama']}",
                                                             f"precision.compute_dtype={dtype}"))
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "disttrain-tests" / "inductor"
    return train_many(jobs, nproc=2, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})


def _assert_parity(run, reference):
    """To EXACT on losses and every parameter element. Measured worst: 1.5e-12 (Qwen2's key biases under TP; a
    rotary key bias has a real gradient), 4.6e-13 (GPT-2's fused q/k/v bias, whose key third has an exactly-zero
    gradient: in fp64 its rounding noise is far below Adam's eps, so it no longer moves)."""
    assert_parity(run, reference, step=6)


@pytest.mark.parametrize("kind,layout", PAIRS)
def test_hf_model_trains_like_one_process(kind, layout, two_rank_runs, references):
    _assert_parity(two_rank_runs[f"{kind} {layout}"], references[kind])


@pytest.mark.parametrize("layout", list(MORE_LAYOUTS))
def test_hf_model_under_the_other_data_parallel_layouts(layout, two_rank_runs, references):
    """Compile fuses each RMSNorm into one kernel that sums the variance in another order: exact only because the
    norms stay float64 (models/hf/float64.py); with transformers' float32 round trip it was 6e-9 off in the loss."""
    run = two_rank_runs[f"llama {layout}"]
    graphs = json.loads((run / "dynamo_stats.json").read_text()).get("unique_graphs", 0)
    assert (graphs >= 1) == layout.endswith("compile"), graphs  # compile really ran, and only there
    _assert_parity(run, references["llama"])


@pytest.mark.parametrize("dtype", list(LOW_PRECISION))
def test_hf_model_in_low_precision_tracks_fp32(dtype, two_rank_runs, references):
    """Autocast really ran (not fp32's numbers) and stays within that precision's rounding."""
    ref, run = losses(references["llama fp32"]), losses(two_rank_runs[f"llama {dtype}"])
    diffs = [abs(run[s] - ref[s]) / ref[s] for s in ref]
    assert 0 < max(diffs) <= LOW_PRECISION[dtype], diffs


def test_a_model_without_the_llama_structure_trains_under_zero3(two_rank_runs, references):
    """GPT-2 (blocks in `transformer.h`, Conv1D, learned positions): FSDP units come from its block list."""
    _assert_parity(two_rank_runs["gpt2 zero3"], references["gpt2"])


@pytest.mark.parametrize("layout", list(DOCUMENT_LAYOUTS))
def test_hf_document_masking_trains_like_one_process(layout, two_rank_runs, references):
    """Positions restart per document (transformers masks between packed sequences), on every layout."""
    _assert_parity(two_rank_runs[f"llama documents {layout}"], references["llama documents"])
    masked, plain = losses(references["llama documents"]), losses(references["llama"])
    assert max(abs(masked[s] - plain[s]) / plain[s] for s in plain) > 1e-4  # masking changes the losses


@pytest.mark.parametrize("layout", [layout for kind, layout in PAIRS if kind == "qwen2"])
def test_tied_embeddings_stay_tied(layout, two_rank_runs):
    params = final_params(two_rank_runs[f"qwen2 {layout}"], 6)
    assert params["lm_head.weight"].equal(params["model.embed_tokens.weight"])


def test_initialisation_does_not_depend_on_the_layout(two_rank_runs, references):
    """Step 1's loss comes from the initial weights: equal everywhere, seeded by parameter name."""
    for kind, layout in PAIRS:
        assert losses(two_rank_runs[f"{kind} {layout}"])[1] == pytest.approx(losses(references[kind])[1], rel=EXACT)


@pytest.mark.parametrize("kind", KINDS)
def test_loaded_weights_give_transformers_logits(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    from disttrain.models.hf.spec import hf_spec
    from disttrain.models.spec import build_model

    directory = save_tiny(kind, tmp_path / kind, weights_seed=7)
    spec = hf_spec(str(directory))
    ours = build_model(spec, torch.device("cpu"), seed=0)  # init, then the directory's weights over it
    theirs = AutoModelForCausalLM.from_pretrained(directory).eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(spec.logits(ours.eval()(x)), theirs(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_norms_stay_float64_in_an_fp64_model(kind, hf_dirs):
    """transformers' RMSNorm rounds through float32 (for bf16 stability); an fp64 model's must not, or its runs
    are not double precision. Other dtypes keep transformers' own forward (the logits test above)."""
    from disttrain.models.hf.spec import hf_spec
    from disttrain.models.spec import build_model

    model = build_model(hf_spec(str(hf_dirs[kind])), torch.device("cpu"), seed=0, dtype=torch.float64)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * 4 + 1  # two per layer and the final one
    h = torch.randn(2, 8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for norm in norms:
            exact = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
            assert norm(h).equal(exact) and not type(norm).forward(norm, h).equal(exact)


def test_checkpoint_resumes_on_one_process(two_rank_runs, references):
    run = two_rank_runs["qwen2 zero3"]
    assert_losses_close(losses(references["qwen2 resumed"]), {s: v for s, v in losses(run).items() if s > 3},
                        rel=EXACT)


@pytest.mark.parametrize("source", ["qwen2 zero3", "llama pp2", "builtin"])
def test_convert_to_hf_loads_in_transformers(source, two_rank_runs, tmp_path, debug_reference):
    """Weights gathered from shards (ZeRO-3) or stages (PP) load with `from_pretrained`, parameters equal to
    the checkpoint's (fp64 runs; the export writes float32); for HF-sourced models the names are the
    checkpoint's own."""
    from transformers import AutoModelForCausalLM

    run = debug_reference if source == "builtin" else two_rank_runs[source]
    out = tmp_path / "hf"
    code, _, err = run_main("convert", str(run), "--to", "hf", "--out", str(out))  # starts no process
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(out)
    loaded = dict(model.named_parameters())
    saved = {k: v.float() for k, v in final_params(run, 20 if source == "builtin" else 6).items()}
    if source == "builtin":
        assert loaded["model.embed_tokens.weight"].equal(saved["tok_embeddings.weight"])
        assert loaded["model.layers.1.mlp.down_proj.weight"].equal(saved["layers.1.feed_forward.w2.weight"])
    else:
        for name, param in loaded.items():
            assert param.detach().equal(saved[name]), name


BAD = {
    "no config.json": (lambda d: d.mkdir(), [], "no config.json inside"),
    "shape key with hf": (lambda d: save_tiny("llama", d), ["model.dim=32"],
                          "model.dim=32 with model.hf="),
    "no TP plan": (lambda d: save_tiny("gpt2", d), ["parallel.tp=2"],
                   "parallel.tp=2: model gpt2 from model.hf="),
    "no pipeline structure": (lambda d: save_tiny("gpt2", d), ["parallel.pp=2", "train.micro_batch_size=1"],
                              "cannot be split into pipeline stages"),
    "sequence parallel under a pipeline": (lambda d: save_tiny("llama", d),
                                           ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2",
                                            "parallel.zero_stage=2", "train.micro_batch_size=1"],
                                           "parallel.sequence_parallel=true with parallel.pp=2: model llama from", "4"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_hf_input_is_one_line(name, tmp_path):
    """Refused by the launcher before any worker starts (resolve_run), so run in this process as the launcher
    runs it."""
    make, overrides, expected, *nproc = BAD[name]
    make(tmp_path / "model")
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path / 'runs'}", f"model.hf={tmp_path / 'model'}",
                            *overrides, "--nproc-per-node", nproc[0] if nproc else "2")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_weights_that_do_not_fit_the_config_are_one_line(tmp_path):
    directory = save_tiny("llama", tmp_path / "model", weights_seed=0)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path / 'runs'}", f"model.hf={directory}",
                   "train.steps=2", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.layers.0.mlp.gate_proj.weight has shape (192, 64) in the weights, (128, 64)" in lines[0]


@pytest.mark.parametrize("kind", KINDS)
def test_estimate_counts_the_parameters_of_an_hf_directory(kind, hf_dirs):
    """`estimate --hf DIR` reads config.json: the parameter count transformers' own model has (Qwen2's tied
    embedding once), and the 6-FLOPs-per-parameter floor of its training FLOPs per token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dirs[kind]))
    expected = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    code, stdout, err = run_main("estimate", "--hf", str(hf_dirs[kind]), "--gpus", "2", "--json")
    assert code == 0, err
    out = json.loads(stdout)
    assert out["params"] == expected
    assert out["flops_per_token"] >= 6 * (expected - model.config.hidden_size * model.config.vocab_size)
