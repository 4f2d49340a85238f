#!/usr/bin/env bash
# Fine-tuning end to end on 2 CPU processes, from the repository root:
#   bash examples/sft/run.sh [WORK_DIR [key=value ...]]    (the overrides go to `disttrain train`)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
WORK=${1:-runs/sft-example}
shift $(( $# > 0 ? 1 : 0 ))
HERE=$(dirname "$0")

# a chat dataset, a BPE tokenizer with a chat template, a tiny Llama: made here, nothing downloaded
"$PY" "$HERE/make_assets.py" "$WORK"
# render every record with the chat template; only the assistant's tokens carry loss
"$PY" -m disttrain prepare-data "$WORK/chats.jsonl" --out "$WORK/data" --tokenizer "$WORK/tokenizer" \
    --seq-len 128 --val-fraction 0.05 --force
# LoRA adapters on the frozen base, data parallel over 2 processes
"$PY" -m disttrain train "$HERE/sft.yaml" "model.hf=$WORK/base" "data.source=$WORK/data" "run.dir=$WORK" \
    run.name=run --nproc-per-node 2 "$@"
# the adapters in PEFT's format, and the base with them folded in
"$PY" -m disttrain convert "$WORK/run" --to peft --out "$WORK/adapter"
"$PY" -m disttrain convert "$WORK/run" --to hf --merge-lora --out "$WORK/merged"
# answers from both, through transformers' generate
"$PY" "$HERE/generate.py" "$WORK"
