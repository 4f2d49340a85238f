"""How work is divided, in whole units: micro-batches over data-parallel ranks, layers over pipeline stages.
Pure arithmetic shared by the Layout, the runtime and the planner."""

from __future__ import annotations


def balance_shares(total: int, weights: list[float]) -> list[int]:
    """`total` micro-batches split in proportion to `weights`, at least one each (every rank joins the
    gradient reduction), by largest remainder; ties go to the lower rank, so every rank computes the
    same split from the same weights."""
    if total < len(weights):
        raise ValueError(f"{total} micro-batches cannot give each of {len(weights)} ranks one")
    s = float(sum(weights))
    ideal = [total * w / s for w in weights]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) > total:
        i = max((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: (counts[i] - ideal[i], -i))
        counts[i] -= 1
    while sum(counts) < total:
        i = max(range(len(counts)), key=lambda i: (ideal[i] - counts[i], -i))
        counts[i] += 1
    return counts


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, balanced by count. The first stage also holds the embeddings and the most
    micro-batches in flight, so a remainder goes to the last stages."""
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    for i in range(extra):
        counts[n_stages - 1 - i] += 1
    return counts
