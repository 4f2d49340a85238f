"""Nodes that come and go: two `disttrain train` launchers on loopback act as two nodes of an elastic run
(`--nnodes 1:2`, one worker each). Real processes, real SIGKILLs of a whole node (launcher, agent, worker)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disttrain.bench.processes import kill_tree
from helpers import DEBUG_CONFIG, REPO, assert_losses_close, cli_env, events, free_ports, losses, train

# 0.6 s per step (a sleep on rank 0, after restarts too) leaves time to kill and rejoin mid-run: the node started
# again at step 25 has 35 steps (21 s) to start its interpreter and join, also on a loaded machine (at 0.3 s per
# step, under a loaded test run, the survivor sometimes finished alone first).
PACE = "slow:rank=0:step=0:seconds=0.6:attempts=all"
RUN = ("train.steps=60", "train.global_batch_size=4", "checkpoint.every_steps=5")


def _node(run_dir: Path, port: int, *extra: str, fault: str = PACE) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={run_dir.parent}",
           f"run.name={run_dir.name}", "distributed.timeout_s=60", *extra, "--nproc-per-node", "1", "--nnodes", "1:2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_dir.name, "--max-restarts", "3"]
    env = {**cli_env(), "DISTTRAIN_FAULT": fault, "DISTTRAIN_FAULT_LOG": str(run_dir.parent / "faults.jsonl")}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _kill_node(node: subprocess.Popen) -> None:
    kill_tree(node.pid)
    node.wait()


def _wait_for(predicate, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _logged_steps(run_dir: Path, after: float = 0.0) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if "loss" in r and "event" not in r and r["time"] > after]


@pytest.mark.slow
def test_a_lost_node_is_survived_and_a_returning_node_rejoins_the_same_stream(tmp_path):
    """Node B is killed whole: node A resumes alone (world 1) from the last checkpoint; B started again is
    admitted at the next restart point (A's worker saves on the agent's SIGTERM, both resume at world 2) and
    the losses of every step are those of one uninterrupted process."""
    run, port = tmp_path / "elastic", free_ports()
    a = _node(run, port, *RUN)
    time.sleep(1)  # A hosts the rendezvous
    b = _node(run, port, *RUN)
    _wait_for(lambda: max(_logged_steps(run), default=0) >= 12)
    killed = time.time()
    _kill_node(b)
    _wait_for(lambda: max(_logged_steps(run, after=killed), default=0) >= 25)
    b = _node(run, port, *RUN)
    assert a.wait(timeout=300) == 0 and b.wait(timeout=300) == 0, a.stdout.read()[-3000:]

    resumed = [(e["step"], e["world_size"]) for e in events(run, "resumed")]
    assert [w for _, w in resumed] == [1, 2], resumed
    assert resumed[0][0] <= 12 and resumed[1][0] >= 25  # scale-down from a checkpoint, scale-up mid-run
    reference = train(tmp_path / "one_process", *RUN)
    assert sorted(losses(run)) == list(range(1, 61))
    assert_losses_close(losses(run), losses(reference), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("vanishing_rank", [1, 0])
def test_a_node_vanishing_after_the_end_does_not_hold_the_other_in_the_exit_barrier(tmp_path, vanishing_rank):
    """torchrun's agent waits 300 s for the other agents once its workers finish; `--exit-barrier-timeout`
    bounds it: one node's agent dies as training ends, the other exits 0 within seconds. Rank 0's node is
    usually the one whose agent holds the rendezvous store: its forked worker must not outlive it and keep the
    store's port open and mute (the survivor then hung on it)."""
    run, port = tmp_path / "ending", free_ports()
    common = ("train.steps=6", "--exit-barrier-timeout", "3")
    fault = f"kill_agent_at_exit:rank={vanishing_rank}:step=0"
    nodes = [_node(run, port, *common, fault=fault)]
    time.sleep(1)
    nodes.append(_node(run, port, *common, fault=fault))
    try:
        _wait_for(lambda: any(n.poll() is not None for n in nodes))  # the node whose worker had that rank
        started_waiting = time.monotonic()
        vanished = next(n for n in nodes if n.poll() is not None)
        survivor = next(n for n in nodes if n.poll() is None)
        try:
            code = survivor.wait(timeout=120)
        except subprocess.TimeoutExpired:
            _kill_groups(nodes)
            pytest.fail(f"the surviving node still waits 120 s on:\n{survivor.stdout.read()[-3000:]}")
        output = survivor.stdout.read()
        assert code == 0 and "Traceback" not in output, output[-3000:]  # the barrier's error: one line
        assert time.monotonic() - started_waiting < 60  # torchrun's own barrier would hold it for 300 s
        _wait_for(lambda: not _group_alive(vanished.pid), timeout=30)  # its worker went with its agent
        assert max(losses(run)) == 6 and events(run, "finished")
    finally:
        _kill_groups(nodes)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _kill_groups(nodes: list[subprocess.Popen]) -> None:
    """Every process a node started, orphans included (each node is its own session, `start_new_session`)."""
    for node in nodes:
        if _group_alive(node.pid):
            os.killpg(node.pid, signal.SIGKILL)
