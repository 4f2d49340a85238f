"""Framework overhead: disttrain DDP against a hand-written PyTorch DDP loop (and Accelerate, Fabric).

Each framework trains the same workload (benchmarks/workloads/common.py, configs/bench.yaml) on
2 processes. Start-up costs (imports, corpus, process launch) are removed by running every
framework for a short and a long step count and keeping the difference:
    tokens/s     = tokens x (long - short) / (wall_long - wall_short)
    CPU-s/token  = (cpu_long - cpu_short) / (tokens x (long - short))
where cpu is the user+system time of the whole process tree. Runs are interleaved (each
repetition runs every framework, in rotated order) and ratios are taken within a repetition,
because wall time on a shared 2-core VM drifts by 2-3x.

    python benchmarks/overhead.py --reps 3                     # disttrain vs plain
    python benchmarks/overhead.py --reps 3 --compare           # + Accelerate, Fabric (make bench-env)
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO / "benchmarks" / "workloads"
BENCH_PY = REPO / ".bench-venv" / "bin" / "python"
TOKENS_PER_STEP = 16 * 128


def command(framework: str, steps: int, run_dir: Path) -> list[str]:
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    if framework == "disttrain":
        return disttrain_command([], steps, run_dir)
    python = sys.executable if framework == "plain" else str(BENCH_PY)
    return [python, *torchrun, str(WORKLOADS / f"{framework}_ddp.py"), "--steps", str(steps)]


def measure_command(cmd: list[str], src: Path | None = None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user+system of the whole process tree) of one command; `src`: the disttrain
    source tree it imports (default this checkout's)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(WORKLOADS), str(src or REPO / "src")]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def steady_state(command_for_steps, short: int, long: int, tokens_per_step: int = TOKENS_PER_STEP,
                 src: Path | None = None) -> dict:
    """Throughput and CPU per token of the steps between `short` and `long` (start-up cancels out)."""
    w1, c1 = measure_command(command_for_steps(short), src)
    w2, c2 = measure_command(command_for_steps(long), src)
    tokens = tokens_per_step * (long - short)
    return {"tokens_per_s": tokens / (w2 - w1), "cpu_s_per_token": (c2 - c1) / tokens}


def interleaved(names: list[str], command_for, reps: int, short: int, long: int,
                tokens_per_step: int = TOKENS_PER_STEP, src_for=None) -> dict[str, list[dict]]:
    """Every variant once per repetition, starting one later each time; `command_for(name, steps)`;
    `src_for(name)`: the source tree a variant imports (default this checkout's)."""
    results: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            src = src_for(name) if src_for is not None else None
            row = steady_state(lambda steps: command_for(name, steps), short, long, tokens_per_step, src)
            results[name].append(row)
            print(f"rep {rep + 1}/{reps} {name:>16}: {row['tokens_per_s']:8.0f} tok/s, "
                  f"{1e6 * row['cpu_s_per_token']:7.1f} CPU-us/token", flush=True)
    return results


def disttrain_command(overrides: list[str], steps: int, run_dir: Path) -> list[str]:
    """configs/bench.yaml on 2 processes with `overrides`, as a run of its own (a run name is one run: a
    measurement that reused one would be refused, or would resume)."""
    return [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "bench.yaml"), f"train.steps={steps}",
            f"run.dir={run_dir}", f"run.name=bench-{uuid.uuid4().hex[:12]}", *overrides, "--nproc-per-node", "2"]


def add_common_args(parser: argparse.ArgumentParser, out_name: str) -> None:
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=60)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / out_name))


def write_results(path: str, payload: dict) -> None:
    """The payload with the date, machine and command line (disttrain.bench.results)."""
    from disttrain.bench.results import write_results as write

    write(path, **payload)


def summarize(results: dict[str, list[dict]], baseline: str) -> dict:
    summary = {}
    for name, rows in results.items():
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rows, results[baseline])]
        cpu_ratios = [r["cpu_s_per_token"] / b["cpu_s_per_token"] for r, b in zip(rows, results[baseline])]
        summary[name] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
            "cpu_us_per_token_median": 1e6 * statistics.median(r["cpu_s_per_token"] for r in rows),
            "throughput_ratio_median": statistics.median(ratios), "throughput_ratio_range": [min(ratios), max(ratios)],
            "cpu_per_token_ratio_median": statistics.median(cpu_ratios),
            "cpu_per_token_ratio_range": [min(cpu_ratios), max(cpu_ratios)],
        }
    return summary


def print_table(summary: dict, baseline: str) -> None:
    print(f"\n| variant | tokens/s (median) | vs {baseline}, throughput (median, range) | CPU-us/token (median) "
          f"| vs {baseline}, CPU/token (median, range) |\n|---|---|---|---|---|")
    for name, s in summary.items():
        lo, hi = s["throughput_ratio_range"]
        clo, chi = s["cpu_per_token_ratio_range"]
        print(f"| {name} | {s['tokens_per_s_median']:,.0f} | {s['throughput_ratio_median']:.3f} ({lo:.3f}-{hi:.3f}) "
              f"| {s['cpu_us_per_token_median']:.1f} | {s['cpu_per_token_ratio_median']:.3f} ({clo:.3f}-{chi:.3f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "overhead.json")
    parser.add_argument("--compare", action="store_true", help="also run Accelerate and Lightning Fabric")
    args = parser.parse_args()
    frameworks = ["plain", "disttrain"] + (["accelerate", "fabric"] if args.compare else [])
    if args.compare and not BENCH_PY.exists():
        raise SystemExit("the comparison environment is missing: run `make bench-env` first")
    run_dir = REPO / "runs" / "bench-overhead"
    results = interleaved(frameworks, lambda fw, steps: command(fw, steps, run_dir), args.reps, args.short, args.long)
    summary = summarize(results, "plain")
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})
    print_table(summary, "plain")


if __name__ == "__main__":
    main()
