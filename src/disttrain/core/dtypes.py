"""Config dtype names to torch dtypes (the one mapping)."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Upcast bf16/fp16 for numerically sensitive work (softmax, loss, rotary); fp32 and fp64 stay as they are."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
