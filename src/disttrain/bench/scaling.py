"""`disttrain bench scaling CONFIG --max-procs N`: weak scaling on the current machine.

The config runs at 1, 2, 4, ... processes with the per-rank batch fixed (the config's
`train.global_batch_size` is the batch of one process; n processes train n times it), each run
its own `disttrain train` launch. Throughput is the median over steps after the first 5 (start-up,
allocator warm-up), so launch cost is not counted. speedup = tokens/s(n) / tokens/s(1),
efficiency = speedup / n.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from disttrain.core.errors import UserError

WARMUP_STEPS = 5


def process_counts(max_procs: int) -> list[int]:
    if max_procs < 1:
        raise UserError(f"--max-procs={max_procs}: must be at least 1")
    counts, n = [], 1
    while n <= max_procs:
        counts.append(n)
        n *= 2
    return counts


def scaled_config(cfg, n: int):
    scaled = cfg.model_copy(deep=True)
    scaled.train.global_batch_size = cfg.train.global_batch_size * n
    return scaled


def run(config: str, overrides: list[str], cfg, counts: list[int], steps: int, out: Path | None) -> list[dict]:
    out = out or Path(cfg.run.dir) / f"scaling-{Path(config).stem}"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for n in counts:
        name = f"procs_{n}"
        shutil.rmtree(out / name, ignore_errors=True)  # a measurement of an earlier `bench scaling`: a new run
        cmd = [sys.executable, "-m", "disttrain", "train", config, *overrides,
               f"train.global_batch_size={cfg.train.global_batch_size * n}", f"train.steps={steps}",
               f"run.dir={out}", f"run.name={name}", "checkpoint.resume=none", "checkpoint.save_final=false",
               "checkpoint.every_steps=0", "checkpoint.every_minutes=0", "train.eval_every=0",
               "train.sample_tokens=0", "metrics.log_every=1", "--nproc-per-node", str(n)]
        print(f"scaling: {n} process(es), {steps} steps ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{n} processes failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        tps = [r["tokens_per_sec"] for r in records if "event" not in r and r["step"] > WARMUP_STEPS]
        if not tps:
            raise RuntimeError(f"{n} processes: no steps after the first {WARMUP_STEPS}; raise --steps")
        rows.append({"procs": n, "tokens_per_s": statistics.median(tps),
                     "tokens_per_s_spread": [min(tps), max(tps)]})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base
        row["efficiency"] = row["speedup"] / row["procs"]
    (out / "scaling.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "scaling.png")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = [r["procs"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(procs, [r["tokens_per_s"] for r in rows], "o-", label="measured")
    a.plot(procs, [rows[0]["tokens_per_s"] * p for p in procs], "--", label="ideal")
    a.set(xlabel="processes", ylabel="tokens/s", title="Weak scaling: throughput")
    a.legend()
    b.plot(procs, [100 * r["efficiency"] for r in rows], "o-")
    b.set(xlabel="processes", ylabel="efficiency (%)", ylim=(0, 110), title="Scaling efficiency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'procs':>5}  {'tokens/s':>10}  {'(min-max)':>17}  {'speedup':>7}  {'efficiency':>10}"]
    for r in rows:
        lo, hi = r["tokens_per_s_spread"]
        lines.append(f"{r['procs']:>5}  {r['tokens_per_s']:>10,.0f}  {lo:>8,.0f}-{hi:<8,.0f}  {r['speedup']:>7.2f}  "
                     f"{r['efficiency']:>10.1%}")
    return "\n".join(lines)
