"""Routed SwiGLU experts held as fused 3-D parameters, run over token rows already sorted by expert.

`w1`/`w3` are (experts, hidden, dim) and `w2` is (experts, dim, hidden): nn.Linear's (out, in) per expert,
the layout transformers' fused MoE experts use, so conversion is a reshape. Expert parallelism
(parallel/expert.py) splits them on dim 0 over the expert-parallel ranks: plain tensors holding this rank's
experts, or FSDP's DTensors, whose forward runs on this rank's slice (`to_local`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # F.grouped_mm refuses float64 (torch 2.13)


def local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def grouped_gemm_fits(x: torch.Tensor, hidden: int) -> bool:
    """F.grouped_mm needs a supported dtype and every row stride a multiple of 16 bytes."""
    size = x.element_size()
    return (hasattr(F, "grouped_mm") and x.dtype in GROUPED_DTYPES and (x.shape[-1] * size) % 16 == 0
            and (hidden * size) % 16 == 0)


class AutocastWeights:
    """Expert weights in the autocast dtype, made once and shared by every forward of the step, as autocast's
    own cache does for the weights F.linear casts (grouped_mm is on no autocast list: torch 2.13). A copy
    per call would be saved for backward by every micro-batch in flight: 32 copies of 128 experts on the
    first stage of a 32-stage pipeline (found by the dry run). Under activation checkpointing (saved-tensor
    hooks active: the forward and its recomputation) each call casts again, so that no copy outlives its
    block's forward there, as with autocast. Keyed by each parameter and its version (an optimizer step,
    FSDP's next all-gather change it); dropped after each optimizer step (`release`). Written here because
    autocast's cache only serves the ops on its lists."""

    def __init__(self):
        self.entry: tuple | None = None  # (key, weights in the autocast dtype)

    def get(self, params: tuple, weights: tuple, dtype: torch.dtype) -> tuple:
        key = (dtype, *((id(p), local(p)._version) for p in params))
        if self.entry is not None and self.entry[0] == key:
            return self.entry[1]
        copies = tuple(w.to(dtype) for w in weights)
        checkpointed = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        if torch.is_grad_enabled() and not checkpointed:
            self.entry = (key, copies)
        return copies

    def release(self) -> None:
        self.entry = None


def in_autocast_dtype(cache: AutocastWeights, rows: torch.Tensor, params: tuple) -> tuple:
    """(rows, weights) as the experts compute them: cast to the autocast dtype when autocast is on."""
    weights = tuple(local(p) for p in params)
    device = rows.device.type
    if not torch.is_autocast_enabled(device):
        return rows, weights
    dtype = torch.get_autocast_dtype(device)
    if weights[0].dtype != dtype:
        weights = cache.get(params, weights, dtype)
    return rows.to(dtype), weights


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))  # down
        self.grouped_gemm = True  # False: always the per-expert loop (benchmarks compare the two)
        self.autocast_weights = AutocastWeights()

    @property
    def compute_copies(self) -> tuple | None:  # (key, weights in the autocast dtype) or None
        return self.autocast_weights.entry

    def release_compute_copies(self) -> None:
        self.autocast_weights.release()

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, counts_list: list[int] | None = None) -> torch.Tensor:
        """rows (n, dim) sorted by this rank's experts, `counts` rows per local expert (int64 tensor);
        `counts_list` the same on the host when the caller already has it (saves the loop a sync)."""
        # grouped_mm is on no autocast list (torch 2.13): cast as F.linear is
        rows, (w1, w2, w3) = in_autocast_dtype(self.autocast_weights, rows, (self.w1, self.w2, self.w3))
        if rows.shape[0] and self.grouped_gemm and grouped_gemm_fits(rows, w1.shape[1]):
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            h = F.silu(F.grouped_mm(rows, w1.transpose(-2, -1), offs=offsets)) * \
                F.grouped_mm(rows, w3.transpose(-2, -1), offs=offsets)
            return F.grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        # Per-expert loop (float64, unaligned widths, no rows): one host sync for the counts unless given.
        sizes = counts_list if counts_list is not None else counts.tolist()
        outs = [F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e])
                for e, x in enumerate(torch.split(rows, sizes))]
        return torch.cat(outs) if outs else rows.new_zeros(0, w2.shape[1])
