"""What Muon (optim.name=muon, train/muon.py) adds to a rank's memory and step time, beside AdamW's terms.

Memory: the block matrices keep one fp32 momentum instead of two moments (plan/memory.py), and the step holds
its largest matrix whole for a moment. Time: each matrix's Newton-Schulz iteration runs on one of the ranks
sharing it (bf16 matmuls at the cluster's matmul rate), a DTensor's update is gathered whole first, and the
owner's bf16 result is broadcast to the others; none of it overlaps the step's compute.
"""

from __future__ import annotations

from disttrain.layout.layout import Layout
from disttrain.models.flops import newton_schulz_flops
from disttrain.models.registry import ModelShape

FP32, BF16 = 4, 2
BUCKET_ELEMENTS = 2 ** 25  # train/muon.py's bucket (the planner does not import training code; a test holds them equal)


def muon_params(shape: ModelShape, held) -> float:
    """Of the parameters a rank holds (plan/params.py's RankParams), those Muon steps: the repeated blocks' but
    their two norm weights (and an MoE router, which plan/moe.py leaves out)."""
    return held.block - held.layers * 2 * shape.dim


def muon_temporaries(matrix: float, total: float) -> float:
    """What Muon's step holds at once (train/muon.py), for a largest matrix of `matrix` elements among `total`
    whole-matrix elements: a bucket of matrices (BUCKET_ELEMENTS, at least the largest) gathered whole in fp32 with
    their bf16 results, and two bf16 copies of one matrix inside torch's Newton-Schulz iteration (its input and
    output; the Gram matrices are of the short side, no larger)."""
    bucket = max(matrix, min(BUCKET_ELEMENTS, total))
    return (FP32 + BF16) * bucket + 2 * BF16 * matrix


def block_matrices(shape: ModelShape) -> list[tuple[int, int]]:
    """The whole matrices Muon orthogonalises in one dense block: attention's four projections and the SwiGLU's
    three; an MoE block's routed experts are counted apart (`expert_matrices`)."""
    kv = shape.n_kv_heads * shape.head_dim
    return [(shape.dim, shape.dim)] * 2 + [(kv, shape.dim)] * 2 + [(shape.ffn_hidden_dim, shape.dim)] * 3


def sharing_ranks(layout: Layout) -> int:
    """Ranks one dense matrix's update is shared by, of which one orthogonalises it: the FSDP mesh (data, context
    and tensor ranks) under ZeRO-2/3; the data and context ranks under DDP; the tensor ranks under DDP + TP (the
    replicas each repeat it)."""
    if layout.zero_stage >= 2 or layout.tp == 1:
        return layout.gradient_ranks * layout.tp
    return layout.tp


def muon_step_s(shape: ModelShape, layout: Layout, layers: int, matmul_flops_per_s: float, link,
                all_gather_s) -> float:
    """Seconds Muon's step adds on one rank holding `layers` blocks: its share of the iterations (the owners
    balance them), and per matrix a gather of the fp32 update over the tensor or FSDP ranks holding shards and a
    broadcast of the bf16 result. `link(ranks, kind)` -> (bytes/s, latency), the cluster's; `all_gather_s(ranks,
    bytes, bandwidth, latency)`, plan/timing.py's (which imports this module)."""
    n = sharing_ranks(layout)
    matrices = block_matrices(shape) * layers if shape.moe is None else \
        block_matrices(shape)[:4] * layers  # MoE: attention here, the experts below
    flops = sum(newton_schulz_flops(r, c) for r, c in matrices) / n
    if shape.moe is not None:  # each rank's own experts, orthogonalised where they live
        experts = shape.moe.num_experts // layout.ep
        flops += layers * experts * 3 * newton_schulz_flops(shape.moe.moe_intermediate_size, shape.dim)
    seconds = flops / matmul_flops_per_s
    if n > 1:
        bw, lat = link(n, "all_gather")
        sharded = layout.zero_stage >= 2 or layout.tp > 1
        for r, c in matrices:
            seconds += all_gather_s(n, BF16 * r * c, bw, lat)  # the broadcast: the whole matrix once
            if sharded:
                seconds += all_gather_s(n, FP32 * r * c, bw, lat)
    return seconds
