#!/bin/bash
# What needs a GPU, in one pass on one GPU (docs/benchmarks.md, "On a GPU"): a `1b` bf16 training run (MFU and
# CUDA peak memory, held to the planner and the dry run on the CPU afterwards), a tiny-sized MoE in bf16 through
# grouped GEMM, and grouped GEMM against the per-expert loop at Qwen3-30B-A3B's expert shape. Writes under $OUT.
#     OUT=/tmp/cuda bash benchmarks/cuda_check.sh
set -u
OUT=${OUT:-/tmp/cuda_check}
RUNS=${RUNS:-/tmp/cuda_check_runs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
COMMON="data.seq_len=2048 train.global_batch_size=8 train.micro_batch_size=4 optim.warmup_steps=0 train.eval_every=0
 train.sample_tokens=0 checkpoint.every_steps=0 checkpoint.save_final=false checkpoint.resume=none metrics.log_every=5
 precision.compute_dtype=bf16 run.dir=$RUNS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')" 2>&1 | tee -a "$OUT/gpu.txt"
for run in "selective 0" "none 0" "selective 3"; do
  set -- $run
  timeout 240 $PY -m disttrain train configs/demo.yaml model.name=1b $COMMON train.steps=25 \
      parallel.activation_checkpointing=$1 parallel.zero_stage=$2 run.name=1b-$1-zero$2 2>&1 | tail -3
  cp "$RUNS/1b-$1-zero$2/metrics.jsonl" "$OUT/1b_$1_zero$2.jsonl" 2>/dev/null
done
timeout 180 $PY -m disttrain train configs/demo.yaml model.name=debug-moe model.dim=256 model.n_layers=4 model.n_heads=8 \
    model.n_kv_heads=4 model.ffn_hidden_dim=768 model.max_seq_len=2048 model.moe.num_experts=16 model.moe.moe_intermediate_size=256 \
    $COMMON train.steps=30 run.name=moe 2>&1 | tail -3
cp "$RUNS/moe/metrics.jsonl" "$OUT/moe_metrics.jsonl" 2>/dev/null
cp "$RUNS/moe/config.yaml" "$OUT/moe_config.yaml" 2>/dev/null
timeout 120 $PY benchmarks/moe_grouped_gemm.py --device cuda --dtype bf16 --shapes tiny-moe,qwen3-30b-moe --tokens 8192 \
    --reps 10 2>&1 | tee "$OUT/grouped_gemm.txt"
