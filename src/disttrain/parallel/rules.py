"""What this torch's parallel techniques cannot do on this device, as layout rules (`ctx`: the run being
resolved, config/resolve.py's RunContext)."""

from __future__ import annotations

from disttrain.layout.problem import Problem


def compile_problems(ctx) -> list[Problem]:
    """torch 2.13 on CPU: a compiled block's backward hands a plain tensor to DTensor's redistribute backward
    ("'Tensor' object has no attribute '_local_tensor'"); eager TP and compiled DDP/FSDP work."""
    lay = ctx.layout
    if ctx.cfg.parallel.compile and lay.tp > 1 and ctx.device_type == "cpu":
        return [Problem("parallel.compile", True, "false with tp > 1 on CPU", "parallel.compile=true with "
                        f"parallel.tp={lay.tp} does not run on CPU with this torch (compiled DTensor backward fails); "
                        "allowed on CPU: parallel.compile=false with tp > 1, or compile with tp=1")]
    return []


def ddp_static_graph_problems(ctx) -> list[Problem]:
    """torch 2.13: DDP with static_graph fails an internal assert in the first backward when a step accumulates
    gradients (the micro-batches before the last run under no_sync; pytorch/pytorch#143580)."""
    lay = ctx.layout
    accumulates = lay.microbatches > 1 or (lay.balanced and lay.total_microbatches > lay.dp)
    if ctx.cfg.parallel.ddp_static_graph and lay.gradient_wrapper == "ddp" and lay.pp == 1 and accumulates:
        return [Problem("parallel.ddp_static_graph", True, "false with several micro-batches per data-parallel rank",
                        "parallel.ddp_static_graph=true with gradient accumulation (several micro-batches per "
                        "data-parallel rank) fails in this torch's DDP (an internal assert in the first backward); "
                        "allowed: parallel.ddp_static_graph=false, or one micro-batch per rank")]
    return []
