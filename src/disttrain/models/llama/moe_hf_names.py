"""The built-in MoE family's parameters as transformers' Qwen2-MoE (`Qwen2MoeForCausalLM`), and back (here,
beside the Llama names: the family's blocks are Llama's, models/moe/).

Why Qwen2-MoE: of transformers' MoE families it is the one with the same blocks. Its attention is
Llama's without biases (`qkv_bias=False`) and without the q/k norms Qwen3-MoE and OLMoE add; its router
is a softmax whose top-k weights are used as they are (`norm_topk_prob=False`, as here); leading dense
layers are its `mlp_only_layers`; experts are fused `gate_up_proj (E, 2I, H)` = [w1; w3] and
`down_proj (E, H, I)` = w2. Mixtral renormalises the top-k weights and has no shared experts; DeepSeek-V3
has latent attention. Its shared expert is scaled by `sigmoid(shared_expert_gate(x))`, which the built-in
family does not have: the export writes that gate as zeros (sigmoid(0) = 1/2 exactly) and the shared
down projection doubled, so the product is the same number (scaling by 2 is exact in floating point).

Not expressible there, refused in one line: sigmoid scoring (DeepSeek-V3's), and a balancing bias that
has moved (`model.moe.bias_update_rate`): Qwen2-MoE's router has no bias to choose experts with.
"""

from __future__ import annotations

import re

import torch

from disttrain.core.errors import UserError
from disttrain.models.llama import hf_names as llama_names
from disttrain.models.shape import ModelShape

_SHARED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expressible(shape: ModelShape) -> None:
    if shape.moe.scoring_func != "softmax":
        raise UserError(f"--to hf: model.moe.scoring_func={shape.moe.scoring_func} has no transformers family with "
                        "the built-in MoE's other blocks (allowed: softmax, exported as Qwen2-MoE)")


def to_hf(state: dict, shape: ModelShape) -> dict:
    expressible(shape)
    out, dense = {}, {}
    for name, tensor in state.items():
        m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(router|experts|shared_experts)\.(.+)", name)
        if m is None:
            dense[name] = tensor
            continue
        layer, part, rest = m.groups()
        mlp = f"model.layers.{layer}.mlp"
        if part == "router" and rest == "expert_bias":
            if tensor.any():
                raise UserError(f"--to hf: layer {layer}'s balancing bias has moved (model.moe.bias_update_rate); "
                                "Qwen2-MoE's router has none to choose experts with (allowed: runs without "
                                "model.moe.bias_update_rate, or --to torch|safetensors)")
        elif part == "router":
            out[f"{mlp}.gate.weight"] = tensor
            out[f"{mlp}.shared_expert_gate.weight"] = tensor.new_zeros(1, shape.dim)
        elif part == "experts" and rest == "w1":
            w3 = state[name[:-2] + "w3"]
            out[f"{mlp}.experts.gate_up_proj"] = torch.cat([tensor, w3], dim=1)
        elif part == "experts" and rest == "w2":
            out[f"{mlp}.experts.down_proj"] = tensor
        elif part == "shared_experts":
            w = rest.split(".")[0]
            out[f"{mlp}.shared_expert.{_SHARED[w]}.weight"] = tensor * 2 if w == "w2" else tensor
    out.update(llama_names.to_hf(dense, shape))
    return out


def from_hf(state: dict) -> dict:
    """Back from an export (the shared expert gate must be zero, as the export writes it)."""
    out, dense = {}, {}
    for name, tensor in state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate|experts|shared_expert|shared_expert_gate)\.(.+)", name)
        if m is None:
            dense[name] = tensor
            continue
        layer, part, rest = m.groups()
        ff = f"layers.{layer}.feed_forward"
        if part == "gate":
            out[f"{ff}.router.gate.weight"] = tensor
        elif part == "experts" and rest == "gate_up_proj":
            out[f"{ff}.experts.w1"], out[f"{ff}.experts.w3"] = tensor.chunk(2, dim=1)
        elif part == "experts":
            out[f"{ff}.experts.w2"] = tensor
        elif part == "shared_expert_gate":
            if tensor.any():
                raise ValueError(f"{name} is not zero: the built-in MoE family's shared experts have no gate")
        else:
            w = {v: k for k, v in _SHARED.items()}[rest.split(".")[0]]
            out[f"{ff}.shared_experts.{w}.weight"] = tensor / 2 if w == "w2" else tensor
    out.update(llama_names.from_hf(dense))
    return out


def hf_config(shape: ModelShape) -> dict:
    expressible(shape)
    moe = shape.moe
    config = llama_names.hf_config(shape)
    config.update({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "qkv_bias": False,
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": moe.moe_intermediate_size * moe.n_shared_experts,
        "mlp_only_layers": list(range(moe.first_k_dense_replace)), "use_sliding_window": False,
        "output_router_logits": False,
    })
    for key in ("mlp_bias", "attention_bias"):
        config.pop(key, None)
    return config
