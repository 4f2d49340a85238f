"""What an RMSNorm keeps for its backward, by the kernel the model runs (`ModelShape.norm_kind`): a fused one, the
CPU's decomposition, transformers' modules (Llama-style ones, and gpt-oss's, which multiplies its weight in fp32)."""

from __future__ import annotations

from disttrain.models.shape import ModelShape
from disttrain.plan.dtypes import FP32


def norm_bytes(er: int, tokens: int, h: int, r: int, fused: bool, kind: str = "fused") -> float:
    """What one RMSNorm keeps: its input and the fp32 reciprocal RMS (fused CUDA kernel), or the input
    upcast to fp32 and the fp32 normalised x̂ besides (the CPU's decomposition, and `norm_fused`'s unfused norms).
    `kind` "module": transformers' Llama-style RMSNorm module, on any device: its input upcast to fp32 (kept by
    the square and the scaling) and the normalised tensor cast back to the input's dtype (kept by the weight's
    product), besides the reciprocal RMS (listed with saved-tensor hooks, tests/test_plan_module_norms.py). Counted
    wherever the layer's tensors are: saved without checkpointing, and in the one layer being recomputed under it
    (a tiny DeepSeek-V3 under full checkpointing whose peak falls in a recomputation: −3.6% against its dry run
    with a fused norm's there, +0.6% with the module's; tests/test_dryrun_cuda_attention.py)."""
    kept_input = FP32 + er if kind == "module" else er if fused else 2 * FP32
    return kept_input * tokens * h / r + FP32 * tokens / r


def norm_fused(shape: ModelShape, fused_norm: bool) -> bool:
    """Whether the RMSNorms keep what a fused kernel keeps (their input, the fp32 reciprocal RMS). gpt-oss's
    (transformers', `norm_kind` "fp32_product") upcasts its input to fp32 and multiplies its weight into the fp32
    normalised tensor, which keeps both, as `norm_bytes` counts an unfused norm (live tensors at a tiny gpt-oss's
    peak, ring attention, no checkpointing; gpt-oss-20b at 131,072 tokens, cp=32: 3.2 GiB of its 4.2 GiB under its
    dry run). Counted where they are saved: every layer's without checkpointing, the final norm's always. A
    recomputed layer keeps the same, but gpt-oss-120b's plan at 131,072 tokens (full checkpointing, cp=2), 0.1%
    under its dry run, would be 3.1% over with them: not counted there until that peak is listed tensor by tensor."""
    return fused_norm and shape.norm_kind != "fp32_product"
