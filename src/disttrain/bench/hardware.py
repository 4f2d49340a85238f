"""`disttrain bench hardware`: measure this machine once, so `estimate --time` and `plan` can predict its
step times (`--hardware FILE`).

Every rank of the launch measures at once, as they train at once (on a CPU the ranks share cores and
memory bandwidth):
- matmul FLOP/s at the shapes a model's step runs: for each linear layer the forward product and the
  two backward products (input and weight gradients) of `micro_batch x seq_len` tokens, FLOP-weighted
  (total FLOPs over total time), per model and dtype, and again for a tensor-parallel rank's slices;
- causal attention (SDPA forward + backward) FLOP/s at each model's heads and sequence length;
- the bytes/s of element-wise work (a fused multiply-add over tensors far larger than cache), which
  bounds norms, activations, residual adds and rotary; the fixed cost of one eager op and of one
  DTensor op (tensor parallelism dispatches every op of a block through DTensor); and the seconds
  per parameter of an AdamW step with gradient clipping;
- FSDP2's seconds per parameter byte to gather and to reduce-scatter units of the model's block size,
  copies and fresh allocations included (what ZeRO-2/3 add beyond the collectives' α-β cost here);
- one tensor-parallel collective as the runtime's DTensor plan issues it (a column/row-parallel pair
  against the same slices run locally), at the model's width and micro-batch;
- each collective's α and β (all-reduce, all-gather, reduce-scatter): times at sizes from 4 KiB to
  16 MiB fitted to the same α-β cost the planner uses for that kind.
The slowest rank's time counts for each figure, as it does in a step.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from disttrain.layout.rules import split_problems
from disttrain.models.shape import ModelShape

ALL_REDUCE_SIZES = tuple(2 ** k for k in range(12, 25, 2))  # 4 KiB .. 16 MiB
TP_DEGREES = (2,)  # tensor-parallel degrees whose matmul slices are measured (this machine has 2 cores)
PROFILE_KIND = "disttrain-hardware-profile"  # plan/profile.py checks the same string (the runtime may not import the planner)


def linear_shapes(shape: ModelShape, tp: int = 1) -> list[tuple[int, int]]:
    """(in, out) features of every matmul weight in one step's model (per layer, then the output)."""
    kv = shape.n_kv_heads * shape.head_dim
    h, f = shape.dim, shape.ffn_hidden_dim
    layer = [(h, h // tp), (h, kv // tp), (h, kv // tp), (h // tp, h), (h, f // tp), (h, f // tp), (f // tp, h)]
    return layer * shape.n_layers + [(h, shape.vocab_size // tp)]


def _slowest(seconds: float) -> float:
    if not dist.is_initialized():
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn, reps: int) -> float:
    """Median over `reps` calls of the slowest rank's time (after one warm-up call)."""
    fn()  # warm-up: allocation, kernel selection
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(_slowest(time.perf_counter() - t0))
    return statistics.median(times)


def matmul_flops(shape: ModelShape, tokens: int, dtype: torch.dtype, reps: int = 3, tp: int = 1) -> float:
    """FLOP/s over the forward and both backward matmuls of each distinct linear shape (each rank's slice
    under tensor parallelism of `tp`), weighted by how often the model runs it."""
    counts: dict[tuple[int, int], int] = {}
    for key in linear_shapes(shape, tp):
        counts[key] = counts.get(key, 0) + 1
    flops = seconds = 0.0
    for (k, n), count in counts.items():
        x, w, g = (torch.randn(tokens, k, dtype=dtype), torch.randn(k, n, dtype=dtype),
                   torch.randn(tokens, n, dtype=dtype))
        t = _timed(lambda: (x @ w, g @ w.T, x.T @ g), reps)
        flops += count * 3 * 2.0 * tokens * k * n
        seconds += count * t
    return flops / seconds


def elementwise_bytes_per_s(numel: int = 2 ** 24, reps: int = 5) -> float:
    """addcmul over fp32 tensors of 64 MiB each: three read, one written."""
    a, b, c = (torch.rand(numel) for _ in range(3))
    out = torch.empty(numel)
    return 4 * 4 * numel / _timed(lambda: torch.addcmul(a, b, c, out=out), reps)


def attention_flops(shape: ModelShape, micro_batch: int, seq_len: int, reps: int = 3) -> float:
    """Causal SDPA forward + backward at the model's heads, in the planner's FLOP convention
    (12·H·Q·T per token and layer, the full score matrix): what `flops.attention_flops_per_token` counts."""
    q = torch.randn(micro_batch, shape.n_heads, seq_len, shape.head_dim, requires_grad=True)
    k = torch.randn(micro_batch, shape.n_heads, seq_len, shape.head_dim, requires_grad=True)
    v = torch.randn(micro_batch, shape.n_heads, seq_len, shape.head_dim, requires_grad=True)
    grad = torch.randn(micro_batch, shape.n_heads, seq_len, shape.head_dim)

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    return 12.0 * shape.n_heads * shape.head_dim * seq_len * micro_batch * seq_len / _timed(run, reps)


def optimizer_seconds_per_param(numel: int = 2 ** 22, tensors: int = 16, reps: int = 3) -> float:
    """A step of AdamW (foreach, as the trainer builds it) with gradient-norm clipping, per parameter."""
    params = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def run():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return _timed(run, reps) / numel


def op_overhead_seconds(reps: int = 2000) -> float:
    """The fixed cost of one eager op (dispatch, allocation) on a tensor too small to take time itself."""
    a, b = torch.ones(8), torch.ones(8)
    return _timed(lambda: [torch.add(a, b) for _ in range(reps)], 1) / reps


def dtensor_op_seconds(reps: int = 300) -> float:
    """The host cost of one DTensor op (Python dispatch, sharding propagation from its cache) on a mesh
    of every rank: what tensor parallelism adds to each op of a block on top of the eager op."""
    if not dist.is_initialized():
        return 0.0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    a, b = (distribute_tensor(torch.ones(8), mesh, [Replicate()]) for _ in range(2))
    return _timed(lambda: [a + b for _ in range(reps)], 3) / reps


def fsdp_round_trip(shape: ModelShape, reps: int = 3) -> dict | None:
    """Seconds per byte of unsharded fp32 parameters that FSDP2 spends gathering (forward) and
    reduce-scattering (backward) units of this model's block size, with everything around the
    collectives: copy-in, copy-out into freshly allocated unsharded parameters, the unsharded gradients
    and their copy into the reduce-scatter buffer. On a CPU those allocations fault in new pages at a
    fraction of the element-wise rate (measured here: 3-5 GB/s against 20+), so the α-β cost of the
    collectives alone misses most of what a ZeRO-2/3 round costs. One-token inputs keep compute out."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from disttrain.models.flops import block_params

    rows = block_params(shape) // shape.n_layers // shape.dim  # a Linear(dim, rows) per block: its bytes
    model = nn.Sequential(*(nn.Linear(shape.dim, rows, bias=False) for _ in range(shape.n_layers)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in model:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    x = torch.randn(1, shape.dim)
    times: dict[str, list[float]] = {"gather": [], "reduce": []}
    for rep in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        out = x
        for unit in model:  # each unit's input is the previous output's first `dim` features
            out = unit(out[:, :shape.dim])
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if rep:
            times["gather"].append(_slowest(t1 - t0))
            times["reduce"].append(_slowest(t2 - t1))
    nbytes = 4.0 * rows * shape.dim * shape.n_layers
    return {"gather_s_per_byte": statistics.median(times["gather"]) / nbytes,
            "reduce_s_per_byte": statistics.median(times["reduce"]) / nbytes,
            "unit_bytes": nbytes / shape.n_layers, "ranks": dist.get_world_size(), "dim": shape.dim}


def tp_collective(shape: ModelShape, tokens: int, reps: int = 5) -> dict | None:
    """Seconds one tensor-parallel collective costs as the runtime issues it: a column- then row-parallel
    pair of linears (DTensor plan, 2 all-reduces: the row layer's output forward, the column layer's input
    gradient backward) against the same slices run locally, forward and backward at `tokens` tokens.
    Besides the α-β cost of the bytes this holds DTensor's redistribution and functional-collective
    wrappers, and the wait for the other rank at each of these synchronisation points."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n, h, f = dist.get_world_size(), shape.dim, shape.ffn_hidden_dim
    mesh = init_device_mesh("cpu", (n,))
    pair = parallelize_module(nn.Sequential(nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)), mesh,
                              {"0": ColwiseParallel(), "1": RowwiseParallel()})
    local = nn.Sequential(nn.Linear(h, f // n, bias=False), nn.Linear(f // n, h, bias=False))
    x = torch.randn(tokens, h, requires_grad=True)  # its gradient is the column layer's all-reduce
    sharded, alone = [], []
    for _ in range(reps):  # interleaved: this machine's speed drifts
        sharded.append(_timed(lambda: pair(x).sum().backward(), 1))
        alone.append(_timed(lambda: local(x).sum().backward(), 1))
    extra = statistics.median(sharded) - statistics.median(alone)
    return {"seconds": max(extra, 0.0) / 2, "bytes": 4 * tokens * h, "ranks": n, "dim": h}


def collective_alpha_beta(op: str = "all_reduce", sizes=ALL_REDUCE_SIZES, reps: int = 7) -> dict:
    """Least-squares fit of the planner's α-β cost of `op` over the measured sizes: all-reduce
    t = 2(n−1)·α + 2(n−1)/n·M/β, all-gather and reduce-scatter t = (n−1)·α + (n−1)/n·M/β (M: the whole
    tensor). Fitted per kind because backends differ: gloo's reduce-scatter costs an all-reduce."""
    from disttrain.bench import comm

    n = dist.get_world_size() if dist.is_initialized() else 1
    if n < 2:
        return {"latency_s": None, "bandwidth_gbs": None, "ranks": n, "points": []}
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    share = steps / n
    device, rank = torch.device("cpu"), dist.get_rank()
    points = []
    for size in sizes:
        inp, out = comm._buffers(op, size, n, rank, device)
        whole = (out if op == "all_gather" else inp).numel() * 4
        points.append((whole, _timed(lambda: comm._run(op, inp, out), reps)))
    xs = [share * m for m, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(my - slope * mx, 0.0)
    return {"latency_s": intercept / steps, "bandwidth_gbs": 1 / slope / 1e9, "ranks": n,
            "points": [{"bytes": m, "seconds": t} for m, t in points]}


def measure(models: dict[str, ModelShape], micro_batch: int, seq_len: int, dtypes=("fp32", "bf16")) -> dict:
    from disttrain.core.dtypes import DTYPES

    tokens = micro_batch * seq_len
    matmul, attention, fsdp, tp_collectives = {}, {}, {}, {}
    for name, shape in models.items():
        matmul[name] = {"dim": shape.dim, **{d: matmul_flops(shape, tokens, DTYPES[d]) for d in dtypes}}
        # a tensor-parallel rank's slices are narrower: at small micro-batches they run far slower
        matmul[name]["tp"] = {str(tp): {d: matmul_flops(shape, tokens, DTYPES[d], tp=tp) for d in dtypes}
                              for tp in TP_DEGREES if not split_problems(shape, tp, 1)}
        attention[name] = attention_flops(shape, micro_batch, seq_len)
        fsdp[name] = fsdp_round_trip(shape)
        tp_collectives[name] = tp_collective(shape, tokens)
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        memory_gb = 0.0
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    return {"kind": PROFILE_KIND, "device": "cpu", "host": platform.node(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "ranks": ranks, "threads_per_rank": torch.get_num_threads(),
            "memory_gb_per_rank": memory_gb / ranks, "micro_batch": micro_batch, "seq_len": seq_len,
            "matmul_flops": matmul, "attention_flops": attention, "elementwise_bytes_per_s": elementwise_bytes_per_s(),
            "optimizer_s_per_param": optimizer_seconds_per_param(), "op_overhead_s": op_overhead_seconds(),
            "dtensor_op_s": dtensor_op_seconds(), "fsdp_round_trip": fsdp,
            "tp_collective": tp_collectives,
            "collectives": {op: collective_alpha_beta(op) for op in ("all_reduce", "all_gather", "reduce_scatter")}}


def summary(profile: dict) -> str:
    lines = [f"{profile['ranks']} rank(s) x {profile['threads_per_rank']} thread(s) on {profile['machine']}, "
             f"micro-batch {profile['micro_batch']} x {profile['seq_len']} tokens"]
    for name, rates in profile["matmul_flops"].items():
        lines.append(f"  matmul {name:<6} " + ", ".join(f"{d} {r / 1e9:.1f} GFLOP/s" for d, r in rates.items() if d not in ("dim", "tp"))
                     + "".join(f"; tp={tp} fp32 {r['fp32'] / 1e9:.1f}" for tp, r in rates.get("tp", {}).items())
                     + f"; causal attention {profile['attention_flops'][name] / 1e9:.1f} GFLOP/s")
    lines.append(f"  element-wise {profile['elementwise_bytes_per_s'] / 1e9:.2f} GB/s, one eager op "
                 f"{profile['op_overhead_s'] * 1e6:.1f} us (DTensor {profile['dtensor_op_s'] * 1e6:.0f} us), AdamW + clipping {profile['optimizer_s_per_param'] * 1e9:.2f} ns "
                 "per parameter")
    for op, fit in profile["collectives"].items():
        if fit["latency_s"] is not None:
            lines.append(f"  {op.replace('_', '-')} over {fit['ranks']} ranks: α {fit['latency_s'] * 1e6:.1f} us, "
                         f"β {fit['bandwidth_gbs']:.2f} GB/s")
    return "\n".join(lines)
