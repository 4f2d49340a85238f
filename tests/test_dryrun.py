"""The dry run (disttrain.dryrun): one rank of a large job simulated with a fake process group and fake
tensors. Checked against a real run on real tensors (same code, same tracker), against the ZeRO
arithmetic, and against the collectives a layout implies."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, cli_env

from disttrain.config.load import load_config
from disttrain.dryrun.simulate import simulate
from disttrain.models.registry import MODEL_SHAPES
from disttrain.config.resolve import resolve_run

TINY = ["model.name=tiny", "data.seq_len=128", "train.micro_batch_size=2"]
# DDP and ZeRO-3 with two micro-batches (accumulation: DDP's no_sync gradients, FSDP's unsharded ones); FSDP2's
# bf16 policy, whose peak falls inside the gradient reduction.
REAL_LAYOUTS = {
    "ddp": [*TINY, "train.global_batch_size=8", "parallel.dp_shard=1", "parallel.dp_replicate=2"],
    "zero3": [*TINY, "train.global_batch_size=8", "parallel.dp_shard=2", "parallel.zero_stage=3"],
    "tp2": [*TINY, "train.global_batch_size=4", "parallel.dp_shard=1", "parallel.tp=2"],
    "pp2": [*TINY, "train.global_batch_size=4", "train.micro_batch_size=1", "parallel.dp_shard=1", "parallel.pp=2"],
    "ddp-fp16": [*TINY, "train.global_batch_size=4", "parallel.dp_shard=1", "parallel.dp_replicate=2",
                 "precision.compute_dtype=fp16"],  # autocast with the loss scaler
    "zero3-bf16": [*TINY, "train.global_batch_size=4", "parallel.dp_shard=2", "parallel.zero_stage=3",
                   "precision.param_dtype=bf16"],
    # LoRA adapters on a frozen base stored in bf16: gradients and optimizer states of the adapters alone
    "zero3-lora": [*TINY, "train.global_batch_size=4", "parallel.dp_shard=2", "parallel.zero_stage=3",
                   "precision.compute_dtype=bf16", "model.lora.rank=4"],
}


def _simulate(overrides: list[str], world: int, rank: int = 0, device_type: str = "cpu"):
    cfg = load_config(None, overrides)
    return simulate(cfg, resolve_run(cfg, world, device_type), rank)


def _measure_real(tmp_path) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    jobs, out = tmp_path / "jobs.json", tmp_path / "out.json"
    jobs.write_text(json.dumps(REAL_LAYOUTS))
    cmd = [sys.executable, "-m", "disttrain.launch.agent", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "workers" / "measure_step.py"), str(jobs), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_dry_run_equals_a_real_run(tmp_path):
    """tiny on 2 real gloo ranks, measured by the same tracker on real tensors, against the dry run of the
    same configs: model states to the byte, activations and temporaries within 5%, the peak within 5%, the same
    collectives. The pipeline's stage shapes come from meta copies of the stages in both (tests pass them up front).

    The real side counts only what the training code allocates (tests/workers/measure_step.py): gloo's worker
    threads hold a collective's tensors for a moment after completing it, and the reduce-scatter's own copy of its
    input, which its `wait()` splits in the tracker's sight; a buffer freed by such a thread (when it got a CPU)
    once read the real temporaries or peak a few MB high on a loaded machine. No counted buffer may be freed by
    another thread: the measurement does not depend on scheduling."""
    real = _measure_real(tmp_path)
    for name, overrides in REAL_LAYOUTS.items():
        for rank in (0, 1) if name.startswith("pp") else (0,):  # pipeline stages differ; other ranks alike
            fake = _simulate(overrides, 2, rank)
            measured = real[name][rank]["bytes"]
            for key in ("parameters", "gradients", "optimizer", "communication"):
                assert fake.bytes[key] == measured[key], (name, rank, key, fake.bytes, measured)
            for key in ("activations", "temporary"):
                assert abs(fake.bytes[key] - measured[key]) <= 0.05 * measured[key], (name, rank, key, fake.bytes,
                                                                                      measured)
            peak = real[name][rank]["peak_bytes"]
            assert abs(fake.peak_bytes - peak) <= 0.05 * peak, (name, rank, fake.peak_bytes, peak)
            assert fake.collectives == real[name][rank]["collectives"], (name, rank)
            assert measured["parameters"] > 0 and measured["activations"] > 0
        assert [r["freed_by_other_threads"] for r in real[name]] == [0, 0], name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_follow_the_zero_arithmetic_at_32_ranks(stage):
    """Per-rank bytes at the peak of step 2, 32 simulated ranks, fp32 + AdamW: parameters 4Ψ (sharded by 32
    under FSDP2, stages 2 and 3), optimizer 8Ψ (sharded at stages 1-3), DDP's gradient bucket 4Ψ (sharded
    gradients are freed by zero_grad and not yet back at the peak). tiny's dims all divide by 32."""
    n = MODEL_SHAPES["tiny"].num_params()
    wrapper = ["parallel.dp_shard=1", "parallel.dp_replicate=32"] if stage < 2 else ["parallel.dp_shard=32"]
    run = _simulate([*TINY, "train.global_batch_size=64", f"parallel.zero_stage={stage}", *wrapper], 32,
                    device_type="cuda")
    model = _meta_model("tiny")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # filed under parameters
    params, opt = run.bytes["parameters"] - buffers, run.bytes["optimizer"]
    steps = 4 * len(list(model.parameters()))  # AdamW's fp32 step counter per parameter tensor
    assert params == (4 * n // 32 if stage >= 2 else 4 * n)  # FSDP2 keeps ZeRO-2's parameters sharded at rest too
    if stage == 1:  # ZeroRedundancyOptimizer gives whole tensors to ranks: rank 0's share is near 1/32
        assert 0 < opt < 3 * (8 * n // 32)
    else:
        assert opt == (8 * n // 32 if stage >= 2 else 8 * n) + steps
    if stage == 0:
        assert run.bytes["gradients"] == 4 * n  # DDP's bucket, whose views the gradients are


def _meta_model(name: str):
    import torch

    from disttrain.models.llama import llama_spec

    with torch.device("meta"):
        return llama_spec(MODEL_SHAPES[name]).build()


def test_zero3_collectives_at_8_ranks():
    """One step of ZeRO-3 on 8 simulated ranks, one micro-batch: an all-gather per FSDP unit in forward and
    again in backward (the root, kept gathered after forward, only once) sending this rank's bf16 shard,
    a reduce-scatter per unit sending the whole fp32 gradient, and the gradient norm's one all-reduce."""
    shape = MODEL_SHAPES["tiny"]
    cfg = load_config(None, [*TINY, "train.global_batch_size=16", "parallel.dp_shard=8", "parallel.zero_stage=3",
                             "precision.param_dtype=bf16", "precision.reduce_dtype=fp32"])
    run = simulate(cfg, resolve_run(cfg, 8, "cuda"), 0)
    table = {(c["kind"], c["dim"]): c for c in run.collectives}
    assert set(table) == {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("all_reduce", "dp_shard")}
    units = shape.n_layers + 1
    assert table["all_gather", "dp_shard"]["count"] == 2 * units - 1
    gathered = shape.num_params() + shape.n_layers * _layer(shape)  # every unit, then the blocks again
    assert table["all_gather", "dp_shard"]["bytes"] == 2 * gathered // 8  # this rank's bf16 shards
    assert table["reduce_scatter", "dp_shard"]["count"] == units
    assert table["reduce_scatter", "dp_shard"]["bytes"] == 4 * shape.num_params()
    assert table["all_reduce", "dp_shard"]["count"] == 1


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"])
def test_pipeline_transfers_at_8_ranks(schedule):
    """Stage 0 of a 2-stage pipeline (x ZeRO-3 over 4; ZeRO-2 under zero-bubble, which refuses ZeRO-3) sends each
    micro-batch's activations once per stage boundary it owns and receives as many gradients: per step, (stage
    boundaries this rank sends across) x micro-batches transfers of micro-batch x seq x dim in the compute dtype, and
    no other point-to-point."""
    shape = MODEL_SHAPES["tiny"]
    micro_batches = 4
    stage = 2 if schedule == "zero_bubble" else 3
    cfg = load_config(None, [*TINY, "train.micro_batch_size=1", f"train.global_batch_size={4 * micro_batches}",
                             "parallel.dp_shard=4", f"parallel.zero_stage={stage}", "parallel.pp=2",
                             f"parallel.pp_schedule={schedule}", "precision.param_dtype=fp32"])
    resolved = resolve_run(cfg, 8, "cuda")
    layout = resolved.layout
    run = simulate(cfg, resolved, 0)
    table = {(c["kind"], c["dim"]): c for c in run.collectives}
    # rank 0 owns stages 0 (and 2 when interleaved): it sends forward from each, and backward from stage 2
    boundaries = 1 if layout.stages_per_rank == 1 else 3
    one = 128 * shape.dim * 4
    for kind in ("send", "recv"):
        assert table[kind, "pp"]["count"] == boundaries * micro_batches
        assert table[kind, "pp"]["bytes"] == boundaries * micro_batches * one


def test_gemma4_stages_send_what_their_successors_need(tmp_path):
    """Gemma 4 in 2 stages (the tiny family config: per-layer inputs, its last two layers reusing layers 0 and 1's
    keys and values): the dry run gives the schedule every stage's shapes up front, and stage 0 sends per
    micro-batch its hidden states, the per-layer inputs of layers 2 and 3 and both kinds' keys and values (2 x
    2 tensors of batch x heads x seq x head dim), and receives the gradients of the same."""
    from hf_models import family_config, save_tiny

    directory = save_tiny("gemma4_text", tmp_path / "gemma4")
    c = family_config("gemma4_text")
    b, t, micro_batches = 1, 64, 2
    run = _simulate([f"model.hf={directory}", f"data.seq_len={t}", f"train.micro_batch_size={b}",
                     f"train.global_batch_size={micro_batches}", "parallel.pp=2"], 2)
    table = {(r["kind"], r["dim"]): r for r in run.collectives}
    one = b * t * (c.hidden_size + 2 * c.hidden_size_per_layer_input + 2 * 2 * c.num_key_value_heads * c.head_dim)
    for kind in ("send", "recv"):
        assert table[kind, "pp"]["count"] == 6 * micro_batches  # hidden, per-layer inputs, 2 keys, 2 values
        assert table[kind, "pp"]["bytes"] == micro_batches * one * 4


def _layer(shape) -> int:
    kv = shape.n_kv_heads * shape.head_dim
    return 2 * shape.dim * shape.dim + 2 * shape.dim * kv + 3 * shape.dim * shape.ffn_hidden_dim + 2 * shape.dim


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """`disttrain ...` in this process (the dry run needs no launcher): (exit code, stdout, stderr)."""
    from disttrain.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_fits_means_within_the_budget_estimate_and_plan_use():
    """A peak between the budget (memory less the headroom) and the GPU's whole memory does not fit: one
    budget for estimate, plan and dry run."""
    from types import SimpleNamespace

    from disttrain.cli.dryrun import _fit

    memory = 80 * 2**30
    run = SimpleNamespace(peak_bytes=int(0.95 * memory), bytes={"activations": 2**30, "temporary": 0})
    assert _fit(run, 0.9 * memory, 1)["fits"] is False
    assert _fit(run, 1.0 * memory, 1)["fits"] is True


def test_dryrun_cli_json_and_bad_input(capsys):
    code, out, err = _cli(capsys, "dryrun", "configs/debug.yaml", "parallel.zero_stage=3", "parallel.dp_shard=-1",
                          "train.global_batch_size=8", "--world-size", "8", "--gpu", "a100-80g", "--json")
    assert code == 0, err
    result = json.loads(out)
    for key in ("peak_bytes", "bytes", "planner", "collectives", "fits"):
        assert key in result
    assert set(result["bytes"]) == {"parameters", "gradients", "optimizer", "activations", "temporary", "communication"}
    assert set(result["planner"]) == set(result["bytes"]) | {"peak_bytes"}
    assert result["fits"] is True and result["peak_bytes"] == sum(result["bytes"].values())
    assert result["budget_bytes"] == int(0.9 * 80e9)  # the A100 80GB less 10% kept free, as estimate and plan
    for args, message in [(["engine=deepspeed"], "engine=deepspeed cannot be dry-run"),
                          (["--rank", "9"], "--rank=9: not a rank of --world-size=8"),
                          (["--gpu", "z80"], "z80")]:
        code, out, err = _cli(capsys, "dryrun", "configs/debug.yaml", "--world-size", "8", "train.global_batch_size=8",
                              *args)
        assert code == 2 and message in err and "Traceback" not in err and out == "", err
        assert len(err.strip().splitlines()) == 1


def test_plan_verify_is_the_dry_run_of_the_planned_config(tmp_path, capsys):
    """`plan --verify 1` dry-runs the winner it writes with --out: its measured peak is the one `disttrain dryrun`
    reports for that config, and the planner's figure beside it is the plan's own."""
    out = tmp_path / "winner.yaml"
    code, stdout, err = _cli(capsys, "plan", "--model", "debug", "--gpus", "2", "--gpu", "a100-80g", "--seq-len", "64",
                             "--global-batch-size", "4", "--verify", "1", "--out", str(out), "--json")
    assert code == 0, err
    plan = json.loads(stdout)
    (checked,) = plan["verified"]
    assert checked["planner_peak_bytes"] == plan["winner"]["bytes_per_rank"]["total"]
    code, stdout, err = _cli(capsys, "dryrun", str(out), "--world-size", "2", "--json")
    direct = json.loads(stdout)
    assert checked["peak_bytes"] == max(r["peak_bytes"] for r in direct["ranks"])
    assert checked["planner_error"] == pytest.approx(checked["planner_peak_bytes"] / checked["peak_bytes"] - 1, abs=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hugging_face_models_follow_the_zero_arithmetic(kind, tmp_path):
    """A transformers model from its config.json, ZeRO-3 over 8 simulated ranks: parameters and AdamW states
    are 4Ψ/8 and 8Ψ/8 of the model transformers builds (Qwen2's tied embedding counted once: the tie is
    restored after the fake materialisation)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_models import save_tiny

    directory = save_tiny(kind, tmp_path / kind)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    n = sum(p.numel() for p in reference.parameters())  # shared tensors once
    buffers = sum(b.numel() * b.element_size() for b in reference.buffers())
    overrides = [f"model.hf={directory}", "data.seq_len=64", "train.micro_batch_size=1", "train.global_batch_size=8",
                 "parallel.dp_shard=8", "parallel.zero_stage=3"]
    run = _simulate(overrides, 8)
    assert run.bytes["parameters"] - buffers == 4 * n // 8
    assert run.bytes["optimizer"] == 8 * n // 8 + 4 * len(list(reference.parameters()))
    # transformers computes cos/sin per forward: the planner counts no rotary tables (the built-in models' are)
    from disttrain.plan.memory import estimate_memory

    resolved = resolve_run(load_config(None, overrides), 8, "cuda")
    assert estimate_memory(resolved.shape, resolved.layout).states.tables == 0 < buffers


def test_3d_states_follow_the_planner_at_8_ranks():
    """pp=2 x dp_shard=2 x tp=2 on 8 simulated ranks: each pipeline rank's parameter and optimizer bytes are
    the planner's for that stage (its layers and embedding or head, split by tp, sharded by dp_shard), and
    its step talks over all three dimensions."""
    from disttrain.plan.memory import estimate_memory

    cfg = load_config(None, [*TINY, "train.micro_batch_size=1", "train.global_batch_size=4", "parallel.dp_shard=2",
                             "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=3"])
    resolved = resolve_run(cfg, 8, "cuda")
    layout = resolved.layout
    model = _meta_model("tiny")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    for rank, pp_rank in ((0, 0), (4, 1)):
        run = simulate(cfg, resolved, rank)
        planned = estimate_memory(resolved.shape, layout, pp_rank=pp_rank).states
        assert run.bytes["parameters"] - buffers == planned.params, (rank, run.bytes)
        steps = run.bytes["optimizer"] - planned.optimizer  # AdamW's 4-byte step counter per tensor
        assert 0 < steps <= 4 * len(list(model.parameters())) and steps % 4 == 0, (rank, run.bytes)
        dims = {c["dim"] for c in run.collectives}
        assert {"dp_shard", "tp", "pp"} <= dims, run.collectives
