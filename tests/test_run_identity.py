"""A run name is one run: what a command may change when it resumes a run directory, what it may not, and
what it is told; checked at the launcher's front door, before any worker starts (in-process here: the
refusals are about the checks, not about launching)."""

from __future__ import annotations

import shutil

import pytest
import torch

from disttrain.checkpoint import lease
from disttrain.checkpoint.run_identity import check_run_dir, model_problem
from disttrain.cli import main
from disttrain.config.load import load_config
from disttrain.core.errors import UserError
from disttrain.config.resolve import resolve_run
from helpers import DEBUG_CONFIG, events, records, run_cli, train

# configs/debug.yaml (lr 3e-3, 2 warmup steps, cosine) with a floor, saved every 2 steps up to step 6
RUN = ("train.steps=6", "checkpoint.every_steps=2", "optim.min_lr=3e-4")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return train(tmp_path_factory.mktemp("identity") / "run", *RUN)


def _cfg(run, *overrides):
    return load_config(DEBUG_CONFIG, [f"run.dir={run.parent}", f"run.name={run.name}", *RUN, *overrides])


def _front_door(run, *overrides, key="another-launch"):
    cfg = _cfg(run, *overrides)
    check_run_dir(cfg, resolve_run(cfg, 2, "cpu"), key)


def _launch(capsys, run, *overrides):
    """`disttrain train ... --nproc-per-node 2` in this process: (exit status, what it printed on stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(["train", str(DEBUG_CONFIG), f"run.dir={run.parent}", f"run.name={run.name}", *RUN, *overrides,
              "--nproc-per-node", "2"])
    return exc.value.code, capsys.readouterr().err


def _listing(run):
    return sorted((str(p.relative_to(run)), p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*"))


def test_another_run_under_the_same_name_is_refused_before_anything_starts(saved, capsys):
    before = _listing(saved)
    for change, saved_value, new_value in (("optim.lr=1e-3", "0.003", "0.001"), ("train.steps=200", "6", "200"),
                                           ("train.global_batch_size=8", "4", "8"), ("data.seq_len=32", "64", "32"),
                                           ("train.seed=1", "0", "1")):
        code, err = _launch(capsys, saved, change)
        key = change.split("=")[0]
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{key}={saved_value} there, {new_value} here" in err, err
        assert "run.name=NAME" in err and "run.allow_changes=true" in err  # the two ways out
    assert _listing(saved) == before  # nothing written, nothing started

    # What may change on resume: the layout, the world size, intervals, metrics; and an explicit continuation.
    _front_door(saved, "parallel.zero_stage=3", "metrics.log_every=5", "checkpoint.every_steps=3",
                "train.micro_batch_size=1", "train.eval_every=2")
    _front_door(saved, "optim.lr=1e-3", "train.steps=10", "run.allow_changes=true")
    _front_door(saved.parent / "elsewhere", "optim.lr=1e-3")  # a run name of its own


def test_a_model_that_cannot_load_is_refused_at_the_front_door_with_the_saved_values(saved, capsys, tmp_path):
    code, err = _launch(capsys, saved, "model.vocab_size=512", "data.source=builtin")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "model.vocab_size=256 when saved, 512 now" in err, err  # 256: the debug model's resolved vocabulary
    code, err = _launch(capsys, saved, "model.n_layers=3", "run.allow_changes=true")  # no override loads it
    assert code == 2 and "model.n_layers=2 when saved, 3 now" in err, err

    # A checkpoint written before the resolved shape was recorded: the saved values are resolved again.
    old = tmp_path / "old"
    shutil.copytree(saved / "checkpoints" / "step_00000006", old / "checkpoints" / "step_00000006")
    state_file = old / "checkpoints" / "step_00000006" / "train_state.pt"
    state = torch.load(state_file, weights_only=True)
    del state["model"]
    torch.save(state, state_file)
    with pytest.raises(UserError, match="model.vocab_size=256 when saved, 512 now"):
        _front_door(old, "model.vocab_size=512")

    # Another family: its parameters have other names, whatever the shape.
    cfg = _cfg(saved)
    shape = resolve_run(cfg, 1, "cpu").shape
    assert model_problem(state, "Hugging Face llama", shape, "another") == \
        "model family built-in llama when saved, Hugging Face llama now"


def test_resume_none_in_a_directory_holding_another_run_is_refused(saved, capsys):
    before = _listing(saved)
    code, err = _launch(capsys, saved, "checkpoint.resume=none")
    assert code == 2 and err.count("\n") == 1, err
    assert f"checkpoint.resume=none: {saved} already holds a run (checkpoints and metrics.jsonl)" in err, err
    assert _listing(saved) == before
    # The run's own job starting again (a requeued job with the same claim key) is not another run.
    claim = lease.read(saved)
    assert claim is not None and claim.released
    _front_door(saved, "checkpoint.resume=none", key=claim.key)


def test_longer_train_steps_continue_the_learning_rate_where_it_was(saved, tmp_path):
    """Resumed at step 4 of 6 with train.steps=10: step 5 runs at the rate the 6-step run used there (no
    jump), and the rest decays from it to min_lr at step 10."""
    first = {r["step"]: r["lr"] for r in records(saved) if "lr" in r}
    run = tmp_path / "longer"
    shutil.copytree(saved / "checkpoints" / "step_00000004", run / "checkpoints" / "step_00000004")
    train(run, *RUN, "train.steps=10", "run.allow_changes=true", "train.eval_batches=2")
    changes = events(run, "resumed")[0]["config_changes"]  # what changed, as the console lists it
    assert changes["trajectory"] == ["train.steps: 6 -> 10"]
    assert "train.eval_batches: 4 -> 2" in changes["safe"] and "run.name: 'run' -> 'longer'" in changes["safe"]
    lrs = {r["step"]: r["lr"] for r in records(run) if "lr" in r}
    assert sorted(lrs) == list(range(5, 11))
    assert lrs[5] == pytest.approx(first[5], rel=1e-12)
    assert all(lrs[s] > lrs[s + 1] > 3e-4 for s in range(5, 10))
    assert lrs[10] < first[5] / 2  # decays over the new length, not held


def test_extending_a_finished_cosine_run_keeps_its_final_rate():
    """The demo's schedule (peak 3e-3, 20 warmup steps, cosine to 3e-4) finished at step 200, then resumed with
    train.steps=240: it was at min_lr and stays there (recomputing the cosine for 240 steps jumped to 5.1e-4)."""
    from types import SimpleNamespace

    from disttrain.train.optim import build_scheduler

    optim_cfg = SimpleNamespace(warmup_steps=20, schedule="cosine", min_lr=3e-4, lr=3e-3)

    def schedule(total):
        weights = torch.nn.Parameter(torch.zeros(2, 2))
        optimizer = torch.optim.AdamW([weights], lr=optim_cfg.lr)
        return optimizer, build_scheduler(optimizer, optim_cfg, total)

    optimizer, scheduler = schedule(200)
    for _ in range(200):
        optimizer.step()
        scheduler.step()
    longer_opt, longer = schedule(240)
    longer_opt.load_state_dict(optimizer.state_dict())
    longer.load_state_dict(scheduler.state_dict())
    rates = []
    for _ in range(40):
        rates.append(longer_opt.param_groups[0]["lr"])
        longer_opt.step()
        longer.step()
    assert rates == pytest.approx([3e-4] * 40, rel=1e-12)


def test_a_finished_run_says_so_and_starts_no_worker(saved, capsys):
    """Running a finished run's command again: one line, exit 0, nothing started or written (before, the workers
    started, loaded the last checkpoint and wrote a second `finished`)."""
    before = _listing(saved)
    with pytest.raises(SystemExit) as exc:
        main(["train", str(DEBUG_CONFIG), f"run.dir={saved.parent}", f"run.name={saved.name}", *RUN,
              "--nproc-per-node", "2"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert out.splitlines() == [f"{saved} already finished at step 6: nothing to train (to train it again, give it "
                                f"another run.name or remove {saved})"]
    assert _listing(saved) == before


def test_a_run_without_checkpoints_starts_over_and_its_earlier_files_move_aside(tmp_path):
    """configs/debug.yaml saves no checkpoint: a second command under its name cannot resume. It starts over in a
    metrics.jsonl of its own (before, each start appended steps 1-N again to the same file), the earlier run's
    files kept under previous/<time>/; the same command again is then a finished run."""
    run = train(tmp_path / "run", "train.steps=3")
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run", "train.steps=4")
    assert f"{run} holds an earlier run with no checkpoint to resume: starting over" in proc.stdout
    assert [r["step"] for r in records(run) if "loss" in r] == [1, 2, 3, 4]
    assert len(events(run, "started")) == 1
    (earlier,) = (run / "previous").iterdir()
    assert [r["step"] for r in records(earlier) if "loss" in r] == [1, 2, 3]
    assert (earlier / "logs" / "rank_00000.log").is_file() and (earlier / "config.yaml").is_file()
    again = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run", "train.steps=4")
    assert again.stdout.splitlines()[-1].startswith(f"{run} already finished at step 4")
    assert len(events(run, "started")) == 1
