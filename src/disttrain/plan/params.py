"""Parameters one rank holds after tensor and pipeline splitting: what the memory and time terms both
start from."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.layout.layout import Layout
from disttrain.models.shape import ModelShape
from disttrain.layout.splits import split_layers
from disttrain.plan.mixers import mixer_params
from disttrain.plan.per_layer_inputs import root_params as per_layer_root_params


@dataclass
class RankParams:
    """Parameters one rank holds after tensor and pipeline splitting, before data-parallel sharding."""

    layers: int
    embedding: bool
    output: bool
    block: int  # parameters in those layers
    root: int  # embeddings, output layer, final norm: FSDP's root unit
    experts: int = 0  # of `block`, the routed experts this rank holds (plan/moe.py: num_experts / ep per layer)

    @property
    def total(self) -> int:
        return self.block + self.root


def rotary_table_bytes(shape: ModelShape) -> int:
    """The built-in models' rotary tables (cos and sin, max_seq_len x head_dim fp32): buffers every rank holds
    whole, whatever the layout (the dry run files them under parameters); none in transformers' models."""
    return 2 * 4 * shape.max_seq_len * shape.head_dim if shape.rotary_tables else 0


def layer_params(shape: ModelShape, tp: int = 1, ep: int = 1) -> int:
    if shape.moe is not None or shape.mla is not None or shape.extras is not None:  # the largest block (a dense
        # leading one or an MoE one), each family's layer as transformers builds it
        from disttrain.plan.moe import largest_layer
        return largest_layer(shape, tp, ep)
    kv_dim = shape.n_kv_heads * shape.head_dim
    matrices = 2 * shape.dim * shape.dim + 2 * shape.dim * kv_dim + 3 * shape.dim * shape.ffn_hidden_dim
    return matrices // tp + 2 * shape.dim  # the two RMSNorm weights are replicated across tp


def stage_layers(shape: ModelShape, layout: Layout) -> list[list[int]]:
    """Layer counts of the (virtual) stages each pipeline rank owns; rank r owns stages r, r+pp, ..."""
    counts = split_layers(shape.n_layers, layout.pp * layout.stages_per_rank)
    return [counts[r::layout.pp] for r in range(layout.pp)]


def rank_params(shape: ModelShape, layout: Layout, pp_rank: int = 0) -> RankParams:
    per_stage = stage_layers(shape, layout)[pp_rank]
    n_stages = layout.pp * layout.stages_per_rank
    first = pp_rank == 0
    last = (n_stages - 1) % layout.pp == pp_rank
    table = shape.vocab_size * shape.dim // layout.tp
    root = 0
    if first:
        root += table + per_layer_root_params(shape, first)  # Gemma 4's per-layer input modules
    if last:
        root += shape.dim  # final norm
        # A tied output matrix is the embedding itself when one rank holds both.
        if not (shape.tie_embeddings and first):
            root += table
    layers = sum(per_stage)
    if shape.moe is not None or shape.mla is not None or shape.extras is not None:
        from disttrain.plan.moe import block_params, held_layers
        block, experts = block_params(shape, layout, held_layers(shape, layout, pp_rank))
        return RankParams(layers, first, last, block, root, experts)
    return RankParams(layers, first, last, layers * layer_params(shape, layout.tp), root)


def lora_layer_params(shape: ModelShape, rank: int, tp: int = 1) -> int:
    """Adapter parameters one rank holds for one layer with LoRA of `rank` on every projection (the default
    targets): next to a column-parallel base lora_A is whole and lora_B split; next to a row-parallel base
    (o, down) lora_A is split and lora_B whole (parallel/lora_tp.py)."""
    kv_dim = shape.n_kv_heads * shape.head_dim
    d, f = shape.dim, shape.ffn_hidden_dim
    column = sum(rank * d + rank * out // tp for out in (d, kv_dim, kv_dim, f, f))  # q, k, v, gate, up
    row = sum(rank * inp // tp + rank * d for inp in (d, f))  # o, down
    return column + row
