"""Fault tolerance with real processes and real signals: restarts, preemption, corruption, hangs, resizing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DEBUG_CONFIG, REPO, assert_losses_close, cli_env, events, free_ports, losses, run_cli, train

RUN = ("train.steps=16", "train.global_batch_size=4", "train.micro_batch_size=1", "checkpoint.every_steps=4")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference, with workers started as fresh interpreters (the default); the runs compared with it
    fork theirs from the launcher (the suite's setting), so bitwise equality covers both ways."""
    return train(tmp_path_factory.mktemp("ft") / "run", *RUN, nproc=2, env={"DISTTRAIN_WORKER_START": "exec"})


def test_sigkill_of_one_worker_restarts_and_continues_bitwise(uninterrupted, tmp_path):
    run = train(tmp_path / "run", *RUN, nproc=2, launch=("--max-restarts", "1"),
                env={"DISTTRAIN_FAULT": "kill:rank=1:step=7"})
    resumed = events(run, "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] == 4  # steps 5-7 were lost with the kill and redone
    assert losses(run) == losses(uninterrupted)  # bitwise, including the redone steps


def test_sigterm_saves_an_emergency_checkpoint_and_resumes(uninterrupted, tmp_path):
    run = train(tmp_path / "run", *RUN, nproc=2, launch=("--max-restarts", "1"),
                env={"DISTTRAIN_FAULT": "signal:rank=0:step=6:sig=TERM"})
    saved = [e for e in events(run, "checkpoint_saved") if e["reason"] == "preemption"]
    assert [e["step"] for e in saved] == [6]  # at the step boundary, agreed by both ranks
    assert events(run, "preempted")[0]["exit_code"] == 75
    assert [e["step"] for e in events(run, "resumed")] == [6]
    assert losses(run) == losses(uninterrupted)


def test_preempted_single_this_processs_75_with_committed_checkpoint(tmp_path):
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=r", "train.steps=50",
                   check=False, env={"DISTTRAIN_FAULT": "signal:rank=0:step=3:sig=USR1"})
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert (tmp_path / "r" / "checkpoints" / "step_00000003" / "COMMIT").is_file()


@pytest.mark.parametrize("nproc", [1, 4])
def test_resume_on_another_world_size_continues_the_stream(uninterrupted, nproc, tmp_path):
    ckpt = uninterrupted / "checkpoints" / "step_00000008"
    run = train(tmp_path / "run", *RUN, f"checkpoint.resume={ckpt}", nproc=nproc if nproc > 1 else None)
    expected = {s: v for s, v in losses(uninterrupted).items() if s > 8}
    assert_losses_close(losses(run), expected, rel=1e-5)  # same global batches; reduction order differs


def test_corrupted_or_truncated_checkpoints_fall_back_to_the_previous(tmp_path):
    """Every file's size and CRC-32 is in COMMIT (hashed by both ranks, each its share); a flipped bit
    in the newest checkpoint and a truncated shard in the one before are both caught, named, and the
    run resumes from the one before those."""
    import zlib

    run = train(tmp_path / "run", "train.steps=18", "checkpoint.every_steps=6", nproc=2)
    first = losses(run)
    # as if killed right after step 18's save, before recording its end (a finished run is not trained again)
    metrics = run / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(keepends=True)
                               if '"event": "finished"' not in line))
    newest = run / "checkpoints" / "step_00000018"
    files = json.loads((newest / "COMMIT").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in newest.iterdir() if p.name != "COMMIT")
    for name, (size, crc) in files.items():
        data = (newest / name).read_bytes()
        assert (len(data), f"{zlib.crc32(data):08x}") == (size, crc), name
    flipped = newest / "__1_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, same size: only the checksum sees it
    flipped.write_bytes(bytes(data))
    shard = run / "checkpoints" / "step_00000012" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run", "train.steps=18",
                   "checkpoint.every_steps=6", nproc=2)
    assert f"{flipped} does not match its checksum" in proc.stdout and f"{shard} is truncated" in proc.stdout
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if f"{flipped} does not match" in line]
    assert len(said) == 1 and said[0].startswith("warning: skipped checkpoint: "), said
    assert "WARNING" not in proc.stderr  # once, in the run's words: no timestamped record per rank beside it
    reasons = [e["reason"] for e in events(run, "checkpoint_skipped")]
    assert reasons[0].startswith(f"{flipped} does not match its checksum") and reasons[1].startswith(f"{shard} is truncated")
    assert events(run, "resumed")[-1]["step"] == 6
    assert losses(run) == first  # steps 7-18 redone from step 6, identically

    # Nothing loadable at all: start fresh, and say so.
    for step in (6, 12, 18):
        (run / "checkpoints" / f"step_{step:08d}" / "train_state.pt").write_bytes(b"")
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run", "train.steps=2",
                   "checkpoint.save_final=false")
    assert "could be loaded: starting fresh" in proc.stdout


def test_watchdog_names_the_stalled_rank_and_dumps_stacks(tmp_path):
    t0 = time.monotonic()
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run", "train.steps=100",
                   "distributed.watchdog_min_s=3", "distributed.watchdog_factor=5", "distributed.timeout_s=120",
                   nproc=2, check=False, env={"DISTTRAIN_FAULT": "hang_backward:rank=1:step=5:seconds=300"})
    assert proc.returncode != 0 and time.monotonic() - t0 < 90
    for rank in (0, 1):
        text = (tmp_path / "run" / "logs" / f"rank_{rank:05d}.log").read_text()
        # Rank 1 stops inside step 5's backward; rank 0 finishes step 5 and then waits for it in the next
        # collective (the metrics all-reduce), which makes it a victim, not a cause.
        assert "completed no step for" in text and ("stalled rank(s): 1 (last completed step 4; rank 0: step 5: "
                                                    "metrics all-reduce; rank 1: step 5: backward)") in text, text[-2000:]
        assert 'File "' in text and "Thread 0x" in text  # faulthandler's stacks of every thread
    sleeper = (tmp_path / "run" / "logs" / "rank_00001.log").read_text()
    assert "in after_backward" in sleeper  # the stalled rank's stack shows where it is stuck


def test_async_save_commits_and_a_kill_mid_save_keeps_the_previous(uninterrupted, tmp_path):
    run = train(tmp_path / "run", *RUN, "checkpoint.async=true", nproc=2, launch=("--max-restarts", "1"),
                env={"DISTTRAIN_FAULT": "kill_after_save:rank=1:step=8"})
    started = events(run, "checkpoint_started")
    assert started and all(e["blocking_s"] >= 0 for e in started)
    # Step 8's write began but never committed: the restart resumed from step 4 and removed step 8's debris.
    assert [e["step"] for e in events(run, "resumed")] == [4]
    committed = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "COMMIT").is_file())
    assert committed == ["step_00000004", "step_00000008", "step_00000012", "step_00000016"]
    assert losses(run) == losses(uninterrupted)


def _signal_after_steps(cmd: list[str], run: Path, sig: int, steps: int = 4,
                        own: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, int, list[int]]:
    """(the launch, signalled after `steps` logged steps; its launcher's pid; the processes holding the `own`
    arguments just before the signal)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # waits for a state only: generous for a loaded machine
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= steps:
            break
        time.sleep(0.05)
    running = _processes_with(*own) if own else []
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), proc.pid, running


def _processes_with(*args: str) -> list[int]:
    """The live processes whose command line holds each of `args` as a whole argument: this test's own launch
    (`run.dir=` its tmp_path, which no other test shares), found after its launcher is gone (orphaned workers
    leave the launcher's process tree, and forked workers keep the launcher's command line). Not `pgrep -f
    run.name=...`, which also matches another test's run of that name under pytest-xdist."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if all(arg.encode() in argv for arg in args):
            found.append(int(entry.name))
    return found


def test_sigusr1_to_the_launchers_ends_in_a_committed_checkpoint(tmp_path):
    """SLURM's warning signal, sent for real: to `disttrain train --nproc-per-node` (its torchrun child
    handles SIGUSR1 and passes it on; the launcher exits 75), and to a plain `torchrun` that does not
    handle it and dies of it (the orphaned workers notice their agent is gone, save and stop)."""
    common = [str(DEBUG_CONFIG), f"run.dir={tmp_path}", "train.steps=100000", "checkpoint.save_final=false",
              "metrics.comm_profile_every=0", "distributed.timeout_s=60"]
    launchers = {
        "disttrain": [sys.executable, "-m", "disttrain", "train", *common, "run.name=disttrain",
                      "--nproc-per-node", "2"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     "-m", "disttrain", "train", *common, "run.name=torchrun"],
    }
    for name, cmd in launchers.items():
        run = tmp_path / name
        own = (f"run.dir={tmp_path}", f"run.name={name}")
        proc, launcher, running = _signal_after_steps(cmd, run, signal.SIGUSR1, own=own)
        # the lookup below sees this launch while it trains: its launcher and (at least) both workers
        assert launcher in running and len(running) >= 3, (name, launcher, running)
        assert proc.returncode == (75 if name == "disttrain" else -signal.SIGUSR1), (name, proc.stderr[-3000:])
        if name == "disttrain":  # the workers' `preempted: saved step N` is the last word, no torchrun report
            assert "Traceback" not in proc.stderr and proc.stdout.strip().splitlines()[-1].startswith("preempted:")
        step = events(run, "preempted")[0]["step"]
        assert (run / "checkpoints" / f"step_{step:08d}" / "COMMIT").is_file()
        deadline = time.monotonic() + 30  # the workers exit on their own, nothing trains on unsupervised
        while _processes_with(*own):
            assert time.monotonic() < deadline, f"{name}: workers still running after the launcher exited"
            time.sleep(0.2)
        assert losses(run)[step] and max(losses(run)) == step


def _srun_step(tmp_path: Path, name: str, *overrides: str, signal_after: int | None = None,
               tasks: int = 2, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """What `srun --ntasks=N disttrain train ...` starts: N plain processes that find their rank, the world
    size and the rendezvous in SLURM's variables (no torchrun); with `signal_after`, SLURM's warning
    signal reaches every task after that many logged steps (as `--signal=USR1@...` delivers it)."""
    port = free_ports()
    procs = []
    for rank in range(tasks):
        task_env = {**cli_env(), **(env or {}), "SLURM_JOB_ID": "777", "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_PROCID": str(rank),
               "SLURM_LOCALID": str(rank), "SLURM_STEP_TASKS_PER_NODE": str(tasks), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        cmd = [sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", f"run.name={name}",
               "distributed.timeout_s=60", *overrides]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=task_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    if signal_after is not None:
        deadline = time.monotonic() + 600  # waits for a state only: generous for a loaded machine
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            metrics = tmp_path / name / "metrics.jsonl"
            if metrics.is_file() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= signal_after:
                break
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGUSR1)
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=180), *p.communicate()) for p in procs]


def test_srun_tasks_preempted_then_requeued_resume_the_same_run(uninterrupted, tmp_path):
    """The srun-without-torchrun path on 2 processes: SIGUSR1 to every task -> committed emergency checkpoint
    and exit 75 from each; the requeued job (same run name) resumes it and ends with the losses of a run
    that was never interrupted."""
    slow = {"DISTTRAIN_FAULT": "slow:rank=0:step=0:seconds=0.1"}  # steps long enough to signal mid-run
    first = _srun_step(tmp_path, "job", *RUN, "checkpoint.every_steps=0", signal_after=3, env=slow)
    assert [p.returncode for p in first] == [75, 75], [p.stderr[-2000:] for p in first]
    step = events(tmp_path / "job", "preempted")[0]["step"]
    assert (tmp_path / "job" / "checkpoints" / f"step_{step:08d}" / "COMMIT").is_file()
    again = _srun_step(tmp_path, "job", *RUN)
    assert [p.returncode for p in again] == [0, 0], [p.stderr[-2000:] for p in again]
    assert events(tmp_path / "job", "resumed")[-1]["step"] == step
    assert losses(tmp_path / "job") == losses(uninterrupted)  # bitwise: same global batches, same reductions


@pytest.mark.slow
def test_deepspeed_under_srun_and_in_one_process(tmp_path):
    import deepspeed  # noqa: F401  (installed by `make test`: missing, this fails here rather than skipping)

    runs = _srun_step(tmp_path, "ds", "engine=deepspeed", "parallel.zero_stage=2", "train.steps=3")
    assert [p.returncode for p in runs] == [0, 0], [p.stderr[-2000:] for p in runs]
    one = train(tmp_path / "one", "engine=deepspeed", "train.steps=3")
    assert len(losses(tmp_path / "ds")) == len(losses(one)) == 3
