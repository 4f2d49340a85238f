"""Metric sinks with real processes: Prometheus scraped over HTTP from every rank, TensorBoard read back."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from helpers import DEBUG_CONFIG, REPO, cli_env, events, losses, train


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", 0))
                port = a.getsockname()[1]
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    return {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_rank_serves_prometheus_metrics_during_a_run(tmp_path):
    port = _free_port_pair()
    cmd = [sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run",
           "train.steps=100000", "metrics.log_every=5", f"metrics.prometheus_port={port}",
           "checkpoint.save_final=false", "distributed.timeout_s=60", "--nproc-per-node", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        scraped = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(scraped) < 2:
            for rank in (0, 1):
                try:
                    samples = _scrape(port + rank)
                except OSError:
                    continue
                if samples.get("disttrain_steps_total") and samples["disttrain_steps_total"].value >= 10 \
                        and "disttrain_tokens_per_second" in samples:
                    scraped[rank] = samples
            time.sleep(0.5)
        assert len(scraped) == 2, f"not both ranks served metrics: {sorted(scraped)}"
        for rank, samples in scraped.items():
            assert samples["disttrain_tokens_per_second"].labels == {"rank": str(rank)}
            assert samples["disttrain_tokens_per_second"].value > 100
            assert 0 < samples["disttrain_loss"].value < 10
            assert samples["disttrain_memory_peak_bytes"].value > 1e6
            assert samples["disttrain_step_seconds_count"].value >= 10  # the histogram saw every step
            assert samples["disttrain_step_seconds_sum"].value > 0
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    # SIGTERM to the launcher reached the workers through torchrun: they agreed, saved and committed.
    preempted = events(tmp_path / "run", "preempted")
    assert len(preempted) == 1, proc.stderr.read().decode()[-2000:]
    assert (tmp_path / "run" / "checkpoints" / f"step_{preempted[0]['step']:08d}" / "COMMIT").is_file()


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(tmp_path / "run", "train.steps=6", "train.eval_every=3", "metrics.tensorboard=true")
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "eval/loss"} <= set(tags)
    logged = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert logged == {s: pytest_approx(v) for s, v in losses(run).items()}
    assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6]


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-6)  # TensorBoard stores float32
