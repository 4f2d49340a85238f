"""`disttrain bench comm`: every collective checked for correct values, bandwidths as NCCL's tests define them."""

from __future__ import annotations

import json

import pytest

from disttrain.bench.comm import OPS
from helpers import run_cli


def test_bench_comm_two_ranks_json(tmp_path):
    proc = run_cli("bench", "comm", "--sizes", "4K,256K", "--iters", "3", "--warmup", "1", "--json", nproc=2)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted({r["op"] for r in rows}) == sorted(OPS) and len(rows) == 2 * len(OPS)
    n = 2
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}
    for r in rows:
        assert r["ranks"] == n and r["time_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor.get(r["op"], (n - 1) / n))
    assert {r["bytes"] for r in rows if r["op"] == "all_reduce"} == {4096, 262144}


def test_bench_comm_refuses_unknown_ops():
    proc = run_cli("bench", "comm", "--ops", "all_reduce,gossip", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("disttrain: error: --ops=all_reduce,gossip: unknown gossip (allowed: all_reduce, "
                                   "all_gather, reduce_scatter, broadcast, all_to_all)")
