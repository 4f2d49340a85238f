"""The Layout's rules for context parallelism (`parallel.cp`, `parallel.cp_method`): what holds whatever
the model family (the ones that need the ModelSpec are in models/rules.py). Pure Python (no torch)."""

from __future__ import annotations

from disttrain.layout.problem import Problem

CP_METHODS = ("ring", "allgather", "ulysses")


def cp_problems(shape, layout) -> list[Problem]:
    """Every reason `parallel.cp` > 1 cannot cut this layout (`shape` None: dimensions unknown)."""
    lay, cp, problems = layout, layout.cp, []
    if lay.cp_method not in CP_METHODS:
        problems.append(Problem("parallel.cp_method", lay.cp_method, ", ".join(CP_METHODS),
                                f"parallel.cp_method={lay.cp_method} (allowed: {', '.join(CP_METHODS)})"))
    if lay.seq_len % (2 * cp):
        problems.append(Problem("data.seq_len", lay.seq_len, f"a multiple of 2 x parallel.cp = {2 * cp}",
                                f"data.seq_len={lay.seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (each "
                                f"sequence is cut into 2 x cp chunks; allowed: a multiple of {2 * cp})"))
    elif lay.sequence_parallel and (lay.seq_len // cp) % lay.tp:
        problems.append(Problem("parallel.tp", lay.tp, f"a divisor of data.seq_len / parallel.cp = {lay.seq_len // cp}",
                                f"parallel.tp={lay.tp} does not divide data.seq_len / parallel.cp = {lay.seq_len // cp} "
                                "(sequence parallel shards each context rank's tokens)"))
    if lay.cp_method == "ulysses" and shape is not None:
        global_kv = shape.extras.global_kv_heads if shape.extras is not None else 0  # Gemma 4's full-attention layers
        for key, heads in (("model.n_heads", shape.n_heads), ("model.n_kv_heads", shape.n_kv_heads),
                           ("num_global_key_value_heads", global_kv)):
            if not heads:
                continue
            local = heads // lay.tp if heads % lay.tp == 0 else heads
            if local % cp:
                per = f" / parallel.tp={lay.tp} = {local}" if lay.tp > 1 else ""
                problems.append(Problem("parallel.cp_method", "ulysses", "ring, allgather",
                                        f"parallel.cp_method=ulysses with parallel.cp={cp}: {key}={heads}{per} is not "
                                        f"divisible by {cp} (ulysses gives each context rank whole heads; allowed: "
                                        "ring, allgather, or a cp dividing the heads)"))
                break
    if lay.engine == "deepspeed":
        problems.append(Problem("parallel.cp", cp, "1 with engine=deepspeed", f"parallel.cp={cp} needs engine=torch "
                                "(allowed with engine=deepspeed: parallel.cp=1)"))
    if lay.balanced:
        problems.append(Problem("parallel.cp", cp, "1 with uneven shares", f"parallel.cp={cp} with parallel.balance: "
                                "context ranks share each sequence, so shares cannot differ between them (allowed: "
                                "parallel.cp=1, or equal shares)"))
    return problems
