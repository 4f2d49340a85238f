"""Model + optimizer state through torch.distributed.checkpoint (sharded, reshardable on load).

`get_state_dict`/`set_state_dict` give every layout (DDP, FSDP2, TP DTensors, a pipeline's pruned
model) the same fully-qualified names, so a checkpoint written by one layout loads into another.
ZeRO-1's optimizer (each rank owns some parameters' states) supplies its own state dicts.
A model with LoRA adapters (models/lora.py) saves and loads only what trains: the frozen base is
rebuilt from its source on resume, and its fingerprint is checked instead (train/resume.py).
The location is a local path or an fsspec URL: DCP's file-system or fsspec storage (storage.py).
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from disttrain.core import storage
from disttrain.models.lora import has_adapters


def _options(model) -> StateDictOptions:
    """Under LoRA, only the trained parameters: DCP refuses a checkpoint lacking any of them, and loading
    leaves the frozen base (absent from the state) as built."""
    parts = model if isinstance(model, (list, tuple)) else [model]  # a pipeline's stages
    lora = any(has_adapters(part) for part in parts)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def save(path, model, optimizer, async_group=None, optim_state=None):
    """Collective. `optim_state`: the optimizer's state dict when it is not the standard one (ZeRO-1).
    Returns a future when `async_group` is given (the write continues in the background)."""
    if optim_state is None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    else:
        model_sd, optim_sd = get_model_state_dict(model, options=_options(model)), optim_state
    state = {"model": model_sd, "optim": optim_sd}
    if async_group is not None:
        return dcp.async_save(state, storage_writer=storage.dcp_writer(path), process_group=async_group)
    dcp.save(state, storage_writer=storage.dcp_writer(path))
    return None


def load(path, model, optimizer, optim_template=None):
    """Collective: restore in place. With `optim_template` (ZeRO-1) returns the loaded optimizer
    state for the caller to install; otherwise installs it."""
    options = _options(model)
    if optim_template is not None:
        state = {"model": get_model_state_dict(model, options=options), "optim": optim_template}
        dcp.load(state, storage_reader=storage.dcp_reader(path))
        set_model_state_dict(model, state["model"], options=options)
        return state["optim"]
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=storage.dcp_reader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    return None
