"""A LoRA run's weights out: the adapters in PEFT's format (`--to peft`), or folded into the base as
ordinary weights (`--merge-lora`).

The checkpoint holds only the adapters; the base is rebuilt exactly as training built it (the model
directory's weights, `model.init_from`, or the seeded initialisation) and must match the fingerprint the
run recorded. Folding uses peft's own `merge`; the adapter folder is what `PeftModel.save_pretrained`
writes (`adapter_config.json` from peft's LoraConfig, `adapter_model.safetensors` under PEFT's names).
"""

from __future__ import annotations

from pathlib import Path

import torch

from disttrain.core.errors import UserError


def _hf_module_names(spec, modules: list[str]) -> dict[str, str]:
    """The Hugging Face name of each adapted module (the spec's state-dict adapter, asked per weight)."""
    if spec.to_hf is None:
        raise UserError(f"--to peft: model {spec.name} has no Hugging Face name mapping, so PEFT cannot load its "
                        "adapters (allowed for it: --to torch|safetensors|hf --merge-lora)")
    names = {}
    for module in modules:
        (hf,) = spec.to_hf({f"{module}.weight": torch.empty(0)}).keys()
        names[module] = hf.removesuffix(".weight")
    return names


def export_peft(saved, adapters: dict[str, torch.Tensor], out: Path) -> Path:
    """adapter_config.json + adapter_model.safetensors that `PeftModel.from_pretrained(base, out)` loads;
    `saved`: the run (config/saved.py); `adapters`: the checkpoint's parameters (export.full_model_state)."""
    from safetensors.torch import save_file

    from disttrain.models.lora import is_adapter, peft_config

    spec = saved.spec
    state = {k: v for k, v in adapters.items() if is_adapter(k)}
    modules = sorted({k.split(".lora_")[0] for k in state})
    hf = _hf_module_names(spec, modules)
    tensors = {}
    for name, tensor in state.items():
        module, rest = name.split(".lora_")
        part = "lora_" + rest.split(".")[0]  # lora_A / lora_B; PEFT's files leave the adapter name out
        tensors[f"base_model.model.{hf[module]}.{part}.weight"] = tensor.clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config(saved.model.lora, [hf[m] for m in modules], base=saved.model_dir).save_pretrained(str(out))
    return out


@torch.no_grad()
def merged_state(saved, adapters: dict[str, torch.Tensor], init_from) -> dict[str, torch.Tensor]:
    """The base as training built it, with the checkpoint's `adapters` folded in: fp32, the model's own names.
    `saved`: the run (config/saved.py); `init_from(model, path, spec)`: how a run loads `model.init_from`
    (export.init_from)."""
    from disttrain.models.lora import apply_lora, merge_lora
    from disttrain.models.spec import build_model

    spec, model_cfg, trained_on = saved.spec, saved.model, saved.state.get("lora_base")
    model = build_model(spec, torch.device("cpu"), saved.seed, torch.float64 if saved.fp64 else None)
    if model_cfg.init_from:
        init_from(model, model_cfg.init_from, spec)
    base = apply_lora(model, spec, model_cfg.lora, saved.seed)
    if trained_on and base != trained_on:
        raise UserError(f"--merge-lora: the base model rebuilt from the run's config differs from the one its "
                        f"adapters were trained on (fingerprint {base}, trained on {trained_on}): were "
                        f"the weights of model.hf={saved.model_dir or '(none)'} or model.init_from replaced?")
    params = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}  # buffers, ties
    for name, tensor in adapters.items():  # (DeepSeek's routing-correction bias; a tied head under its own name)
        params[name].copy_(tensor.to(params[name].dtype))
    merge_lora(model)
    return {k: v.detach().float().contiguous() for k, v in model.named_parameters()}
