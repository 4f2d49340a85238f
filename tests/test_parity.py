"""Parity: data parallel and micro-batching must not change the numbers (fp64 to 1e-10 relative, real processes);
the DDP options, communication hooks (against fp32, which they compress) and torch.compile reached through the config."""

from __future__ import annotations

import json

import pytest

from helpers import PARITY, PARITY_FP32, assert_losses_close, assert_parity, losses, train, train_many


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Every 2-rank run of this module, in one launch: DDP with its options and hooks, and parallel.compile=true
    (inductor, one compiled graph per block) under DDP and ZeRO-3 ("compiled ddp", "compiled zero3")."""
    import os
    from pathlib import Path

    root = tmp_path_factory.mktemp("ddp")
    hooks = {f"hook_{h}": (root / f"hook_{h}", (*PARITY_FP32, "train.micro_batch_size=1", f"parallel.ddp_comm_hook={h}"))
             for h in ("fp16", "bf16", "powersgd")}
    compiled = (*PARITY, "train.micro_batch_size=1", "parallel.compile=true")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "disttrain-tests" / "inductor"
    return train_many({
        "micro_1": (root / "micro_1", (*PARITY, "train.micro_batch_size=1")),
        "options": (root / "options", (*PARITY, "train.micro_batch_size=2", "parallel.ddp_static_graph=true",
                                       "parallel.ddp_gradient_as_bucket_view=false", "parallel.ddp_bucket_cap_mb=0.01")),
        **hooks,
        "compiled ddp": (root / "compiled_ddp", compiled),
        "compiled zero3": (root / "compiled_zero3", (*compiled, "parallel.zero_stage=3")),
    }, nproc=2, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})


def test_reference_trains(debug_reference):
    curve = losses(debug_reference)
    assert len(curve) == 20 and curve[20] < curve[1] - 1.0


def test_four_micro_batches_of_one_equal_one_of_four(debug_reference, tmp_path):
    assert_parity(train(tmp_path / "run", *PARITY, "train.micro_batch_size=1"), debug_reference)


def test_ddp_two_ranks_equals_single_process(ddp_runs, debug_reference):
    # 2 ranks x 2 micro-batches of 1: exercises DDP all-reduce and no_sync accumulation together.
    assert_parity(ddp_runs["micro_1"], debug_reference)


def test_ddp_options_keep_parity(ddp_runs, debug_reference):
    assert_parity(ddp_runs["options"], debug_reference)


@pytest.mark.parametrize("hook,bound", [("fp16", 1e-3), ("bf16", 1e-2)])
def test_compressing_comm_hooks_through_the_config(hook, bound, ddp_runs, debug_reference_fp32):
    """parallel.ddp_comm_hook reaches DDP: the all-reduce really ran in the low precision (the losses
    are not fp32's) and stays within that precision's rounding (fp16: 2^-11, bf16: 2^-8 unit roundoff,
    carried through 20 Adam steps)."""
    ref, run = losses(debug_reference_fp32), losses(ddp_runs[f"hook_{hook}"])
    diffs = [abs(run[s] - ref[s]) / ref[s] for s in ref]
    assert diffs[0] <= 1e-6  # step 1's loss comes before any gradient
    assert 0 < max(diffs) <= bound, diffs


def test_powersgd_hook_through_the_config(ddp_runs, debug_reference_fp32):
    """PowerSGD all-reduces exactly for its first `powersgd_start_iter`=2 iterations, then compresses
    (rank 1): the first steps equal fp32 DDP, later ones differ, and training still progresses."""
    ref, run = losses(debug_reference_fp32), losses(ddp_runs["hook_powersgd"])
    assert_losses_close({s: run[s] for s in (1, 2, 3)}, {s: ref[s] for s in (1, 2, 3)}, rel=1e-5)
    assert max(abs(run[s] - ref[s]) / ref[s] for s in range(4, 21)) > 1e-4
    assert run[20] < run[1] - 1.0


@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_compile_equals_eager(layout, ddp_runs, debug_reference):
    """Compiled blocks (dynamo captured graphs in this run, none in an eager run of the same launch: train_many
    counts per job) give eager's numbers."""
    stats = json.loads((ddp_runs[f"compiled {layout}"] / "dynamo_stats.json").read_text())
    assert stats.get("unique_graphs", 0) >= 1, stats
    assert json.loads((ddp_runs["micro_1"] / "dynamo_stats.json").read_text()).get("unique_graphs", 0) == 0
    assert_parity(ddp_runs[f"compiled {layout}"], debug_reference)


def test_compile_with_tensor_parallel_is_refused_on_cpu(tmp_path):
    """Compiled DTensor blocks fail in backward with torch 2.13 on CPU: refused up front in one line (by the
    launcher before any worker starts: the command in this process)."""
    from helpers import DEBUG_CONFIG, run_main

    code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "parallel.compile=true", "parallel.tp=2",
                            "--nproc-per-node", "2")
    assert code == 2 and err.strip().splitlines() == [
        "disttrain: error: parallel.compile=true with parallel.tp=2 does not run on CPU with this torch (compiled "
        "DTensor backward fails); allowed on CPU: parallel.compile=false with tp > 1, or compile with tp=1"]
    assert not any(tmp_path.iterdir())
