"""The Layout's rules for uneven data-parallel shares (`parallel.balance`, `parallel.balance_weights`).

Asked by rules.py's `cut_problems` and `batch_problems`. Pure Python (no torch).
"""

from __future__ import annotations

from disttrain.layout.problem import Problem


def balance_cut_problems(layout: "Layout") -> list[Problem]:
    if layout.balance == "auto":
        key, value, what = "parallel.balance", "auto", "parallel.balance=auto"
    else:
        key, value, what = "parallel.balance_weights", list(layout.balance_weights), "parallel.balance_weights"
    problems = []
    if layout.engine != "torch":
        problems.append(Problem(key, value, "equal shares with engine=deepspeed", f"{what} needs engine=torch "
                                "(DeepSpeed splits the batch evenly itself)"))
    if layout.pp > 1:
        problems.append(Problem(key, value, "equal shares with pp > 1", f"{what} with parallel.pp={layout.pp}: a "
                                "pipeline schedule runs the same number of micro-batches on every rank (allowed: pp=1)"))
    if any(not w > 0 for w in layout.balance_weights):
        problems.append(Problem("parallel.balance_weights", list(layout.balance_weights), "positive weights",
                                f"parallel.balance_weights={list(layout.balance_weights)}: every weight must be positive"))
    return problems


def balance_batch_problems(layout: "Layout") -> list[Problem]:
    g, m, dp = layout.global_batch_size, layout.micro_batch_size, layout.dp
    problems = []
    if layout.balance_weights and len(layout.balance_weights) != dp:
        weights = list(layout.balance_weights)
        problems.append(Problem("parallel.balance_weights", weights, f"{dp} weights", f"parallel.balance_weights="
                                f"{weights}: {len(weights)} weight(s) for {dp} data-parallel rank(s) (world size "
                                f"{layout.world_size}); give one per rank"))
    if g % m:
        problems.append(Problem("train.micro_batch_size", m, f"a divisor of {g}", f"train.micro_batch_size={m} does "
                                f"not divide train.global_batch_size={g} (uneven shares are counted in whole "
                                "micro-batches)"))
    elif g // m < dp:
        problems.append(Problem("train.micro_batch_size", m, f"at most {g // dp}", f"train.global_batch_size={g} / "
                                f"train.micro_batch_size={m} = {g // m} micro-batches, fewer than the {dp} "
                                "data-parallel ranks (each needs at least one)"))
    return problems
