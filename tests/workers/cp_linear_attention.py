"""A Gated DeltaNet layer (transformers' Qwen3-Next and Qwen3.5 modules) sharded over the context-parallel ranks
against the same layer on the whole sequence: this rank's outputs, its inputs' gradients and every parameter's
gradient (summed over the ranks), in float64 (the recurrence kept float64, as a float64 run keeps it) and in float32
(transformers' float32 kernels, computed again in backward); and with document masking (the document-aware kernels,
models/hf/linear_documents.py), documents starting on a chunk's first token, inside a chunk and inside the
convolution's reach of the next chunk, in float64. `check(out)` runs in a launch's process group (a
`train_many` job) and writes each case's result, "ok" or the mismatch, to `out`.rank<r>.json; run alone it prints
them:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/cp_linear_attention.py
"""

import copy
import importlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from disttrain.models.hf import linear_kernels
from disttrain.models.hf.context import _across_shards
from disttrain.models.hf.float64 import keep_float64
from disttrain.models.hf.linear_documents import causal_conv, chunk_gated_delta_rule
from disttrain.parallel.context import ContextParallel

import rank_results

LAYERS = {"qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5_text": "Qwen3_5GatedDeltaNet"}
SIZES = dict(hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
             linear_value_head_dim=16, layer_types=["linear_attention"], num_hidden_layers=1)


def _layer(kind: str, dtype) -> torch.nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.for_model(kind, **SIZES)
    module = importlib.import_module(f"transformers.models.{kind.removesuffix('_text')}.modeling_"
                                     f"{kind.removesuffix('_text')}")
    torch.manual_seed(0)
    layer = getattr(module, LAYERS[kind])(config, layer_idx=0).to(dtype)
    keep_float64(layer)
    return layer


# document lengths: seq 32 (chunks of 8): starts at 8 (a chunk's first token), 13 (inside one) and 15 (in the
# 3-token reach of the chunk starting at 16); seq 200 (chunks of 50): at 50, 87 and 167
DOCUMENTS = {32: (8, 5, 2, 11, 6), 200: (50, 37, 80, 33)}


def _case(mesh, kind: str, dtype, seq: int, tol: float, documents: bool = False) -> str:
    whole = _layer(kind, dtype)
    sharded = copy.deepcopy(whole)
    positions = {}
    if documents:
        for layer in (whole, sharded):
            linear_kernels.replace(layer, causal_conv, chunk_gated_delta_rule)
        positions = {"document_positions": torch.cat([torch.arange(n) for n in DOCUMENTS[seq]]).expand(2, seq)}
    g = torch.Generator().manual_seed(1)
    x, go = (torch.randn(2, seq, SIZES["hidden_size"], dtype=torch.float64, generator=g).to(dtype) for _ in range(2))
    full_x = x.clone().requires_grad_()
    ref = whole(full_x, **positions)
    ref.backward(go)
    cp = ContextParallel(mesh, "allgather", seq)
    _across_shards(sharded, cp)
    idx = cp.index(seq, "cpu")
    local_x = x[:, idx].clone().requires_grad_()
    out = sharded(local_x, cp_documents=None, **{k: v[:, idx] for k, v in positions.items()})
    out.backward(go[:, idx])
    try:
        torch.testing.assert_close(out, ref[:, idx], rtol=tol, atol=tol)
        torch.testing.assert_close(local_x.grad, full_x.grad[:, idx], rtol=tol, atol=tol, msg=lambda m: f"dx: {m}")
        for (name, mine), theirs in zip(sharded.named_parameters(), whole.parameters()):
            summed = mine.grad.clone()
            dist.all_reduce(summed)
            torch.testing.assert_close(summed, theirs.grad, rtol=tol, atol=tol, msg=lambda m, n=name: f"d{n}: {m}")
        return "ok"
    except AssertionError as exc:
        return str(exc).splitlines()[0]


def results() -> dict[str, str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    out_of = {}
    for kind in LAYERS:
        # 32 tokens: chunks of 8 (the convolution reaches 3 back); 200: chunks of 50, the kernel's blocks of 64
        # cut elsewhere than one process's
        for seq in (32, 200):
            out_of[f"{kind} float64 seq={seq}"] = _case(mesh, kind, torch.float64, seq, 1e-12)
            out_of[f"{kind} documents seq={seq}"] = _case(mesh, kind, torch.float64, seq, 1e-12, documents=True)
        out_of[f"{kind} float32"] = _case(mesh, kind, torch.float32, 32, 1e-5)
    return out_of


def check(out: str) -> None:
    rank_results.write(out, results())


if __name__ == "__main__":
    rank_results.run_as_script(results)
