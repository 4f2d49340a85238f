"""TRL's DPOTrainer with a peft LoRA adapter on the benchmark's pairs (benchmarks/dpo_vs_trl.py), under torchrun:
the same model, chat template, batch (8 pairs per process, 16 per step), sequence limit, adapter (rank 16, alpha
32, every linear layer of the blocks, no dropout), beta, loss (sigmoid), reference (the base: the adapters
switched off), precision (fp32) and recomputation (none) as disttrain's side. Batches are padded to their
longest sequence (TRL's default collator)."""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()

    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    work = args.work
    tokenizer = AutoTokenizer.from_pretrained(f"{work}/tokenizer")
    model = AutoModelForCausalLM.from_pretrained(f"{work}/base", dtype=torch.float32)
    data = load_dataset("json", data_files=f"{work}/pairs.jsonl", split="train")
    config = DPOConfig(output_dir=f"{work}/trl-out-{os.getpid()}", max_steps=args.steps, per_device_train_batch_size=8,
                       gradient_accumulation_steps=1, learning_rate=2e-3, lr_scheduler_type="constant",
                       warmup_steps=0, max_length=256, beta=0.1, loss_type=["sigmoid"], logging_steps=10_000,
                       save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0,
                       disable_tqdm=True, bf16=False, gradient_checkpointing=False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora).train()


if __name__ == "__main__":
    main()
