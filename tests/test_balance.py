"""Uneven data-parallel shares (heterogeneous clusters): the same losses and parameters as one process
whatever the split, fixed weights and measured re-splits, recorded and resumed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disttrain.data.loader import DistributedBatchLoader, TokenWindows
from disttrain.data.sampling import GlobalBatchSampler
from disttrain.layout.splits import balance_shares
from helpers import LR, PARITY, assert_parity, events, records, train, train_many
from workers import fault_env

MICRO = ("train.micro_batch_size=1",)  # 4 micro-batches of the global batch of 4
# A straggler: rank 1 sleeps before each forward, inside the forward time the balancer measures. Re-splitting 4
# micro-batches [2, 2] -> [3, 1] needs rank 1 at least 5/3 as slow per micro-batch as rank 0 (balance_shares), i.e.
# (its forward + SLEEP) / rank 0's forward >= 5/3: a forward of this model takes a few ms, but the machine's load
# stretches it (40 ms forwards measured on a loaded machine, where +20 ms, then +60 ms, left too small a margin). At
# 250 ms the split is [3, 1] unless rank 0's forwards average over 150 ms, 30x an idle machine's. Only the runs of
# `parallel.balance=auto` sleep that long (35 forwards of rank 1: 9 s, mostly waited, not computed); the fixed-weight
# ZeRO-3 run keeps a straggler of 60 ms, to show that fixed weights do not move whatever the speed.
SLEEP = 0.25
SLOW_RANK_1 = f"slow:rank=1:step=0:seconds={SLEEP}"


@pytest.mark.parametrize("total,weights,expected", [
    (4, [3, 1], [3, 1]), (8, [1, 1], [4, 4]), (8, [2, 1, 1], [4, 2, 2]), (7, [1, 1], [4, 3]),
    (4, [1e-6, 1, 1, 1], [1, 1, 1, 1]), (16, [312, 312, 125, 125], [6, 6, 2, 2]), (10, [0.2, 0.3, 0.5], [2, 3, 5]),
])
def test_shares_are_proportional_whole_and_at_least_one(total, weights, expected):
    assert balance_shares(total, weights) == expected


def test_shares_stay_close_to_the_ideal_split():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        total = int(rng.integers(n, 64))
        weights = list(rng.uniform(0.05, 5, n))
        shares = balance_shares(total, weights)
        ideal = [total * w / sum(weights) for w in weights]
        assert sum(shares) == total and min(shares) >= 1
        assert all(abs(s - i) < 1 or s == 1 for s, i in zip(shares, ideal)), (shares, ideal)


@pytest.mark.parametrize("shares", [[3, 1], [1, 3], [2, 2], [1, 1, 1, 5]])
def test_uneven_slices_cover_the_global_batch_in_order(shares):
    windows = TokenWindows(np.arange(10_000, dtype=np.uint16) % 256, seq_len=16)
    sampler = GlobalBatchSampler(len(windows), 8 if len(shares) == 4 else 4, seed=3)
    mbs = sampler.global_batch_size // sum(shares)
    for step in (1, 5):
        whole = windows.batch(sampler.indices(step))[0]
        parts = [x for r in range(len(shares))
                 for x, _ in DistributedBatchLoader(windows, sampler, r, len(shares), mbs, shares).micro_batches(step)]
        assert [len(p) for p in parts] == [mbs] * sum(shares)
        assert torch.equal(torch.cat(parts), whole)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One launch of 2 processes: fixed weights under DDP, ZeRO-2 and ZeRO-3 (rank 1 slowed by 60 ms), and, with
    rank 1 slowed by SLEEP, `auto` (re-split every 5 steps) saved at step 10 and resumed from there."""
    root = tmp_path_factory.mktemp("balance2")
    auto = ("parallel.zero_stage=3", "parallel.balance=auto", "parallel.balance_every=5")
    return train_many({
        "ddp 3:1": (root / "ddp", (*PARITY, *MICRO, "parallel.balance_weights=[3,1]")),
        "zero2 1:3": (root / "zero2", (*PARITY, *MICRO, "parallel.zero_stage=2", "parallel.balance_weights=[1,3]")),
        "slow 60 ms": fault_env.job("slow:rank=1:step=0:seconds=0.06"),
        "zero3 3:1": (root / "zero3", (*PARITY, *MICRO, "parallel.zero_stage=3", "parallel.balance_weights=[3,1]",
                                       "train.eval_every=10")),
        "slow": fault_env.job(SLOW_RANK_1),
        "auto": (root / "auto", (*PARITY, *MICRO, *auto, "checkpoint.every_steps=10")),
        "auto resumed": (root / "resumed", (*PARITY, *MICRO, *auto,
                                            f"checkpoint.resume={root / 'auto' / 'checkpoints' / 'step_00000010'}")),
    }, nproc=2)


@pytest.mark.parametrize("layout", ["ddp 3:1", "zero2 1:3", "zero3 3:1", "auto"])
def test_two_rank_uneven_shares_match_single_process(layout, two_rank_runs, debug_reference):
    assert_parity(two_rank_runs[layout], debug_reference)


def test_fixed_weights_are_logged(two_rank_runs):
    run = two_rank_runs["zero3 3:1"]
    assert events(run, "balance")[0]["shares"] == [3, 1]
    assert {tuple(r["balance_shares"]) for r in records(run) if "balance_shares" in r} == {(3, 1)}
    assert not events(run, "rebalance")
    assert [e["step"] for e in events(run, "eval")] == [10, 20]  # evaluation under uneven shares


def test_report_shows_the_splits(two_rank_runs, tmp_path):
    from disttrain.observe.run_report import load_records, summary

    rows = dict(summary(*load_records(two_rank_runs["auto"])))
    assert rows["micro-batches per data-parallel rank"].startswith("[2, 2] -> [3, 1] (")
    assert "step 5: [3, 1]" in rows["micro-batches per data-parallel rank"]


def test_auto_moves_work_off_the_slow_rank(two_rank_runs):
    """Rank 1 sleeps SLEEP per forward: at the first re-split (step 5) it gives micro-batches to rank 0, the split
    computed from the measured seconds per micro-batch (the same on every rank)."""
    run = two_rank_runs["auto"]
    first = events(run, "rebalance")[0]
    assert first["step"] == 5 and first["previous_shares"] == [2, 2] and first["shares"] == [3, 1]
    fast, slow = first["seconds_per_micro_batch"]
    assert balance_shares(4, [1 / fast, 1 / slow]) == [3, 1]
    # the slow rank does the same work plus its sleep, which its measured time holds whole; how long the work itself
    # takes depends on the machine's load, so the two ranks are compared (the gap: SLEEP less rank 0's extra delay)
    assert slow >= SLEEP and slow - fast > SLEEP / 2
    by_step = {r["step"]: r["balance_shares"] for r in records(run) if "balance_shares" in r}
    assert by_step[5] == [2, 2] and by_step[6] == [3, 1]  # a new split takes effect at the next step


def test_auto_split_is_resumed_from_the_checkpoint(two_rank_runs):
    run, resumed = two_rank_runs["auto"], two_rank_runs["auto resumed"]
    # the checkpoint of step 10 holds the split step 11 uses (a re-split at step 10 takes effect there)
    after_save = {r["step"]: r["balance_shares"] for r in records(run) if "balance_shares" in r}[11]
    assert events(resumed, "balance")[0]["shares"] == after_save
    # steps 11-20: the uninterrupted run's losses, gradient norms, learning rates and final parameters, to EXACT
    assert_parity(resumed, run, after=10)


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    """Global batch 8 (one sequence per micro-batch) on 4 ranks, uneven weights, one launch; and its
    one-process reference."""
    root = tmp_path_factory.mktemp("balance4")
    common = ("train.steps=6", "train.global_batch_size=8", f"optim.lr={LR}", "checkpoint.save_final=true",
              "precision.compute_dtype=fp64", *MICRO)
    reference = train(root / "reference", *common[:-1], "train.micro_batch_size=8")
    runs = train_many({
        "ddp": (root / "ddp", (*common, "parallel.balance_weights=[1,2,3,2]")),
        "zero2": (root / "zero2", (*common, "parallel.zero_stage=2", "parallel.balance_weights=[2,1,1,4]")),
        "zero3": (root / "zero3", (*common, "parallel.zero_stage=3", "parallel.balance_weights=[3,1,2,2]")),
    }, nproc=4)
    return runs, reference


@pytest.mark.parametrize("layout,shares", [("ddp", [1, 2, 3, 2]), ("zero2", [2, 1, 1, 4]), ("zero3", [3, 1, 2, 2])])
def test_four_rank_uneven_shares_match_single_process(layout, shares, four_rank_runs):
    runs, reference = four_rank_runs
    assert events(runs[layout], "balance")[0]["shares"] == shares
    assert_parity(runs[layout], reference, step=6)
