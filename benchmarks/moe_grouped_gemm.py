"""Grouped GEMM against the per-expert loop for the MoE experts' forward + backward, on this CPU or a GPU.

    python benchmarks/moe_grouped_gemm.py [--reps 6]
    python benchmarks/moe_grouped_gemm.py --device cuda --dtype bf16 --shapes tiny-moe,qwen3-30b-moe --tokens 8192

Runs `models/moe/experts.GroupedExperts` on the same token rows both ways (`grouped_gemm` True/False),
interleaved repetition by repetition so machine load falls on both alike; prints the median and range of
seconds per forward + backward, their ratio, and CPU seconds per 1,000 routed rows. Shapes: debug-moe's
experts (8 x 64 -> 64) and a `tiny`-sized MoE (16 experts, 256 -> 256), top-2 over 8 x 256 tokens; on a GPU
also Qwen3-30B-A3B's (128 experts, 2048 -> 768, top-8). On a GPU each pass is timed between synchronisations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from disttrain.models.moe.experts import GroupedExperts

SHAPES = {"debug-moe": (8, 64, 64, 2), "tiny-moe": (16, 256, 256, 2), "qwen3-30b-moe": (128, 2048, 768, 8)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def one_pass(experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor, upstream: torch.Tensor) -> tuple:
    sync = torch.cuda.synchronize if rows.is_cuda else (lambda: None)
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    out = experts(rows, counts)
    out.backward(upstream)
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=8 * 256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--shapes", default="debug-moe,tiny-moe", help=f"of {', '.join(SHAPES)}")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    for name in args.shapes.split(","):
        e, dim, hidden, top_k = SHAPES[name]
        torch.manual_seed(0)
        experts = GroupedExperts(e, dim, hidden).to(device, dtype)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.02)
        choice = torch.randint(0, e, (args.tokens * top_k,)).sort().values  # top-k assignments sorted by expert
        counts = torch.bincount(choice, minlength=e).to(device)
        rows = torch.randn(choice.numel(), dim, device=device, dtype=dtype, requires_grad=True)
        upstream = torch.randn(choice.numel(), dim, device=device, dtype=dtype)
        times = {True: [], False: []}
        for rep in range(args.reps + 1):  # the first round warms up
            for grouped in (True, False) if rep % 2 else (False, True):
                experts.grouped_gemm = grouped
                wall, cpu = one_pass(experts, rows, counts, upstream)
                if rep:
                    times[grouped].append((wall, cpu))
        g, loop = ([w for w, _ in times[k]] for k in (True, False))
        cpu_per_k = {k: 1000 * statistics.median(c for _, c in times[k]) / choice.numel() for k in times}
        print(f"{name} ({args.device}, {args.dtype}, {choice.numel()} rows): grouped {statistics.median(g) * 1e3:.2f} ms [{min(g) * 1e3:.2f}-{max(g) * 1e3:.2f}], "
              f"loop {statistics.median(loop) * 1e3:.2f} ms [{min(loop) * 1e3:.2f}-{max(loop) * 1e3:.2f}], "
              f"loop/grouped {statistics.median(loop) / statistics.median(g):.2f}, CPU s per 1k rows "
              f"grouped {cpu_per_k[True]:.4f} loop {cpu_per_k[False]:.4f}")


if __name__ == "__main__":
    main()
