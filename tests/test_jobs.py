"""The loop's job protocol as users see it (`train.callbacks`): a job sees every step, runs when it says it is due,
and can stop the run cleanly (every rank stops at the same step, a checkpoint is committed, exit status 0)."""

from __future__ import annotations

import json
import textwrap

from helpers import DEBUG_CONFIG, run_cli, run_main

JOB_FILE = textwrap.dedent('''
    import json, os
    from pathlib import Path

    from disttrain.train.jobs import Job


    class StopAtLossOrStep(Job):
        """Records every step it is asked about and every run; stops at STOP_STEP on the ranks in STOP_RANKS."""

        label = "test job"

        def __init__(self):
            self.asked, self.ran = [], []

        def due(self, step):
            self.asked.append(step)
            return step % 2 == 0

        def run(self, trainer):
            self.ran.append((trainer.step, round(float(trainer.outcome.result.grad_norm), 12) > 0))
            stop_ranks = [int(r) for r in os.environ.get("STOP_RANKS", "0").split(",")]
            if trainer.step == int(os.environ["STOP_STEP"]) and trainer.run.runtime.rank in stop_ranks:
                trainer.request_stop(f"asked by rank {trainer.run.runtime.rank}")

        def finish(self, trainer):
            out = Path(os.environ["JOB_OUT"]) / f"rank{trainer.run.runtime.rank}.json"
            out.write_text(json.dumps({"asked": self.asked, "ran": self.ran, "final": trainer.step}))


    class NotAJob:
        pass
''')


def _records(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" not in r], [r for r in lines if "event" in r]


def test_a_user_job_sees_every_step_and_stops_the_run_cleanly(tmp_path, monkeypatch):
    """In this process (one rank): the job is asked about steps 1..5, runs at 2 and 4, stops the run at 4 of 20:
    step 4's checkpoint is committed, the run says why it stopped and finished, and the command exits 0."""
    (tmp_path / "myjobs.py").write_text(JOB_FILE)
    monkeypatch.setenv("STOP_STEP", "4")
    monkeypatch.setenv("JOB_OUT", str(tmp_path))
    code, out, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=stop", "train.steps=20",
                              "checkpoint.save_final=true", f"train.callbacks=[{tmp_path / 'myjobs.py'}:StopAtLossOrStep]")
    assert code == 0, err
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["asked"] == [1, 2, 3, 4] and seen["ran"] == [[2, True], [4, True]] and seen["final"] == 4
    run = tmp_path / "stop"
    steps, events = _records(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    names = [e["event"] for e in events]
    assert names.index("stopped") < names.index("checkpoint_saved") < names.index("finished")
    stopped = next(e for e in events if e["event"] == "stopped")
    assert (stopped["step"], stopped["reason"]) == (4, "asked by rank 0")
    assert (run / "checkpoints" / "step_00000004" / "COMMIT").is_file()
    assert "done: 4 steps" in out


def test_a_stop_asked_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Two processes: only rank 1's job asks; both ranks stop after step 6 (the boundary agreement), the checkpoint
    of step 6 is committed by both, and the launcher exits 0."""
    (tmp_path / "myjobs.py").write_text(JOB_FILE)
    env = {"STOP_STEP": "6", "STOP_RANKS": "1", "JOB_OUT": str(tmp_path)}
    run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=stop2", "train.steps=20",
            "checkpoint.save_final=true", f"train.callbacks=[{tmp_path / 'myjobs.py'}:StopAtLossOrStep]", nproc=2, env=env)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["asked"] == [1, 2, 3, 4, 5, 6] and seen["final"] == 6, (rank, seen)
    steps, events = _records(tmp_path / "stop2")
    assert steps[-1]["step"] == 6
    assert next(e for e in events if e["event"] == "stopped")["reason"] == "a job on another rank asked to stop"
    assert (tmp_path / "stop2" / "checkpoints" / "step_00000006" / "COMMIT").is_file()


def test_a_callback_that_is_not_a_job_is_refused_in_one_line(tmp_path):
    (tmp_path / "myjobs.py").write_text(JOB_FILE)
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "train.steps=2",
                            f"train.callbacks=[{tmp_path / 'myjobs.py'}:NotAJob]")
    assert code == 2 and err.count("\n") == 1
    assert "train.callbacks=" in err and "has no due(step) and run(trainer)" in err
    code, _, err = run_main("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "train.steps=2",
                            f"train.callbacks=[{tmp_path / 'myjobs.py'}:Missing]")
    assert code == 2 and f"train.callbacks={tmp_path / 'myjobs.py'}:Missing: " in err and "has no function Missing" in err
    assert not (tmp_path / "debug").exists()  # refused before anything was written
