"""Metric sinks with real processes: Prometheus scraped over HTTP from every rank, TensorBoard read back."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

import math

import pytest

from disttrain.models.registry import MODEL_SHAPES
from helpers import (DEBUG_CONFIG, REPO, cli_env, events, free_ports, load_checkpoint_state, losses, records, run_cli,
                     step_records, train, train_many)
from workers import clock


def _scrape(port: int) -> dict:
    return _samples(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode())


def _samples(text: str) -> dict:
    """Sample name -> sample; labelled families (phase, collective, kind) also under (name, label value)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = s
            for key in ("phase", "collective", "kind", "dp_rank"):
                if key in s.labels:
                    out[(s.name, s.labels[key])] = s
    return out


def test_every_rank_serves_prometheus_metrics_during_a_run(tmp_path):
    port = free_ports(2)  # one endpoint per rank
    # ScrapeProbe, a job of the loop after the metrics job, reads this rank's endpoint at each logged step
    cmd = [sys.executable, "-m", "disttrain", "train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run",
           "train.steps=100000", "metrics.log_every=5", f"metrics.prometheus_port={port}", "metrics.comm_profile_every=5",
           "checkpoint.save_final=false", "distributed.timeout_s=60", "train.micro_batch_size=1",
           "parallel.balance_weights=[3,1]", f"train.callbacks=[{REPO}/tests/workers/probes.py:ScrapeProbe]",
           "--nproc-per-node", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        scraped = {}
        deadline = time.monotonic() + 600  # waits for a state only: generous for a loaded machine
        while time.monotonic() < deadline and len(scraped) < 2 and proc.poll() is None:
            for rank in (0, 1):
                try:
                    samples = _scrape(port + rank)
                except OSError:
                    continue
                if samples.get("disttrain_steps_total") and samples["disttrain_steps_total"].value >= 10 \
                        and ("disttrain_collective_seconds", "all_reduce") in samples:
                    scraped[rank] = samples
            time.sleep(0.5)
        assert len(scraped) == 2, (f"not both ranks served metrics: {sorted(scraped)}, the launch "
                                   f"{'exited ' + str(proc.returncode) if proc.poll() is not None else 'running'}"
                                   f"\n{proc.stderr.read().decode()[-3000:] if proc.poll() is not None else ''}")
        for rank, samples in scraped.items():
            assert samples["disttrain_tokens_per_second"].labels == {"rank": str(rank)}
            assert samples["disttrain_tokens_per_second"].value > 100
            assert 0 < samples["disttrain_loss"].value < 10
            assert samples["disttrain_memory_peak_bytes"].value > 1e6
            assert samples["disttrain_step_seconds_count"].value >= 10  # the histogram saw every step
            assert samples["disttrain_step_seconds_sum"].value > 0
            # per-rank step breakdown, communication per collective kind (profiled steps), memory
            for phase in ("data", "forward", "backward", "comm_exposed", "optimizer"):
                sample = samples[("disttrain_step_phase_seconds", phase)]
                assert sample.labels == {"rank": str(rank), "phase": phase} and sample.value >= 0
            assert samples[("disttrain_step_phase_seconds", "forward")].value > 0
            assert samples[("disttrain_collective_seconds", "all_reduce")].value > 0
            assert samples[("disttrain_memory_bytes", "rss")].value > 1e6
            assert samples["disttrain_slowest_rank"].value in (0, 1)
            # uneven shares: micro-batches per data-parallel rank, as configured
            assert [samples[("disttrain_balance_share_microbatches", str(r))].value for r in (0, 1)] == [3, 1]
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    # SIGTERM to the launcher reached the workers through torchrun: they agreed, saved and committed.
    preempted = events(tmp_path / "run", "preempted")
    assert len(preempted) == 1, proc.stderr.read().decode()[-2000:]
    assert (tmp_path / "run" / "checkpoints" / f"step_{preempted[0]['step']:08d}" / "COMMIT").is_file()
    _assert_served_values_are_the_records(tmp_path / "run")


# metrics.jsonl key -> the gauge serving it; GLOBAL: the keys whose value is the same on every rank (the rest are
# this rank's own: its throughput over its own window, its phases and collectives, its memory)
SERVED = {"step": "disttrain_step", "loss": "disttrain_loss", "lr": "disttrain_learning_rate",
          "grad_norm": "disttrain_grad_norm", "tokens_per_sec": "disttrain_tokens_per_second",
          "mem_peak_bytes": "disttrain_memory_peak_bytes", "rank_compute_max_s": "disttrain_rank_compute_seconds",
          "slowest_rank": "disttrain_slowest_rank", "mfu": "disttrain_mfu_ratio"}
GLOBAL = {"step", "loss", "lr", "grad_norm", "mem_peak_bytes", "rank_compute_max_s", "slowest_rank", "balance_shares"}


def _served(record: dict) -> dict:
    """What an endpoint serves for a step record: sample key (a name, or (name, label value)) -> value, per key."""
    out = {}
    for key, value in record.items():
        if key in SERVED:
            out[key] = (SERVED[key], value)
        elif key.startswith("time_") and key.endswith("_s"):
            out[key] = (("disttrain_step_phase_seconds", key[5:-2]), value)
        elif key.startswith("comm_") and key.endswith("_s") and key != "comm_time_s":
            out[key] = (("disttrain_collective_seconds", key[5:-2]), value)
        elif key in ("mem_allocated_bytes", "mem_reserved_bytes", "mem_rank_peak_bytes", "mem_rss_bytes"):
            out[key] = (("disttrain_memory_bytes", key[4:-6]), value)
        elif key == "balance_shares":
            for dp_rank, share in enumerate(value):
                out[f"{key}[{dp_rank}]"] = (("disttrain_balance_share_microbatches", str(dp_rank)), share)
    return out


def _assert_served_values_are_the_records(run):
    """At each logged step, after the metrics job fed every sink, each rank read its own endpoint (ScrapeProbe):
    rank 0 served exactly the values of that step's metrics.jsonl record, every one it serves (Prometheus' text
    carries a float's shortest repr: equal, not close); rank 1 the same for the numbers common to every rank; and
    both counted every step so far (steps counter, step-time histogram)."""
    logged = step_records(run)
    steps = sorted(int(p.name.split(".step")[1][:-4]) for p in run.glob("scrape.rank0.step*.txt"))
    assert steps[:2] == [5, 10] and set(steps) <= set(logged), (steps, sorted(logged))
    for step in steps:
        record = logged[step]
        assert any(k.startswith("comm_") for k in record) and "balance_shares" in record  # profiled, uneven
        for rank in (0, 1):  # (a preemption stops both ranks at the step boundary, after the probe)
            samples = _samples((run / f"scrape.rank{rank}.step{step}.txt").read_text())
            expected = {k: v for k, v in _served(record).items() if rank == 0 or k.split("[")[0] in GLOBAL}
            served = {k: samples[name].value for k, (name, _) in expected.items()}
            assert served == {k: value for k, (_, value) in expected.items()}, (rank, step)
            assert samples["disttrain_steps_total"].value == samples["disttrain_step_seconds_count"].value == step
            if rank == 0:  # and nothing more: no collective kind left from an earlier profile
                kinds = {k[1] for k in samples if isinstance(k, tuple) and k[0] == "disttrain_collective_seconds"}
                assert kinds == {k[5:-2] for k in record if k.startswith("comm_") and k != "comm_time_s"}, kinds


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One run logging to every sink at once: TensorBoard, MLflow's file store and W&B offline."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the sink sets for itself; MLflow's client reads it too
        yield train(tmp_path_factory.mktemp("tracked") / "run", "train.steps=6", "train.eval_every=3",
                    "metrics.tensorboard=true", "metrics.peak_tflops=0.5", "metrics.mlflow=true", "metrics.wandb=true",
                    env={"WANDB_SILENT": "true"})


def test_tensorboard_scalars_read_back(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tracked_run
    # MFU: PaLM's 6N + 12·L·H·Q·T per token (N without the input embedding lookup) over the peak.
    shape = MODEL_SHAPES["debug"]
    per_token = 6 * (shape.num_params() - shape.vocab_size * shape.dim) + 12 * shape.n_layers * shape.dim * 64
    steps = [r for r in records(run) if "event" not in r]
    assert len(steps) == 6
    for record in steps:
        assert record["mfu"] == pytest_approx(per_token * record["tokens_per_sec"] / 0.5e12)
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


def test_desynchronised_replica_is_named_and_stops_the_run(tmp_path):
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run", "train.steps=20",
                   "metrics.sync_check_every=2", "distributed.timeout_s=60", nproc=2, check=False,
                   env={"DISTTRAIN_FAULT": "desync:rank=1:step=3"})
    assert proc.returncode != 0
    assert ("disttrain: stopped: data-parallel replicas differ after step 4 in 1 parameter(s): "
            "tok_embeddings.weight") in proc.stderr
    assert max(losses(tmp_path / "run")) == 3  # stopped by the check after step 4, before step 4 was logged


def _bitwise_equal(a, b) -> bool:
    import torch

    if not isinstance(a, torch.Tensor):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("policy", ["stop", "skip_step"])
def test_nonfinite_loss_policy(policy, tmp_path):
    saves = ("checkpoint.every_steps=1",) if policy == "skip_step" else ()  # the state after each step
    proc = run_cli("train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", "run.name=run", "train.steps=6",
                   f"metrics.nonfinite={policy}", *saves, check=False, env={"DISTTRAIN_FAULT": "nan:rank=0:step=3"})
    run = tmp_path / "run"
    if policy == "stop":
        assert proc.returncode == 3
        assert proc.stderr.strip().splitlines()[-1].startswith("disttrain: stopped: non-finite gradient norm at step 3")
        assert max(losses(run)) == 2
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert [e["step"] for e in events(run, "nonfinite_step_skipped")] == [3]
        curve = losses(run)
        assert all(math.isfinite(curve[s]) for s in (1, 2, 4, 5, 6)) and math.isnan(curve[3])
        # The skipped update left the parameters as they were: step 4 trains on what step 2 produced.
        assert curve[6] < curve[1]
        saved = {s: load_checkpoint_state(run / "checkpoints" / f"step_{s:08d}") for s in (2, 3, 4)}
        # bit for bit: the model and Adam's moments and step count after step 3 are those after step 2
        for part in ("model", "optim"):
            before = saved[2][part] if part == "model" else saved[2][part]["state"]
            after = saved[3][part] if part == "model" else saved[3][part]["state"]
            assert before.keys() == after.keys()
            for name in before:
                if part == "model":
                    assert _bitwise_equal(after[name], before[name]), name
                else:
                    assert before[name].keys() == after[name].keys()
                    assert all(_bitwise_equal(after[name][k], before[name][k]) for k in before[name]), name
        # and step 4's update, on finite gradients again, moved every parameter
        changed = [n for n in saved[3]["model"] if not saved[4]["model"][n].equal(saved[3]["model"][n])]
        assert changed == list(saved[3]["model"]), sorted(set(saved[3]["model"]) - set(changed))


# Rank 1's sleep before each forward in the straggler test. The report compares the ranks' own (data + forward)
# seconds, and the machine's load delays rank 0's alone by a noise of its own: a 0.2 s sleep, held to a 0.1 s gap,
# failed when a loaded suite (its forwards took over 0.2 s) delayed rank 0 by more than 0.1 s. At 0.5 s the gap
# holds unless rank 0 is held up 0.25 s more than rank 1 in one step's data and forward, a few ms on an idle machine.
STRAGGLER_SLEEP = 0.5


def test_straggler_report_names_the_slow_rank(tmp_path):
    run = train(tmp_path / "run", "train.steps=6", nproc=2,
                env={"DISTTRAIN_FAULT": f"slow:rank=1:step=0:seconds={STRAGGLER_SLEEP}"})
    # Step 2 is left out: DDP rebuilds its gradient buckets in the second forward with a broadcast,
    # so there rank 0 waits for rank 1 inside forward and both look equally slow.
    rows = [r for r in records(run) if "loss" in r and r["step"] != 2]
    assert len(rows) == 5
    # Rank 1 does rank 0's work plus its sleep, which its measured time holds whole (>= the sleep, exactly); the
    # work itself took over 0.2 s in a heavily loaded suite, so the fast rank is held to the gap (half the sleep),
    # not to an absolute time.
    assert all(r["slowest_rank"] == 1 and r["rank_compute_max_s"] >= STRAGGLER_SLEEP and
               r["rank_compute_max_s"] - r["rank_compute_min_s"] > STRAGGLER_SLEEP / 2 for r in rows), rows


def test_step_breakdown_adds_up_to_the_step_time(tmp_path):
    """data + forward + backward + exposed communication + optimizer, each measured on its own,
    account for the time of the step (median over steps; what is left is the loop's own
    bookkeeping). The exposed part is the wait for DDP's last all-reduce after backward compute.

    Timed on the ranks' CPU time (tests/workers/clock.py swaps the clock every timer of the run reads, the same
    code measuring): on wall time a loaded machine that kept a rank from a core between two phases charged the
    step for it (measured: one step in eight left 15% unaccounted, at load 8 to 11 on 2 cores), which no part holds.
    The CPU clock leaves out such waits, and with them the time a rank waits for the other in a collective;
    it still counts the exposed all-reduce, which gloo's threads compute while backward waits for them."""
    import statistics

    run = tmp_path / "run"
    train_many({"cpu clock": clock.job("cpu"),
                "run": (run, ("model.name=tiny", "data.seq_len=128", "train.global_batch_size=8",
                              "train.micro_batch_size=2", "train.steps=8", "metrics.comm_profile_every=0")),
                "wall clock": clock.job("wall")}, nproc=2)
    steps = [r for r in records(run) if "event" not in r and r["step"] > 1]
    parts = ("data", "forward", "backward", "comm_exposed", "optimizer")
    ratios = []
    for r in steps:
        assert all(r[f"time_{p}_s"] >= 0 for p in parts) and r["time_forward_s"] > 0 and r["time_backward_s"] > 0
        assert r["time_comm_exposed_s"] > 0  # DDP's last all-reduce is waited for after backward compute
        ratios.append(sum(r[f"time_{p}_s"] for p in parts) / r["step_time_s"])
    assert 0.9 <= statistics.median(ratios) <= 1.0 + 1e-6, ratios

    # The same run directory makes a report: every plot a DDP run can have, a page holding them,
    # and a summary whose numbers come from metrics.jsonl.
    proc = run_cli("report", str(run))
    report = run / "report"
    expected = {"loss.png", "lr.png", "grad_norm.png", "throughput.png", "step_breakdown.png", "memory.png",
                "rank_step_time.png"}
    assert expected <= {p.name for p in report.glob("*.png")}
    assert all((report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in expected)
    page = (report / "index.html").read_text()
    assert all(f'src="{name}"' in page for name in expected)
    every = [r for r in records(run) if "event" not in r]
    median_tps = statistics.median(r["tokens_per_sec"] for r in every)
    assert "tokens/s (median)" in proc.stdout and f"{median_tps:,.0f}" in proc.stdout


def test_fp16_overflows_are_counted(tmp_path):
    """fp16 autocast with dynamic loss scaling: an injected inf/NaN gradient is an overflow step
    (the GradScaler skips it and lowers the scale); the count and the scale are logged."""
    run = train(tmp_path / "run", "train.steps=5", "precision.compute_dtype=fp16",
                env={"DISTTRAIN_FAULT": "nan:rank=0:step=3"})
    steps = {r["step"]: r for r in records(run) if "event" not in r}
    assert [steps[s]["fp16_overflows_total"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert steps[3]["loss_scale"] < steps[2]["loss_scale"]


def _wandb_offline_file(run_dir):
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0].read_bytes()


def test_mlflow_and_wandb_trackers_log_offline(tracked_run):
    """The real packages, offline: MLflow's file store under the run directory (read back with its own
    client), W&B's offline run file (its records carry the logged keys and the config)."""
    from mlflow.tracking import MlflowClient

    run = tracked_run
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    [logged_run] = client.search_runs([client.get_experiment_by_name("disttrain").experiment_id])
    assert logged_run.info.run_name == "run" and logged_run.info.status == "FINISHED"
    assert logged_run.data.params["model.name"] == "debug"
    history = {m.step: m.value for m in client.get_metric_history(logged_run.info.run_id, "loss")}
    assert history == pytest_approx_dict(losses(run))
    assert [m.step for m in client.get_metric_history(logged_run.info.run_id, "eval_loss")] == [3, 6]
    data = _wandb_offline_file(run)
    for key in (b"train/loss", b"train/tokens_per_sec", b"eval/loss", b'"debug"'):
        assert key in data, key


def pytest_approx_dict(d):
    import pytest

    return {k: pytest.approx(v, rel=1e-9) for k, v in d.items()}


def test_tracker_without_its_package_is_one_line(tmp_path, monkeypatch):
    """A package hidden from the import system (as if not installed) is refused in one line."""
    import importlib.util

    from disttrain.config.load import load_config
    from disttrain.core.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match="metrics.wandb=true needs the wandb package"):
        load_config(DEBUG_CONFIG, [f"run.dir={tmp_path}", "metrics.wandb=true"])


def test_bench_scaling_table_and_plot(tmp_path):
    """1 and 2 processes at a fixed per-rank batch: speedup and efficiency follow from the two runs'
    own metrics (on 2 shared cores the value itself says little; docs/benchmarks/scaling.md)."""
    import json as _json
    import statistics

    out = tmp_path / "scaling"
    proc = run_cli("bench", "scaling", str(DEBUG_CONFIG), "--max-procs", "2", "--steps", "10", "--out", str(out),
                   "--json")
    rows = _json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["procs"] for r in rows] == [1, 2]
    tps, tokens_per_step = {}, {}
    for n in (1, 2):
        recs = [r for r in records(out / f"procs_{n}") if "event" not in r]
        assert len(recs) == 10
        tokens_per_step[n] = recs[0]["tokens_seen"]
        tps[n] = statistics.median(r["tokens_per_sec"] for r in recs if r["step"] > 5)
    assert tokens_per_step[2] == 2 * tokens_per_step[1]  # weak scaling: the per-rank batch is fixed
    assert rows[1]["speedup"] == pytest.approx(tps[2] / tps[1])
    assert rows[1]["efficiency"] == pytest.approx(tps[2] / tps[1] / 2)
    assert (out / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert "efficiency" in proc.stdout


def test_profiler_read_out_equals_the_profilers_event_tree():
    """The periodic sample reads kineto's raw records (fast) instead of building `events()`: the same
    durations per op name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from disttrain.observe.breakdown import _records

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            (a @ b).relu().sum()
    raw: dict[str, float] = {}
    for name, seconds, kernel in _records(prof):
        raw[name] = raw.get(name, 0.0) + seconds
        assert not kernel
    tree: dict[str, float] = {}
    for event in prof.events():
        tree[event.name] = tree.get(event.name, 0.0) + event.cpu_time_total / 1e6
    assert raw.keys() >= {"aten::mm", "aten::relu", "aten::sum"}
    for name in ("aten::mm", "aten::relu", "aten::sum"):
        assert raw[name] == pytest.approx(tree[name], rel=1e-6, abs=1e-9), name
