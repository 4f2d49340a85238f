"""Third-party log records that say nothing a user can act on, dropped at their loggers (each with why), so that
what the console shows is disttrain's own lines and real trouble. Installed by the CLI and by every rank."""

from __future__ import annotations

import logging


class _Drop(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(f in str(record.msg) for f in self.fragments)


DROPPED = {
    # DTensor, 8 times and ~400 characters each on a dp x tp x pp mesh: gradient-norm reductions over several mesh
    # dimensions run as one all-reduce per dimension. The reduction order it warns about is the same on every rank
    # here (parity with one process holds to 1e-10 on these layouts, tests/test_model_parallel.py); the cost is one
    # small all-reduce per dimension per step.
    "torch.distributed.tensor._redistribute": ("This is suboptimal",),
    # DeepSpeed, whenever something imports it on a machine without a GPU (peft and transformers probe it): CPU
    # training is what the user asked for, and a GPU that is not seen fails loudly where it matters (backend=nccl).
    "DeepSpeed": ("Setting accelerator to CPU",),
    # torchao, as it imports: its prebuilt CUDA kernels for MX formats and CUTLASS do not load on a machine without
    # a matching CUDA; float8 training with rowwise scales and the 8-bit optimizer do not use them.
    "torchao": ("Failed to load",),
    # torch, when torchao registers its enum as a pytree constant (a deprecation aimed at torchao, not the user).
    "torch.utils._pytree": ("is an Enum subclass",),
}


def quiet_third_party() -> None:
    for name, fragments in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(*fragments))
