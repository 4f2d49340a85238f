"""What `data.document_masking=true` costs per training step: forward + backward of the built-in model
with and without it, on windows of the built-in corpus (byte tokens, documents of a few hundred bytes).

One process, one thread (as each of `make demo`'s two ranks); repetitions interleave masking on and off;
figures are medians with ranges, wall and CPU seconds per token, and the ratio within each repetition.

    python benchmarks/document_masking.py --reps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from disttrain.bench.results import write_results  # noqa: E402
from disttrain.data.loader import TokenWindows  # noqa: E402
from disttrain.data.source import load_splits  # noqa: E402
from disttrain.models.llama import llama_spec  # noqa: E402
from disttrain.models.registry import MODEL_SHAPES  # noqa: E402
from disttrain.models.spec import build_model  # noqa: E402

SHAPES = {"tiny": (128, 8), "125m": (256, 2), "125m seq 1024": (1024, 1)}  # (seq_len, micro-batch)


def step_seconds(model, batch: torch.Tensor, iters: int) -> tuple[float, float]:
    x, y = batch[:, :-1], batch[:, 1:]
    wall = cpu = 0.0
    for i in range(iters + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if i:  # the first pass warms up
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
    return wall / iters, cpu / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "document_masking.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok, splits = load_splits("builtin", "byte")
    rows = []
    for name, (seq, mbs) in SHAPES.items():
        shape = MODEL_SHAPES[name.split()[0]]
        windows = TokenWindows(splits["train"], seq)
        rng = np.random.default_rng(0)
        ids = rng.choice(len(windows), mbs, replace=False)
        x, y = windows.batch(ids)
        batch = torch.cat([x, y[:, -1:]], dim=1)
        boundaries = int((x == tok.eos_id).sum())
        models = {}
        for masked in (False, True):
            model = build_model(llama_spec(shape), torch.device("cpu"), seed=0)
            if masked:
                model.document_eos = tok.eos_id
            models[masked] = model
        for rep in range(args.reps):
            row = {"shape": name, "seq_len": seq, "micro_batch": mbs, "boundaries": boundaries, "rep": rep}
            for masked in ((False, True) if rep % 2 == 0 else (True, False)):
                wall, cpu = step_seconds(models[masked], batch, args.iters)
                key = "masked" if masked else "plain"
                row[f"{key}_s"], row[f"{key}_cpu_s_per_token"] = wall, cpu / (seq * mbs)
            row["ratio"] = row["masked_s"] / row["plain_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for name in SHAPES:
        mine = [r for r in rows if r["shape"] == name]
        summary[name] = {"ratio_median": statistics.median(r["ratio"] for r in mine),
                         "ratio_range": [min(r["ratio"] for r in mine), max(r["ratio"] for r in mine)],
                         "plain_s": statistics.median(r["plain_s"] for r in mine),
                         "masked_s": statistics.median(r["masked_s"] for r in mine),
                         "plain_cpu_s_per_token": statistics.median(r["plain_cpu_s_per_token"] for r in mine),
                         "masked_cpu_s_per_token": statistics.median(r["masked_cpu_s_per_token"] for r in mine)}
    write_results(args.out, rows=rows, summary=summary)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
