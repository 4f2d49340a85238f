"""TRL's SFTTrainer with a peft LoRA adapter on the benchmark's conversations (benchmarks/sft_vs_trl.py), under
torchrun: the same model, chat template, batch (8 conversations per process, 16 per step), sequence limit,
adapter (rank 16, alpha 32, every linear layer of the blocks, no dropout), loss (assistant tokens only, from
the template's generation markers), precision (fp32) and recomputation (none) as disttrain's side. TRL's own
defaults would differ on the last two: bf16 autocast (25x slower matmuls on this CPU) and gradient checkpointing. Padding to each batch's longest conversation is TRL's
default collator; `--packing` packs instead (TRL's best-fit packing, padding-free); `--padding-free` keeps each
batch's conversations but lays them end to end in one row (TRL's padding_free; position ids keep them apart)."""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--padding-free", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch_compile=True (TrainingArguments')")
    parser.add_argument("--count-rows", action="store_true", help="print the training rows TRL made, and stop")
    args = parser.parse_args()

    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    work = args.work
    tokenizer = AutoTokenizer.from_pretrained(f"{work}/tokenizer")
    model = AutoModelForCausalLM.from_pretrained(f"{work}/base", dtype=torch.float32)
    data = load_dataset("json", data_files=f"{work}/chats.jsonl", split="train")
    config = SFTConfig(output_dir=f"{work}/trl-out-{os.getpid()}", max_steps=args.steps, per_device_train_batch_size=8,
                       gradient_accumulation_steps=1, learning_rate=2e-3, lr_scheduler_type="constant",
                       warmup_steps=0, max_length=256, packing=args.packing, assistant_only_loss=True,
                       padding_free=args.padding_free, torch_compile=args.compile,
                       logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True,
                       dataloader_num_workers=0, seed=0, disable_tqdm=True,
                       bf16=False, gradient_checkpointing=False)  # TRL's defaults: bf16 autocast, recomputation
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora)
    if args.count_rows:  # packed, several conversations a row: the benchmark's conversations per step
        print(f"ROWS {len(trainer.train_dataset)} CONVERSATIONS {len(data)}")
        return
    trainer.train()


if __name__ == "__main__":
    main()
