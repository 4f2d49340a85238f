"""Ray Train: `disttrain train --ray` on a real Ray cluster of two nodes on this machine (started once for this module;
asked for 127.0.0.1, which Ray advertises as the machine's own address), against
one process and an uninterrupted run; a worker actor killed under an elastic worker count, one sent SIGTERM, a resize
from 2 to 1 and back to 2 workers; the mistakes refused in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import (PARITY, REPO, assert_losses_close, assert_parity, cli_env, events, losses, run_cli, run_main,
                     run_module, step_records, train)

import ray  # noqa: E402,F401  (the test install has the ray extra: a missing Ray fails here, not skips)

RAY = str(Path(sys.executable).with_name("ray"))
# The fault runs: 16 steps, a checkpoint every 4; rank 1 sleeps before each forward, so that a step lasts long enough
# for the test to act in the middle of the run (the sleep changes no number).
RUN = ("train.steps=16", "train.global_batch_size=4", "train.micro_batch_size=1", "checkpoint.every_steps=4")
SLOW_RANK_1 = {"DISTTRAIN_FAULT": "slow:rank=1:step=0:seconds=0.4"}
# A node whose raylet is gone is declared dead after 1 s x 3 missed health checks (Ray's defaults: 3 s x 5): a lost
# node is noticed in seconds.
FAST_NODE_LOSS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
# Workers on ports the system picks (the ephemeral range), not Ray's 10002-19999, where the suite's other modules
# start their servers (helpers.free_ports).
WORKER_PORTS = ("--min-worker-port=0", "--max-worker-port=0")
# A cluster on loopback for this test alone: no token authentication (its nodes and drivers all agree on that).
NO_TOKEN = {"RAY_AUTH_MODE": "disabled"}


def _gcs_port() -> int:
    """A free port for the cluster's GCS, outside Ray's worker ports (10002-19999) and the ephemeral range."""
    import random

    for _ in range(100):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


class RayNode:
    """One Ray node of this machine, `ray start --block` in its own session: stopping it ends its processes (the
    raylet's workers included) and nothing else."""

    def __init__(self, log: Path, *args: str):
        self.log = log
        self.proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
                                      "--num-cpus=1", *WORKER_PORTS, *args], env={**cli_env(), **NO_TOKEN},
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 90) -> None:
        """Until the node has joined (`ray start` says so once its raylet registered)."""
        deadline = time.time() + timeout
        while "Ray runtime started" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.time() < deadline, f"the Ray node did not start in {timeout} s"
            time.sleep(0.3)

    def stop(self) -> None:
        """As a node leaves when its machine is shut down: `ray start` stops its raylet, which tells the cluster
        (SIGTERM); whatever of it is left after 15 s is killed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Cluster:
    """Two Ray nodes of one CPU each on this machine: the head and a second node that a test may take away and bring
    back (capacity lost and returned)."""

    def __init__(self, logs: Path):
        self.logs, self.port, self.started = logs, _gcs_port(), 0
        self.head = RayNode(logs / "head.log", "--head", f"--port={self.port}", "--include-dashboard=false",
                            f"--system-config={json.dumps(FAST_NODE_LOSS)}")
        self.second = None
        try:
            self.head.wait()
            self.add_node()
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add_node(self) -> RayNode:
        self.started += 1
        self.second = RayNode(self.logs / f"node{self.started}.log", f"--address={self.address}")
        self.second.wait()

    def stop(self) -> None:
        """The end of the module: every process of both nodes, at once."""
        if self.second is not None:
            self.second.kill()
        self.head.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The Ray cluster of every test of this module."""
    cluster = Cluster(tmp_path_factory.mktemp("ray"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def ray_address(cluster):
    return cluster.address


def ray_train(run_dir: Path, *overrides: str, workers: str, address: str, extra: tuple = (), env: dict | None = None,
              check: bool = True):
    return run_cli("train", str(Path(__file__).parents[1] / "configs" / "debug.yaml"), f"run.dir={run_dir.parent}",
                   f"run.name={run_dir.name}", "distributed.timeout_s=60", *overrides, "--ray", "--workers", workers,
                   "--ray-address", address, *extra, env={**NO_TOKEN, **(env or {})}, check=check, timeout=400)


def _pid_of_rank(run_dir: Path, rank: int, after: int = 0) -> int:
    """The process id the rank's worker actor logged (launch/ray_worker.py), its `after`-th start counted from 0."""
    found = re.findall(r"ray worker: pid (\d+), world rank", (run_dir / "logs" / f"rank_{rank:05d}.log").read_text())
    return int(found[after])


def _when(run_dir: Path, condition, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if condition():
                return
        except (FileNotFoundError, IndexError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{run_dir}: condition not met in {timeout} s")


def _in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def _logged_step(run_dir: Path) -> int:
    return max(step_records(run_dir), default=0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The fault runs' reference: one process, never stopped, in fp32."""
    return train(tmp_path_factory.mktemp("ray_ref") / "run", *RUN)


# ---------------------------------------------------------------- mistakes: one line, exit 2, nothing started
@pytest.mark.parametrize("flags, expected", [
    (("--ray", "--workers", "0"), "--workers=0: 0 workers cannot train"),
    (("--ray", "--workers", "3:2"), "--workers=3:2: MIN 3 is above MAX 2"),
    (("--workers", "2"), "--workers needs --ray"),
    (("--ray", "--nproc-per-node", "2"), "--ray with --nproc-per-node"),
])
def test_bad_worker_flags_are_one_line(flags, expected, tmp_path):
    code, out, err = run_main("train", "configs/debug.yaml", f"run.dir={tmp_path}", *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"disttrain: error: {expected}"), err
    assert "Traceback" not in err + out
    assert not any(tmp_path.iterdir())


def test_an_unreachable_address_is_one_line(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.time()
    code, out, err = run_main("train", "configs/debug.yaml", f"run.dir={tmp_path}", "--ray",
                              "--ray-address", f"127.0.0.1:{port}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--ray-address=127.0.0.1:{port}: no Ray cluster answers there" in err
    assert time.time() - started < 10 and not any(tmp_path.iterdir())


def test_without_ray_installed_it_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    code, out, err = run_main("train", "configs/debug.yaml", f"run.dir={tmp_path}", "--ray")
    assert code == 2
    assert err.strip() == ("disttrain: error: --ray needs Ray Train, which is not installed: "
                           "pip install 'disttrain[ray]'")


def test_a_run_directory_on_this_machines_disk_is_refused_on_a_cluster_of_other_machines(tmp_path):
    """The check behind the refusal, on this machine's real mounts: tmp_path is on a local disk; an object store is
    not; nodes that all run on this machine share its disk (the tests' cluster), a node elsewhere does not. (A
    cluster of several machines cannot be started here: its node list stands in for Ray's `ray.nodes()`.)"""
    from disttrain.config.load import load_config
    from disttrain.core.errors import UserError
    from disttrain.launch.ray_train import check_cluster, local_filesystem

    assert local_filesystem(tmp_path) is not None and local_filesystem("s3://bucket/runs") is None
    cfg = load_config("configs/debug.yaml", [f"run.dir={tmp_path}"])
    here, elsewhere = {"Alive": True, "NodeManagerHostname": socket.gethostname()}, \
        {"Alive": True, "NodeManagerHostname": "node-7"}

    class Nodes:
        def __init__(self, *nodes):
            self.nodes = lambda: list(nodes)

    check_cluster(Nodes(here, dict(here)), cfg)  # two nodes of this machine
    with pytest.raises(UserError, match=rf"^run.dir={tmp_path}: on this machine's own disk .*node-7"):
        check_cluster(Nodes(here, elsewhere), cfg)
    shared = load_config("configs/debug.yaml", [f"run.dir={tmp_path}", "checkpoint.dir=s3://bucket/runs/debug"])
    check_cluster(Nodes(here, elsewhere), shared)  # checkpoints every node reaches


# ---------------------------------------------------------------- the same numbers
def test_two_ray_workers_equal_one_process(ray_address, debug_reference, tmp_path):
    """DDP over Ray's process group: two workers of two micro-batches each give one process's losses, gradient norms
    and final parameters to 1e-10 in fp64; every step record says it ran on 2 ranks; the final checkpoint is the
    one Ray reported."""
    run = tmp_path / "run"
    proc = ray_train(run, *PARITY, "train.micro_batch_size=1", workers="2", address=ray_address)
    assert_parity(run, debug_reference)
    assert {r["world_size"] for r in step_records(run).values()} == {2}
    assert "done: 20 steps" in proc.stdout + proc.stderr
    snapshot = (run / "checkpoints" / "checkpoint_manager_snapshot.json").read_text()
    assert "step_00000020" in snapshot  # Ray's own record of the run's checkpoints names the committed one


def test_zero3_through_the_python_entry_point_equals_one_process(ray_address, debug_reference, tmp_path):
    """ZeRO-3 (FSDP2) on two workers through `RayJob` in a TorchTrainer of the user's own (docs/guide.md): one
    process's numbers to 1e-10 in fp64, and Ray's Result names the final committed checkpoint where it lies."""
    run = tmp_path / "run"
    overrides = (f"run.dir={tmp_path}", "run.name=run", "distributed.timeout_s=60", *PARITY, "parallel.zero_stage=3")
    proc = run_module("workers.ray_entry", [ray_address, str(REPO / "configs" / "debug.yaml"), *overrides],
                      env={**cli_env(), **NO_TOKEN}, cwd=REPO / "tests", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_parity(run, debug_reference)
    assert f"result checkpoint: {run / 'checkpoints' / 'step_00000020'}" in proc.stdout


# ---------------------------------------------------------------- restarts
def test_a_killed_worker_actor_restarts_and_continues_the_curve(ray_address, uninterrupted, tmp_path):
    """Under --workers 1:2, SIGKILL of rank 1's worker actor mid-run: Ray restarts the group, disttrain resumes from
    the newest committed checkpoint, and every step's loss equals the uninterrupted run's within 1e-5 (fp32; the
    steps after the checkpoint were redone). metrics.jsonl records the restart and each step's world size."""
    run = tmp_path / "run"
    thread, out = _in_background(lambda: ray_train(run, *RUN, workers="1:2", address=ray_address, env=SLOW_RANK_1))
    _when(run, lambda: _logged_step(run) >= 6)
    os.kill(_pid_of_rank(run, 1), signal.SIGKILL)
    thread.join(400)
    assert out and out[0].returncode == 0
    restarts = events(run, "restart")
    assert len(restarts) == 1 and restarts[0]["world_size"] in (1, 2), restarts
    resumed = events(run, "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] in (4, 8) and resumed[0]["step"] == restarts[0]["step"]
    assert_losses_close(losses(run), losses(uninterrupted), rel=1e-5)
    sizes = {s: r["world_size"] for s, r in step_records(run).items()}  # the last record of each step
    assert all(sizes[s] == 2 for s in sizes if s <= resumed[0]["step"])
    assert all(sizes[s] == restarts[0]["world_size"] for s in sizes if s > resumed[0]["step"])


def test_sigterm_to_a_worker_actor_saves_the_emergency_checkpoint(ray_address, uninterrupted, tmp_path):
    """SIGTERM to one worker actor, as a scheduler sends before a kill: both ranks save at the next step boundary
    (as under torchrun) and leave; with no restart allowed (a fixed count's default) the launch exits 75, as
    torchrun's does. The same command again resumes from that checkpoint with the uninterrupted run's losses."""
    run = tmp_path / "run"
    thread, out = _in_background(lambda: ray_train(run, *RUN, workers="2", address=ray_address, env=SLOW_RANK_1,
                                                   check=False))
    _when(run, lambda: _logged_step(run) >= 5)
    os.kill(_pid_of_rank(run, 1), signal.SIGTERM)
    thread.join(400)
    assert out and out[0].returncode == 75, out[0].stderr[-3000:] if out else "no result"
    saved = [e for e in events(run, "checkpoint_saved") if e["reason"] == "preemption"]
    assert len(saved) == 1 and 5 <= saved[0]["step"] < 16 and events(run, "preempted")[0]["step"] == saved[0]["step"]
    ray_train(run, *RUN, workers="2", address=ray_address)
    assert [e["step"] for e in events(run, "resumed")] == [saved[0]["step"]]
    assert_losses_close(losses(run), losses(uninterrupted), rel=1e-5)


def test_resize_from_two_to_one_and_back_to_two(cluster, uninterrupted, tmp_path):
    """The second node is lost mid-run (its processes killed at once, as when a machine dies; a node stopped with
    `ray stop` drains first, and a run shorter than the drain never sees it go): Ray restarts the group on the one
    CPU left and disttrain resumes at world size 1. Once that group has committed a checkpoint the node comes back:
    Ray grows the group to 2 (it looks every --ray-resize-interval seconds) and disttrain resumes from it at world
    size 2. The global batch stays 4: every step's loss equals the uninterrupted run's within 1e-5, and the step
    records say which steps ran on 1 worker."""
    run = tmp_path / "run"
    slow = {"DISTTRAIN_FAULT": "slow:rank=0:step=0:seconds=1;slow:rank=1:step=0:seconds=1",  # time for a node to join
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}  # a group asked of a node just lost gives up sooner
    thread, out = _in_background(lambda: ray_train(run, *RUN, workers="1:2", address=cluster.address, env=slow,
                                                   extra=("--ray-resize-interval", "2")))
    _when(run, lambda: _logged_step(run) >= 5)
    cluster.second.kill()
    _when(run, lambda: any(e["world_size"] == 1 for e in events(run, "restart")), timeout=180)
    shrunk = events(run, "restart")[0]
    _when(run, lambda: any(e["step"] > shrunk["step"] for e in events(run, "checkpoint_saved")), timeout=120)
    cluster.add_node()
    thread.join(400)
    assert out and out[0].returncode == 0, out[0].stderr[-3000:] if out else "no result"
    restarts = events(run, "restart")
    assert [e["world_size"] for e in restarts] == [1, 2], restarts
    assert restarts[1]["step"] > restarts[0]["step"]  # grown from the checkpoint the one worker committed
    assert_losses_close(losses(run), losses(uninterrupted), rel=1e-5)
    sizes = {s: r["world_size"] for s, r in step_records(run).items()}  # the last record of each step
    assert all(sizes[s] == (1 if restarts[0]["step"] < s <= restarts[1]["step"] else 2) for s in sizes), sizes
