"""The dry run of MoE layouts (routing stated: dryrun/routing.py) against a real run and the planner.

    python benchmarks/moe_dryrun.py real --out benchmarks/results/moe_dryrun_real.json
    python benchmarks/moe_dryrun.py skew CONFIG [key=value ...] --world-size 32 --skews 1,1.5,2 --microbatches 8

`real`: debug-moe at ep=2 on 2 real gloo ranks (DDP and ZeRO-3, 2 micro-batches), measured by the same memory
tracker on real tensors (tests/workers/measure_step.py), once with the router's own routing of random tokens and
once with the dry run's balanced routing installed; then the dry run of rank 0 of each. `skew`: `disttrain
dryrun` of one layout at each routing skew, the measured peak and the planner's side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["model.name=debug-moe", "data.seq_len=128", "train.micro_batch_size=2", "train.global_batch_size=8",
          "parallel.ep=2"]
LAYOUTS = {"DDP ep=2": [*COMMON, "parallel.zero_stage=0"], "ZeRO-3 ep=2": [*COMMON, "parallel.zero_stage=3"]}


def real(out: Path) -> dict:
    from disttrain.config.load import load_config
    from disttrain.dryrun.simulate import simulate
    from disttrain.plan.memory import estimate_memory
    from disttrain.config.resolve import resolve_run
    from dryrun_vs_real import measure_real  # benchmarks/ is on the path when a script here runs

    jobs = {}
    for name, overrides in LAYOUTS.items():
        jobs[f"{name}, router's routing"] = overrides
        jobs[f"{name}, balanced routing"] = {"overrides": overrides, "routing_skew": 1.0}
    measured, real_s = measure_real(jobs)
    rows = []
    for name, overrides in LAYOUTS.items():
        cfg = load_config(None, overrides)
        resolved = resolve_run(cfg, 2, "cpu")
        t0 = time.perf_counter()
        fake = simulate(cfg, resolved, 0)
        planner = estimate_memory(resolved.shape, resolved.layout)
        rows.append({"layout": name, "dry_run": {"peak_bytes": fake.peak_bytes, **fake.bytes},
                     "dry_run_s": round(time.perf_counter() - t0, 1),
                     "planner": {"peak_bytes": planner.total, **planner.categories()},
                     **{f"real, {k.split(', ')[1]}": [{"peak_bytes": r["peak_bytes"], **r["bytes"]} for r in v]
                        for k, v in measured.items() if k.startswith(name)}})
    report = {"date": time.strftime("%Y-%m-%d"), "real_launch_s": round(real_s, 1), "layouts": rows}
    out.write_text(json.dumps(report, indent=2))
    return report


def skew(config: str | None, overrides: list[str], world: int, skews: list[float], microbatches: int | None,
         gpu: str | None, out: Path, ranks: list[int] | None = None) -> dict:
    from disttrain.cli.dryrun import dry_run
    from disttrain.config.load import load_config

    cfg = load_config(config, overrides)
    rows = []
    for s in skews:
        t0 = time.perf_counter()
        r = dry_run(cfg, world, ranks, gpu_name=gpu, microbatches=microbatches, routing_skew=s,
                    progress=lambda m: print(m, file=sys.stderr, flush=True))
        rows.append({"routing_skew": s, "seconds": round(time.perf_counter() - t0, 1),
                     "ranks": [{k: e[k] for k in ("rank", "role", "peak_bytes", "bytes", "planner", "error",
                                                  "collectives", "seconds")} for e in r["ranks"]]})
        print(json.dumps(rows[-1]), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "world_size": world, "overrides": overrides,
              "microbatches": microbatches, "layout": r["layout"], "skews": rows}
    out.write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("real")
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("skew")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--skews", default="1,1.5,2")
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--gpu", default=None)
    p.add_argument("--rank", type=int, action="append", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.what == "real":
        print(json.dumps(real(args.out), indent=2))
    else:
        config = args.config if args.config and args.config.endswith((".yaml", ".yml")) else None
        overrides = args.overrides if config else [*([args.config] if args.config else []), *args.overrides]
        skew(config, overrides, args.world_size, [float(s) for s in args.skews.split(",")], args.microbatches,
             args.gpu, args.out, args.rank)


if __name__ == "__main__":
    main()
