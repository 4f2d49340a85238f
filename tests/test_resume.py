"""Basic resume: a run that stops after step 10 and resumes logs what an uninterrupted run logs."""

from __future__ import annotations

import shutil

from helpers import losses, records, train

COMMON = ("train.steps=20", "train.global_batch_size=4", "train.micro_batch_size=1",
          "checkpoint.every_steps=10")


def test_resume_auto_continues_exactly(tmp_path):
    full = train(tmp_path / "full", *COMMON, nproc=2)
    ckpts = full / "checkpoints"
    assert (ckpts / "step_00000010" / "COMMIT").is_file() and (ckpts / "step_00000020" / "COMMIT").is_file()

    # The interrupted run: its run directory holds only what existed when step 10 was saved,
    # plus the debris of a save that crashed before its COMMIT.
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpts / "step_00000010", resumed / "checkpoints" / "step_00000010")
    debris = resumed / "checkpoints" / "step_00000015"
    debris.mkdir()
    (debris / "__0_0.distcp").write_bytes(b"partial")
    train(resumed, *COMMON, "checkpoint.resume=auto", nproc=2)

    after = losses(resumed)
    assert sorted(after) == list(range(11, 21))
    before = losses(full)
    assert after == {s: before[s] for s in range(11, 21)}  # bitwise: fp32 on CPU is deterministic
    events = [r for r in records(resumed) if r.get("event") == "resumed"]
    assert events and events[0]["step"] == 10
    assert not debris.exists(), "an uncommitted checkpoint must be cleaned up, never loaded"


def test_keep_last_retains_newest_committed(tmp_path):
    run = train(tmp_path / "run", "train.steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=2")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
