"""MFU inputs: the peak FLOP/s of the device, from `metrics.peak_tflops` or, on a known GPU, the
hardware table (model FLOPs per token come from the ModelSpec)."""

from __future__ import annotations

import torch

from disttrain.core.gpus import match_device_name


def matmul_dtype(layout) -> str:
    """The dtype the matmuls run in: the autocast or FSDP parameter dtype, else fp32/tf32."""
    for dtype in (layout.compute_dtype, layout.param_dtype):
        if dtype in ("bf16", "fp16"):
            return dtype
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops_per_device(cfg, layout, device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the number comes from); None where it is unknown (CPU
    without `metrics.peak_tflops`), in which case MFU is not logged."""
    if cfg.metrics.peak_tflops:
        return cfg.metrics.peak_tflops * 1e12, "metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = match_device_name(name)
        if gpu is not None:
            dtype = matmul_dtype(layout)
            return gpu.peak_flops(dtype), f"{gpu.description} dense {dtype} peak"
    return None, "unknown"
