"""Compute precision: fp32 or fp64 (no autocast), bf16 autocast, or fp16 autocast with dynamic loss scaling."""

from __future__ import annotations

import contextlib

import torch

from disttrain.core.dtypes import DTYPES


class Precision:
    def __init__(self, compute_dtype: str, device: torch.device):
        self.dtype = DTYPES[compute_dtype]
        self.device_type = device.type
        # GradScaler is a no-op when disabled, so the loop calls it unconditionally.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)

    def autocast(self):
        if self.dtype in (torch.float32, torch.float64):  # parameters already hold the compute dtype
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def inputs(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A batch's inputs on the device; floating-point ones (images, features) in fp64 for an fp64 model,
        which has no autocast to convert them (token ids stay integers)."""
        if self.dtype == torch.float64 and x.is_floating_point():
            return x.to(device, torch.float64, non_blocking=True)
        return x.to(device, non_blocking=True)
