"""Token sequences whose targets are partly the ignore index (-100), as fine-tuning data has them (prompt
tokens and padding carry no loss): a map-style Dataset for `data.source=py:tests/data/masked_tokens.py:splits`.

Each sample masks a different number of leading targets (none, a few, most, all), so data-parallel ranks
and micro-batches hold very different numbers of valid targets: a divisor counted per rank or per
micro-batch, or one that counts masked targets, gives another loss than the mean over the global batch.
"""

import torch
from torch.utils.data import Dataset

SEQ_LEN = 64
VOCAB = 256
MASKED_LEADING = (0, 60, 3, 33, 64, 10, 50, 1, 20, 63, 0, 41)  # per sample, cycled; 64 = every target masked


class MaskedTokens(Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        # a learnable stream: each sequence counts up from a random start with a random stride
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        row = self.tokens[i]
        x, y = row[:-1].clone(), row[1:].clone()
        y[:MASKED_LEADING[i % len(MASKED_LEADING)]] = -100
        return x, y


def splits() -> dict:
    return {"train": MaskedTokens(96, seed=1), "val": MaskedTokens(16, seed=2)}
