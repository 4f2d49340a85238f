"""The degrees must multiply to the world size: the one Layout rule that needs it, and `dp_shard=-1` resolved.
Pure Python."""

from __future__ import annotations

from disttrain.core.errors import UserError
from disttrain.layout.problem import Problem


def resolve_dp_shard(parallel, world_size: int) -> int:
    """`dp_shard=-1` takes what is left of the world size; the product must equal it."""
    problems = world_problems(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp, world_size,
                              parallel.cp)
    if problems:
        raise UserError(str(problems[0]))
    fixed = parallel.dp_replicate * parallel.tp * parallel.pp * parallel.cp
    return world_size // fixed if parallel.dp_shard == -1 else parallel.dp_shard



def world_problems(dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int,
                   cp: int = 1) -> list[Problem]:
    """The degrees must multiply to the world size (`dp_shard=-1`: whatever is left of it)."""
    fixed = dp_replicate * tp * pp * cp
    cp_text = f" x parallel.cp={cp}" if cp > 1 else ""
    if dp_shard == -1:
        if world_size % fixed:
            return [Problem("parallel.dp_shard", dp_shard, f"degrees whose product divides {world_size}",
                            f"parallel.dp_replicate={dp_replicate} x parallel.tp={tp} x parallel.pp={pp}{cp_text} = "
                            f"{fixed} does not divide the world size {world_size}")]
        dp_shard = world_size // fixed
    if fixed * dp_shard != world_size:
        return [Problem("parallel.dp_shard", dp_shard, f"degrees multiplying to {world_size}",
                        f"parallel.dp_replicate={dp_replicate} x parallel.dp_shard={dp_shard} x parallel.tp={tp} x "
                        f"parallel.pp={pp}{cp_text} = {fixed * dp_shard} does not equal the world size {world_size}")]
    return []
