#!/bin/bash
# What needs a GPU, on one GPU (docs/benchmarks/gpu.md). Writes under $OUT; training runs under $RUNS.
#     OUT=/tmp/cuda bash benchmarks/cuda_check.sh dense   # `1b` in bf16 (MFU, CUDA peak memory for the dry run and
#                                                         # the planner to be held to on the CPU afterwards), a
#                                                         # tiny-sized MoE through grouped GEMM, grouped GEMM against
#                                                         # the per-expert loop up to Qwen3-30B-A3B's expert shape
#     OUT=/tmp/cuda bash benchmarks/cuda_check.sh moe     # a mid-sized built-in MoE's CUDA peak memory, and a
#                                                         # Hugging Face Qwen3-MoE trained through `model.hf`
#     OUT=/tmp/cuda bash benchmarks/cuda_check.sh speed   # `1b` bf16 at 2,048 tokens: the loss in chunks or whole,
#                                                         # compile, float8 rowwise (torchao installed), checkpointing
# The parts are separate so that each call's files fit what one device call brings back (8).
set -u
PART=${1:-dense}
OUT=${OUT:-/tmp/cuda_check}
RUNS=${RUNS:-/tmp/cuda_check_runs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BASE="optim.warmup_steps=0 train.eval_every=0 train.sample_tokens=0 checkpoint.every_steps=0 checkpoint.save_final=false
 checkpoint.resume=none metrics.log_every=5 precision.compute_dtype=bf16 run.dir=$RUNS"

train() {  # NAME SECONDS KEY=VALUE...: one training run, its metrics copied to $OUT/NAME.jsonl. The dry run of the
  local name=$1 seconds=$2  # same run: `disttrain dryrun configs/demo.yaml KEY=VALUE... --world-size 1 --gpu h200`
  shift 2
  timeout "$seconds" $PY -m disttrain train configs/demo.yaml $BASE "$@" run.name="$name" 2>&1 | tail -3
  cp "$RUNS/$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
}

if [ "$PART" = dense ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')" 2>&1 | tee -a "$OUT/gpu.txt"
  DENSE="data.seq_len=2048 train.global_batch_size=8 train.micro_batch_size=4"
  for run in "selective 0" "none 0" "selective 3"; do
    set -- $run
    train "1b_$1_zero$2" 240 model.name=1b $DENSE train.steps=25 parallel.activation_checkpointing=$1 parallel.zero_stage=$2
  done
  train moe 180 model.name=debug-moe model.dim=256 model.n_layers=4 model.n_heads=8 model.n_kv_heads=4 model.ffn_hidden_dim=768 \
      model.max_seq_len=2048 model.moe.num_experts=16 model.moe.moe_intermediate_size=256 $DENSE train.steps=30
  timeout 120 $PY benchmarks/moe_grouped_gemm.py --device cuda --dtype bf16 --shapes tiny-moe,qwen3-30b-moe --tokens 8192 \
      --reps 10 2>&1 | tee "$OUT/grouped_gemm.txt"
elif [ "$PART" = moe ]; then
  for ac in none selective; do
    train "moe_$ac" 200 model.name=debug-moe model.dim=1024 model.n_layers=8 model.n_heads=16 model.n_kv_heads=4 \
        model.ffn_hidden_dim=2816 model.max_seq_len=4096 model.moe.num_experts=32 model.moe.num_experts_per_tok=4 \
        model.moe.moe_intermediate_size=1024 data.seq_len=4096 train.micro_batch_size=2 train.global_batch_size=4 \
        train.steps=20 parallel.activation_checkpointing=$ac
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
  train hf_qwen3_moe 200 model.hf=/tmp/qwen3_moe_small data.seq_len=1024 train.micro_batch_size=4 \
      train.global_batch_size=8 train.steps=30
elif [ "$PART" = speed ]; then
  DENSE="model.name=1b data.seq_len=2048 train.global_batch_size=8 train.micro_batch_size=4 train.steps=30"
  train 1b_chunked 240 $DENSE
  train 1b_whole 240 $DENSE train.loss_chunk_tokens=0
  train 1b_compile 300 $DENSE parallel.compile=true
  train 1b_float8 300 $DENSE precision.float8=rowwise
  train 1b_float8_compile 300 $DENSE precision.float8=rowwise parallel.compile=true
  train 1b_float8_compile_selective 300 $DENSE precision.float8=rowwise parallel.compile=true \
      parallel.activation_checkpointing=selective
else
  echo "usage: bash benchmarks/cuda_check.sh dense|moe|speed" >&2
  exit 2
fi
