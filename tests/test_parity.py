"""Parity: data parallel and micro-batching must not change the numbers (fp32, real processes)."""

from __future__ import annotations

import pytest

from helpers import assert_losses_close, assert_params_close, load_model_params, losses, train

LR = 3e-3  # configs/debug.yaml
COMMON = ("train.steps=20", "train.global_batch_size=4", f"optim.lr={LR}", "checkpoint.save_final=true",
          "metrics.sync_check_every=5")  # replicas are compared during every layout's run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, one micro-batch of 4: the plain single-device computation."""
    return train(tmp_path_factory.mktemp("ref") / "run", *COMMON, "train.micro_batch_size=4")


def _final_params(run_dir):
    return load_model_params(run_dir / "checkpoints" / "step_00000020")


def test_reference_trains(reference):
    curve = losses(reference)
    assert len(curve) == 20 and curve[20] < curve[1] - 1.0


def test_four_micro_batches_of_one_equal_one_of_four(reference, tmp_path):
    run = train(tmp_path / "run", *COMMON, "train.micro_batch_size=1")
    assert_losses_close(losses(run), losses(reference), rel=1e-5)
    assert_params_close(_final_params(run), _final_params(reference), rel=1e-5, lr=LR)


def test_ddp_two_ranks_equals_single_process(reference, tmp_path):
    # 2 ranks x 2 micro-batches of 1: exercises DDP all-reduce and no_sync accumulation together.
    run = train(tmp_path / "run", *COMMON, "train.micro_batch_size=1", nproc=2)
    assert_losses_close(losses(run), losses(reference), rel=1e-5)
    assert_params_close(_final_params(run), _final_params(reference), rel=1e-5, lr=LR)


def test_ddp_options_and_compile_keep_parity(reference, tmp_path):
    run = train(tmp_path / "run", *COMMON, "train.micro_batch_size=2", "parallel.ddp_static_graph=true",
                "parallel.ddp_gradient_as_bucket_view=false", "parallel.ddp_bucket_cap_mb=0.01", nproc=2)
    assert_losses_close(losses(run), losses(reference), rel=1e-5)
