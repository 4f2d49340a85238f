"""Optimizer states in bf16 (`optim.state_dtype=bf16`): half the bytes of AdamW's two moments and Muon's momentum.

torch's AdamW keeps its moments in the parameter's dtype: its single-tensor and foreach steps refuse moments of
another dtype, and only its fused CUDA kernel mixes them (not on CPU, not for a list mixing DTensors and plain
tensors). So the bf16 step is written here, per tensor: each moment is read into the parameter's dtype, updated by
the same operations as torch.optim.AdamW's single-tensor step, used at that precision, and stored back rounded. One
step therefore equals torch.optim.AdamW's step from the rounded moments, which is how the tests check it.

8-bit states (`optim.state_dtype=int8`) are torchao's AdamW8bit: each moment in blocks of 256 values, one byte a
value and one fp32 scale a block (tensors under 4,096 values stay in their own dtype), on plain tensors and on
FSDP2's and tensor parallel's DTensors (each rank quantizes its own shard).
"""

from __future__ import annotations

import torch

STATE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "int8": None}  # None: the parameter's own dtype (torch's
# default; int8's quantized moments are torchao's tensor subclass, not a dtype)
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


class AdamWBf16States(torch.optim.AdamW):
    """torch.optim.AdamW (decoupled decay, no amsgrad) whose moments are stored in bf16. The dtype is a class
    attribute, not an argument: ZeroRedundancyOptimizer copies its extra arguments into every param group (and so
    into checkpoints)."""

    state_dtype = torch.bfloat16

    def __init__(self, params, **kwargs):
        kwargs.pop("foreach", None)
        super().__init__(params, foreach=False, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        return loss

    def _step_one(self, p, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, grad, state = group["lr"], p.grad, self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        if group["weight_decay"] != 0:
            p.mul_(1 - lr * group["weight_decay"])
        exp_avg = state["exp_avg"].to(p.dtype).lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].to(p.dtype).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        p.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1 ** step)))

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # torch casts every state to its parameter's dtype: cast back
        keep_states_in(self, self.state_dtype)


def keep_states_in(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None) -> None:
    """Cast `optimizer`'s moments back to `dtype` (after a load, which gives them the parameters' dtype)."""
    if dtype is None:
        return
    for entry in optimizer.state.values():
        for key in MOMENTS:
            if key in entry and entry[key].dtype != dtype:
                entry[key] = entry[key].to(dtype)


def adamw_class(optim_cfg) -> type[torch.optim.Optimizer]:
    """The AdamW that keeps its moments in optim.state_dtype."""
    if optim_cfg.state_dtype == "int8":
        return adamw_8bit()
    return torch.optim.AdamW if STATE_DTYPES[optim_cfg.state_dtype] is None else AdamWBf16States


def adamw_8bit() -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit, stepped eagerly off CUDA. torchao compiles its per-parameter step for every parameter
    shape and dtype (about 20 s each on a CPU, where tests and small runs train); `force_eager` runs the same
    function uncompiled. Its learning rate is a tensor in each param group (torchao's requirement; schedules
    fill it in place)."""
    from torchao.optim import AdamW8bit

    class AdamWInt8States(AdamW8bit):
        def __init__(self, params, foreach=None, **kwargs):  # torchao's step has no foreach switch
            super().__init__(params, **kwargs)

        @torch.no_grad()
        def step(self, closure=None):
            first = next((p for group in self.param_groups for p in group["params"]), None)
            if first is not None and first.is_cuda:  # one device for all
                return super().step(closure)
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)

    return AdamWInt8States
