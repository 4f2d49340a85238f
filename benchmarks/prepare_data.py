"""prepare-data throughput against `datasets.map(batched=True, num_proc=2)`, same Parquet file, same tokenizer.

The input: the built-in corpus repeated to about `--mb` MB, written as one Parquet file; the tokenizer:
a byte-level BPE (vocabulary 8192) trained on the corpus, as tokenizer.json. Per repetition, in
rotated order, each in a fresh process:
  disttrain   disttrain prepare-data FILE --tokenizer tokenizer.json --workers 2   (token shards written)
  datasets    load_dataset("parquet") + .map(encode_batch, batched=True, num_proc=2) (Arrow cache written)
Tokens/s counts the tokens each produced over the process's wall time (start-up included for both);
CPU-s/token is user+system time of the process tree.

    python benchmarks/prepare_data.py --reps 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from overhead import measure_command  # wall and CPU seconds of one command (this folder)

REPO = Path(__file__).resolve().parents[1]
DATASETS_SCRIPT = r"""
import sys, datasets
from tokenizers import Tokenizer
parquet, tok_path, cache, count_file = sys.argv[1:5]
tok = Tokenizer.from_file(tok_path)
def encode(batch):
    return {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}
ds = datasets.load_dataset("parquet", data_files=parquet, cache_dir=cache)["train"]
out = ds.map(encode, batched=True, num_proc=2, remove_columns=ds.column_names)
# + one end-of-document token each, as prepare-data writes
open(count_file, "w").write(str(sum(len(x) for x in out["ids"]) + len(out)))
"""


def make_inputs(root: Path, megabytes: float) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from disttrain.data.corpus import builtin_splits
    from disttrain.data.prepare import train_bpe

    docs = builtin_splits()["train"]
    size = sum(len(d.encode()) for d in docs)
    copies = max(1, round(megabytes * 1e6 / size))
    pq.write_table(pa.table({"text": docs * copies}), root / "corpus.parquet")
    (root / "seed.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_bpe([root / "seed.jsonl"], "text", 8192, root / "tokenizer.json")
    return root / "corpus.parquet", root / "tokenizer.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--mb", type=float, default=30.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "prepare_data.json"))
    args = ap.parse_args()
    reps = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        parquet, tok = make_inputs(root, args.mb)
        for rep in range(args.reps):
            row = {}
            for name in (["disttrain", "datasets"] if rep % 2 == 0 else ["datasets", "disttrain"]):
                out = root / f"{name}{rep}"
                if name == "disttrain":
                    wall, cpu = measure_command([sys.executable, "-m", "disttrain", "prepare-data", str(parquet),
                                                 "--out", str(out), "--tokenizer", str(tok), "--workers", "2"])
                    meta = json.loads((out / "meta.json").read_text())
                    tokens = sum(meta["splits"].values())
                else:
                    count = root / f"count{rep}"
                    wall, cpu = measure_command([sys.executable, "-c", DATASETS_SCRIPT, str(parquet), str(tok),
                                                 str(out), str(count)])
                    tokens = int(count.read_text())
                row[name] = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "cpu_s_per_token": cpu / tokens}
            row["ratio"] = row["disttrain"]["tokens_per_s"] / row["datasets"]["tokens_per_s"]
            reps.append(row)
            print(f"rep {rep + 1}: disttrain {row['disttrain']['tokens_per_s']:,.0f} tok/s, datasets "
                  f"{row['datasets']['tokens_per_s']:,.0f} tok/s, ratio {row['ratio']:.3f}", flush=True)
    ratios = [r["ratio"] for r in reps]
    summary = {name: {"tokens_per_s_median": statistics.median(r[name]["tokens_per_s"] for r in reps),
                      "tokens_per_s_range": [min(r[name]["tokens_per_s"] for r in reps),
                                             max(r[name]["tokens_per_s"] for r in reps)],
                      "cpu_s_per_token_median": statistics.median(r[name]["cpu_s_per_token"] for r in reps),
                      "tokens": reps[0][name]["tokens"]} for name in ("disttrain", "datasets")}
    summary["ratio_median"], summary["ratio_range"] = statistics.median(ratios), [min(ratios), max(ratios)]
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": "python benchmarks/prepare_data.py " + " ".join(sys.argv[1:]), "input_mb": args.mb,
              "reps": reps, "summary": summary}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
