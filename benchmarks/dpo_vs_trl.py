"""DPO with LoRA on chat pairs: disttrain against TRL's DPOTrainer + peft, 2 CPU processes each, interleaved
repetitions.

    make bench-env && .venv/bin/python benchmarks/dpo_vs_trl.py --reps 4

The workload: the fine-tuning example's tiny Llama (4 layers, hidden 64), its BPE tokenizer and ChatML template
(examples/sft/make_assets.py), and 1,024 pairs: conversations of one to four questions about sums whose last
answer is right (chosen) or wrong and longer (rejected). 16 pairs a step (8 per process), LoRA rank 16 on every
linear layer of the blocks, beta 0.1, the sigmoid loss, the base (adapters off) as reference, fp32, unpacked:
each framework pads a batch to its longest sequence. Each figure is the steady state between a short and a long
run (start-up cancels out): milliseconds and CPU-milliseconds per pair; the ratio is TRL's time over
disttrain's (above 1: disttrain is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid

from overhead import BENCH_PY, REPO, WORKLOADS, add_common_args, interleaved, write_results
from sft_vs_trl import _assets_module

VARIANTS = ("disttrain", "trl")
PER_STEP = 16
WORK = REPO / "runs" / "bench-dpo"
CONFIG = REPO / "examples" / "dpo" / "dpo.yaml"


def pair_records(n: int) -> list[dict]:
    """Explicit-prompt pairs from the example's conversations: the last answer right, or wrong and longer."""
    assets = _assets_module()
    out = []
    for i, record in enumerate(assets.make_records(n, max_turns=4, instructions=0)):
        *prompt, answer = record["messages"]
        good = answer["content"]
        wrong = good.rsplit(" ", 1)[0] + f" {i % 7 + 19}, or so I believe, give or take a few."
        out.append({"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": wrong}]})
    return out


def make_work(n: int = 1024) -> dict:
    """The model, tokenizer, pairs and disttrain's prepared shards under runs/bench-dpo."""
    assets = _assets_module()
    WORK.mkdir(parents=True, exist_ok=True)
    records = pair_records(n)
    (WORK / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    texts = [m["content"] for r in records for k in ("prompt", "chosen", "rejected") for m in r[k]]
    assets.train_tokenizer(texts, WORK / "tokenizer", vocab_size=384, template=assets.chat_template())
    assets.save_base(WORK / "base", vocab_size=384)
    from disttrain.cli import main as disttrain_main

    disttrain_main(["prepare-data", str(WORK / "pairs.jsonl"), "--out", str(WORK / "data"), "--tokenizer",
                    str(WORK / "tokenizer"), "--seq-len", "256", "--val-fraction", "0", "--force"])
    meta = json.loads((WORK / "data" / "meta.json").read_text())["preference"]
    return {"pairs": meta["written"], "tokens_per_pair": meta["tokens"] / meta["written"]}


def command(variant: str, steps: int) -> list[str]:
    if variant == "trl":
        return [str(BENCH_PY), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                str(WORKLOADS / "trl_dpo.py"), "--work", str(WORK), "--steps", str(steps)]
    return [sys.executable, "-m", "disttrain", "train", str(CONFIG), f"model.hf={WORK / 'base'}",
            f"data.source={WORK / 'data'}", "data.seq_len=256", "train.global_batch_size=16",
            "train.micro_batch_size=8", f"train.steps={steps}", "train.eval_every=0", "train.sample_tokens=0",
            "checkpoint.every_steps=0", "checkpoint.save_final=false", "optim.lr=2e-3", "optim.schedule=constant",
            "optim.warmup_steps=0", "metrics.log_every=1000", f"run.dir={WORK / 'runs'}",
            f"run.name=bench-{uuid.uuid4().hex[:12]}", "--nproc-per-node", "2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "dpo_vs_trl.json")
    parser.set_defaults(short=4, long=68)  # 64 steps apart: 1,024 pairs, one epoch
    args = parser.parse_args()
    if not BENCH_PY.exists():
        raise SystemExit("the comparison environment is missing: run `make bench-env` first")
    data = make_work()
    print(f"{data['pairs']} pairs, {data['tokens_per_pair']:.1f} tokens a pair on average", flush=True)
    results = interleaved(list(VARIANTS), command, args.reps, args.short, args.long, tokens_per_step=PER_STEP)
    for rows in results.values():  # tokens_per_step=PER_STEP: the harness's "tokens" are pairs here
        for row in rows:
            row["pairs_per_s"] = row.pop("tokens_per_s")
            row["cpu_s_per_pair"] = row.pop("cpu_s_per_token")
    summary = {name: {"ms_per_pair": statistics.median(1e3 / r["pairs_per_s"] for r in rows),
                      "range": [min(1e3 / r["pairs_per_s"] for r in rows), max(1e3 / r["pairs_per_s"] for r in rows)],
                      "cpu_ms_per_pair": statistics.median(1e3 * r["cpu_s_per_pair"] for r in rows)}
               for name, rows in results.items()}
    ratios = [o["pairs_per_s"] / t["pairs_per_s"] for o, t in zip(results["disttrain"], results["trl"])]
    summary["disttrain / trl"] = {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    write_results(args.out, {"args": vars(args), "data": data, "runs": results, "summary": summary})
    for name, row in summary.items():
        print(f"{name:>20}: {json.dumps(row)}")


if __name__ == "__main__":
    main()
