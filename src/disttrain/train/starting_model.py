"""The single-device model a run starts from, built the same way for the model that trains and for the frozen
ones beside it (DPO's reference copy, a distillation teacher): the same seed or weights give the same start on
every layout and after every resume."""

from __future__ import annotations

import torch
from torch import nn

from disttrain.core.errors import UserError
from disttrain.models.spec import ModelSpec, build_model


def starting_model(cfg, spec: ModelSpec, layout, device, tokenizer, masks_targets: bool) -> nn.Module:
    """The single-device model as training starts from it: built and initialised from the seed, or loaded from
    `model.init_from`, with document masking and MoE padding exclusion in place (no adapters, no parallelism)."""
    model = build_model(spec, device, cfg.train.seed, torch.float64 if layout.compute_dtype == "fp64" else None)
    if cfg.data.document_masking:  # validation checked the spec can and the tokenizer has an end token
        spec.mask_documents(model, tokenizer.eos_id)
    if spec.moe_layers is not None and masks_targets and tokenizer.eos_id is not None \
            and layout.pp == layout.cp == 1:  # a stage or a sequence shard sees no whole rows of token ids
        from disttrain.models.moe.padding import exclude_padding  # padding reaches no expert

        exclude_padding(model, spec.moe_layers(model).values(), tokenizer.eos_id)
    if cfg.model.init_from:
        from disttrain.checkpoint.export import init_from

        try:
            init_from(model, cfg.model.init_from, spec)
        except ValueError as exc:
            raise UserError(f"model.init_from={cfg.model.init_from}: {exc}") from None
        except Exception as exc:  # not weights at all: safetensors, pickle and zip readers raise their own types
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise UserError(f"model.init_from={cfg.model.init_from}: not a weights file written by "
                            f"`disttrain convert` ({type(exc).__name__}: {reason})") from None
    return model
