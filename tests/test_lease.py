"""One writer per run: a second launch of a live run is refused, a crashed holder's claim expires, and a job's
own restarts (torchrun's, a replaced node's, a requeued SLURM job's) are never refused by its earlier claim."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from disttrain.checkpoint import lease
from disttrain.cli import main
from helpers import DEBUG_CONFIG, REPO, cli_env, records


def _write_claim(run_dir, **fields):
    run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    claim = {"key": "slurm-job-41", "host": "node-a", "pid": 4242, "pidns": 0, "since": now - 100, "renewed": now,
             "released": False, **fields}
    (run_dir / lease.LEASE).write_text(json.dumps(claim))


def test_a_live_claim_refuses_others_and_admits_its_own_job(tmp_path):
    run = tmp_path / "run"
    _write_claim(run)  # held by SLURM job 41 from node-a, renewed just now (a shared file system)
    held, holder = lease.acquire(run, lease.process_key({"SLURM_JOB_ID": "42"}))
    assert held is None and (holder.host, holder.pid) == ("node-a", 4242)
    # The same job requeued, or one of its nodes replaced: same key, admitted; the claim keeps its start.
    held, holder = lease.acquire(run, lease.process_key({"SLURM_JOB_ID": "41"}))
    assert holder is None and lease.read(run).host == socket.gethostname() and lease.read(run).since < time.time() - 99
    held.release()
    assert lease.read(run).released
    # torchrun's restarts keep TORCHELASTIC_RUN_ID; nodes of one `disttrain train` launch share rdzv id and endpoint.
    assert lease.process_key({"TORCHELASTIC_RUN_ID": "abc"}) == lease.process_key({"TORCHELASTIC_RUN_ID": "abc"})
    assert lease.launch_key("j7", "node-a:29400", {}) == lease.launch_key("j7", "node-a:29400", {})
    assert lease.launch_key(None, None, {}) != lease.launch_key(None, None, {})  # two single-node launches


def test_a_crashed_holders_claim_expires(tmp_path):
    run = tmp_path / "run"
    _write_claim(run, renewed=time.time() - lease.TTL_S - 1)  # another host, not renewed for a minute
    held, holder = lease.acquire(run, "launch-b")
    assert holder is None
    held.release()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a holder on this host whose process has ended: free at once, before the minute
    _write_claim(run, host=socket.gethostname(), pid=gone.pid, pidns=os.stat("/proc/self/ns/pid").st_ino)
    held, holder = lease.acquire(run, "launch-c")
    assert holder is None
    held.start(every=0.05)  # the holder renews its claim while it runs
    first = lease.read(run).renewed
    time.sleep(0.3)
    assert lease.read(run).renewed > first and not lease.read(run).released
    held.release()


def test_a_second_launch_of_a_live_run_is_refused_and_a_preemption_ends_quietly(tmp_path, capsys):
    """A real launch (launcher + 1 worker) holds the run; a second launch, with one setting changed, is refused
    in one line naming the first launch's host, pid and start, and writes nothing. The first then ends by
    preemption (SIGUSR1 to its worker, as SLURM signals every task): exit 75, and its last line is
    disttrain's, with no torchrun report after it."""
    common = [str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run", "train.steps=400",
              "checkpoint.save_final=false", "metrics.comm_profile_every=0", "distributed.timeout_s=60"]
    first = subprocess.Popen([sys.executable, "-m", "disttrain", "train", *common, "--nproc-per-node", "1"], cwd=REPO,
                             env={**cli_env(), "DISTTRAIN_FAULT": "slow:rank=0:step=0:seconds=0.05"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "run"
    deadline = time.monotonic() + 600  # waits for a state only: generous for a loaded machine
    while not ((run / "metrics.jsonl").is_file() and '"loss"' in (run / "metrics.jsonl").read_text()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    config = (run / "config.yaml").read_text()
    for launch in (["--nproc-per-node", "2"], []):  # the launcher's check, and a single process's
        with pytest.raises(SystemExit) as exc:
            main(["train", *common, "optim.lr=1e-3", *launch])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1, err
        assert f"{run} is being written by another launch (host {socket.gethostname()}, pid {first.pid}, since " in err
    workers = subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True, text=True).stdout.split()
    for pid in workers:
        os.kill(int(pid), 10)  # SIGUSR1
    out, err = first.communicate(timeout=120)
    assert first.returncode == 75, err[-3000:]
    assert out.strip().splitlines()[-1].startswith("preempted: saved step ")
    assert "Traceback" not in err and "exitcode" not in err and "FAILED" not in err, err
    steps = [r["step"] for r in records(run) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no step twice
    assert (run / "config.yaml").read_text() == config
    assert lease.read(run).released


def test_a_run_refused_while_assembling_leaves_no_renewal_behind(tmp_path, capsys, monkeypatch):
    """Weights that do not fit the model are found after the claim is taken; the fresh run directory is removed.
    The claim must stop renewing first: a renewal into the removed directory once printed a logging traceback
    from the lease thread (seen when the machine was slow enough for a renewal to fall in between)."""
    from safetensors.torch import save_file
    import threading
    import torch

    weights = tmp_path / "w.safetensors"
    save_file({"tok_embeddings.weight": torch.zeros(256, 64)}, str(weights))
    monkeypatch.setattr(lease.Lease.start, "__defaults__", (0.0002,))  # renew as often as possible
    failures = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    for attempt in range(3):
        with pytest.raises(SystemExit) as exc:
            main(["train", str(DEBUG_CONFIG), f"run.dir={tmp_path / 'runs'}", f"run.name=r{attempt}",
                  f"model.init_from={weights}"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and "the weights lack" in err, err
        assert not (tmp_path / "runs" / f"r{attempt}").exists()
    assert not failures
