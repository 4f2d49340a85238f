"""Counting the collectives one training step issues, by kind, mesh dimension and bytes sent.

A dispatch mode sees every c10d op (eager `torch.distributed` calls, FSDP2's and DDP's) and every
functional collective (DTensor's) as it is dispatched, before the fake process group drops it.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# op-name fragment -> kind, longest first so "reduce_scatter" is not read as "scatter"
_KINDS = (("reduce_scatter", "reduce_scatter"), ("allgather", "all_gather"), ("all_gather", "all_gather"),
          ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("all_to_all", "all_to_all"),
          ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("send", "send"), ("recv", "recv"),
          ("barrier", "barrier"))


def collective_kind(op_name: str) -> str | None:
    name = op_name.split(".")[0].lstrip("_")
    return next((kind for fragment, kind in _KINDS if fragment in name), None)


class CollectiveCounter(TorchDispatchMode):
    """Counts dispatched collectives: (kind, mesh dimension) -> count and bytes of the tensors sent."""

    def __init__(self, group_dims: dict[str, str] | None = None):
        super().__init__()
        self.group_dims = group_dims or {}  # the ranks of a group (frozenset) -> mesh dimension it spans
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def _dim(self, args) -> str:
        for a in args:
            group = None
            if isinstance(a, str):  # a functional collective names its group
                try:
                    group = c10d._resolve_process_group(a)
                except (KeyError, RuntimeError, ValueError):
                    continue
            elif isinstance(a, torch.ScriptObject):
                try:
                    group = dist.ProcessGroup.unbox(a)
                except (RuntimeError, TypeError):
                    continue
            if group is not None:
                ranks = frozenset(dist.get_process_group_ranks(group))
                return self.group_dims.get(ranks, "world" if len(ranks) == dist.get_world_size() else
                                           f"{len(ranks)} ranks")
        return "world"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            # Let DTensor run first: the collectives it issues inside its own dispatch (implicit
            # redistributions) come back through this mode as plain functional ops.
            return NotImplemented
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = collective_kind(func.__name__)
            if kind is not None:
                key = (kind, self._dim(args))
                self.counts[key] += 1
                self.bytes[key] += sum(t.numel() * t.element_size() for t in _sent(kind, args, func.namespace == "c10d"))
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()

    def table(self) -> list[dict]:
        return [{"kind": kind, "dim": dim, "count": self.counts[(kind, dim)], "bytes": int(self.bytes[(kind, dim)])}
                for kind, dim in sorted(self.counts)]


def _sent(kind: str, args, output_first: bool) -> list[torch.Tensor]:
    """The tensors a collective sends: its first tensor argument, or the second for the c10d
    all-gather and reduce-scatter (which take the output first); lists are flattened."""
    groups = []
    for a in args:
        if isinstance(a, torch.Tensor):
            groups.append([a])
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            groups.append(list(a))
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, (list, tuple)) for t in a):
            groups.append([t for inner in a for t in inner if isinstance(t, torch.Tensor)])
    if output_first and kind in ("all_gather", "reduce_scatter") and len(groups) >= 2:
        return groups[1]
    return groups[0] if groups else []
