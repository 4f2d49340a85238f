"""Health checks: replicas in sync, finite losses and gradients, stragglers.

- Replica sync: every `metrics.sync_check_every` steps each data-parallel replica reduces every
  parameter it holds to a float64 checksum (sum and sum of squares); the checksums are gathered over
  the replicas and compared. Any difference names the parameters and stops the run: replicas that
  drifted apart (a missed all-reduce, a rank-local update, corrupted memory) silently train
  different models. Under ZeRO-2/3 a rank holds shards, so only the `dp_replicate` copies of the
  same shard are compared (nothing to compare without HSDP).
- Non-finite loss or gradient norm: `metrics.nonfinite` = `stop` (raise) or `skip_step` (drop the
  update, keep going). The global gradient norm is identical on every rank after the gradient
  reduction, so all ranks take the same decision without another collective. With fp16 loss
  scaling the GradScaler already skips such steps and this check stays out of its way.
- Stragglers: at logging steps the ranks' local (data + forward) seconds are gathered; the record
  gets their min/median/max and the slowest rank. Forward has no collective under DDP, so it is the
  rank's own speed, not time spent waiting for the others.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from disttrain.observe.model_bytes import local_shard
from disttrain.parallel.param_names import clean_fqn


class ReplicaDivergence(RuntimeError):
    pass


class NonFiniteError(RuntimeError):
    pass


@torch.no_grad()
def replica_checksums(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    names, sums = [], []
    for name, p in model.named_parameters():
        if getattr(p, "expert_parallel", False):
            continue
        local = local_shard(p).detach().double()
        names.append(clean_fqn(name))
        sums.append(torch.stack([local.sum(), (local * local).sum()]))
    return names, torch.stack(sums)


def check_replicas_in_sync(model: torch.nn.Module, group, step: int) -> None:
    """Collective over `group` (the ranks that hold identical copies). Raises ReplicaDivergence."""
    if group is None or dist.get_world_size(group) == 1:
        return
    names, local = replica_checksums(model)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    stacked = torch.stack(gathered)  # (replicas, params, 2)
    differs = (stacked != stacked[0:1]).any(dim=2).any(dim=0)
    if bool(differs.any()):
        bad = [n for n, d in zip(names, differs.tolist()) if d]
        raise ReplicaDivergence(f"data-parallel replicas differ after step {step} in {len(bad)} parameter(s): "
                                + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))


def rank_stats(local_seconds: float, peak_bytes: int, device) -> dict:
    """Collective over the world (one all-gather per logging step): per-rank local compute time, and the
    peak memory's maximum over ranks."""
    t = torch.tensor([local_seconds, float(peak_bytes)], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    rows = torch.stack(gathered).tolist()
    values = [row[0] for row in rows]
    slowest = max(range(len(values)), key=values.__getitem__)
    return {"rank_compute_min_s": min(values), "rank_compute_median_s": statistics.median(values),
            "rank_compute_max_s": values[slowest], "slowest_rank": slowest,
            "mem_peak_bytes": int(max(row[1] for row in rows))}
