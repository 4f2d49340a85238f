"""8-bit AdamW states (`optim.state_dtype=int8`, torchao's AdamW8bit): a one-process run equals torchao's optimizer in
a plain loop, the states in memory are 8-bit, checkpoints resume exactly, the layouts it covers train as one process
does, the others are refused in one line."""

from __future__ import annotations

import pytest
import torch

from helpers import (DEBUG_CONFIG, WHOLE_LOGITS, final_params, load_checkpoint_state, losses, run_cli, step_records,
                     train_many)

STEPS = 6
INT8 = "optim.state_dtype=int8"
COMMON = (f"train.steps={STEPS}", "train.micro_batch_size=2", "checkpoint.save_final=true", "optim.grad_clip=0.5",
          WHOLE_LOGITS)  # the loss as the plain loop computes it


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """disttrain with 8-bit states, torchao's AdamW8bit in a plain loop (tests/workers/optim_reference.py), fp32
    states, and the 8-bit run resumed from its step-3 checkpoint: one launch of one process each."""
    root = tmp_path_factory.mktemp("int8")
    jobs = {"int8": (root / "int8", (*COMMON, INT8, "checkpoint.every_steps=3")),
            "fp32": (root / "fp32", COMMON),
            "reference": {"call": "optim_reference:train", "args": [
                str(DEBUG_CONFIG), [f"run.dir={root}", "run.name=reference", *COMMON, INT8], str(root / "ref.pt")]}}
    train_many(jobs, nproc=1)
    saved = root / "int8" / "checkpoints" / "step_00000003"
    train_many({"resumed": (root / "resumed", (*COMMON, INT8, f"checkpoint.resume={saved}"))}, nproc=1)
    return root, torch.load(root / "ref.pt")


def test_one_process_equals_torchaos_adamw8bit_in_a_plain_loop(one_process):
    """Losses, learning rates and gradient norms per step and every final parameter equal the plain loop's (the
    same operations in the same order); fp32 states train otherwise (asserted: the states really are 8-bit)."""
    root, ref = one_process
    ours = step_records(root / "int8")
    for key in ("loss", "grad_norm", "lr"):
        assert [ours[s][key] for s in sorted(ours)] == pytest.approx(ref[key], rel=1e-12, abs=0), key
    assert max(ref["grad_norm"]) > 0.5, "the clip never triggered"
    from torchao.optim.subclass_8bit import OptimState8bit

    with torch.serialization.safe_globals([OptimState8bit]):  # the checkpoint holds them (below)
        params = final_params(root / "int8", STEPS)
    assert params.keys() == ref["params"].keys()
    for name, expected in ref["params"].items():
        assert torch.equal(params[name], expected), name
    fp32 = losses(root / "fp32")
    assert max(abs(fp32[s] - ours[s]["loss"]) for s in fp32) > 1e-4


def test_checkpoints_hold_eight_bit_states_and_resume_exactly(one_process):
    """The checkpoint holds torchao's 8-bit tensors themselves (a byte a value: under half of what the fp32
    weight beside it takes), and the run resumed from it at step 3 ends where the uninterrupted one does."""
    import torch.distributed.checkpoint as dcp

    root, _ = one_process
    stored = {index.fqn: info.length for index, info in
              dcp.FileSystemReader(root / "int8" / "checkpoints" / "step_00000003").read_metadata().storage_data.items()}
    weight = stored["model.layers.0.attention.wq.weight"]  # 64 x 64 fp32: 16 KiB and a header
    for moment in ("exp_avg", "exp_avg_sq"):
        assert stored[f"optim.state.layers.0.attention.wq.weight.{moment}"] < weight / 2
    whole, resumed = losses(root / "int8"), losses(root / "resumed")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == whole[s] for s in resumed)


def test_the_moments_are_eight_bit_in_memory():
    """A tensor of at least 4,096 values (and a multiple of 256) keeps a byte a moment value and one scale per 256
    values; smaller ones (norms, here the 64 x 32 key projection) keep fp32 moments, as torchao does."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from disttrain.config.load import load_config
    from disttrain.models.registry import model_spec
    from disttrain.models.spec import build_model
    from disttrain.train.optim import build_optimizer

    cfg = load_config(DEBUG_CONFIG, [INT8])
    model = build_model(model_spec(cfg.model), torch.device("cpu"), 0)
    optimizer = build_optimizer(model, cfg.optim)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    for name, p in model.named_parameters():
        moment = optimizer.state[p]["exp_avg"]
        if p.numel() >= 4096 and p.numel() % 256 == 0:
            assert isinstance(moment, OptimState8bit), name
            assert moment.codes.dtype == torch.uint8 and moment.codes.numel() == p.numel()
            assert moment.scale.numel() == p.numel() // 256
        else:
            assert not isinstance(moment, OptimState8bit) and moment.dtype == torch.float32, name


@pytest.mark.parametrize("overrides, fragment", [
    (("optim.name=muon",), "optim.state_dtype=int8 with optim.name=muon"),
    (("parallel.zero_stage=1",), "optim.state_dtype=int8 with parallel.zero_stage=1"),
    (("model.name=debug-moe", "parallel.ep=2"), "optim.state_dtype=int8 with parallel.ep=2"),
    (("precision.compute_dtype=fp64",), "optim.state_dtype=int8 with precision.compute_dtype=fp64"),
    (("engine=deepspeed",), "optim.state_dtype=int8 needs engine=torch"),
])
def test_refused_in_one_line(tmp_path, overrides, fragment):
    result = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", INT8, *overrides, check=False)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_the_planner_counts_a_byte_a_moment():
    from disttrain.plan.memory import STATE_BYTES

    result = run_cli("estimate", "--model", "7b", "--gpus", "8", "--zero-stage", "3", "--state-dtype", "int8",
                     "--json")
    import json

    int8 = json.loads(result.stdout)["bytes_per_rank"]["optimizer"]
    fp32 = json.loads(run_cli("estimate", "--model", "7b", "--gpus", "8", "--zero-stage", "3", "--json").stdout)
    assert int8 == pytest.approx(fp32["bytes_per_rank"]["optimizer"] * STATE_BYTES["int8"] / 4, rel=1e-9)
    assert STATE_BYTES["int8"] == 1 + 4 / 256  # a byte a value, an fp32 scale per block of 256 (torchao's)
    refused = run_cli("estimate", "--model", "7b", "--optimizer", "muon", "--state-dtype", "int8", check=False)
    assert refused.returncode == 2 and "8-bit states are AdamW's" in refused.stderr


LAYOUTS = {
    "ddp": ("parallel.zero_stage=0",),
    "pp2": ("parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_microbatches=2"),
    "zero3": ("parallel.zero_stage=3", "checkpoint.every_steps=3"),
    "zero2": ("parallel.zero_stage=2",),
    "tp2": ("parallel.tp=2", "parallel.dp_shard=1"),
    "cp2": ("parallel.cp=2", "parallel.dp_shard=1"),
}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8_layouts")
    common = (f"train.steps={STEPS}", "train.micro_batch_size=2", INT8)
    train_many({name: (root / name.replace(" ", "_"), (*common, *extra)) for name, extra in LAYOUTS.items()}, nproc=2)
    saved = root / "zero3" / "checkpoints" / "step_00000003"
    train_many({"one": (root / "one", common), "one fp32": (root / "one_fp32", common[:-1]),
                "zero3 resumed": (root / "zero3_resumed", (*common, f"checkpoint.resume={saved}"))}, nproc=1)
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_trains_as_one_process_does(layout, two_processes):
    """DDP, the pipeline and CP quantize the same whole tensors as one process: equal losses (CP to its fp32
    reduction order). ZeRO-2/3 and TP quantize each rank's shard in its own blocks of 256, and a shard under 4,096
    values keeps fp32 moments where the whole tensor had 8-bit ones: losses within 2% of what 8-bit states change
    against fp32 ones on one process, which a lost gradient or state would exceed a hundred times."""
    root = two_processes
    one, ours = losses(root / "one"), losses(root / layout.replace(" ", "_"))
    effect = max(abs(a - one[s]) for s, a in losses(root / "one_fp32").items())
    assert effect > 1e-3
    if layout in ("ddp", "pp2"):
        assert ours == one
    elif layout == "cp2":
        assert ours == pytest.approx(one, rel=1e-6)
    else:
        assert max(abs(ours[s] - one[s]) for s in one) <= 0.02 * effect


def test_a_zero3_checkpoint_resumes_on_one_process(two_processes):
    """8-bit states saved as ZeRO-3 shards load on one process (resharded by DCP) and training goes on: within 2%
    of 8-bit states' own effect of the uninterrupted ZeRO-3 run (one process quantizes whole tensors where ZeRO-3
    quantized shards, or kept small shards in fp32)."""
    root = two_processes
    zero3, resumed = losses(root / "zero3"), losses(root / "zero3_resumed")
    one = losses(root / "one")
    effect = max(abs(a - one[s]) for s, a in losses(root / "one_fp32").items())
    assert sorted(resumed) == [4, 5, 6]
    assert max(abs(resumed[s] - zero3[s]) for s in resumed) <= 0.02 * effect
