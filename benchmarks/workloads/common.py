"""The shared benchmark workload: the same model, batch, data and optimizer for every framework.

Every framework trains disttrain's single-device Llama model (so only the training framework
differs) on the built-in corpus, global batch 16 x 128 tokens, 2 micro-batches of 4 per rank
on 2 ranks, fp32, AdamW, global-norm clipping at 1.0.
"""

import argparse

import torch

from disttrain.data.source import load_splits
from disttrain.models.llama import llama_spec
from disttrain.models.spec import build_model
from disttrain.models.registry import MODEL_SHAPES

SHAPE = "tiny"
SEQ_LEN = 128
GLOBAL_BATCH = 16
MICRO_BATCH = 4
LR = 3e-3


def parse_steps() -> int:
    return parse_args().steps


def parse_args(extra=None) -> argparse.Namespace:
    """--steps N and --micro-batch M (default MICRO_BATCH); `extra(parser)` adds a workload's own flags."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def make_model(device="cpu"):
    return build_model(llama_spec(MODEL_SHAPES[SHAPE]), torch.device(device), seed=0)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


class RandomWindows:
    """Uniformly sampled windows of the built-in corpus: what a hand-written loop would do."""

    def __init__(self, rank: int, seq_len: int = SEQ_LEN, micro_batch: int = MICRO_BATCH):
        _, splits = load_splits("builtin", "byte")
        self.tokens = torch.from_numpy(splits["train"].astype("int64"))
        self.gen = torch.Generator().manual_seed(rank)
        self.seq_len, self.size = seq_len, micro_batch

    def micro_batch(self):
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.size,), generator=self.gen)
        rows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


def ddp_accumulate(model, data, accum: int) -> None:
    """One step's forward and backward over `accum` micro-batches of a DDP model, synchronising on the last."""
    for i in range(accum):
        x, y = data.micro_batch()
        if i < accum - 1:
            with model.no_sync():
                (loss_fn(model(x), y) / accum).backward()
        else:
            (loss_fn(model(x), y) / accum).backward()


def loss_fn(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
