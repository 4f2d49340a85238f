"""`disttrain report RUN RUN ...`: several runs' curves on shared axes (an lr sweep, a layout against another),
and each run's summary, as one HTML page with PNGs."""

from __future__ import annotations

import html
from pathlib import Path

from disttrain.observe.run_report import _series, load_records, summary

# (record key, file name, title, y label): what every run logs, one line per run
CURVES = (("loss", "loss.png", "Training loss", "loss"), ("val_loss", "val_loss.png", "Validation loss", "loss"),
          ("lr", "lr.png", "Learning rate", "learning rate"),
          ("grad_norm", "grad_norm.png", "Gradient norm (before clipping)", "norm"),
          ("tokens_per_sec", "throughput.png", "Throughput", "tokens/s (all ranks)"))


def _labels(runs: list[Path]) -> list[str]:
    """Each run's directory name, or its path where two runs share a name."""
    names = [r.name for r in runs]
    return [str(r) if names.count(r.name) > 1 else r.name for r in runs]


def overlay(runs: list[Path]) -> tuple[dict[str, object], list[tuple[str, str]]]:
    """File name -> matplotlib Figure with one line per run, and the summary rows of every run (prefixed by its
    label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = []
    for run in runs:
        records, events = load_records(run)
        if not records:
            raise ValueError(f"{run}: metrics.jsonl has no step records yet")
        evals = [{"step": e["step"], "val_loss": e["val_loss"]} for e in events
                 if e.get("event") == "eval" and "val_loss" in e]
        loaded.append((records, events, evals))
    labels, figs = _labels(runs), {}
    for key, name, title, ylabel in CURVES:
        series = [(_series(evals if key == "val_loss" else records, key), label)
                  for (records, _, evals), label in zip(loaded, labels)]
        if not any(values for (_, values), _ in series):
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        for (steps, values), label in series:
            if values:
                ax.plot(steps, values, "o-" if key == "val_loss" else "-", label=label, markersize=3)
        ax.legend(fontsize="small")
        figs[name] = fig
    rows = [(f"{label}: {k}", v) for (records, events, _), label in zip(loaded, labels)
            for k, v in summary(records, events)]
    return figs, rows


def compare(runs: list[Path], out: Path) -> tuple[Path, list[Path], list[tuple[str, str]]]:
    """Write the overlaid plots and index.html into `out`; returns (html path, pngs, summary rows by run)."""
    import matplotlib.pyplot as plt

    figs, rows = overlay(runs)
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for name, fig in figs.items():
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        pngs.append(out / name)
    labels = _labels(runs)
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    images = "".join(f'<figure><img src="{p.name}" alt="{p.stem}"></figure>' for p in pngs)
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>disttrain report: "
            f"{html.escape(', '.join(labels))}</title><style>body{{font-family:sans-serif;margin:2em}}"
            "th{text-align:left;padding-right:1em}img{max-width:100%}figure{display:inline-block;margin:0.5em;"
            f"width:46%}}</style></head><body><h1>{html.escape(' vs '.join(labels))}</h1><table>{table}</table>"
            f"{images}</body></html>")
    index = out / "index.html"
    index.write_text(page)
    return index, pngs, rows
