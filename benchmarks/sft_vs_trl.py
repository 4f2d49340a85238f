"""Supervised fine-tuning with LoRA on chat data: disttrain against TRL's SFTTrainer + peft, 2 CPU processes each,
interleaved repetitions.

    make bench-env && .venv/bin/python benchmarks/sft_vs_trl.py --reps 4

The workload: the fine-tuning example's tiny Llama (4 layers, hidden 64), its BPE tokenizer and ChatML template
with generation markers (examples/sft/make_assets.py), and 1,024 conversations of one to eight questions about
sums (about 120 tokens on average, at most 256); 16 conversations a step (8 per process), LoRA rank 16 on every
linear layer of the blocks, loss on the assistant's tokens only, fp32. Variants:
- `disttrain`: unpacked, each micro-batch padded to its longest conversation (data.padding=longest, the default);
- `disttrain-seq_len`: unpacked, every conversation padded to data.seq_len=256;
- `disttrain-padding_free`: unpacked, each micro-batch's conversations laid end to end in rows of 256 tokens
  (data.padding=none; the same conversations and losses as padded);
- `disttrain-padding_free-compile`: the same with parallel.compile=true (torch.compile of each decoder block);
- `disttrain-packed`: conversations packed first-fit with document masking;
- `trl`: unpacked, TRL's default collator (each batch padded to its longest);
- `trl-padding_free`: unpacked, each batch's conversations in one row (TRL's padding_free);
- `trl-packed`: TRL's packing.
Each figure is the steady state between a short and a long run (start-up cancels out): milliseconds and
CPU-milliseconds per conversation; the ratio is TRL's time over disttrain's (above 1: disttrain is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import uuid

from overhead import BENCH_PY, REPO, WORKLOADS, add_common_args, interleaved, write_results

VARIANTS = ("disttrain", "disttrain-seq_len", "disttrain-padding_free", "disttrain-padding_free-compile",
            "disttrain-packed", "trl", "trl-padding_free", "trl-packed")
PER_STEP = 16
PADDING = {"seq_len": "seq_len", "padding_free": "none"}  # disttrain's data.padding per variant
WORK = REPO / "runs" / "bench-sft"


def _assets_module():
    spec = importlib.util.spec_from_file_location("make_assets", REPO / "examples" / "sft" / "make_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_work(n: int = 1024) -> dict:
    """The model, tokenizer, conversations and disttrain's prepared shards under runs/bench-sft; their lengths."""
    from transformers import AutoTokenizer

    assets = _assets_module()
    WORK.mkdir(parents=True, exist_ok=True)
    records = assets.make_records(n, max_turns=8, instructions=0)  # chats only: 1-8 turns each
    (WORK / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    texts = [m["content"] for r in records for m in r["messages"]]
    assets.train_tokenizer(texts, WORK / "tokenizer", vocab_size=384, template=assets.chat_template())
    assets.save_base(WORK / "base", vocab_size=384)
    from disttrain.cli import main as disttrain_main

    disttrain_main(["prepare-data", str(WORK / "chats.jsonl"), "--out", str(WORK / "data"), "--tokenizer",
                    str(WORK / "tokenizer"), "--seq-len", "256", "--val-fraction", "0.01", "--force"])
    tok = AutoTokenizer.from_pretrained(WORK / "tokenizer")
    lengths = [len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
               for r in records]
    return {"conversations": n, "mean_tokens": statistics.mean(lengths), "max_tokens": max(lengths),
            "per_step": conversations_per_step()}


def conversations_per_step() -> dict[str, float]:
    """A step reads 16 rows: 16 conversations unpacked, more packed (each framework's own packing)."""
    from disttrain.data.source import load_samples

    one = len(load_samples(str(WORK / "data"), "auto", 256, False)[1])
    packed = len(load_samples(str(WORK / "data"), "auto", 256, True)[1])
    counted = subprocess.run([str(BENCH_PY), str(WORKLOADS / "trl_sft.py"), "--work", str(WORK), "--steps", "1",
                              "--packing", "--count-rows"], capture_output=True, text=True, check=True).stdout
    rows, convs = re.search(r"ROWS (\d+) CONVERSATIONS (\d+)", counted).groups()
    per_step = {v: float(PER_STEP) for v in VARIANTS}
    per_step["disttrain-packed"] = PER_STEP * one / packed
    per_step["trl-packed"] = PER_STEP * int(convs) / int(rows)
    return per_step


def command(variant: str, steps: int) -> list[str]:
    if variant.startswith("trl"):
        return [str(BENCH_PY), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                str(WORKLOADS / "trl_sft.py"), "--work", str(WORK), "--steps", str(steps),
                *(["--packing"] if variant.endswith("packed") else []),
                *(["--padding-free"] if variant.endswith("padding_free") else [])]
    return [sys.executable, "-m", "disttrain", "train", str(REPO / "examples" / "sft" / "sft.yaml"),
            f"model.hf={WORK / 'base'}", f"data.source={WORK / 'data'}", "data.seq_len=256",
            f"data.packing={'true' if variant.endswith('packed') else 'false'}",
            f"data.padding={next((v for k, v in PADDING.items() if k in variant), 'longest')}",
            f"parallel.compile={'true' if variant.endswith('compile') else 'false'}",
            f"train.steps={steps}", "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every_steps=0",
            "checkpoint.save_final=false", "optim.lr=2e-3", "optim.schedule=constant", "optim.warmup_steps=0",
            "metrics.log_every=1000", f"run.dir={WORK / 'runs'}", f"run.name=bench-{uuid.uuid4().hex[:12]}",
            "--nproc-per-node", "2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "sft_vs_trl.json")
    parser.set_defaults(short=4, long=64)  # 60 steps apart: 960 conversations, most of one epoch
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if any(v.startswith("trl") for v in variants) and not BENCH_PY.exists():
        raise SystemExit("the comparison environment is missing: run `make bench-env` first")
    data = make_work()
    print(f"{data['conversations']} conversations, {data['mean_tokens']:.1f} tokens on average, "
          f"at most {data['max_tokens']}; conversations per step: {data['per_step']}", flush=True)
    results = interleaved(variants, command, args.reps, args.short, args.long, tokens_per_step=PER_STEP)
    for name, rows in results.items():  # per conversation, whatever a step holds
        for row in rows:
            scale = data["per_step"][name] / PER_STEP
            row["conversations_per_s"] = row.pop("tokens_per_s") * scale
            row["cpu_s_per_conversation"] = row.pop("cpu_s_per_token") / scale
    summary = {}
    for name, rows in results.items():
        ms = [1e3 / r["conversations_per_s"] for r in rows]
        cpu = [1e3 * r["cpu_s_per_conversation"] for r in rows]
        summary[name] = {"ms_per_conversation": statistics.median(ms), "range": [min(ms), max(ms)],
                         "cpu_ms_per_conversation": statistics.median(cpu)}
    for ours, theirs in (("disttrain", "trl"), ("disttrain-seq_len", "trl"), ("disttrain-padding_free", "trl"),
                         ("disttrain-padding_free", "trl-padding_free"), ("disttrain-padding_free-compile", "trl"),
                         ("disttrain-packed", "trl-packed"),
                         ("disttrain-packed", "trl")):
        if ours in results and theirs in results:  # per repetition: the two ran minutes apart at most
            ratios = [o["conversations_per_s"] / t["conversations_per_s"]
                      for o, t in zip(results[ours], results[theirs])]
            summary[f"{ours} / {theirs}"] = {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    write_results(args.out, {"args": vars(args), "data": data, "runs": results, "summary": summary})
    for name, row in summary.items():
        print(f"{name:>32}: {json.dumps(row)}")


if __name__ == "__main__":
    main()
