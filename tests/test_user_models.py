"""Any nn.Module through `model.spec=FILE.py:function` and any map-style Dataset through
`data.source=py:FILE.py:function`, shown with the ResNet-18 image classifier of examples/vision."""

from __future__ import annotations

import pytest

from helpers import (EXACT, FP64, REPO, assert_losses_close, assert_params_exact, final_params, losses, run_cli,
                     train, train_many)

EXAMPLE = REPO / "examples" / "vision"
CONFIG = EXAMPLE / "vision.yaml"
# The example's learning rate, in fp64, with Adam's eps at 1e-6: near g = 0 Adam's step g / (|g| + eps) has slope
# 1/eps, so at eps 1e-8 a weight whose gradient is ~1e-8 moves by lr/eps = 1e5 times that gradient's rounding.
# BatchNorm's backward cancels: permuting the batch in one process moves fp64 gradients by 2e-14 (in norm), which
# that slope turned into 1.6e-9 of a tensor's largest weight within 4 steps; at eps 1e-6, 5e-12.
# One forward per rank per step (no accumulation), so BatchNorm sees the same samples as one process's
# single forward over the whole global batch of 8.
COMMON = ("train.steps=4", "train.global_batch_size=8", "train.eval_every=0", "checkpoint.every_steps=0",
          "checkpoint.save_final=true", "metrics.log_every=1", "optim.lr=1e-3", "optim.eps=1e-6",
          "optim.warmup_steps=0", FP64)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref") / "run", *COMMON, "train.micro_batch_size=8",
                 "parallel.zero_stage=0", config=CONFIG)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    return train_many({layout: (root / layout, (*COMMON, "train.micro_batch_size=4", f"parallel.zero_stage={stage}"))
                       for layout, stage in (("ddp", 0), ("zero3", 3))}, nproc=2, config=CONFIG)


@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_resnet_with_sync_batchnorm_equals_one_process(layout, two_rank_runs, reference):
    """Same losses and parameters as one process on the same global batch; BatchNorm's running
    statistics (in the checkpoint with the parameters) equal one process's: every rank normalised with
    the statistics of the whole batch."""
    run = two_rank_runs[layout]
    assert_losses_close(losses(run), losses(reference), rel=EXACT)
    ours, theirs = final_params(run, 4), final_params(reference, 4)
    stats = [k for k in theirs if k.endswith(("running_mean", "running_var"))]
    assert len(stats) == 2 * 20  # 20 BatchNorm layers in ResNet-18
    assert ours.keys() == theirs.keys()
    counts = [k for k in theirs if k.endswith("num_batches_tracked")]
    assert all(ours[k].equal(theirs[k]) for k in counts)
    floats = [k for k in theirs if k not in counts]
    assert_params_exact({k: ours[k] for k in floats}, {k: theirs[k] for k in floats})


def test_the_example_runs_from_its_readme(tmp_path):
    """The command examples/vision/README.md gives, shortened: trains, evaluates and checkpoints."""
    run = train(tmp_path / "vision", "train.steps=10", "train.eval_every=5", "checkpoint.every_steps=5",
                config=CONFIG, nproc=2)
    curve = losses(run)
    assert len(curve) >= 2 and curve[10] < curve[min(curve)]
    assert (run / "checkpoints" / "step_00000010" / "COMMIT").is_file()


BAD = {
    "spec file missing": (["model.spec=nowhere.py:f"], "model.spec=nowhere.py:f: no such file nowhere.py"),
    "spec not importable": (["model.spec=broken.py:f"], "importing broken.py failed (SyntaxError"),
    "spec wrong type": (["model.spec=wrong.py:f"], "model.spec=wrong.py:f: returned int, expected a "
                                                   "disttrain.models.spec.ModelSpec"),
    "spec no function": (["model.spec=wrong.py:g"], "model.spec=wrong.py:g: wrong.py has no function g"),
    "dataset wrong type": ([f"model.spec={EXAMPLE / 'resnet.py'}:resnet18_spec", "data.source=py:wrong.py:f"],
                           "data.source=py:wrong.py:f: returned int, expected a map-style torch.utils.data.Dataset"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_user_code_mistakes_are_one_line(name, tmp_path):
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "wrong.py").write_text("def f():\n    return 3\n")
    overrides, expected = BAD[name]
    proc = run_cli("train", str(CONFIG), f"run.dir={tmp_path / 'runs'}", *overrides, check=False, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()
