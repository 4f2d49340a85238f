"""Launch paths, environment detection, precision modes and time-based checkpoint triggers."""

from __future__ import annotations

import math

import pytest

from disttrain.distributed.env import detect_env
from disttrain.launch.self_launch import LaunchOptions, torchrun_args
from helpers import DEBUG_CONFIG, REPO, assert_losses_close, cli_env, losses, records, run_module, train, train_many


def test_detects_torchrun_slurm_and_single():
    tr = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                     "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (tr.launcher, tr.rank, tr.world_size, tr.local_rank, tr.master_addr) == ("torchrun", 3, 8, 1, "n1")
    sl = detect_env({"SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
                     "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5",
                     "SLURM_JOB_ID": "4242"})
    assert (sl.launcher, sl.rank, sl.world_size, sl.local_rank, sl.local_world_size) == ("slurm", 9, 16, 1, 8)
    assert sl.master_addr == "10.0.0.5" and sl.master_port == 24242
    # Inside an sbatch script but outside srun, SLURM's job variables alone must not mean "distributed".
    batch = detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "1"})
    assert batch.launcher == "single" and batch.world_size == 1


def test_self_launch_passes_elastic_options_through():
    args = torchrun_args(LaunchOptions("8", nnodes="1:4", max_restarts=3, rdzv_endpoint="head:29400",
                                       rdzv_id="job7"), ["train", "c.yaml", "optim.lr=1e-3"])
    assert args[:3] == ["--nproc-per-node=8", "--nnodes=1:4", "--max-restarts=3"]
    assert "--rdzv-endpoint=head:29400" in args and "--rdzv-id=job7" in args and "--standalone" not in args
    # disttrain's rendezvous defaults, each overridable
    assert "--rdzv-conf=last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3" in args
    custom = torchrun_args(LaunchOptions("8", nnodes="2", rdzv_endpoint="head:29400",
                                         rdzv_conf="last_call_timeout=60, join_timeout=900"), ["train"])
    assert "--rdzv-conf=last_call_timeout=60,keep_alive_interval=2,keep_alive_max_attempt=3,join_timeout=900" in custom
    assert args[-5:] == ["-m", "disttrain", "train", "c.yaml", "optim.lr=1e-3"]
    assert "--standalone" in torchrun_args(LaunchOptions("2"), ["train", "c.yaml"])


def test_torchrun_module_launch_with_time_triggered_checkpoints(tmp_path):
    """`torchrun -m disttrain train` works as is; a minutes trigger fires on both ranks together."""
    single = train(tmp_path / "single", "train.steps=12")
    run = tmp_path / "torchrun"
    args = ["--standalone", "--nproc-per-node=2", "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={tmp_path}",
            "run.name=torchrun", "train.steps=12", "checkpoint.every_minutes=0.0005", "checkpoint.save_final=false",
            "distributed.timeout_s=60"]
    proc = run_module("torch.distributed.run", args, env=cli_env(), cwd=REPO, timeout=300)  # torchrun's own main
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_losses_close(losses(run), losses(single), rel=1e-5)
    saved = [r["step"] for r in records(run) if r.get("event") == "checkpoint_saved"]
    assert len(saved) >= 2, saved  # 30 ms interval: fires repeatedly, decided by rank 0 for both ranks
    assert all((run / "checkpoints" / f"step_{s:08d}" / "COMMIT").is_file() for s in saved)


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    """10 steps in fp32, bf16 and fp16 autocast: one process, one launch."""
    root = tmp_path_factory.mktemp("precision")
    return train_many({dtype: (root / dtype, ("train.steps=10", f"precision.compute_dtype={dtype}"))
                       for dtype in ("fp32", "bf16", "fp16")}, nproc=1)


# Bounds: half the dtype's unit roundoff (2^-8 for bf16, 2^-11 for fp16) on the global-batch mean loss;
# measured here: bf16 5.6e-5, fp16 1.5e-5 over 10 steps.
@pytest.mark.parametrize("dtype,bound", [("bf16", 2e-3), ("fp16", 2.5e-4)])
def test_low_precision_tracks_fp32(dtype, bound, precision_runs):
    ref, run = losses(precision_runs["fp32"]), precision_runs[dtype]
    low = losses(run)
    diffs = [abs(low[s] - ref[s]) / ref[s] for s in ref]
    assert 0 < max(diffs) <= bound, diffs  # autocast really ran (not bitwise fp32) and stays close
    scales = [r.get("loss_scale") for r in records(run) if "loss" in r]
    assert all(s is not None and s > 1 for s in scales) if dtype == "fp16" else not any(scales)


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """fp16 with dynamic loss scaling on 2 ranks, DDP and ZeRO-3, a NaN injected into rank 0's loss at
    step 3 only: every rank skips that update (replicas stay equal: checked every step under DDP), the
    loss scale halves and stays equal on all ranks, and the run continues as one process with the same
    fault does."""
    common = ("train.steps=8", "train.global_batch_size=4", "train.micro_batch_size=1",
              "precision.compute_dtype=fp16", "metrics.sync_check_every=1")
    env = {"DISTTRAIN_FAULT": "nan:rank=0:step=3"}
    runs = train_many({"ddp": (tmp_path / "ddp", common),
                       "zero3": (tmp_path / "zero3", (*common, "parallel.zero_stage=3"))}, nproc=2, env=env)
    single = losses(train(tmp_path / "single", *common, env=env))
    assert math.isnan(single[3])
    for run in runs.values():
        steps = {r["step"]: r for r in records(run) if "event" not in r}
        assert [steps[s]["fp16_overflows_total"] for s in range(1, 9)] == [0, 0] + [1] * 6
        assert steps[3]["loss_scale"] == steps[2]["loss_scale"] / 2
        assert all(r["loss_scale_min"] == r["loss_scale_max"] == r["loss_scale"] for r in steps.values())
        curve = losses(run)
        assert math.isnan(curve[3])
        assert_losses_close({s: v for s, v in curve.items() if s != 3}, {s: v for s, v in single.items() if s != 3},
                            rel=1e-5)
