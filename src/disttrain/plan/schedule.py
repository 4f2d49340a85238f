"""Pipeline schedules as time × stage tables, simulated from each rank's order of work.

Every rank runs its list of actions in order; an action starts once its inputs exist (a forward
needs the previous stage's forward of that micro-batch, a backward the next stage's backward)
and a rank with nothing runnable idles ("-"). A forward takes 1 unit and a backward 2 (input and
weight gradients); zero-bubble splits the backward into B (input gradient, 1 unit) and W (weight
gradient, 1 unit) and runs pending W's whenever the next action would have to wait. Bubble =
idle slots / all slots, to compare with the closed forms in `plan.timing.bubble_fraction`.
"""

from __future__ import annotations

from disttrain.layout.layout import VIRTUAL_STAGES
from disttrain.plan.timing import bubble_fraction


def _one_f_one_b(forwards: list[tuple[int, int]], backwards: list[tuple[int, int]], warmup: int) -> list[tuple[str, tuple[int, int]]]:
    order = [("F", f) for f in forwards[:warmup]]
    fi, bi = warmup, 0
    while fi < len(forwards):
        order.append(("F", forwards[fi]))
        fi += 1
        order.append(("B", backwards[bi]))
        bi += 1
    order += [("B", b) for b in backwards[bi:]]
    return order


def rank_orders(schedule: str, pp: int, microbatches: int, virtual_stages: int = VIRTUAL_STAGES) -> list[list[tuple[str, int, int]]]:
    """Per rank, the (kind, stage, micro-batch) sequence the schedule runs."""
    m = microbatches
    orders = []
    for r in range(pp):
        if schedule in ("gpipe", "1f1b"):
            fwd = [(r, i) for i in range(m)]
            if schedule == "gpipe":
                seq = [("F", f) for f in fwd] + [("B", f) for f in fwd]
            else:
                seq = _one_f_one_b(fwd, fwd, min(pp - 1 - r, m))
        else:
            v = virtual_stages
            # Megatron's interleaved order: micro-batches in groups of pp, chunk by chunk.
            fwd = [(c * pp + r, g * pp + i) for g in range(m // pp) for c in range(v) for i in range(pp)]
            bwd = [(c * pp + r, g * pp + i) for g in range(m // pp) for c in reversed(range(v)) for i in range(pp)]
            warmup = min((pp - r - 1) * 2 + (v - 1) * pp, len(fwd))
            seq = _one_f_one_b(fwd, bwd, warmup)
        orders.append([(kind, stage, micro) for kind, (stage, micro) in seq])
    return orders


def simulate(schedule: str, pp: int, microbatches: int, virtual_stages: int = VIRTUAL_STAGES) -> tuple[list[list[str]], float]:
    """(grid[time][rank] cell text, bubble fraction) for the schedule."""
    v = virtual_stages if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    n_stages = pp * v
    split = schedule == "zero_bubble"
    orders = rank_orders(schedule, pp, microbatches, virtual_stages)
    done: dict[tuple[str, int, int], int] = {}  # action -> time it finished
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    busy_until = [0] * pp
    current: list[tuple | None] = [None] * pp
    position = [0] * pp
    grid: list[list[str]] = []
    t = 0
    total_actions = sum(len(o) for o in orders) + (sum(len(o) // 2 for o in orders) if split else 0)
    finished = 0
    while finished < total_actions or any(b > t for b in busy_until):
        row = []
        for r in range(pp):
            if current[r] is not None and busy_until[r] > t:
                row.append(current[r][1])
                continue
            started = None
            if position[r] < len(orders[r]):
                kind, stage, micro = orders[r][position[r]]
                if _ready(kind, stage, micro, n_stages, done, t):
                    started = (kind, stage, micro)
                    position[r] += 1
            if started is None and split and pending_w[r]:
                stage, micro = pending_w[r].pop(0)
                started = ("W", stage, micro)
            if started is None:
                row.append("-")
                current[r] = None
                continue
            kind, stage, micro = started
            length = 2 if kind == "B" and not split else 1
            label = f"{kind}{micro}" if v == 1 else f"{kind}{micro}.{stage // pp}"
            current[r] = (started, label)
            busy_until[r] = t + length
            done[started] = t + length
            finished += 1
            if split and kind == "B":
                pending_w[r].append((stage, micro))
            row.append(label)
        grid.append(row)
        t += 1
        if t > 100 * (total_actions + 1):
            raise RuntimeError("schedule simulation does not terminate")
    idle = sum(cell == "-" for row in grid for cell in row)
    return grid, idle / (len(grid) * pp)


def _ready(kind: str, stage: int, micro: int, n_stages: int, done: dict, t: int) -> bool:
    def finished(key) -> bool:
        return key in done and done[key] <= t

    if kind == "F":
        return stage == 0 or finished(("F", stage - 1, micro))
    # backward: needs this stage's forward and the next stage's backward
    return finished(("F", stage, micro)) and (stage == n_stages - 1 or finished(("B", stage + 1, micro)))


def format_table(grid: list[list[str]]) -> str:
    pp = len(grid[0]) if grid else 0
    width = max([6] + [len(c) + 2 for row in grid for c in row])
    lines = ["Time".ljust(7) + "".join(f"GPU{r}".ljust(width) for r in range(pp))]
    for t, row in enumerate(grid, 1):
        lines.append(str(t).ljust(7) + "".join(c.ljust(width) for c in row))
    return "\n".join(line.rstrip() for line in lines)


def describe_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = VIRTUAL_STAGES) -> dict:
    v = virtual_stages if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    grid, simulated = simulate(schedule, pp, microbatches, virtual_stages)
    return {"schedule": schedule, "pp": pp, "microbatches": microbatches, "virtual_stages": v,
            "bubble_theory": bubble_fraction(schedule, pp, microbatches, v), "bubble_simulated": simulated,
            "table": format_table(grid)}
