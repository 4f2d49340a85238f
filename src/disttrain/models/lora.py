"""LoRA adapters (`model.lora`) through Hugging Face PEFT, put on the single-device model before any
parallelism is applied.

peft's `inject_adapter_in_model` replaces each targeted `nn.Linear` by its `lora.Linear`: the original
layer stays as `base_layer`, the pair as `lora_A.default` / `lora_B.default`, and every other parameter
is frozen. The optimizer then holds state for the adapters only, and checkpoints hold only them plus a
fingerprint of the base (checkpoint/dcp_io.py, train/resume.py). Data parallel, FSDP2, activation
checkpointing and the pipeline split compose with these layers unchanged: they see ordinary modules.
Tensor parallelism places the adapters after their base layers (parallel/lora_tp.py).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util

import torch
from torch import nn

ADAPTER = "default"  # peft's adapter name: parameters are `<module>.lora_A.default.weight`
INSTALL_HINT = "model.lora needs the peft package: pip install -c constraints.txt 'disttrain[lora]'"
_SAMPLE = 1 << 16  # leading elements of each base parameter that the fingerprint reads


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def linear_names(model: nn.Module, spec) -> tuple[list[str], list[str]]:
    """(every nn.Linear's full name, those inside the repeated blocks: attention and MLP projections)."""
    blocks = spec.blocks(model)
    prefix = next(n for n, m in model.named_modules() if m is blocks)
    every = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    inside = [n for n in every if n.startswith(f"{prefix}.")] if prefix else every
    return every, inside


def matches(name: str, pattern: str) -> bool:
    """A module name (`q_proj`, `self_attn.q_proj`: any module whose name ends so, peft's rule) or a glob
    on the full name (`model.layers.0.*`)."""
    return name == pattern or name.endswith(f".{pattern}") or fnmatch.fnmatchcase(name, pattern)


def peft_reaimed(model: nn.Module) -> tuple[str, ...]:
    """Module names peft re-aims for this transformers model type: to load adapters written for transformers 4,
    peft (0.18+) turns a target ending in `gate_proj`, `up_proj` or `down_proj` (Mixtral: w1, w2, w3) of an MoE
    family into LoRA on the fused experts, also when the module named is a shared expert or a dense MLP of
    transformers 5 (peft's own conversion table, read here). Adapters on such modules would train and load on
    other weights than asked, so they are left out of the default targets and refused when named."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        return ()
    pattern = getattr(conversion, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    mapping = getattr(conversion, "_MOE_TARGET_MODULE_MAPPING", {}).get(pattern) or {}
    return tuple(old for old, new in mapping.items() if new.endswith("_proj"))


def target_names(model: nn.Module, spec, targets: list[str]) -> list[str]:
    """The full names of the linear modules `targets` selects; ValueError naming a pattern that selects none, or
    one that selects a module peft would re-aim (`peft_reaimed`)."""
    every, inside = linear_names(model, spec)
    reaimed = peft_reaimed(model)
    if not targets:
        return [n for n in inside if n.rsplit(".", 1)[-1] not in reaimed]
    chosen = []
    for pattern in targets:
        found = [n for n in every if matches(n, pattern)]
        bad = [n for n in found if n.rsplit(".", 1)[-1] in reaimed]
        if bad:
            raise ValueError(f"model.lora.targets: {pattern!r} selects {bad[0]}, which peft re-aims at the fused "
                             f"experts of {model.config.model_type} models (its conversion of transformers-4 "
                             f"adapters of {', '.join(reaimed)}), so the adapter would not be where it trained "
                             "(allowed: the attention projections and other modules)")
        if not found:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in every})
            raise ValueError(f"model.lora.targets: {pattern!r} matches no linear module of model {spec.name} "
                             f"(allowed: its linear modules' names, {', '.join(leaves)}, or globs on their full "
                             f"names, e.g. {every[0] if every else 'none'})")
        chosen += [n for n in found if n not in chosen]
    return chosen


def lora_problem(spec, lora, layout) -> str | None:
    """Why this run cannot train the LoRA adapters `lora` (model.lora: rank, alpha, dropout, targets) under
    `layout`, in one line; None if it can. Builds the model on the meta device (no memory) to check the targets
    before anything is written."""
    if lora is None:
        return None
    if importlib.util.find_spec("peft") is None:
        return INSTALL_HINT
    if layout.engine == "deepspeed":
        return "model.lora with engine=deepspeed: adapters train with the torch engine (allowed: engine=torch)"
    if layout.tp > 1 and lora.dropout > 0:
        return (f"model.lora.dropout={lora.dropout} with parallel.tp={layout.tp}: each tensor-parallel rank would "
                "drop other inputs of the same adapter (allowed with tp > 1: model.lora.dropout=0)")
    with torch.device("meta"):
        model = spec.build()
    try:
        names = target_names(model, spec, lora.targets)
    except ValueError as exc:
        return str(exc)
    from disttrain.models.hf.tp_plans import HAND_SPLIT_LINEARS

    hand = [n for n in names if n.rsplit(".", 1)[-1] in HAND_SPLIT_LINEARS] if layout.tp > 1 else []
    if hand:
        return (f"model.lora on {hand[0]} with parallel.tp={layout.tp}: tensor parallelism changes that layer's "
                f"output or gradient by hand, which its adapter would not follow (allowed with tp > 1: "
                f"model.lora.targets without {', '.join(HAND_SPLIT_LINEARS)})")
    return None


def base_fingerprint(model: nn.Module) -> str:
    """Identifies the frozen base the adapters were trained on: every parameter's name, shape and dtype,
    its sum and its leading elements (cheap on a 70B model, and any other seed or checkpoint differs)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        t = param.detach()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{float(t.double().sum()):.17g}".encode())
        digest.update(t.reshape(-1)[:_SAMPLE].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def peft_config(lora, names: list[str], base: str = ""):
    """peft's LoraConfig for these exact modules (full names: peft matches a name equal to the target)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(names),
                      bias="none", base_model_name_or_path=base or None)


def apply_lora(model: nn.Module, spec, lora, seed: int, base_dtype: torch.dtype | None = None) -> str:
    """Inject adapters into the built, initialised single-device model and freeze the rest; returns the
    base's fingerprint. lora_A starts from peft's rule (Kaiming-uniform, bound 1/sqrt(in)) drawn from a
    generator seeded by parameter name, so every layout starts identical; lora_B starts at zero.
    `base_dtype` (bf16/fp16 compute): the frozen base is stored in it, half the bytes, since no optimizer
    updates it; the adapters stay fp32 (autocast computes with both)."""
    fingerprint = base_fingerprint(model)
    inject_lora(model, spec, lora, base_dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
                bound = param.shape[1] ** -0.5
                gen = torch.Generator(device=param.device).manual_seed(key)
                param.copy_(torch.rand(param.shape, generator=gen, dtype=torch.float64, device=param.device)
                            .mul_(2 * bound).sub_(bound).to(param.dtype))
    return fingerprint


def inject_lora(model: nn.Module, spec, lora, base_dtype: torch.dtype | None = None) -> None:
    """peft's adapters on the targets, every other parameter frozen, the base stored in `base_dtype`: no values
    read or written (the dry run's model on the meta device takes it as it is)."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(lora, target_names(model, spec, lora.targets)), model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if base_dtype is not None and not is_adapter(name) and param.is_floating_point():
                param.data = param.data.to(base_dtype)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base weight (peft's own `merge`) and put the plain layer back, so the
    model has its original parameter names."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(adapter_names=[ADAPTER])
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    return model
