"""Micro-batches of masked data cut to what they hold, instead of to `data.seq_len`.

Chat and instruction data without packing hold one conversation per sequence, padded with the end token to
`data.seq_len` + 1 tokens; most conversations are much shorter. A causal model's output at a position depends
only on the tokens before it, so the padding after a micro-batch's last real token changes no loss and no
gradient: each micro-batch is cut just after that token (the end token of its longest conversation: it carries
no loss, but a mixture-of-experts layer routes it, as it routes every real token), rounded up to
`data.pad_to_multiple_of`
(8 by default: bf16 and fp16 matmuls use the GPU's tensor cores on multiples of 8, and a handful of widths
keeps compiled graphs few; a larger multiple only computes more padding). The layout may need a larger
multiple: sequence parallelism splits the sequence over `parallel.tp` ranks, context parallelism cuts it into
2 x `parallel.cp` chunks. Pipeline parallelism keeps `data.seq_len`: its stages exchange activations of one
shape for the whole run. The planner and the dry run keep `data.seq_len` as the worst case.
"""

from __future__ import annotations

import math

import torch


def padding_multiple(data_cfg, layout) -> int:
    """The width multiple micro-batches are cut to; 0: they keep data.seq_len."""
    if data_cfg.padding == "seq_len" or layout.pp > 1:
        return 0
    multiple = data_cfg.pad_to_multiple_of
    if layout.tp > 1 and layout.sequence_parallel:
        multiple = math.lcm(multiple, layout.tp)
    if layout.cp > 1:
        multiple = math.lcm(multiple, 2 * layout.cp)
    return multiple


def cut_padding(inputs: torch.Tensor, targets: torch.Tensor, held: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one micro-batch whose longest sequence fills `held` input positions, cut to `held`
    rounded up to `multiple` (at most their width)."""
    width = targets.shape[1]
    cut = min(width, -(-max(held, 1) // multiple) * multiple)
    if cut == width:
        return inputs, targets
    return inputs[:, :cut].contiguous(), targets[:, :cut].contiguous()
