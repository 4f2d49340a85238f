"""LoRA against full fine-tuning on this machine: model-state bytes per rank (measured in the engine's own
step by disttrain.bench.model_states, beside what `disttrain estimate` plans for the same run) and
throughput (interleaved repetitions, start-up removed as in overhead.py).

    python benchmarks/lora.py --reps 4 [--memory-model 125m] [--short 10 --long 40]

Memory: 2 processes, DDP and ZeRO-3, fp32 and bf16 compute, full training against adapters of rank 8 and
64 on every projection of the blocks. Throughput: configs/bench.yaml (the `tiny` model, DDP on 2
processes) with the same three variants.
"""

from __future__ import annotations

import argparse

from overhead import REPO, add_common_args, disttrain_command, interleaved, print_table, summarize, write_results

from disttrain.bench.model_states import launch
from disttrain.config.load import load_config
from disttrain.plan.estimate import estimate
from disttrain.config.resolve import resolve_run

VARIANTS = {"full": [], "lora r8": ["model.lora.rank=8", "model.lora.alpha=16"],
            "lora r64": ["model.lora.rank=64", "model.lora.alpha=128"]}
KEYS = ("params", "grads", "optimizer")


def planned(model: str, stage: int, extra: list[str]) -> dict:
    """The planner's bytes per rank for the run the probe measures (its batch, sequence and precision)."""
    cfg = load_config(None, [f"model.name={model}", "train.global_batch_size=4", "data.seq_len=32",
                             "train.micro_batch_size=1", f"parallel.zero_stage={stage}", *extra])
    resolved = resolve_run(cfg, 2, "cpu")
    rank = cfg.model.lora.rank if cfg.model.lora is not None else 0
    est = estimate(resolved.shape, resolved.layout, model=model, accounting="runtime", lora_rank=rank).as_dict()
    return est["bytes_per_rank"]


def memory(model: str, run_dir) -> list[dict]:
    rows = []
    print(f"\nModel states per rank, {model}, 2 processes (MiB measured / planned):\n\n| compute | stage | variant | "
          "params | grads | optimizer | total | vs full |\n|---|---|---|---|---|---|---|---|")
    for dtype in ("fp32", "bf16"):
        full_total = {}
        for name, extra in VARIANTS.items():
            overrides = [*extra, f"precision.compute_dtype={dtype}"]
            for got in launch(2, run_dir, stages=[0, 3], overrides=overrides, model=model):
                if got["rank"] != 0:
                    continue
                stage = got["stage"]
                plan = planned(model, stage, overrides)
                total = sum(got[k] for k in KEYS)
                full_total.setdefault(stage, total)
                row = {"compute": dtype, "stage": stage, "variant": name, "measured": {k: got[k] for k in KEYS},
                       "planned": {k: plan[k] for k in KEYS}, "planned_total_with_activations": plan["total"]}
                rows.append(row)
                cells = " | ".join(f"{got[k] / 2**20:,.1f} / {plan[k] / 2**20:,.1f}" for k in KEYS)
                planned_total = sum(plan[k] for k in KEYS)
                print(f"| {dtype} | {stage} | {name} | {cells} | {total / 2**20:,.1f} / {planned_total / 2**20:,.1f} "
                      f"| {total / full_total[stage]:.3f} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "lora.json")
    parser.add_argument("--memory-model", default="125m")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    run_dir = REPO / "runs" / "bench-lora"
    rows = memory(args.memory_model, run_dir)
    results, summary = {}, {}
    if not args.skip_throughput:
        results = interleaved(list(VARIANTS), lambda name, steps: disttrain_command(VARIANTS[name], steps, run_dir),
                              args.reps, args.short, args.long)
        summary = summarize(results, "full")
        print_table(summary, "full")
    write_results(args.out, {"args": vars(args), "memory": rows, "runs": results, "summary": summary})


if __name__ == "__main__":
    main()
