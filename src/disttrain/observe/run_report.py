"""`disttrain report RUN_DIR`: plots of a run's metrics.jsonl (PNG, plus one HTML page holding them)
and a summary table in the terminal. Reads only the run directory; needs no process group."""

from __future__ import annotations

import html
import json
import statistics
from pathlib import Path

from disttrain.observe.breakdown import PARTS as BREAKDOWN


def load_records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a disttrain run directory?)")
    steps, events = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash; the rest of the file still counts
        (events if "event" in record else steps).append(record)
    # A step logged twice (redone after a restart) keeps its last record.
    by_step = {r["step"]: r for r in steps if "step" in r}
    return [by_step[k] for k in sorted(by_step)], events


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def summary(records: list[dict], events: list[dict]) -> list[tuple[str, str]]:
    rows = []
    if records:
        last = records[-1]
        rows.append(("steps logged", f"{len(records)} (last step {last['step']})"))
        rows.append(("loss", f"{records[0].get('loss', float('nan')):.4f} -> {last.get('loss', float('nan')):.4f}"))
    evals = [e for e in events if e.get("event") == "eval" and "val_loss" in e]
    if evals:
        best = min(evals, key=lambda e: e["val_loss"])
        rows.append(("validation loss", f"last {evals[-1]['val_loss']:.4f}, best {best['val_loss']:.4f} "
                                        f"at step {best['step']}"))
    for key, label, fmt in (("tokens_per_sec", "tokens/s (median)", "{:,.0f}"), ("mfu", "MFU (median)", "{:.1%}"),
                            ("step_time_s", "step time (median)", "{:.3f} s"), ("pp_bubble", "pipeline bubble (median)", "{:.1%}")):
        _, values = _series(records, key)
        if values:
            rows.append((label, fmt.format(statistics.median(values))))
    _, mem = _series(records, "mem_peak_bytes")
    if mem:
        rows.append(("peak memory (max over ranks)", f"{max(mem) / 2**30:.2f} GiB"))
    parts = {p: _series(records, f"time_{p}_s")[1] for p in BREAKDOWN}
    if all(parts.values()):
        total = sum(statistics.median(v) for v in parts.values())
        rows.append(("step breakdown (median)", ", ".join(
            f"{p} {statistics.median(v) / total:.0%}" for p, v in parts.items())))
    comm = sorted({k for r in records for k in r if k.startswith("comm_") and k.endswith("_s") and k != "comm_time_s"})
    if comm:
        rows.append(("communication (median per step)", ", ".join(
            f"{k[5:-2]} {statistics.median(_series(records, k)[1]) * 1e3:.1f} ms" for k in comm)))
    slowest = [r["slowest_rank"] for r in records if "slowest_rank" in r]
    if slowest:
        most = max(set(slowest), key=slowest.count)
        rows.append(("slowest rank", f"{most} ({slowest.count(most)} of {len(slowest)} logged steps)"))
    shares = [r["balance_shares"] for r in records if "balance_shares" in r]
    if shares:
        splits = [e for e in events if e.get("event") == "rebalance"]
        rows.append(("micro-batches per data-parallel rank", f"{shares[0]} -> {shares[-1]}" + (
            f" ({len(splits)} re-split(s): " + "; ".join(f"step {e['step']}: {e['shares']}" for e in splits[:6])
            + (" ..." if len(splits) > 6 else "") + ")" if splits else " (fixed)")))
    counts: dict[str, int] = {}
    for e in events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    if counts:
        rows.append(("events", ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))))
    return rows


def make_report(run_dir: Path, out_dir: Path | None = None) -> tuple[Path, list[Path], list[tuple[str, str]]]:
    """Write the PNGs and index.html; returns (html path, pngs, summary rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, events = load_records(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl has no step records yet")
    out = out_dir or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        pngs.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "loss"), label="train")
    evals = [e for e in events if e.get("event") == "eval" and "val_loss" in e]
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    ax.legend()
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "tokens_per_sec"))
    ax.set(xlabel="step", ylabel="tokens/s (all ranks)", title="Throughput")
    save(fig, "throughput.png")

    steps, mfu = _series(records, "mfu")
    if mfu:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [100 * m for m in mfu])
        ax.set(xlabel="step", ylabel="MFU (%)", title="Model FLOPs utilisation")
        save(fig, "mfu.png")

    parts = {p: _series(records, f"time_{p}_s") for p in BREAKDOWN}
    if all(v[1] for v in parts.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.stackplot(parts["data"][0], *[v[1] for v in parts.values()], labels=list(parts))
        ax.set(xlabel="step", ylabel="seconds per step", title="Step breakdown, rank 0")
        ax.legend(loc="upper right", fontsize="small")
        save(fig, "step_breakdown.png")

    steps, mem = _series(records, "mem_peak_bytes")
    if mem:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [m / 2**30 for m in mem])
        ax.set(xlabel="step", ylabel="GiB", title="Peak memory (max over ranks)")
        save(fig, "memory.png")

    if any("rank_compute_max_s" in r for r in records):
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in (("rank_compute_min_s", "fastest rank"), ("rank_compute_median_s", "median rank"),
                           ("rank_compute_max_s", "slowest rank")):
            ax.plot(*_series(records, key), label=label)
        ax.set(xlabel="step", ylabel="seconds", title="Per-rank step compute time")
        ax.legend()
        save(fig, "rank_step_time.png")

    rows = summary(records, events)
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    images = "".join(f'<figure><img src="{p.name}" alt="{p.stem}"></figure>' for p in pngs)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>disttrain report: {html.escape(run_dir.name)}"
            "</title><style>body{font-family:sans-serif;margin:2em}th{text-align:left;padding-right:1em}"
            "img{max-width:100%}figure{display:inline-block;margin:0.5em;width:46%}</style></head><body>"
            f"<h1>{html.escape(str(run_dir))}</h1><table>{table}</table>{images}"
            "<p>Step breakdown: comm_exposed is the gradient reduction still running after the last backward "
            "computation; collectives inside forward and backward count in those phases and, per kind, in the "
            "communication row (profiled steps).</p></body></html>")
    index = out / "index.html"
    index.write_text(page)
    return index, pngs, rows
