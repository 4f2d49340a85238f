"""`disttrain dryrun CONFIG [key=value ...] --world-size N`: the real training step of chosen ranks of
an N-rank job, simulated in this process (dryrun/simulate.py), beside the planner's figures for the
same config, and whether it fits a GPU of the planner's table."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings

from disttrain.errors import UserError
from disttrain.hardware import GPUS, find_gpu

GIB = 2 ** 30


def add_parser(sub) -> None:
    p = sub.add_parser("dryrun", help="run the real training step of one rank of an N-rank job on this CPU (fake "
                                      "process group, fake tensors): bytes by category, collectives, the planner's "
                                      "figures beside them")
    p.add_argument("config", help="YAML config (key=value overrides after it)")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the simulated job")
    p.add_argument("--rank", type=int, action="append", default=None,
                   help="rank to simulate (repeatable; default: one rank per distinct role)")
    p.add_argument("--gpu", default=None, help=f"fits on this GPU? ({', '.join(GPUS)})")
    p.add_argument("--steps", type=int, default=2, help="steps to run (the peak is over all; optimizer states exist "
                                                        "from the second)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def default_ranks(layout) -> list[int]:
    """One rank per distinct role. Without pipeline stages every rank holds the same shapes (FSDP pads
    shards to equal size; TP splits evenly, which validation checks), so rank 0 stands for all."""
    return [0]


def dry_run(cfg, world_size: int, ranks: list[int] | None = None, gpu_name: str | None = None, steps: int = 2,
            progress=None) -> dict:
    """Simulate each rank and compare with the planner; the JSON `disttrain dryrun --json` prints."""
    from disttrain.dryrun.simulate import simulate, unsupported
    from disttrain.models.registry import model_shape
    from disttrain.plan.memory import estimate_memory
    from disttrain.validation import validate_world

    if world_size < 1:
        raise UserError(f"--world-size={world_size}: must be at least 1")
    try:
        gpu = find_gpu(gpu_name) if gpu_name else None
    except KeyError as exc:
        raise UserError(f"--gpu={exc.args[0]}") from None
    layout = validate_world(cfg, world_size, "cuda")
    problem = unsupported(cfg, layout)
    if problem:  # before any progress line: a refusal is one line
        raise UserError(problem)
    ranks = ranks or default_ranks(layout)
    for r in ranks:
        if not 0 <= r < world_size:
            raise UserError(f"--rank={r}: not a rank of --world-size={world_size} (allowed: 0..{world_size - 1})")
    shape = model_shape(cfg.model)
    planned = estimate_memory(shape, layout)
    planner = {**planned.categories(), "peak_bytes": planned.total}
    out = []
    for rank in ranks:
        if progress:
            progress(f"dry run: rank {rank} of {world_size} ...")
        with _quiet():
            run = simulate(cfg, layout, rank, steps)
        entry = {"rank": rank, "role": run.role, "peak_bytes": run.peak_bytes, "bytes": run.bytes,
                 "planner": {k: int(v) for k, v in planner.items()},
                 "error": {k: _error(planner[k], v) for k, v in [*run.bytes.items(), ("peak_bytes", run.peak_bytes)]},
                 "collectives": run.collectives, "seconds": round(run.seconds, 2)}
        if gpu is not None:
            entry.update(_fit(run, gpu.memory_bytes, layout.micro_batch_size))
        out.append(entry)
    worst = max(out, key=lambda e: e["peak_bytes"])
    result = {"world_size": world_size, "layout": layout.as_dict(), "gpu": gpu.name if gpu else None, **worst,
              "fits": worst.get("fits"), "ranks": out}
    return result


def _error(predicted: float, measured: int) -> float | None:
    """Planner relative to measured (+0.05: the planner says 5% more)."""
    return None if measured == 0 else round(predicted / measured - 1, 4)


def _fit(run, memory: int, micro_batch: int) -> dict:
    """Fits with what headroom; the largest micro-batch from the measured bytes per sequence
    (activations and temporaries grow with it, the rest does not)."""
    per_sequence = (run.bytes["activations"] + run.bytes["temporary"]) / micro_batch
    fixed = run.peak_bytes - per_sequence * micro_batch
    largest = math.floor((memory - fixed) / per_sequence) if per_sequence > 0 else None
    return {"fits": run.peak_bytes <= memory, "headroom_bytes": memory - run.peak_bytes,
            "largest_micro_batch": max(largest, 0) if largest is not None else None}


class _quiet:
    """torch's distributed warnings (one line per fake rank) would bury the report."""

    def __enter__(self):
        self.level = logging.getLogger("torch.distributed").level
        logging.getLogger("torch.distributed").setLevel(logging.ERROR)
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self.warnings.__exit__(*exc)
        logging.getLogger("torch.distributed").setLevel(self.level)


def cmd_dryrun(args: argparse.Namespace, overrides: list[str]) -> None:
    from disttrain.config import load_config

    cfg = load_config(args.config, overrides)
    result = dry_run(cfg, args.world_size, args.rank, args.gpu, args.steps,
                     progress=None if args.json else lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2) if args.json else render(result))


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def render(result: dict) -> str:
    lines = [f"dry run: {result['world_size']} ranks, layout "
             + " ".join(f"{k}={v}" for k, v in result["layout"].items() if k in ("dp_replicate", "dp_shard", "tp", "pp",
                                                                                  "zero_stage", "micro_batch_size"))]
    for r in result["ranks"]:
        lines += ["", f"rank {r['rank']} ({r['role']}), {r['seconds']:.1f} s",
                  f"  {'bytes':<14}{'measured':>12}{'planner':>12}{'error':>9}"]
        for key in [*r["bytes"], "peak_bytes"]:
            measured = r["bytes"].get(key, r["peak_bytes"])
            err = r["error"][key]
            label = "peak" if key == "peak_bytes" else key
            lines.append(f"  {label:<14}{_size(measured):>12}{_size(r['planner'][key]):>12}"
                         f"{'' if err is None else f'{err:+.1%}':>9}")
        lines.append(f"  {'collective':<16}{'dim':<14}{'count':>6}{'bytes sent':>14}")
        for c in r["collectives"]:
            lines.append(f"  {c['kind']:<16}{c['dim']:<14}{c['count']:>6}{_size(c['bytes']):>14}")
        if "fits" in r:
            verdict = "fits" if r["fits"] else "does NOT fit"
            lines.append(f"  on {result['gpu']}: {verdict} (headroom {r['headroom_bytes'] / GIB:+.1f} GiB); largest "
                         f"micro-batch ~{r['largest_micro_batch']} (from the measured bytes per sequence)")
    return "\n".join(lines)
