"""Tensor, sequence and pipeline parallelism, alone and composed with FSDP2: the same losses and
final parameters as one process (fp32, real gloo processes), and checkpoints that move between
layouts."""

from __future__ import annotations

import pytest

from helpers import assert_losses_close, assert_params_close, load_model_params, losses, records, train

LR = 3e-3
# 4 layers so that interleaved schedules get 2 stages per rank on 2 ranks; 4 micro-batches of 1.
COMMON = ("train.steps=20", "train.global_batch_size=4", "train.micro_batch_size=1", "model.n_layers=4",
          f"optim.lr={LR}", "checkpoint.save_final=true", "metrics.sync_check_every=5")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref") / "run", *COMMON)


def _final(run):
    return load_model_params(run / "checkpoints" / "step_00000020")


def _assert_parity(run, reference):
    assert_losses_close(losses(run), losses(reference), rel=1e-5)
    assert_params_close(_final(run), _final(reference), rel=1e-5, lr=LR)


@pytest.mark.parametrize("extra", [(), ("parallel.sequence_parallel=true", "parallel.activation_checkpointing=selective")],
                         ids=["tp2", "tp2-sp-selective-ac"])
def test_tensor_parallel_equals_single_process(extra, reference, tmp_path):
    _assert_parity(train(tmp_path / "run", *COMMON, "parallel.tp=2", *extra, nproc=2), reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_pipeline_schedules_equal_single_process(schedule, reference, tmp_path):
    run = train(tmp_path / "run", *COMMON, "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                "train.eval_every=10", nproc=2)
    _assert_parity(run, reference)
    bubbles = [r["pp_bubble"] for r in records(run) if "event" not in r]
    assert len(bubbles) == 20 and all(0 <= b < 1 for b in bubbles)


def test_pipeline_with_a_hand_set_split(reference, tmp_path):
    """parallel.pp_layers=[1,3]: an unbalanced split trains the same numbers."""
    run = train(tmp_path / "run", *COMMON, "parallel.pp=2", "parallel.pp_layers=[1,3]", nproc=2)
    _assert_parity(run, reference)


def test_fsdp_with_tensor_parallel_on_four_ranks(reference, tmp_path):
    run = train(tmp_path / "run", *COMMON, "parallel.dp_shard=2", "parallel.tp=2", "parallel.zero_stage=3", nproc=4)
    _assert_parity(run, reference)


def test_pipeline_with_fsdp_on_four_ranks(reference, tmp_path):
    run = train(tmp_path / "run", *COMMON, "parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=2",
                "parallel.pp_schedule=interleaved_1f1b", nproc=4)
    _assert_parity(run, reference)


@pytest.fixture(scope="module")
def pipeline_tensor_run(tmp_path_factory):
    """pp=2 x tp=2 with sequence parallelism, checkpointing every 10 steps."""
    return train(tmp_path_factory.mktemp("pptp") / "run", *COMMON, "parallel.pp=2", "parallel.tp=2",
                 "parallel.sequence_parallel=true", "checkpoint.every_steps=10", nproc=4)


def test_pipeline_with_tensor_parallel_on_four_ranks(pipeline_tensor_run, reference):
    _assert_parity(pipeline_tensor_run, reference)


def test_pp_tp_checkpoint_resumes_on_other_layouts(pipeline_tensor_run, tmp_path):
    """Saved by pp=2 x tp=2; resumed by one process and by ZeRO-3 over 2 ranks: the same losses."""
    ckpt = pipeline_tensor_run / "checkpoints" / "step_00000010"
    expected = {s: v for s, v in losses(pipeline_tensor_run).items() if s > 10}
    single = train(tmp_path / "single", *COMMON, f"checkpoint.resume={ckpt}")
    assert_losses_close(losses(single), expected, rel=1e-5)
    sharded = train(tmp_path / "fsdp", *COMMON, "parallel.zero_stage=3", f"checkpoint.resume={ckpt}", nproc=2)
    assert_losses_close(losses(sharded), expected, rel=1e-5)


@pytest.mark.slow
def test_three_d_on_eight_ranks(reference, tmp_path):
    """pp=2 x dp_shard=2 x tp=2 (8 processes: slow on 2 cores, run with `make test-slow`)."""
    run = train(tmp_path / "run", *COMMON, "train.global_batch_size=4", "parallel.pp=2", "parallel.dp_shard=2",
                "parallel.tp=2", "parallel.zero_stage=3", nproc=8, timeout=900)
    _assert_parity(run, reference)


@pytest.mark.parametrize("override,layout", [("parallel.tp=2", {"tp": 2}), ("parallel.pp=2", {"pp": 2})])
def test_per_rank_model_states_match_the_planner(override, layout, tmp_path):
    """Tensor parallel halves every matrix (norms replicated); pipeline ranks hold their stages
    (embedding first, norm and output last): parameter, gradient and Adam bytes per rank equal
    the planner's `rank_params` accounting."""
    from disttrain.bench.model_states import launch
    from disttrain.models.registry import MODEL_SHAPES
    from disttrain.layout import Layout
    from disttrain.plan.memory import model_state_bytes, rank_params

    rows = launch(2, tmp_path, stages=[0], overrides=[override])
    assert len(rows) == 2
    shape, lay = MODEL_SHAPES["tiny"], Layout(param_dtype="fp32", **layout)
    for row in rows:
        pp_rank = row["rank"] if lay.pp > 1 else 0
        predicted = model_state_bytes(rank_params(shape, lay, pp_rank).total, lay, "runtime")
        for key in ("params", "grads", "optimizer"):
            assert row[key] == getattr(predicted, key), (row, key)


def test_sampling_under_sequence_parallel_matches_one_process(tmp_path):
    """Generation feeds prompts of any length; under sequence parallelism each forward is right-padded
    to a multiple of tp (causal attention keeps the real positions exact): same text as one process."""
    from helpers import DEBUG_CONFIG, run_cli

    def sample(*extra, nproc=None):
        out = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "train.steps=5", "train.sample_tokens=24",
                      "model.n_layers=4", *extra, nproc=nproc).stdout
        return [line for line in out.splitlines() if line.startswith("sample: ")]

    single = sample("run.name=single")
    assert len(single) == 1 and len(single[0]) > len("sample: ")
    assert sample("run.name=tp_sp", "parallel.tp=2", "parallel.sequence_parallel=true", nproc=2) == single
