"""float8 matmuls (`precision.float8=rowwise`): torchao's float8 training, rowwise scales, on the Linear layers
of the repeated blocks.

Applied first by `parallelize` (before tensor parallelism, FSDP, checkpointing and compile), to the single-device
model or one pipeline stage of it, so every later step wraps float8 layers exactly as it wraps plain ones. Which
layers, by rule:
- an `nn.Linear` inside the repeated blocks (`spec.blocks`): the output head is outside them and keeps the compute
  dtype (its loss runs in chunks, models/output_head.py), as do the embeddings;
- both of its dimensions multiples of 16, what float8 matmul kernels (`torch._scaled_mm`) require;
- not a router's (a module that picks experts, i.e. has `top_k`): float8 rounding of routing logits moves whole
  tokens to other experts, for a matmul too small to gain anything;
- not a LoRA adapter's factor (`lora_A`, `lora_B`): rank-sized, nothing to gain.
Routed experts' grouped GEMMs are not Linear layers and stay in the compute dtype.

The weights stay parameters of their own dtype (torchao casts them to float8 per matmul): checkpoints, resumes
and exports are unchanged. torchao imports lazily, only when float8 is on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

MULTIPLE = 16  # torch._scaled_mm's requirement on both dimensions
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


@dataclass
class Float8Choice:
    """Which Linear layers of the blocks take float8 matmuls, and which do not (with why)."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why

    def describe(self) -> str:
        reasons: dict[str, int] = {}
        for why in self.skipped.values():
            reasons[why] = reasons.get(why, 0) + 1
        kept = "; ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
        return (f"rowwise float8 matmuls in {len(self.converted)} of {len(self.converted) + len(self.skipped)} "
                f"Linear layers of the blocks" + (f" (kept in the compute dtype: {kept})" if kept else ""))


def choose_layers(model: nn.Module, spec) -> Float8Choice:
    """The rule above, as names in `model` (the whole model or a pipeline stage)."""
    blocks = spec.blocks(model)
    prefix = next(name for name, module in model.named_modules() if module is blocks)
    routers = [name for name, module in blocks.named_modules() if hasattr(module, "top_k") and name]
    choice = Float8Choice()
    for name, module in blocks.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        full = f"{prefix}.{name}" if prefix else name
        if any(name.startswith(r + ".") for r in routers):
            choice.skipped[full] = "router"
        elif ".lora_" in f".{name}":
            choice.skipped[full] = "LoRA factor"
        elif module.in_features % MULTIPLE or module.out_features % MULTIPLE:
            choice.skipped[full] = f"dimension not a multiple of {MULTIPLE}"
        else:
            choice.converted.append(full)
    return choice


def apply_float8(model: nn.Module, spec, device: torch.device) -> Float8Choice:
    """Swap the chosen layers for torchao's Float8Linear (rowwise recipe), in place. Off CUDA through torchao's
    emulation: inputs, weights and gradients rounded to float8 with the same scales, multiplied in fp32 (no float8
    kernel; the numerics the tests hold)."""
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    choice = choose_layers(model, spec)
    chosen = set(choice.converted)
    config = replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=device.type != "cuda")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    return choice


def float8_device_problem(device: torch.device) -> str | None:
    """Why this device cannot run float8 matmuls (None: it can). CPUs run torchao's emulation (for tests, not
    speed); CUDA GPUs need compute capability 8.9 or newer."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= MIN_CAPABILITY:
        return None
    name = torch.cuda.get_device_name(device)
    return (f"precision.float8=rowwise needs a GPU with float8 matmuls (compute capability 8.9 or newer: L4, L40, "
            f"H100, H200, B200); this {name} has {capability[0]}.{capability[1]} (allowed here: off)")
