"""Config dtype names to torch dtypes (the one mapping)."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
