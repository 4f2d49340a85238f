"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) split by heads over the tensor-parallel ranks.

Each rank runs the layer on its contiguous block of key heads (and the value heads that go with them): the
recurrence, the L2 norms of queries and keys and the gated norm act on each head alone, so a rank's heads need
nothing of the others'. What the plan entries (tp_plans.py) do with torch's styles: Qwen3-Next's `in_proj_qkvz`
and `in_proj_ba` (their columns grouped per key head) and Qwen3.5's `in_proj_z`, `in_proj_b`, `in_proj_a` split
colwise, `out_proj` rowwise, the gated norm (one weight for every head) replicated with its gradient summed.

What is written here, because no torch style selects a non-contiguous set of rows:
- the depthwise causal convolution runs over the channels `[queries | keys | values]`, all heads of each
  together, so a rank's channels are three separate blocks of `conv1d.weight`; Qwen3.5's `in_proj_qkv` has the
  same three blocks in its rows. Those weights stay whole on every rank; during the layer's forward the module
  reads this rank's rows of them (a local slice whose gradient is summed over the ranks: every row's gradient
  comes from the one rank that used it, the others add zeros, exact), and `in_proj_qkv`'s input gradient is
  summed as `ColwiseParallel` sums it;
- `A_log` and `dt_bias` (one per value head) are split with their heads (tp_heads.shard_with_heads);
- the layer's head counts and widths (`num_k_heads`, `key_dim`, ...) are set to this rank's, since transformers'
  forward reshapes by them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from disttrain.core.errors import UserError
from disttrain.models.hf.tp_heads import shard_with_heads

COUNTS = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


def summed_gradient(t: torch.Tensor, mesh) -> torch.Tensor:
    """`t` unchanged; its gradient summed over the mesh's ranks (a `Replicate` DTensor's local gradient declared
    `Partial`: DTensor all-reduces it on the way back)."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _qkv_rows(module: nn.Module, rank: int, tp: int) -> torch.Tensor:
    """This rank's rows of the `[queries | keys | values]` channels (before the counts are made local)."""
    k, v = module.key_dim // tp, module.value_dim // tp
    return torch.cat([torch.arange(rank * k, (rank + 1) * k), torch.arange(module.key_dim + rank * k,
                      module.key_dim + (rank + 1) * k), torch.arange(2 * module.key_dim + rank * v,
                                                                     2 * module.key_dim + (rank + 1) * v)])


def _rows_during_forward(holder: nn.Module, owner: nn.Module, name: str, rows: torch.Tensor, mesh) -> None:
    """While `holder` runs forward, `owner.<name>` reads this rank's `rows` of the whole parameter."""
    def local_in(mod, args, kwargs):
        owner.__dict__[name] = summed_gradient(owner._parameters[name], mesh)[rows.to(owner._parameters[name].device)]

    def local_out(mod, args, kwargs, output):
        owner.__dict__.pop(name, None)

    holder.register_forward_pre_hook(local_in, with_kwargs=True)
    holder.register_forward_hook(local_out, with_kwargs=True, always_call=True)


def split_gated_delta_net(module: nn.Module, tp_mesh) -> None:
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    if module.num_k_heads % tp or module.num_v_heads % tp:
        raise UserError(f"parallel.tp={tp} does not divide the linear-attention heads (linear_num_key_heads="
                        f"{module.num_k_heads}, linear_num_value_heads={module.num_v_heads})")
    if module.conv1d.bias is not None:
        raise UserError("parallel.tp > 1: a Gated DeltaNet convolution with a bias is not split yet; allowed: "
                        "parallel.tp=1")
    rows = _qkv_rows(module, rank, tp)
    _rows_during_forward(module, module.conv1d, "weight", rows, tp_mesh)
    qkv = getattr(module, "in_proj_qkv", None)
    if qkv is not None:  # Qwen3.5: the same three blocks of rows; its input's gradient summed as colwise does
        _rows_during_forward(qkv, qkv, "weight", rows, tp_mesh)
        qkv.register_forward_pre_hook(lambda mod, args: (summed_gradient(args[0], tp_mesh), *args[1:]))
    for name in ("A_log", "dt_bias"):
        shard_with_heads(module, name, tp_mesh)
    for name in COUNTS:
        setattr(module, name, getattr(module, name) // tp)
