"""MFU inputs: model FLOPs per token (PaLM's 6N + 12·L·H·Q·T, from the planner) and the peak FLOP/s
of the device, from `metrics.peak_tflops` or, on a known GPU, the planner's hardware table."""

from __future__ import annotations

import torch

from disttrain.plan.hardware import match_device_name


def matmul_dtype(cfg) -> str:
    """The dtype the matmuls run in: the autocast or FSDP parameter dtype, else fp32/tf32."""
    prec = cfg.precision
    if prec.compute_dtype in ("bf16", "fp16"):
        return prec.compute_dtype
    if cfg.parallel.zero_stage >= 2 and prec.fsdp_param_dtype("cuda") in ("bf16", "fp16"):
        return prec.fsdp_param_dtype("cuda")
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops_per_device(cfg, device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the number comes from); None where it is unknown (CPU
    without `metrics.peak_tflops`), in which case MFU is not logged."""
    if cfg.metrics.peak_tflops:
        return cfg.metrics.peak_tflops * 1e12, "metrics.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = match_device_name(name)
        if gpu is not None:
            dtype = matmul_dtype(cfg)
            return gpu.peak_flops(dtype), f"{gpu.description} dense {dtype} peak"
    return None, "unknown"
