"""Norms and routers that stay in float64 when the model is float64 (`precision.compute_dtype=fp64`).

transformers' RMSNorms (Llama's and its copies, Gemma's `1 + weight`, Gemma 4's, gpt-oss's) compute in float32 on
purpose, `hidden_states.to(torch.float32)` or `.float()`, so that bf16/fp16 activations are normalised stably;
DeepSeek-V3's and GLM-4-MoE's routers compute their logits in float32 for the same reason, and so do transformers'
torch kernels of Gated DeltaNet layers (Qwen3-Next, Qwen3.5: the decay `A_log.float()`, the chunked recurrence
`.to(torch.float32, memory_format=...)`). On a float64 model
those casts round every normalised activation (and its gradient) or routing weight to float32: the run is no
longer double precision, and a layout that sums in another order (torch.compile's fused norm, tensor
parallelism's split heads, a data-parallel rank's smaller batch in the router's matmul) flips those roundings,
measured 6e-9 apart in the loss and 8e-5 in parameters after 6 steps instead of ~1e-16 (Gemma 3 under TP=2:
7e-10 in the loss; DeepSeek-V3 under DDP: 1.4e-10 in the gradient norm; a Gated DeltaNet recurrence cut at other
chunk boundaries, as context parallelism cuts it: 1e-7). For float64 inputs such a module runs its own forward with
its float32 casts left out (`_NoFloat32Casts`); every other dtype runs it untouched. `keeping_float64` does the
same for a kernel called again outside its module's forward (a recomputation in backward).
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class _NoFloat32Casts(TorchFunctionMode):
    """Inside: a float64 tensor asked to become float32 (`.float()`, `.type(torch.float32)`, `.to(torch.float32)`,
    `.to(dtype=torch.float32)`, or an op's `dtype=torch.float32`) stays float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.float, torch.Tensor.type, torch.Tensor.to) and args and \
                isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            rest = {k: v for k, v in kwargs.items() if k != "dtype"}
            if func is torch.Tensor.float:
                target = torch.float32
            elif len(args) == 2:
                target = args[1] if "dtype" not in kwargs else None
            else:
                target = kwargs.get("dtype") if len(args) == 1 else None
            if target is torch.float32 and set(rest) <= _KEPT:
                return args[0].to(**rest) if rest else args[0]
        elif kwargs.get("dtype") is torch.float32 and args and isinstance(args[0], torch.Tensor) and \
                args[0].dtype == torch.float64:  # Gemma 4's router: softmax(scores, dim=-1, dtype=torch.float32)
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


_KEPT = {"memory_format", "copy", "non_blocking"}  # what such a cast may ask besides the dtype: still honoured


def _dispatch(self, hidden_states: torch.Tensor, *args, **kwargs):
    if hidden_states.dtype != torch.float64:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    with _NoFloat32Casts():
        return type(self).forward(self, hidden_states, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _casts_to_float32(cls: type) -> bool:
    """A norm, router or Gated DeltaNet layer whose forward casts to float32 on purpose."""
    name = cls.__name__
    if not ("RMSNorm" in name or name.endswith(("Router", "GatedDeltaNet"))) or cls.forward is nn.Module.forward:
        return False
    try:
        code = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "torch.float32" in code or ".float()" in code


def keeping_float64(fn):
    """`fn` with its float32 casts of float64 tensors left out when its first argument is float64."""
    @functools.wraps(fn)
    def run(first, *args, **kwargs):
        if not (isinstance(first, torch.Tensor) and first.dtype == torch.float64):
            return fn(first, *args, **kwargs)
        with _NoFloat32Casts():
            return fn(first, *args, **kwargs)

    return run


def keep_float64(model: nn.Module) -> int:
    """Give each such norm, router and Gated DeltaNet layer of `model` a forward that keeps float64 inputs in float64; returns how many."""
    modules = [m for m in model.modules() if _casts_to_float32(type(m))]
    for module in modules:
        module.forward = types.MethodType(_dispatch, module)
    return len(modules)
