"""Context parallelism (`parallel.cp`): every sequence sharded over 2 ranks, attention across the shards by
each `parallel.cp_method`, gives one process's losses and parameters (fp64, 1e-10 relative): the built-in
model and a transformers Llama, on plain text and on packed chat data (several conversations per
sequence under document masking, prompt targets masked in both halves of each sequence); with ZeRO-3 and
activation checkpointing; a checkpoint written at cp=2 resumes on one process and the reverse. The
attention kernels alone match single-device attention with grouped heads, at 2 ranks, and a Gated DeltaNet layer
(Qwen3-Next, Qwen3.5) sharded over 2 ranks, its convolution's reach and recurrent state passed between the shards,
matches the same layer on the whole sequence. Bad input is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chat_tokenizer import records, save_chat_tokenizer
from helpers import (DEBUG_CONFIG, EXACT, FP64, SMALL_CHUNKS, WHOLE_LOGITS, assert_losses_close, assert_params_exact,
                     final_params, losses, run_cli, run_main, train_many)
from hf_models import SIZES

METHODS = ("ring", "allgather", "ulysses")
STEPS = 4
COMMON = (f"train.steps={STEPS}", "train.global_batch_size=4", "optim.lr=3e-3", "checkpoint.save_final=true",
          "metrics.sync_check_every=2", FP64, SMALL_CHUNKS)
CHAT_SEQ = 128
FP32 = (*(o for o in COMMON if o != FP64), "checkpoint.every_steps=2")  # the checkpoint tests' runs
STEP_2 = "checkpoints/step_00000002"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Packed chat data (a chat tokenizer, prepare-data) and a tiny transformers Llama for its vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from disttrain.cli import main

    root = tmp_path_factory.mktemp("cp_data")
    tok = save_chat_tokenizer(root / "tok", markers=True)
    (root / "records.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in records()))
    main(["prepare-data", str(root / "records.jsonl"), "--out", str(root / "chat"), "--tokenizer", str(tok),
          "--seq-len", str(CHAT_SEQ), "--val-fraction", "0.25"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**SIZES, "vocab_size": 384}, tie_word_embeddings=False)) \
        .save_pretrained(root / "llama")
    return root


def _cases(data) -> dict[str, tuple[str, ...]]:
    chat = (f"data.source={data / 'chat'}", "data.packing=true", f"data.seq_len={CHAT_SEQ}", "model.vocab_size=384")
    hf_chat = (f"data.source={data / 'chat'}", "data.packing=true", f"data.seq_len={CHAT_SEQ}",
               f"model.hf={data / 'llama'}")
    return {"debug": (), "debug_chat": chat, "hf": (f"model.hf={data / 'llama'}", "data.tokenizer=byte"),
            "hf_chat": hf_chat}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """Two launches: cp=2 on 2 ranks (every case and method, ZeRO-3 with checkpointing, an fp32 run saving at
    step 2, and the attention kernels alone), then one process (the references, and the fp32 run resumed
    from the cp=2 checkpoint)."""
    root = tmp_path_factory.mktemp("cp_runs")
    cases = _cases(data)
    jobs = {"kernels": {"call": "cp_kernels:check", "args": [str(root / "kernels")]},
            "linear": {"call": "cp_linear_attention:check", "args": [str(root / "linear")]}}
    jobs |= {f"{c}_{m}": (root / f"{c}_{m}", (*COMMON, *o, "parallel.cp=2", f"parallel.cp_method={m}"))
             for c, o in cases.items() for m in METHODS}
    jobs["zero3_checkpointed"] = (root / "zero3_ac", (*COMMON, *cases["debug_chat"], "parallel.cp=2",
                                                     "parallel.zero_stage=3", "parallel.activation_checkpointing=full"))
    jobs["cp2_fp32"] = (root / "cp2_fp32", (*FP32, "parallel.cp=2"))
    two = train_many(jobs, nproc=2)
    one_jobs = {f"ref_{c}": (root / f"ref_{c}", (*COMMON, *o, WHOLE_LOGITS)) for c, o in cases.items()}
    one_jobs["ref_fp32"] = (root / "ref_fp32", FP32)
    one_jobs["one_from_cp2"] = (root / "one_from_cp2", (*FP32, f"checkpoint.resume={root / 'cp2_fp32' / STEP_2}"))
    return {**two, **train_many(one_jobs, nproc=1)}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", ["debug", "debug_chat", "hf", "hf_chat"])
def test_cp2_gives_one_process_losses_and_parameters(runs, case, method):
    run, ref = runs[f"{case}_{method}"], runs[f"ref_{case}"]
    assert len(losses(run)) == STEPS
    assert_losses_close(losses(run), losses(ref), rel=EXACT)
    assert_params_exact(final_params(run, STEPS), final_params(ref, STEPS))


def _four_rank_jobs(root, data, names, resume_from=None) -> dict:
    """cp=2 x dp_shard=2 (ZeRO-3), cp=2 x tp=2 (sequence parallel, ZeRO-2) and cp=2 x pp=2 (ZeRO-2), named
    `{layout}_{case}`; with `resume_from`, also `cp2_from_one` resuming that checkpoint."""
    cases, jobs = _cases(data), {}
    for name in names:
        layout, case = name.split("_", 1)
        chat, o = case.endswith("chat"), cases[case]
        if layout in ("hsdp", "zero1"):
            extra = ("parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.zero_stage=3") if layout == "hsdp" \
                else ("parallel.dp_shard=2", "parallel.zero_stage=1")
        elif layout == "pp2":  # (no document masking with pipeline stages)
            extra = ("parallel.pp=2", "parallel.pp_microbatches=2", "parallel.zero_stage=2")
        elif layout == "dp2":
            extra = ("parallel.dp_shard=2", "parallel.zero_stage=3", f"parallel.cp_method={'allgather' if chat else 'ring'}")
        else:
            extra = ("parallel.tp=2", "parallel.zero_stage=2", "parallel.sequence_parallel=true",
                     f"parallel.cp_method={'ring' if chat else 'allgather'}")
        jobs[name] = (root / name, (*COMMON, *o, "parallel.cp=2", *extra))
    if resume_from is not None:  # one process's checkpoint resumed at cp=2 x dp_shard=2
        jobs["cp2_from_one"] = (root / "cp2_from_one", (*FP32, "parallel.cp=2", "parallel.dp_shard=2",
                                                         f"checkpoint.resume={resume_from}"))
    return train_many(jobs, nproc=4)


FOUR_LEAN = ("dp2_hf_chat", "tp2_debug_chat", "pp2_debug")  # in the suite; the rest with `make test-slow`
FOUR_ALL = tuple(f"{layout}_{case}" for layout in ("dp2", "tp2") for case in ("debug", "debug_chat", "hf", "hf_chat")) \
    + ("pp2_debug", "hsdp_debug_chat", "zero1_hf")


@pytest.fixture(scope="module")
def four_lean(tmp_path_factory, data, runs):
    return _four_rank_jobs(tmp_path_factory.mktemp("cp4"), data, FOUR_LEAN, runs["ref_fp32"] / STEP_2)


@pytest.fixture(scope="module")
def four_rest(tmp_path_factory, data):
    return _four_rank_jobs(tmp_path_factory.mktemp("cp4_rest"), data, [n for n in FOUR_ALL if n not in FOUR_LEAN])


def _check_four(run, runs, name):
    ref = runs[f"ref_{name.split('_', 1)[1]}"]
    assert_losses_close(losses(run), losses(ref), rel=EXACT)
    assert_params_exact(final_params(run, STEPS), final_params(ref, STEPS))


@pytest.mark.parametrize("name", FOUR_LEAN)
def test_cp2_with_data_or_tensor_parallel_on_4_ranks(runs, four_lean, name):
    """Packed documents under cp=2 x dp_shard=2 (HF Llama, all-gather) and cp=2 x tp=2 (built-in, ring);
    cp=2 x pp=2 (built-in, ring, 1F1B)."""
    _check_four(four_lean[name], runs, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FOUR_ALL if n not in FOUR_LEAN])
def test_cp2_with_data_or_tensor_parallel_on_4_ranks_every_case(runs, four_rest, name):
    _check_four(four_rest[name], runs, name)


def test_zero3_with_activation_checkpointing(runs):
    assert_losses_close(losses(runs["zero3_checkpointed"]), losses(runs["ref_debug_chat"]), rel=EXACT)
    assert_params_exact(final_params(runs["zero3_checkpointed"], STEPS), final_params(runs["ref_debug_chat"], STEPS))


def test_a_cp2_checkpoint_resumes_on_one_process(runs):
    """fp32: the steps after the resume give the uninterrupted run's losses within 1e-5."""
    _assert_resumed(losses(runs["one_from_cp2"]), runs["cp2_fp32"])
    assert_losses_close(losses(runs["cp2_fp32"]), losses(runs["ref_fp32"]), rel=1e-5)


def test_a_one_process_checkpoint_resumes_at_cp2_x_dp_shard2(runs, four_lean):
    _assert_resumed(losses(four_lean["cp2_from_one"]), runs["ref_fp32"])


def _assert_resumed(after: dict, saved) -> None:
    assert sorted(after) == [3, 4]
    assert_losses_close(after, {k: v for k, v in losses(saved).items() if k > 2}, rel=1e-5)


def test_packed_sequences_hold_documents_and_masked_targets_in_both_halves(data):
    """What the chat parity cases train on: sequences of several conversations, each rank's half holding
    masked targets and valid ones, so a ring without document masks or a per-rank divisor would give
    another loss."""
    from disttrain.data.source import load_samples

    tok, samples, _ = load_samples(str(data / "chat"), "auto", CHAT_SEQ, True)
    x, y = samples.batch(np.arange(len(samples)))
    x, y = x.numpy(), y.numpy()
    chunk = CHAT_SEQ // 4
    halves = [np.r_[0:chunk, 3 * chunk:4 * chunk], np.r_[chunk:3 * chunk]]  # rank 0's and rank 1's tokens
    starts = ((x[:, :-1] == tok.eos_id) & (x[:, 1:] != tok.eos_id)).sum(axis=1)  # documents after the first
    assert (starts >= 1).mean() > 0.5
    for half in halves:
        assert ((y[:, half] == -100).any(axis=1)).all() and ((y[:, half] != -100).any(axis=1)).mean() > 0.5


def test_kernels_match_single_device_attention(runs):
    """Every method's output and q/k/v gradients, grouped heads, with and without documents (and a window
    within them), and with attention sinks (their gradient too), a sliding window and another value head dim;
    the ring under a window computes only the part of each block the window reaches (fp64, 1e-12;
    tests/workers/cp_kernels.py, run in the 2-rank launch)."""
    import json

    for rank in (0, 1):
        result = json.loads(Path(f"{runs['kernels']['args'][0]}.rank{rank}.json").read_text())
        expected = {f"{m} documents={d}": "ok" for d in ("False", "True", "True window") for m in METHODS}
        expected |= {f"{m} sinks window dv": "ok" for m in METHODS} | {"ring dv": "ok", "ring work": "ok"}
        assert result == expected, (rank, result)


def test_linear_attention_passes_its_state_between_the_shards(runs):
    """transformers' Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over 2 ranks: this rank's outputs and input
    gradients and the parameters' gradients summed over the ranks equal the layer's on the whole sequence, in fp64
    to 1e-12 (32 tokens: chunks of 8, the convolution reaching 3 back; 200 tokens: the kernel's blocks of 64 cut
    elsewhere than one process's) and in fp32 to 1e-5; with document masking, documents starting on a chunk's first
    token, inside a chunk and in the convolution's reach of the next, to 1e-12 in fp64
    (tests/workers/cp_linear_attention.py, in the 2-rank launch)."""
    import json

    for rank in (0, 1):
        result = json.loads(Path(f"{runs['linear']['args'][0]}.rank{rank}.json").read_text())
        expected = {f"{kind} {case}": "ok" for kind in ("qwen3_next", "qwen3_5_text")
                    for case in ("float64 seq=32", "float64 seq=200", "documents seq=32", "documents seq=200",
                                 "float32")}
        assert result == expected, (rank, result)


BAD = [
    (("data.seq_len=66", "parallel.cp=2"), "data.seq_len=66 is not divisible by 2 x parallel.cp = 4"),
    (("parallel.cp=2", "parallel.cp_method=ulysses", "model.n_heads=6", "model.n_kv_heads=3", "model.dim=48"),
     "parallel.cp_method=ulysses with parallel.cp=2: model.n_kv_heads=3 is not divisible by 2"),
    (("parallel.cp=2", "parallel.cp_method=diagonal"), "parallel.cp_method=diagonal"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=["seq_len", "ulysses heads", "method"])
def test_bad_context_parallel_input_is_one_line(overrides, message):
    from disttrain.config.load import load_config
    from disttrain.core.errors import ConfigError
    from disttrain.core.errors import UserError
    from disttrain.config.resolve import resolve_run

    with pytest.raises((UserError, ConfigError)) as err:
        resolve_run(load_config(DEBUG_CONFIG, list(overrides)), 2, "cpu")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_models_that_cannot_shard_their_sequence_are_refused_by_name(tmp_path):
    """A transformers model outside the supported families, by its model type (exit 2 from the CLI); a
    sliding-window Mistral takes every method (the ring builds the window's mask)."""
    from transformers import MistralConfig

    from hf_models import save_tiny

    gpt2 = save_tiny("gpt2", tmp_path / "gpt2")  # (the launcher refuses before starting any worker)
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"model.hf={gpt2}", "parallel.cp=2", "data.tokenizer=byte",
                            f"run.dir={tmp_path / 'runs'}", "--nproc-per-node", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"parallel.cp=2: model gpt2 from model.hf={gpt2} cannot shard its sequence" in err
    assert not (tmp_path / "runs").exists()  # nothing written

    from disttrain.config.load import load_config
    from disttrain.config.resolve import resolve_run

    MistralConfig(**SIZES, sliding_window=16).save_pretrained(tmp_path / "mistral")
    base = [f"model.hf={tmp_path / 'mistral'}", "data.tokenizer=byte", "parallel.cp=2"]
    for method in ("ring", "allgather", "ulysses"):
        assert resolve_run(load_config(DEBUG_CONFIG, [*base, f"parallel.cp_method={method}"]), 2, "cpu").layout.cp == 2


def test_estimate_gives_activation_bytes_falling_as_one_over_cp(tmp_path):
    """`disttrain estimate` of `tiny` at seq 8,192: the ring's per-rank activations at cp 2 and 4 are within
    10% of 1/cp of cp 1's; all-gather and Ulysses keep more (gathered K/V, explicit masks). On whole logits:
    a chunked loss head's chunk and weight gradient do not shrink with cp."""
    import re

    def activations(cp: int, method: str = "ring") -> int:
        cfg = tmp_path / f"cp{cp}_{method}.yaml"
        cfg.write_text(f"model: {{name: tiny, max_seq_len: 8192}}\ndata: {{seq_len: 8192}}\n"
                       "train: {global_batch_size: 1, loss_chunk_tokens: 0}\n"
                       f"parallel: {{cp: {cp}, cp_method: {method}}}\n")
        code, out, err = run_main("estimate", str(cfg), "--gpus", str(cp))  # pure Python: in this process
        assert code == 0, err
        return int(re.search(r"activations\s+([\d,]+) B", out).group(1).replace(",", ""))

    one = activations(1)
    for cp in (2, 4):
        assert abs(activations(cp) * cp / one - 1) < 0.10
    assert activations(2, "allgather") > activations(2) and activations(2, "ulysses") > activations(2, "allgather")


def test_the_planner_proposes_context_parallel_for_long_sequences():
    """7b at 131,072 tokens on 32 H100s: the winner shards the sequence, more than 10% faster than the best
    layout without cp; short sequences search no cp (the rest of the grid as before)."""
    from disttrain.core.gpus import find_gpu
    from disttrain.models.llama.shapes import MODEL_SHAPES
    from disttrain.plan.context import cp_degrees, kv_traffic_bytes
    from disttrain.plan.search import SearchSpace, search
    from disttrain.plan.timing import Cluster
    from dataclasses import replace

    shape = replace(MODEL_SHAPES["7b"], max_seq_len=131072)
    cluster = Cluster(find_gpu("h100"), 8, 4)
    result = search(shape, cluster, SearchSpace(seq_len=131072, global_batch_size=32, param_dtype="bf16"), model="7b")
    winner = result.ranked[0].layout
    assert winner.cp > 1 and winner.cp_method == "ring" and winner.world_size == 32
    best_without = next(e for e in result.ranked if e.layout.cp == 1)  # e.g. tp=8 with full recomputation
    assert result.ranked[0].time.tokens_per_s > 1.1 * best_without.time.tokens_per_s
    assert result.ranked[0].time.cp_comm_s > 0
    assert cp_degrees(4096, 32) == [1] and cp_degrees(131072, 16) == [1, 2, 4, 8, 16]
    ring, gather = (kv_traffic_bytes(shape, winner.replace(cp_method=m))["bytes"] for m in ("ring", "allgather"))
    assert ring > gather > 0  # the ring sends more bytes, hidden behind attention


def test_the_planner_counts_rotary_tables_and_the_whole_embedding_gradient_as_the_dry_run_measures():
    """Three terms that apply to every layout (the 7b's 131,072-token dry run found them), on rank 0 of
    dp_shard=2 x tp=2+sp ZeRO-2 bf16 with 2 micro-batches, simulated in this process: the rotary tables
    (max_seq_len x head_dim fp32, cos and sin) under parameters; FSDP2's bf16 cast of them into every block,
    kept for the backward, under activations; the embedding's accumulated gradient, which DTensor gives whole
    on each tp rank, under gradients (unless the output matrix is tied to it: the output's sharded gradient
    is added to it). Category by category the planner's peak is the dry run's, tied and untied. A long
    max_seq_len and a large vocabulary make each term a sizeable share of its category."""
    from disttrain.config.load import load_config
    from disttrain.dryrun.simulate import simulate
    from disttrain.plan.memory import estimate_memory
    from disttrain.config.resolve import resolve_run

    for tied in ("false", "true"):
        cfg = load_config(None, ["model.name=tiny", "model.n_layers=2", "model.vocab_size=16384",
                                 "model.max_seq_len=8192", f"model.tie_embeddings={tied}", "data.seq_len=256",
                                 "train.micro_batch_size=1", "train.global_batch_size=4", "parallel.dp_shard=2",
                                 "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=2",
                                 "precision.param_dtype=bf16", "precision.compute_dtype=bf16"])
        resolved = resolve_run(cfg, 4, "cuda")
        measured = simulate(cfg, resolved, 0).bytes
        planned = estimate_memory(resolved.shape, resolved.layout, pp_rank=0).categories()
        for category in ("parameters", "gradients", "activations"):
            assert abs(planned[category] / measured[category] - 1) < 1e-3, (tied, category, planned, measured)



def test_the_planner_peak_is_the_dry_runs_with_one_micro_batch_per_rank():
    """cp=2 x dp_shard=2 ZeRO-2, one micro-batch per data-parallel rank, seq 128 (rank 0 simulated in this
    process): the planner's peak within 5% of the dry run's, dense and MoE. The planner once took a block's
    backward for the peak here (+9% and +17%): it counted the block's unsharded gradients beside the previous
    block's reduce-scatter input, and the ring's backward temporaries beside the MLP's tensors. On whole logits
    (the loss in chunks moves the peak to the output head's forward: tests/test_chunked_loss.py)."""
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config

    for name in ("debug", "debug-moe"):
        cfg = load_config(None, [f"model.name={name}", "data.seq_len=128", "train.global_batch_size=4",
                                 "train.micro_batch_size=2", "parallel.zero_stage=2", "parallel.cp=2",
                                 "parallel.dp_shard=2", "train.loss_chunk_tokens=0"])
        rank = dry_run(cfg, 4, ranks=[0])["ranks"][0]
        error = rank["planner"]["peak_bytes"] / rank["peak_bytes"] - 1
        assert abs(error) <= 0.05, (name, rank["planner"], rank["bytes"])

def test_the_planner_counts_the_ring_traffic_the_dry_run_sends():
    """Rank 0 of cp=2 under selective checkpointing (`tiny`, 2 layers, simulated in this process) sends per
    step what the planner counts: K/V blocks forward and backward, dK/dV blocks backward, and the forward's
    K/V blocks once more (checkpointing replays the block, the ring's walk included): 10 blocks, not 8."""
    from disttrain.config.load import load_config
    from disttrain.dryrun.simulate import simulate
    from disttrain.plan.context import kv_traffic_bytes
    from disttrain.config.resolve import resolve_run

    cfg = load_config(None, ["model.name=tiny", "model.n_layers=2", "data.seq_len=512", "train.micro_batch_size=1",
                             "train.global_batch_size=1", "parallel.cp=2", "parallel.activation_checkpointing=selective"])
    resolved = resolve_run(cfg, 2, "cuda")
    sends = [c for c in simulate(cfg, resolved, 0).collectives if c["dim"] == "cp" and c["kind"] == "send"]
    assert sum(c["count"] for c in sends) == 2 * 5  # per layer: 1 K/V forward, 1 again, 1 K/V and 2 dK/dV back
    assert sum(c["bytes"] for c in sends) == 2 * kv_traffic_bytes(resolved.shape, resolved.layout)["bytes"]


@pytest.mark.slow
def test_dry_run_activations_fall_as_one_over_cp(tmp_path):
    """The real step of rank 0 under fake tensors (`disttrain dryrun`), `tiny` at seq 8,192: the activations
    measured at cp 2 and 4 are within 10% of 1/cp of cp 1's (about a minute of CPU)."""
    import re

    measured = {}
    for cp in (1, 2, 4):
        cfg = tmp_path / f"cp{cp}.yaml"
        cfg.write_text(f"model: {{name: tiny, max_seq_len: 8192}}\ndata: {{seq_len: 8192}}\n"
                       "train: {global_batch_size: 1, loss_chunk_tokens: 0}\n"
                       f"parallel: {{cp: {cp}}}\n")
        out = run_cli("dryrun", str(cfg), "--world-size", str(cp), "--rank", "0", timeout=600).stdout
        value, unit = re.search(r"activations\s+([\d.]+) (MiB|GiB)", out).groups()
        measured[cp] = float(value) * (1024 if unit == "GiB" else 1)
    for cp in (2, 4):
        assert abs(measured[cp] * cp / measured[1] - 1) < 0.10, measured


@pytest.mark.slow
def test_dry_run_confirms_the_ring_cache_under_selective_checkpointing(tmp_path):
    """Selective checkpointing caches each ring block's kernel output: the dry run's default ranks include the
    last context rank, which holds (cp - 1) / 2 blocks per layer more than rank 0 (plan/context.py). `tiny`,
    cp=4 on 4 simulated ranks (a few minutes of CPU)."""
    import json

    from disttrain.models.llama.shapes import MODEL_SHAPES
    from disttrain.plan.context import ring_selective_cache_bytes
    from disttrain.config.resolve import resolve_run
    from disttrain.config.load import load_config

    cfg = tmp_path / "cp4.yaml"
    cfg.write_text("model: {name: tiny, max_seq_len: 4096}\ndata: {seq_len: 4096}\ntrain: {global_batch_size: 1}\n"
                   "parallel: {cp: 4, activation_checkpointing: selective}\n")
    code, out, err = run_main("dryrun", str(cfg), "--world-size", "4", "--json")
    assert code == 0, err
    ranks = {r["rank"]: r for r in json.loads(out)["ranks"]}
    assert sorted(ranks) == [0, 3]
    layout = resolve_run(load_config(cfg, []), 4, "cpu").layout
    per_block = ring_selective_cache_bytes(MODEL_SHAPES["tiny"], layout, 4) / (layout.cp - 1)
    extra = ranks[3]["bytes"]["activations"] - ranks[0]["bytes"]["activations"]
    # rank 3: 4 full-row blocks per layer, rank 0: 1 + 3 halves; at the peak (a block's backward) that block's
    # cache has gone to its recomputation, so n_layers - 1 layers hold theirs
    assert abs(extra / ((MODEL_SHAPES["tiny"].n_layers - 1) * 1.5 * per_block) - 1) < 0.02, extra
