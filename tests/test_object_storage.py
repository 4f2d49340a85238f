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

import pytest

from helpers import DEBUG_CONFIG, REPO, assert_losses_close, cli_env, events, losses, train

RUN = ("train.steps=12", "train.global_batch_size=4", "train.micro_batch_size=1", "checkpoint.every_steps=4",
       "metrics.comm_profile_every=0")
ZERO3 = ("parallel.zero_stage=3",)
BUCKET = "disttrain-test"


class S3:
    """The module's S3 server: its endpoint in the environment (as users give it), a bucket, and s3fs to look."""

    def __init__(self, port: int):
        from moto.server import ThreadedMotoServer

        self.port = port
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    server = S3(_free_port())
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


@pytest.fixture(scope="module")
def reference(s3, tmp_path_factory):
    """A 2-rank ZeRO-3 run checkpointing asynchronously to s3:// every 4 steps, keeping the last 2."""
    run = s3_train(s3, tmp_path_factory.mktemp("s3") / "ref", *RUN, *ZERO3, f"checkpoint.dir={s3.url('ref')}",
                   "checkpoint.async=true", "checkpoint.keep_last=2", nproc=2)
    return run


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
    assert "testing" not in (reference / "config.yaml").read_text()  # credentials stay in the environment
    assert "testing" not in (reference / "metrics.jsonl").read_text()


def test_a_killed_run_resumes_bitwise_and_one_launch_writes_at_a_time(s3, reference, tmp_path):
    """A launch on s3:// is SIGKILLed (its whole process tree) after its first checkpoint; a second launch from
    another directory (another machine) is refused while the first lives; after the kill the next launch is not
    blocked by the stale claim, resumes from the newest checkpoint on the store, and matches bitwise."""
    from disttrain.cli import main

    common = [*RUN, *ZERO3, f"checkpoint.dir={s3.url('kill')}", "distributed.timeout_s=60"]
    first = subprocess.Popen([sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={tmp_path}",
                              "run.name=a", *common, "--nproc-per-node", "2"], cwd=REPO, start_new_session=True,
                             env={**cli_env(), **s3.env, "DISTTRAIN_FAULT": "sleep:rank=0:step=5:seconds=600"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not s3.committed("kill"):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    assert first.poll() is None  # rank 0 stopped stepping after step 5: the launch lives and holds the run
    with pytest.raises(SystemExit) as exc:
        main(["train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=b", *common])
    assert exc.value.code == 2
    os.killpg(first.pid, signal.SIGKILL)  # launcher, agent and workers: a node lost
    first.wait()
    run = s3_train(s3, tmp_path / "a", *common, nproc=2)
    resumed = events(run, "resumed")
    assert resumed and resumed[-1]["path"].startswith(s3.url("kill", "step_"))
    after = {s: v for s, v in losses(run).items() if s > resumed[-1]["step"]}
    assert after == {s: v for s, v in losses(reference).items() if s > resumed[-1]["step"]}  # bitwise


def test_refused_launch_says_who_holds_the_store(s3, capsys, tmp_path):
    """The one line of a launch refused by a live claim on the store (written as another host's launch)."""
    from disttrain.checkpoint import store_lease
    from disttrain.cli import main

    held, _ = store_lease.acquire(s3.url("held"), "slurm-job-7")
    try:
        with pytest.raises(SystemExit) as exc:
            main(["train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=x", f"checkpoint.dir={s3.url('held')}"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1, err
        assert f"{s3.url('held')} is being written by another launch (host {socket.gethostname()}, pid " in err
        assert not (tmp_path / "x").exists()  # nothing half-written
        url = store_lease.location(s3.url("held"))  # S3's conditional PUTs, as moto serves them:
        assert not store_lease._put(url, b"{}", None)  # a second create of the claim loses (If-None-Match)
        _, etag = store_lease._get(url)
        assert held.renew() and not store_lease._put(url, b"{}", etag)  # a rewrite from an outdated read loses
        assert store_lease.read(s3.url("held")).key == "slurm-job-7"
    finally:
        held.release()
    assert store_lease.read(s3.url("held")).released


def test_resume_on_one_process_from_the_two_rank_s3_checkpoint_and_convert_it(s3, reference, tmp_path):
    run = s3_train(s3, tmp_path / "one", *RUN, f"checkpoint.resume={s3.url('ref', 'step_00000008')}")
    expected = {s: v for s, v in losses(reference).items() if s > 8}
    assert_losses_close(losses(run), expected, rel=1e-5)  # same global batches; reduction order differs
    import torch

    from disttrain.cli import main

    main(["convert", s3.url("ref"), "--to", "torch", "--out", str(tmp_path / "remote.pt")])
    s3.fs.get(f"{BUCKET}/ref/step_00000012", str(tmp_path / "local" / "step_00000012"), recursive=True)
    main(["convert", str(tmp_path / "local" / "step_00000012"), "--to", "torch", "--out", str(tmp_path / "local.pt")])
    remote, local = (torch.load(tmp_path / f"{n}.pt", weights_only=True)["model"] for n in ("remote", "local"))
    assert remote.keys() == local.keys() and all(torch.equal(remote[k], local[k]) for k in local)


@pytest.fixture(scope="module")
def prepared(s3, tmp_path_factory):
    """A prepare-data directory, locally and uploaded to the bucket."""
    from disttrain.cli import main

    root = tmp_path_factory.mktemp("data")
    (root / "corpus.txt").write_text("\n\n".join(" ".join(f"w{(d * 31 + i) % 101}" for i in range(60))
                                                  for d in range(120)))
    main(["prepare-data", str(root / "corpus.txt"), "--out", str(root / "prepared")])
    s3.fs.put(str(root / "prepared"), f"{BUCKET}/prepared", recursive=True)
    return root / "prepared", s3.url("prepared")


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


def test_store_lost_mid_save_keeps_the_previous_checkpoint_and_says_so(s3, prepared, tmp_path):
    """The store goes away after step 8's data was written and before its COMMIT (the final save): the run fails
    with one line naming the location, what failed and the newest complete checkpoint; step 4 stays intact.
    The run reads its data from the bucket too (a mixture of the bucket's and the local copy)."""
    log = tmp_path / "fault.log"
    local, url = prepared
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={tmp_path}",
                             "run.name=r", "train.steps=8", "checkpoint.every_steps=4", "checkpoint.async=true",
                             f"checkpoint.dir={s3.url('lost')}", "metrics.comm_profile_every=0",
                             f"data.source={{{url}: 1, {local}: 1}}", f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO,
                            env={**cli_env(), **s3.env, "DISTTRAIN_FAULT": "pause_after_save:rank=0:step=8:seconds=4",
                                 "DISTTRAIN_FAULT_LOG": str(log)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not log.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    s3.server.stop()
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        s3.restart()
    assert proc.returncode == 74, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"disttrain: stopped: checkpoint save of step 8 in {s3.url('lost')} failed: "), err[-3000:]
    assert last.endswith(f"newest complete checkpoint: {s3.url('lost', 'step_00000004')}"), last
    assert "Traceback" not in err, err[-3000:]
    assert s3.committed("lost") == ["step_00000004"]
    fs = s3.fs
    record = json.loads(fs.cat(f"{BUCKET}/lost/step_00000004/COMMIT"))
    assert all(fs.size(f"{BUCKET}/lost/step_00000004/{n}") == size for n, (size, _) in record["files"].items())


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not allowed here ({done.stderr.strip()}): needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_removes_the_partial_checkpoint_and_the_relaunch_finishes(reference, tmpfs, tmp_path):
    """3 MB holds one checkpoint of the debug model (about 1.8 MB on 2 ranks), not two: steps 8 and 12 fail with
    no space; each says so in one line, its partial directory goes, step 4 stays; training continues through
    step 8's failure and the run fails at the final save. With space freed the relaunch resumes from step 4 and
    ends with the uninterrupted run's losses."""
    ckpt = tmpfs / "ckpt"
    common = (*RUN, *ZERO3, f"checkpoint.dir={ckpt}")
    env = {**cli_env()}
    proc = subprocess.run([sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={tmp_path}",
                           "run.name=r", "distributed.timeout_s=60", *common, "--nproc-per-node", "2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 74, proc.stderr[-3000:]
    line = (f"checkpoint save of step {{}} in {ckpt} failed: writing {ckpt}/step_{{:08d}} (no space left on the "
            f"device); removed the partial checkpoint; newest complete checkpoint: {ckpt}/step_00000004")
    assert f"warning: {line.format(8, 8)}; training continues, the next checkpoint retries" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == f"disttrain: stopped: {line.format(12, 12)}"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000004"] and (ckpt / "step_00000004" / "COMMIT").is_file()
    run = tmp_path / "r"
    assert losses(run) == losses(reference)  # training went on through the failed interval save
    subprocess.run(["mount", "-o", "remount,size=32m", str(tmpfs)], check=True)
    train(run, *common, nproc=2)
    assert events(run, "resumed")[-1]["step"] == 4
    assert losses(run) == losses(reference)


def test_a_missing_bucket_credentials_or_endpoint_is_refused_at_start(s3, monkeypatch, capsys, tmp_path):
    """One line naming the key and what to fix, exit 2, before anything is written."""
    from disttrain.checkpoint import storage
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
    assert "testing" not in no_keys
