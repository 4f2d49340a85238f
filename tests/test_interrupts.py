"""Ctrl-C with real processes and real signals: SIGINT to the launch's process group (what a terminal sends) in the
middle of a checkpoint save, and SIGINT to the launcher alone (what a scheduler or `kill -INT` sends)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DEBUG_CONFIG, REPO, cli_env, events, records

SLOW_DISK = REPO / "tests" / "workers" / "slow_disk"  # its sitecustomize.py
RUN = ("train.steps=40", "checkpoint.every_steps=2", "run.name=r")


def _start(run_dir: Path, nproc: int | None, env: dict | None = None) -> subprocess.Popen:
    """`disttrain train` in a session of its own (a terminal's foreground process group)."""
    launch = ("--nproc-per-node", str(nproc)) if nproc else ()
    return subprocess.Popen([sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={run_dir}", *RUN,
                             *launch], env={**cli_env(), **(env or {})}, cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"the run ended or stalled before the interrupt (exit {proc.returncode})\n{out}\n{err}")
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, limit_s: float) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running {limit_s} s after Ctrl-C\n{out[-3000:]}\n{err[-3000:]}") from None
    return out, err, time.monotonic() - t0


@pytest.mark.parametrize("nproc", [None, 2], ids=["one-process", "two-processes"])
def test_ctrl_c_during_a_save_removes_it_stops_and_says_where(nproc, tmp_path):
    """The save of step 4 stalls on a slow disk (30 s); Ctrl-C lands in it. Before, DCP's wrapped interrupt was
    taken for a storage fault and training went on."""
    marker = tmp_path / "saving"
    hook = os.pathsep.join(filter(None, [str(SLOW_DISK), os.environ.get("PYTHONPATH")]))
    proc = _start(tmp_path, nproc, {"PYTHONPATH": hook, "DISTTRAIN_TEST_SLOW_DISK": f"30:{marker}:step_00000004"})
    _wait_for(marker.exists, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err, seconds = _finish(proc, limit_s=20)
    run = tmp_path / "r"
    newest = run / "checkpoints" / "step_00000002"
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [f"disttrain: interrupted at step 4; newest checkpoint: {newest}"], err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]  # the partial save went
    assert max(r["step"] for r in records(run) if "loss" in r) == 4  # nothing trained or written after it
    assert [e["step"] for e in events(run, "interrupted")] == [4]
    assert not events(run, "checkpoint_failed")  # an interrupt is not a storage fault


def test_ctrl_c_to_the_launcher_alone_stops_the_workers(tmp_path):
    """SIGINT to the launcher only (`kill -INT`, a scheduler): it passes it on; the workers stop, and the
    launcher's exit status and output are the workers' one line, no torchrun traceback."""
    proc = _start(tmp_path, 2)
    _wait_for(lambda: any("loss" in r and r["step"] >= 3 for r in _records(tmp_path / "r")), proc)
    os.kill(proc.pid, signal.SIGINT)
    out, err, seconds = _finish(proc, limit_s=20)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disttrain: interrupted at step "), err
    step = events(tmp_path / "r", "interrupted")[0]["step"]
    assert f"at step {step}; newest checkpoint: " in lines[0]


def _records(run: Path) -> list[dict]:
    """metrics.jsonl while it is being written: its complete lines."""
    import json

    path = run / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("leaving", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
def test_an_exit_inside_a_save_is_not_a_storage_fault(leaving, tmp_path):
    """DCP gathers whatever a rank raised during a save, an exit or an interrupt included, into one
    CheckpointException: the manager re-raises the exit (no `SaveFailed`, no "training continues") and the partial
    step directory goes."""
    import traceback

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from disttrain.checkpoint.manager import CheckpointManager

    class Engine:
        checkpoint_format = "dcp"

        def save(self, path, group):
            (Path(path) / "__0_0.distcp").write_bytes(b"half")
            raise CheckpointException("save failed", {0: (leaving, traceback.StackSummary())})

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        manager = CheckpointManager(tmp_path, rank=0)
        with pytest.raises(type(leaving)):
            manager.save(2, Engine(), {"step": 2})
        assert not (tmp_path / "step_00000002").exists()
    finally:
        dist.destroy_process_group()
