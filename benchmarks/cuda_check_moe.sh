#!/bin/bash
# Mixtures of experts on one GPU (docs/benchmarks.md, "On one GPU"): a mid-sized built-in MoE in bf16 (CUDA peak
# memory, held to the dry run and the planner on the CPU afterwards), and a Hugging Face Qwen3-MoE (transformers'
# own random init) trained through `model.hf`. Writes under $OUT.
#     OUT=/tmp/cuda bash benchmarks/cuda_check_moe.sh
set -u
OUT=${OUT:-/tmp/cuda_check_moe}
RUNS=${RUNS:-/tmp/cuda_check_runs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
COMMON="optim.warmup_steps=0 train.eval_every=0 train.sample_tokens=0 checkpoint.every_steps=0 checkpoint.save_final=false
 checkpoint.resume=none metrics.log_every=5 precision.compute_dtype=bf16 run.dir=$RUNS"
MOE="model.name=debug-moe model.dim=1024 model.n_layers=8 model.n_heads=16 model.n_kv_heads=4 model.ffn_hidden_dim=2816
 model.max_seq_len=4096 model.moe.num_experts=32 model.moe.num_experts_per_tok=4 model.moe.moe_intermediate_size=1024
 data.seq_len=4096 train.micro_batch_size=2 train.global_batch_size=4"
for ac in none selective; do
  timeout 200 $PY -m disttrain train configs/demo.yaml $MOE $COMMON train.steps=20 parallel.activation_checkpointing=$ac \
      run.name=moe-$ac 2>&1 | tail -3
  cp "$RUNS/moe-$ac/metrics.jsonl" "$OUT/moe_${ac}.jsonl" 2>/dev/null
  cp "$RUNS/moe-$ac/config.yaml" "$OUT/moe_${ac}_config.yaml" 2>/dev/null
done
$PY - <<'PY'
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
config = Qwen3MoeConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=64, vocab_size=256, max_position_embeddings=1024,
                        moe_intermediate_size=512, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                        tie_word_embeddings=False)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).save_pretrained("/tmp/qwen3_moe_small")
print("saved /tmp/qwen3_moe_small")
PY
timeout 200 $PY -m disttrain train configs/demo.yaml model.hf=/tmp/qwen3_moe_small data.seq_len=1024 \
    train.micro_batch_size=4 train.global_batch_size=8 $COMMON train.steps=30 run.name=hf-qwen3-moe 2>&1 | tail -4
cp "$RUNS/hf-qwen3-moe/metrics.jsonl" "$OUT/hf_qwen3_moe.jsonl" 2>/dev/null
