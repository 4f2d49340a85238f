"""What the machine must have for the configured process group (`ctx`: the run being resolved,
config/resolve.py's RunContext)."""

from __future__ import annotations

from disttrain.layout.problem import Problem


def backend_problems(ctx) -> list[Problem]:
    if ctx.cfg.distributed.backend == "nccl" and ctx.device_type != "cuda":
        return [Problem("distributed.backend", "nccl", "auto, gloo", "distributed.backend=nccl needs CUDA devices and "
                        "none are visible (allowed here: auto, gloo)")]
    return []
