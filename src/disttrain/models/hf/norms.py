"""RMSNorms and routers that stay in float64 when the model is float64 (`precision.compute_dtype=fp64`).

transformers' LlamaRMSNorm (and its copies: Qwen2, Mistral, Qwen3, Phi-3, ...) and Gemma's `1 + weight`
RMSNorm (and its copies: Qwen3-Next, ...) compute in float32 on purpose, `hidden_states.to(torch.float32)`, so that bf16/fp16 activations are normalised stably. On a
float64 model that same cast rounds every normalised activation, and its gradient, to float32: the run is
no longer double precision, and a layout that sums the norm's variance in another order (torch.compile's
fused kernel) flips those float32 roundings, measured 6e-9 apart in the loss and 8e-5 in parameters after
6 steps instead of ~1e-16 (Gemma 3 under TP=2: 7e-10 in the loss). Only float64 inputs change; every other
dtype runs transformers' own forward.
"""

from __future__ import annotations

import functools
import inspect
import re
import types

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def _llama_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)  # Llama's formula without the float32 round trip
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _gemma_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self._norm(x) * (1.0 + self.weight)  # Gemma's formula without the float32 round trip


def _references() -> dict:
    """transformers' class whose methods a norm must match letter for letter -> its float64 forward."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return {LlamaRMSNorm: (("forward",), _llama_forward), GptOssRMSNorm: (("forward",), _llama_forward),
            Gemma3RMSNorm: (("forward", "_norm"), _gemma_forward)}


def _code(method) -> str:
    """A method's source without comments (copies of a norm differ in the model name a comment gives)."""
    return "\n".join(line for line in (re.sub(r"#.*$", "", raw).rstrip() for raw in
                                       inspect.getsource(method).splitlines()) if line)


@functools.lru_cache(maxsize=None)
def _float64_forward(cls: type):
    """The float64 forward of a class that is one of the reference norms under another name, else None."""
    if not hasattr(cls, "forward") or cls.forward is nn.Module.forward:
        return None
    for reference, (methods, forward) in _references().items():
        try:
            if all(hasattr(cls, m) and _code(getattr(cls, m)) == _code(getattr(reference, m)) for m in methods):
                return forward
        except (OSError, TypeError):
            continue
    return None


def _dispatch(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != torch.float64:
        return type(self).forward(self, hidden_states)
    return _float64_forward(type(self))(self, hidden_states)


def keep_float64_norms(model: nn.Module) -> int:
    """Give each Llama- or Gemma-style RMSNorm of `model` a forward that keeps float64 inputs in float64; returns
    how many."""
    norms = [m for m in model.modules() if _float64_forward(type(m)) is not None]
    for module in norms:
        module.forward = types.MethodType(_dispatch, module)
    return len(norms)


class _NoFloat32Casts(TorchFunctionMode):
    """Inside: a float64 tensor asked to become float32 (`.float()`, `.type(torch.float32)`, `.to(torch.float32)`)
    stays float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.float, torch.Tensor.type, torch.Tensor.to) and args and \
                isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            target = torch.float32 if func is torch.Tensor.float else \
                (args[1] if len(args) == 2 and not kwargs else kwargs.get("dtype") if len(args) == 1 else None)
            if target is torch.float32:
                return args[0]
        return func(*args, **kwargs)


def _router_dispatch(self, hidden_states: torch.Tensor):
    if hidden_states.dtype != torch.float64:
        return type(self).forward(self, hidden_states)
    with _NoFloat32Casts():
        return type(self).forward(self, hidden_states)


@functools.lru_cache(maxsize=None)
def _float32_router(cls: type) -> bool:
    """A router that computes its logits in float32 on purpose (DeepSeek-V3's, GLM-4-MoE's)."""
    try:
        return cls.__name__.endswith("Router") and "torch.float32" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def keep_float64_routers(model: nn.Module) -> int:
    """Routers that cast to float32 keep float64 inputs in float64 (as the norms above): their float32 logits
    round differently for another number of rows in a batch, 1e-10 apart between layouts after a few steps."""
    routers = [m for m in model.modules() if _float32_router(type(m))]
    for module in routers:
        module.forward = types.MethodType(_router_dispatch, module)
    return len(routers)
