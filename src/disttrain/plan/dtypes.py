"""The dtypes a rank's activations take under its layout: what the matmuls write, and the residual stream's."""

from __future__ import annotations

from disttrain.layout.layout import DTYPE_BYTES, Layout

FP32 = 4


def autocast(layout: Layout) -> bool:
    """Matmuls in a lower precision than the stored fp32 weights: torch.autocast casts per op."""
    stored = "fp32" if layout.zero_stage <= 1 or layout.engine != "torch" else layout.param_dtype
    compute = layout.param_dtype if layout.zero_stage <= 1 else layout.compute_dtype
    return stored == "fp32" and compute in ("bf16", "fp16")


def dtype_bytes(layout: Layout) -> tuple[int, int]:
    """(compute, residual) bytes per element."""
    if autocast(layout):
        return DTYPE_BYTES[layout.param_dtype if layout.zero_stage <= 1 else layout.compute_dtype], FP32
    e = DTYPE_BYTES[layout.param_dtype]
    return e, e
