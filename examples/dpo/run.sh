#!/usr/bin/env bash
# Preference optimisation and distillation end to end on 2 CPU processes, from the repository root:
#   bash examples/dpo/run.sh [WORK_DIR [key=value ...]]    (the overrides go to the DPO training)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
WORK=${1:-runs/dpo-example}
shift $(( $# > 0 ? 1 : 0 ))
HERE=$(dirname "$0")
SFT="$HERE/../sft"

# the fine-tuning example's conversations, tokenizer and tiny base model; a short fine-tuning, merged
"$PY" "$SFT/make_assets.py" "$WORK"
"$PY" -m disttrain prepare-data "$WORK/chats.jsonl" --out "$WORK/chat-data" --tokenizer "$WORK/tokenizer" \
    --seq-len 128 --val-fraction 0.05 --force
"$PY" -m disttrain train "$SFT/sft.yaml" "model.hf=$WORK/base" "data.source=$WORK/chat-data" "run.dir=$WORK" \
    run.name=sft train.sample_tokens=0 --nproc-per-node 2
"$PY" -m disttrain convert "$WORK/sft" --to hf --merge-lora --out "$WORK/sft-merged"

# pairs: each conversation's right last answer preferred over a wrong one; and a smaller student model
"$PY" "$HERE/make_pairs.py" "$WORK"
"$PY" -m disttrain prepare-data "$WORK/pairs.jsonl" --out "$WORK/pair-data" --tokenizer "$WORK/tokenizer" \
    --seq-len 128 --val-fraction 0.05 --force

# DPO with LoRA on the fine-tuned model (its reference: the same model with the adapters off), then both exports
"$PY" -m disttrain train "$HERE/dpo.yaml" "model.hf=$WORK/sft-merged" "data.source=$WORK/pair-data" \
    "run.dir=$WORK" run.name=dpo --nproc-per-node 2 "$@"
"$PY" -m disttrain convert "$WORK/dpo" --to peft --out "$WORK/dpo-adapter"
"$PY" -m disttrain convert "$WORK/dpo" --to hf --merge-lora --out "$WORK/dpo-merged"

# distillation: the smaller student learns the fine-tuned model's distribution on the conversations (the teacher
# is the fine-tuning run itself: its checkpoint, adapters folded in)
"$PY" -m disttrain train "$HERE/distill.yaml" "model.hf=$WORK/student" "data.source=$WORK/chat-data" \
    "distill.teacher=$WORK/sft" "run.dir=$WORK" run.name=distill --nproc-per-node 2
"$PY" -m disttrain convert "$WORK/distill" --to hf --out "$WORK/distilled"

# answers from each model, through transformers' generate
"$PY" "$HERE/generate.py" "$WORK"
