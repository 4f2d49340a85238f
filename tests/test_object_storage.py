"""Checkpoints and data on object storage, through a real S3 API server on 127.0.0.1 (moto's ThreadedMotoServer,
shared by the module), and storage faults: a store lost mid-save, a full disk (a small tmpfs), one writer per run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import DEBUG_CONFIG, REPO, assert_losses_close, cli_env, events, free_ports, losses, run_cli, train

RUN = ("train.steps=12", "train.global_batch_size=4", "train.micro_batch_size=1", "checkpoint.every_steps=4",
       "metrics.comm_profile_every=0")
ZERO3 = ("parallel.zero_stage=3",)
BUCKET = "disttrain-test"
KEY_ID, SECRET = "AKIDDISTTRAINTEST", "s3cr3t-n0t-in-any-file"  # moto takes any


class S3:
    """The module's S3 server: its endpoint in the environment (as users give it), a bucket, and s3fs to look."""

    def __init__(self, port: int):
        from moto.server import ThreadedMotoServer

        self.port = port
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": KEY_ID,
                    "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                    "DISTTRAIN_STORAGE_RETRIES": "1"}
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()

    def restart(self) -> None:
        """Stop and start again on the same port; moto keeps its objects in this process meanwhile."""
        from moto.server import ThreadedMotoServer

        self.server.stop()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    @property
    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True)

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join((BUCKET, *parts))

    def committed(self, prefix: str) -> list[str]:
        fs = self.fs
        listed = fs.ls(f"{BUCKET}/{prefix}") if fs.exists(f"{BUCKET}/{prefix}") else []
        return sorted(p.rsplit("/", 1)[1] for p in listed
                      if p.rsplit("/", 1)[1].startswith("step_") and fs.exists(f"{p}/COMMIT"))


@pytest.fixture(scope="module")
def s3():
    server = S3(free_ports())
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)  # the in-process checks (convert, a refused launch) reach it as workers do
    server.fs.mkdir(BUCKET)
    yield server
    server.server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def s3_train(s3: S3, run_dir: Path, *overrides: str, nproc: int | None = None, env: dict | None = None) -> Path:
    return train(run_dir, *overrides, nproc=nproc, env={**s3.env, **(env or {})})


def launch(s3: S3, run_dir: Path, *overrides: str, nproc: int | None = 2, env: dict | None = None,
           new_session: bool = False) -> subprocess.Popen:
    """`disttrain train` in the background, for a test that acts on it while it runs."""
    cmd = [sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={run_dir.parent}",
           f"run.name={run_dir.name}", "distributed.timeout_s=60", *overrides]
    return subprocess.Popen(cmd + (["--nproc-per-node", str(nproc)] if nproc else []), cwd=REPO,
                            env={**cli_env(), **s3.env, **(env or {})}, start_new_session=new_session,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 600, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(every)


@pytest.fixture(scope="module")
def prepared(s3, tmp_path_factory):
    """A prepare-data directory, locally and uploaded to the bucket: the training data of every run here."""
    from disttrain.cli import main

    root = tmp_path_factory.mktemp("data")
    (root / "corpus.txt").write_text("\n\n".join(" ".join(f"w{(d * 31 + i) % 101}" for i in range(60))
                                                  for d in range(120)))
    main(["prepare-data", str(root / "corpus.txt"), "--out", str(root / "prepared")])
    s3.fs.put(str(root / "prepared"), f"{BUCKET}/prepared", recursive=True)
    return root / "prepared", s3.url("prepared")


@pytest.fixture(scope="module")
def run_args(prepared):
    """The runs' settings, their data read from the bucket."""
    return (*RUN, f"data.source={prepared[1]}")


@pytest.fixture(scope="module")
def reference(s3, run_args, tmp_path_factory):
    """A 2-rank ZeRO-3 run checkpointing asynchronously to s3:// every 4 steps, keeping the last 2."""
    return s3_train(s3, tmp_path_factory.mktemp("s3") / "ref", *run_args, *ZERO3, f"checkpoint.dir={s3.url('ref')}",
                    "checkpoint.async=true", "checkpoint.keep_last=2", nproc=2)


def test_async_save_to_s3_records_blocking_time_and_keeps_the_last_two(s3, reference):
    started = events(reference, "checkpoint_started")
    assert [e["step"] for e in started] == [4, 8, 12]
    assert all(0 < e["blocking_s"] < 30 for e in started)  # what training waited for, recorded per save
    assert s3.committed("ref") == ["step_00000008", "step_00000012"]  # step 4 deleted after 12 committed
    fs = s3.fs
    record = json.loads(fs.cat(f"{BUCKET}/ref/step_00000012/COMMIT"))
    listed = {p.rsplit("/", 1)[1]: fs.size(p) for p in fs.find(f"{BUCKET}/ref/step_00000012")}
    assert {name: size for name, (size, _) in record["files"].items()} == \
        {k: v for k, v in listed.items() if k != "COMMIT"}  # every object there, COMMIT last and naming them
    written = [p for p in reference.rglob("*") if p.is_file()]  # config.yaml, metrics.jsonl, the ranks' logs
    assert {"config.yaml", "metrics.jsonl", "rank_00000.log"} <= {p.name for p in written}
    assert not [p for p in written if KEY_ID.encode() in p.read_bytes() or SECRET.encode() in p.read_bytes()]


def test_preempted_then_killed_launch_resumes_bitwise_and_a_lost_store_keeps_the_last(s3, reference, run_args,
                                                                                      tmp_path):
    """One run on s3:// through a scheduler's preemption and a store lost mid-save.

    1. While a launch lives (rank 1 stalled after step 5), a second launch from another directory (another
       machine) is refused.
    2. SIGTERM: rank 1 wakes, both ranks save the emergency checkpoint of step 5 to the store, committed. The
       launch is still winding down (rank 0 waits after its save) when the grace time ends: SIGKILL to its
       whole process tree, so its claim on the store is never released.
    3. The next launch is not blocked by that stale claim, resumes from step 5 on the store and matches the
       uninterrupted run bitwise. Its final save (async) loses the store after its data was written and before
       COMMIT: exit 74, one line naming the location, what failed and the newest complete checkpoint (step 8,
       written by this launch), which stays intact; no traceback (aiohttp's orphaned tasks stay quiet)."""
    from disttrain.checkpoint import lease
    from disttrain.cli import main

    url = s3.url("kill")
    common = [*run_args, *ZERO3, f"checkpoint.dir={url}"]
    stall = "sleep:rank=1:step=5:seconds=600;pause_after_save:rank=0:step=5:seconds=600"
    first = launch(s3, tmp_path / "a", *common, "distributed.timeout_s=300", new_session=True,
                   env={"DISTTRAIN_FAULT": stall})  # rank 0 waits for the stalled rank 1 until SIGTERM
    # A listing of the store costs this process (client and moto server) ~10 ms of CPU: every 0.5 s, where the
    # runs wait 600 s for the next step
    wait_for(first, lambda: s3.committed("kill"), every=0.5)
    assert first.poll() is None  # rank 1 stopped stepping after step 5: the launch lives and holds the run
    with pytest.raises(SystemExit) as exc:
        main(["train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=b", *common])
    assert exc.value.code == 2

    first.send_signal(signal.SIGTERM)  # the scheduler's notice, to the launcher: it passes it to the workers
    wait_for(first, lambda: "step_00000005" in s3.committed("kill"), every=0.5)
    os.killpg(first.pid, signal.SIGKILL)  # the grace time is over: launcher and workers
    first.communicate()
    run = tmp_path / "a"
    emergency = [e for e in events(run, "checkpoint_saved") if e["reason"] == "preemption"]
    assert [(e["step"], e["path"]) for e in emergency] == [(5, s3.url("kill", "step_00000005"))]
    stale = lease.read(url)
    assert stale is not None and not stale.released and stale.pid == first.pid  # left behind by the SIGKILL

    log = tmp_path / "fault.log"
    second = launch(s3, run, *common, "checkpoint.async=true", env={
        "DISTTRAIN_FAULT": "pause_after_save:rank=0:step=12:seconds=4", "DISTTRAIN_FAULT_LOG": str(log)})
    wait_for(second, log.is_file)
    s3.server.stop()
    try:
        _, err = second.communicate(timeout=180)
    finally:
        s3.restart()
    resumed = events(run, "resumed")
    assert [(e["step"], e["path"]) for e in resumed] == [(5, s3.url("kill", "step_00000005"))]
    assert losses(run) == losses(reference)  # bitwise, steps 6-12 from the emergency checkpoint
    assert second.returncode == 74, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"disttrain: stopped: checkpoint save of step 12 in {url} failed: "), err[-3000:]
    assert last.endswith(f"newest complete checkpoint: {s3.url('kill', 'step_00000008')}"), last
    assert "; the partial checkpoint is removed at the next start; " in last  # the store is gone: it cannot be now
    assert "Traceback" not in err, err[-3000:]
    assert s3.committed("kill") == ["step_00000004", "step_00000005", "step_00000008"]
    fs = s3.fs
    record = json.loads(fs.cat(f"{BUCKET}/kill/step_00000008/COMMIT"))
    assert all(fs.size(f"{BUCKET}/kill/step_00000008/{n}") == size for n, (size, _) in record["files"].items())


def test_refused_launch_says_who_holds_the_store(s3, capsys, tmp_path):
    """The one line of a launch refused by a live claim on the store (written as another host's launch)."""
    from disttrain.checkpoint import lease
    from disttrain.cli import main

    held, _ = lease.acquire(s3.url("held"), "slurm-job-7")
    try:
        with pytest.raises(SystemExit) as exc:
            main(["train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=x", f"checkpoint.dir={s3.url('held')}"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1, err
        assert f"{s3.url('held')} is being written by another launch (host {socket.gethostname()}, pid " in err
        assert not (tmp_path / "x").exists()  # nothing half-written
        url = lease.location(s3.url("held"))  # S3's conditional PUTs, as moto serves them:
        assert not lease.put(url, b"{}", None)  # a second create of the claim loses (If-None-Match)
        _, etag = lease.get(url)
        assert held.renew() and not lease.put(url, b"{}", etag)  # a rewrite from an outdated read loses
        assert lease.read(s3.url("held")).key == "slurm-job-7"
    finally:
        held.release()
    assert lease.read(s3.url("held")).released


@pytest.fixture
def tmpfs(tmp_path):
    """A 3 MB file system: one checkpoint of the debug model (about 1.8 MB) fits, two do not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:  # test_..._onto_a_disk_that_fills runs the same everywhere, its disk emulated
        pytest.skip(f"mounting a tmpfs is not allowed here ({done.stderr.strip()}): needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _resume_onto_a_full_disk(s3, reference, run_args, run_dir: Path, disk: Path, free_space, env: dict) -> None:
    """A resume on 1 process from the 2-rank checkpoint on the store matches within 1e-5, saving every step to
    `disk` (3 MB): step 9 fits; 10 and 11 fail with no space, each says so in one line, its partial directory
    goes, step 9 stays, and training continues; the final save fails the run. With space freed (`free_space()`;
    `env`: the first launch's) the relaunch resumes from step 9 and ends with the losses of the run that never
    stopped."""
    ckpt = disk / "ckpt"
    common = (*run_args, f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1")
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={run_dir.parent}", f"run.name={run_dir.name}",
                   "distributed.timeout_s=60", *common, f"checkpoint.resume={s3.url('ref', 'step_00000008')}",
                   check=False, env={**s3.env, **env})
    assert proc.returncode == 74, proc.stderr[-3000:]
    uninterrupted = losses(run_dir)
    assert_losses_close(uninterrupted, {s: v for s, v in losses(reference).items() if s > 8}, rel=1e-5)
    line = (f"checkpoint save of step {{0}} in {ckpt} failed: writing {ckpt}/step_{{0:08d}} (no space left on the "
            f"device); removed the partial checkpoint; newest complete checkpoint: {ckpt}/step_00000009")
    for step in (10, 11):
        assert f"warning: {line.format(step)}; training continues, the next checkpoint retries" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == f"disttrain: stopped: {line.format(12)}"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000009"] and (ckpt / "step_00000009" / "COMMIT").is_file()
    free_space()
    s3_train(s3, run_dir, *common)
    assert events(run_dir, "resumed")[-1]["step"] == 9
    assert losses(run_dir) == uninterrupted


def test_one_process_resumes_the_two_rank_s3_checkpoint_onto_a_full_disk(s3, reference, run_args, tmpfs, tmp_path):
    """_resume_onto_a_full_disk on a real 3 MB file system (a tmpfs, remounted at 32 MB to free space)."""
    _resume_onto_a_full_disk(s3, reference, run_args, tmp_path / "r", tmpfs, env={}, free_space=lambda: subprocess.run(
        ["mount", "-o", "remount,size=32m", str(tmpfs)], check=True))


FULL_DISK_HOOK = REPO / "tests" / "workers" / "full_disk"  # its sitecustomize.py


def test_one_process_resumes_the_two_rank_s3_checkpoint_onto_a_disk_that_fills(s3, reference, run_args, tmp_path):
    """_resume_onto_a_full_disk where no file system can be mounted too: the 3 MB disk is a directory whose writes
    (DCP's streams, the checkpoint's other files) fail with ENOSPC once its files hold 3 MB, written partly as a
    full disk leaves them (tests/workers/full_disk); the disk is not really full, so the failure is named from the
    error itself. The relaunch runs without the limit (space freed)."""
    disk = tmp_path / "disk"
    hook = os.pathsep.join(filter(None, [str(FULL_DISK_HOOK), os.environ.get("PYTHONPATH")]))
    _resume_onto_a_full_disk(s3, reference, run_args, tmp_path / "r", disk, free_space=lambda: None,
                             env={"PYTHONPATH": hook, "DISTTRAIN_TEST_FULL_DISK": f"{3 * 2 ** 20}:{disk}"})


def test_convert_reads_a_run_whose_checkpoints_are_remote(s3, reference, tmp_path):
    import torch

    from disttrain.cli import main

    main(["convert", s3.url("ref"), "--to", "torch", "--out", str(tmp_path / "remote.pt")])
    s3.fs.get(f"{BUCKET}/ref/step_00000012", str(tmp_path / "local" / "step_00000012"), recursive=True)
    main(["convert", str(tmp_path / "local" / "step_00000012"), "--to", "torch", "--out", str(tmp_path / "local.pt")])
    remote, local = (torch.load(tmp_path / f"{n}.pt", weights_only=True)["model"] for n in ("remote", "local"))
    assert remote.keys() == local.keys() and all(torch.equal(remote[k], local[k]) for k in local)


def test_prepared_data_reads_from_the_bucket_in_ranges(prepared, tmp_path):
    """The same windows as the local directory, mixtures included; read through ranged reads (and the cache)."""
    import numpy as np

    from disttrain.data.remote import RangeArray
    from disttrain.data.source import describe_source, load_samples

    local, url = prepared
    remote_info, local_info = describe_source(url, "byte"), describe_source(str(local), "byte")
    assert (remote_info.vocab_size, remote_info.eos_id) == (local_info.vocab_size, local_info.eos_id)
    _, remote_train, remote_val = load_samples(url, "byte", 64, cache_dir=str(tmp_path / "cache"))
    _, local_train, local_val = load_samples(str(local), "byte", 64)
    assert isinstance(remote_train.tokens, RangeArray) and len(remote_train) == len(local_train) > 8
    ids = np.array([len(local_train) - 1, 0, 5, 3])
    for a, b in zip(remote_train.batch(ids), local_train.batch(ids)):
        assert a.equal(b)
    assert np.array_equal(remote_val.tokens[:], np.asarray(local_val.tokens))
    assert any((tmp_path / "cache").iterdir())  # the ranges read are kept locally
    _, mixed, _ = load_samples({url: 1.0, str(local): 2.0}, "byte", 64)
    assert [len(p) for p in mixed.parts] == [len(local_train)] * 2


def test_a_missing_bucket_credentials_or_endpoint_is_refused_at_start(s3, monkeypatch, capsys, tmp_path):
    """One line naming the key and what to fix, exit 2, before anything is written."""
    from disttrain.core import storage
    from disttrain.cli import main

    def refused(url: str, **env) -> str:
        for key, value in env.items():
            monkeypatch.delenv(key, raising=False) if value is None else monkeypatch.setenv(key, value)
        storage._fs_for.cache_clear()  # a client picks up its environment when it is made
        try:
            with pytest.raises(SystemExit) as exc:
                main(["train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=x", f"checkpoint.dir={url}"])
        finally:
            monkeypatch.undo()
            storage._fs_for.cache_clear()
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and not (tmp_path / "x").exists(), err
        return err

    assert "no such bucket" in refused("s3://no-such-bucket/run")
    no_keys = refused(s3.url("run"), AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None, AWS_PROFILE=None,
                      AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                      AWS_EC2_METADATA_DISABLED="true")
    assert f"checkpoint.dir={s3.url('run')}: no credentials found" in no_keys
    assert "cannot reach the store at http://127.0.0.1:9" in refused(s3.url("run"),
                                                                      AWS_ENDPOINT_URL="http://127.0.0.1:9")
    assert KEY_ID not in no_keys and SECRET not in no_keys


def test_transient_store_errors_are_retried_with_backoff_and_others_are_not(monkeypatch):
    """A dropped connection or throttling is tried again after 0.5 s, then 1 s; no space or a missing object
    fails at once; the last transient error is raised when the retries run out."""
    from disttrain.core import storage

    waits = []
    monkeypatch.setattr(storage, "time", SimpleNamespace(sleep=waits.append))  # this module's clock only

    def flaky(errors):
        def call():
            if errors:
                raise errors.pop(0)
            return "done"
        return call

    throttled = OSError("An error occurred (SlowDown) when calling the PutObject operation: reduce your rate")
    assert storage.retried(flaky([ConnectionResetError("reset by peer"), throttled]), "writing x", 3) == "done"
    assert waits == [0.5, 1.0]
    for permanent in (OSError(28, "No space left on device"), FileNotFoundError("s3://b/missing")):
        with pytest.raises(type(permanent)):
            storage.retried(flaky([permanent]), "writing x", 3)
    assert waits == [0.5, 1.0]
    with pytest.raises(TimeoutError):
        storage.retried(flaky([TimeoutError("read timed out")] * 3), "reading x", 2)
    assert waits == [0.5, 1.0, 0.5, 1.0]
