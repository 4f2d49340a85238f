"""The loss in chunks against whole logits on 2 CPU processes (configs/bench.yaml: `tiny`, DDP): whole logits
(`train.loss_chunk_tokens=0`), the default chunk (here one chunk a micro-batch), and chunks of 128 tokens (several a
micro-batch). Each variant runs `--short` and `--long` steps (start-up cancels out); the variants are interleaved in
rotated order; ratios within a repetition, against whole logits.

    python benchmarks/chunked_loss.py --reps 4 [--vocab 256]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from overhead import (REPO, TOKENS_PER_STEP, add_common_args, disttrain_command, interleaved, print_table, summarize,
                      write_results)

CHUNKS = {"whole logits": 0, "default chunk (2048)": 2048, "chunks of 128": 128}


def command(name: str, steps: int, vocab: int, run_dir: Path) -> list[str]:
    return disttrain_command([f"train.loss_chunk_tokens={CHUNKS[name]}", f"model.vocab_size={vocab}",
                              "metrics.log_every=1000"], steps, run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "chunked_loss.json")
    parser.add_argument("--vocab", type=int, default=256, help="model.vocab_size (256: the byte tokenizer's)")
    args = parser.parse_args()
    names = list(CHUNKS)
    run_dir = REPO / "runs" / "bench-chunked-loss"
    results = interleaved(names, lambda name, steps: command(name, steps, args.vocab, run_dir), args.reps,
                          args.short, args.long, tokens_per_step=TOKENS_PER_STEP)
    summary = summarize(results, names[0])
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})
    print_table(summary, names[0])


if __name__ == "__main__":
    main()
