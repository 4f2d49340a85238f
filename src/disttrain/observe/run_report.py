"""`disttrain report RUN_DIR`: plots of a run's metrics.jsonl (PNG, plus one HTML page holding them)
and a summary table in the terminal. Reads only the run directory; needs no process group."""

from __future__ import annotations

import html
import json
import re
import statistics
from pathlib import Path

from disttrain.observe.breakdown import PARTS as BREAKDOWN


P2P_NOTE = ("send_recv is a pipeline's point-to-point transfers, timed from launch to completion: they run "
            "asynchronously beside compute, so their sum can exceed the step time; the pipeline's waiting shows in "
            "comm_exposed")


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


def _routing_state(record: dict) -> str:
    """Each MoE layer's load imbalance (max / mean tokens per expert: 1 is even) and its idle experts."""
    parts = []
    for name, counts in record["moe_tokens_per_expert"].items():
        index = re.search(r"layers\.(\d+)\.", name)
        layer = index.group(1) if index else name
        idle = sum(1 for c in counts if c == 0)
        imbalance = record.get(f"moe_{layer}_load_imbalance")
        parts.append(f"layer {layer}: imbalance {imbalance:.2f}" if imbalance is not None else f"layer {layer}:")
        parts[-1] += f", {idle} of {len(counts)} experts idle" if idle else ""
    return "; ".join(parts)


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
            f"{k[5:-2]}{' (async, see note)' if k == 'comm_send_recv_s' else ''} "
            f"{statistics.median(_series(records, k)[1]) * 1e3:.1f} ms" for k in comm)))
        if "comm_send_recv_s" in comm:
            rows.append(("note", P2P_NOTE))
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
    routed = [r for r in records if "moe_tokens_per_expert" in r]
    if routed:
        rows.append(("MoE routing (last logged step)", _routing_state(routed[-1])))
    counts: dict[str, int] = {}
    for e in events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    if counts:
        rows.append(("events", ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))))
    return rows


def run_starts(events: list[dict]) -> list[tuple[int, str]]:
    """(step, label) where the run started again after its first start: "restarted" when it began again from
    step 0 (a restart before any checkpoint), "resumed" from a checkpoint, or "layout: ..." when the resumed run
    was cut differently (each start records its layout; older runs only their resumes)."""
    starts = [e for e in events if e.get("event") == "started"]
    if not starts:
        return [(e["step"], "resumed") for e in events if e.get("event") == "resumed"]
    return [(e["step"], "restarted" if e["step"] == 0 else "resumed" if e["layout"] == before["layout"]
             else f"layout: {e['layout']}") for before, e in zip(starts, starts[1:])]


def _mark_starts(ax, marks: list[tuple[int, str]]) -> None:
    for step, label in marks:
        layout = label.startswith("layout")
        ax.axvline(step, color="black" if layout else "grey", linestyle="--" if layout else ":", linewidth=1,
                   label=label)


def figures(records: list[dict], events: list[dict]) -> dict[str, object]:
    """File name -> matplotlib Figure of every plot the records support; each time axis marks resumes and
    layout changes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marks, figs = run_starts(events), {}

    def plot(name: str, title: str, ylabel: str):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        figs[name] = fig
        return ax

    def finish(ax, legend: bool = False) -> None:
        _mark_starts(ax, marks)
        if legend or marks:
            ax.legend(fontsize="small")

    ax = plot("loss.png", "Loss", "loss")
    ax.plot(*_series(records, "loss"), label="train")
    evals = [e for e in events if e.get("event") == "eval" and "val_loss" in e]
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="validation")
    for source in sorted({k for e in evals for k in e.get("val_loss_by_source", {})}):
        pts = [(e["step"], e["val_loss_by_source"][source]) for e in evals if source in e.get("val_loss_by_source", {})]
        ax.plot(*zip(*pts), ".--", label=f"validation: {source}")
    finish(ax, legend=True)

    for key, name, title, ylabel in (("lr", "lr.png", "Learning rate", "learning rate"),
                                     ("grad_norm", "grad_norm.png", "Gradient norm (before clipping)", "norm")):
        if _series(records, key)[1]:
            ax = plot(name, title, ylabel)
            ax.plot(*_series(records, key))
            finish(ax)

    steps, margins = _series(records, "rewards/margins")
    if margins:  # a preference objective: how far apart, and how often right, the policy ranks each pair
        ax = plot("rewards.png", "Preference rewards", "reward margin (chosen - rejected)")
        ax.plot(steps, margins, label="margin")
        accuracy = ax.twinx()
        accuracy.set(ylabel="accuracy (pairs ranked right)", ylim=(0, 1))
        accuracy.plot(*_series(records, "rewards/accuracies"), color="tab:orange", label="accuracy")
        finish(ax)
        figs["rewards.png"].legend(loc="lower right", fontsize="small")

    ax = plot("throughput.png", "Throughput", "tokens/s (all ranks)")
    ax.plot(*_series(records, "tokens_per_sec"))
    finish(ax)

    steps, mfu = _series(records, "mfu")
    if mfu:
        ax = plot("mfu.png", "Model FLOPs utilisation", "MFU (%)")
        ax.plot(steps, [100 * m for m in mfu])
        finish(ax)

    parts = {p: _series(records, f"time_{p}_s") for p in BREAKDOWN}
    if all(v[1] for v in parts.values()):
        ax = plot("step_breakdown.png", "Step breakdown, rank 0", "seconds per step")
        ax.stackplot(parts["data"][0], *[v[1] for v in parts.values()], labels=list(parts))
        finish(ax, legend=True)

    steps, mem = _series(records, "mem_peak_bytes")
    if mem:
        ax = plot("memory.png", "Peak memory (max over ranks)", "GiB")
        ax.plot(steps, [m / 2**30 for m in mem])
        ax.set_ylim(bottom=0)  # from zero: a change reads at its true size
        finish(ax)

    if any("rank_compute_max_s" in r for r in records):
        ax = plot("rank_step_time.png", "Per-rank step compute time", "seconds")
        for key, label in (("rank_compute_min_s", "fastest rank"), ("rank_compute_median_s", "median rank"),
                           ("rank_compute_max_s", "slowest rank")):
            ax.plot(*_series(records, key), label=label)
        finish(ax, legend=True)
    loads = expert_loads(records)
    if loads:
        fig, axes = plt.subplots(len(loads), 1, figsize=(7, 1.2 + 1.6 * len(loads)), squeeze=False)
        for ax, (layer, (steps, grid)) in zip(axes[:, 0], loads.items()):
            image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest",
                              extent=(steps[0] - 0.5, steps[-1] + 0.5, len(grid) - 0.5, -0.5))
            ax.set(ylabel="expert", title=f"{layer}: tokens / mean")
            fig.colorbar(image, ax=ax)
        axes[-1, 0].set_xlabel("step")
        figs["expert_load.png"] = fig
    return figs


def expert_loads(records: list[dict]) -> dict[str, tuple[list[int], list[list[float]]]]:
    """MoE layer -> (logged steps, expert x step grid of tokens per expert over the mean): the heat map's data."""
    rows = [(r["step"], r["moe_tokens_per_expert"]) for r in records if r.get("moe_tokens_per_expert")]
    out = {}
    for layer in (rows[0][1] if rows else {}):
        steps = [s for s, by_layer in rows if layer in by_layer]
        share = [[c / (sum(by_layer[layer]) / len(by_layer[layer]) or 1) for c in by_layer[layer]]
                 for _, by_layer in rows if layer in by_layer]
        out[layer] = (steps, [list(col) for col in zip(*share)])
    return out


def make_report(run_dir: Path, out_dir: Path | None = None) -> tuple[Path, list[Path], list[tuple[str, str]]]:
    """Write the PNGs and index.html; returns (html path, pngs, summary rows)."""
    import matplotlib.pyplot as plt

    records, events = load_records(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl has no step records yet")
    out = out_dir or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []
    for name, fig in figures(records, events).items():
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        pngs.append(out / name)

    rows = summary(records, events)
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    images = "".join(f'<figure><img src="{p.name}" alt="{p.stem}"></figure>' for p in pngs)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>disttrain report: {html.escape(run_dir.name)}"
            "</title><style>body{font-family:sans-serif;margin:2em}th{text-align:left;padding-right:1em}"
            "img{max-width:100%}figure{display:inline-block;margin:0.5em;width:46%}</style></head><body>"
            f"<h1>{html.escape(str(run_dir))}</h1><table>{table}</table>{images}"
            "<p>Step breakdown: comm_exposed is the gradient reduction still running after the last backward "
            "computation; collectives inside forward and backward count in those phases and, per kind, in the "
            f"communication row (profiled steps). {html.escape(P2P_NOTE)}</p></body></html>")
    index = out / "index.html"
    index.write_text(page)
    return index, pngs, rows
