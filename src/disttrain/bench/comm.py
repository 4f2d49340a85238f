"""`disttrain bench comm`: collective bandwidth on the current launch, reported as NCCL's tests define it.

For a collective over n ranks that takes t seconds on a buffer of S bytes:
    algorithmic bandwidth  algbw = S / t
    bus bandwidth          busbw = algbw x factor, the traffic each link carries in an optimal ring:
        all_reduce 2(n-1)/n, all_gather (n-1)/n, reduce_scatter (n-1)/n, all_to_all (n-1)/n, broadcast 1
S is the size of the whole (gathered / unscattered) buffer for all_gather and reduce_scatter, and the
per-rank buffer for the others. Each collective's result is checked once before timing; the reported
time is the slowest rank's mean over the timed iterations.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 has only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DEFAULT_SIZES = tuple(2 ** k for k in range(10, 27, 2))  # 1 KiB .. 64 MiB


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


@dataclass
class CommResult:
    op: str
    bytes: int
    ranks: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float


def _buffers(op: str, size: int, n: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input, output) float32 tensors; `size` bytes as S is defined above, rounded to whole elements."""
    count = max(n, size // 4 // n * n)  # divisible by n for the gathered/scattered layouts
    if op in ("all_reduce", "broadcast"):
        return torch.full((count,), float(rank + 1), device=device), None
    if op == "all_gather":
        return torch.full((count // n,), float(rank + 1), device=device), torch.empty(count, device=device)
    if op == "reduce_scatter":
        return torch.full((count,), float(rank + 1), device=device), torch.empty(count // n, device=device)
    return torch.arange(count, dtype=torch.float32, device=device) + rank * count, torch.empty(count, device=device)


def _run(op: str, inp: torch.Tensor, out: torch.Tensor | None) -> None:
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    elif op == "all_gather":
        _ALL_GATHER(out, inp)
    elif op == "reduce_scatter":
        _REDUCE_SCATTER(out, inp)
    else:
        dist.all_to_all_single(out, inp)


def _check(op: str, size: int, n: int, rank: int, device) -> None:
    """One call on known values; a wrong result here means the numbers below mean nothing."""
    inp, out = _buffers(op, size, n, rank, device)
    _run(op, inp, out)
    total = n * (n + 1) / 2
    if op == "all_reduce":
        ok = torch.all(inp == total)
    elif op == "broadcast":
        ok = torch.all(inp == 1.0)
    elif op == "all_gather":
        ok = torch.equal(out, torch.arange(1, n + 1, device=device, dtype=out.dtype).repeat_interleave(out.numel() // n))
    elif op == "reduce_scatter":
        ok = torch.all(out == total)
    else:
        chunk = inp.numel() // n
        expected = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.float32, device=device)
                              + src * inp.numel() for src in range(n)])
        ok = torch.equal(out, expected)
    if not bool(ok):
        raise RuntimeError(f"{op} returned wrong values on rank {rank}")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(op: str, size: int, device, iters: int, warmup: int) -> CommResult:
    n, rank = dist.get_world_size(), dist.get_rank()
    inp, out = _buffers(op, size, n, rank, device)
    s_bytes = (out if op in ("all_gather",) else inp).numel() * 4
    for _ in range(warmup):
        _run(op, inp, out)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        _run(op, inp, out)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    t = float(elapsed)
    algbw = s_bytes / t / 1e9
    return CommResult(op, s_bytes, n, t, algbw, algbw * bus_factor(op, n))


def run(device, ops=OPS, sizes=DEFAULT_SIZES, iters: int = 20, warmup: int = 5) -> list[CommResult]:
    results = []
    n, rank = dist.get_world_size(), dist.get_rank()
    for op in ops:
        _check(op, 4096, n, rank, device)
        results.extend(measure(op, size, device, iters, warmup) for size in sizes)
    return results


def format_table(results: list[CommResult]) -> str:
    lines = [f"{'collective':<15}{'bytes':>12}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in results:
        lines.append(f"{r.op:<15}{r.bytes:>12,}{1e6 * r.time_s:>12.1f}{r.algbw_gbps:>12.3f}{r.busbw_gbps:>12.3f}")
    return "\n".join(lines)


def as_dicts(results: list[CommResult]) -> list[dict]:
    return [asdict(r) for r in results]
