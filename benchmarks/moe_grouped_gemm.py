"""Grouped GEMM against the per-expert loop for the MoE experts' forward + backward on this CPU.

    python benchmarks/moe_grouped_gemm.py [--reps 6]

Runs `models/moe/experts.GroupedExperts` on the same token rows both ways (`grouped_gemm` True/False),
interleaved repetition by repetition so machine load falls on both alike; prints the median and range of
seconds per forward + backward, their ratio, and CPU seconds per 1,000 routed rows. Shapes: debug-moe's
experts (8 x 64 -> 64) and a `tiny`-sized MoE (16 experts, 256 -> 256), top-2 over 8 x 256 tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from disttrain.models.moe.experts import GroupedExperts

SHAPES = {"debug-moe": (8, 64, 64), "tiny-moe": (16, 256, 256)}


def one_pass(experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor, upstream: torch.Tensor) -> tuple:
    wall, cpu = time.perf_counter(), time.process_time()
    out = experts(rows, counts)
    out.backward(upstream)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=8 * 256)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for name, (e, dim, hidden) in SHAPES.items():
        torch.manual_seed(0)
        experts = GroupedExperts(e, dim, hidden)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.02)
        choice = torch.randint(0, e, (args.tokens * 2,)).sort().values  # top-2 assignments sorted by expert
        counts = torch.bincount(choice, minlength=e)
        rows = torch.randn(choice.numel(), dim, requires_grad=True)
        upstream = torch.randn(choice.numel(), dim)
        times = {True: [], False: []}
        for rep in range(args.reps + 1):  # the first round warms up
            for grouped in (True, False) if rep % 2 else (False, True):
                experts.grouped_gemm = grouped
                wall, cpu = one_pass(experts, rows, counts, upstream)
                if rep:
                    times[grouped].append((wall, cpu))
        g, loop = ([w for w, _ in times[k]] for k in (True, False))
        cpu_per_k = {k: 1000 * statistics.median(c for _, c in times[k]) / choice.numel() for k in times}
        print(f"{name}: grouped {statistics.median(g) * 1e3:.2f} ms [{min(g) * 1e3:.2f}-{max(g) * 1e3:.2f}], "
              f"loop {statistics.median(loop) * 1e3:.2f} ms [{min(loop) * 1e3:.2f}-{max(loop) * 1e3:.2f}], "
              f"loop/grouped {statistics.median(loop) / statistics.median(g):.2f}, CPU s per 1k rows "
              f"grouped {cpu_per_k[True]:.4f} loop {cpu_per_k[False]:.4f}")


if __name__ == "__main__":
    main()
