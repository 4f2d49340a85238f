"""The Hugging Face workload of benchmarks/hf_frameworks.py: transformers' LlamaForCausalLM (hidden 256,
4 layers, 4 heads, FFN 1024, vocab 256), sequences of 256 tokens from the built-in corpus, a micro-batch of
8 per rank on 2 ranks (no accumulation), fp32, AdamW, clipping at 1.0 - the same for every framework."""

import argparse
import os

import torch

SEQ_LEN = 256
MICRO_BATCH = 8
LR = 3e-3
HF_CONFIG = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=256, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--strategy", default="ddp")
    return parser.parse_args()


def make_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**HF_CONFIG, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def RandomWindows(rank: int):  # noqa: N802 - the same sampler as the tiny workload, at this shape
    from common import RandomWindows as Windows

    return Windows(rank, SEQ_LEN, MICRO_BATCH)


def loss_fn(out, targets):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def train_loop(model, steps: int) -> None:
    """The hand-written loops' step: forward, backward, clip to 1.0, AdamW, clear."""
    import torch.distributed as dist

    opt = make_optimizer(model)
    data = RandomWindows(dist.get_rank())
    for _ in range(steps):
        x, y = data.micro_batch()
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
