"""Which model a `model` config section names: a table of resolvers, one per kind of model (a user's ModelSpec,
a Hugging Face directory, the built-in registry), each giving the pure-Python shape and the torch-side ModelSpec.

The registry is where the config section is read (its `spec`, `hf`, `name` and shape keys); the families below
it take a request (a shape, a directory, the routing settings). Pure Python until a spec is asked: the planner
reads shapes only. The ModelSpec is resolved once per process, by config/resolve.py; everything after reads it,
and its `family` says what kind of model it is (which checkpoints it can load).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

from disttrain.core.errors import UserError
from disttrain.models.hf.published import PUBLISHED_CONFIGS, search_limits, published_shapes
from disttrain.models.llama.shapes import MODEL_SHAPES as LLAMA_SHAPES, resolve_shape
from disttrain.models.shape import ModelShape, MoEShape

__all__ = ["MODEL_SHAPES", "ModelShape", "search_limits", "RESOLVERS", "model_shape", "model_spec", "model_tokenizer",
           "resolver_for", "saved_model", "default_balancing"]

BUILT_IN = "built-in llama"  # the family of the Llama registry models, dense or MoE (as checkpoints record it)
# Every `model.name`: the built-in Llama shapes, then the published models transformers builds (models/hf/published.py).
MODEL_SHAPES: dict[str, ModelShape] = {**LLAMA_SHAPES, **published_shapes()}
SHAPE_KEYS = tuple(f.name for f in fields(ModelShape) if f.name not in ("moe", "mla", "extras"))
MOE_SHAPE_KEYS = tuple(f.name for f in fields(MoEShape))


def _routing(section):
    """The router's training settings (`model.moe.*`) as the MoE families take them."""
    from disttrain.models.moe.layer import MoERouting

    moe = section.moe
    return MoERouting(moe.aux_loss_coef or 0.0, moe.bias_update_rate or 0.0, moe.capacity_factor)


AUX_LOSS_COEF = 0.001  # Qwen3-MoE's and Mixtral's router_aux_loss_coef, for a model whose config names none


def default_balancing(section, engine: str, compute_dtype: str) -> tuple[float | None, float | None]:
    """(aux_loss_coef, bias_update_rate) an MoE model trains with when the config leaves them unset; (None, None)
    for a dense model or a user's ModelSpec (its own business). Every MoE balances with the switch-style loss: a
    Hugging Face model at the coefficient its config.json carries, a built-in one at AUX_LOSS_COEF. Not the bias
    (aux-loss-free, DeepSeek-V3's): it needs the torch engine, transformers' routers have none, and a moved bias
    cannot be exported as Qwen2-MoE (`convert --to hf`); it stays one key away. fp16 compute takes no balancing loss
    (models/rules.py): nothing then, and the collapse warning (observe/moe.py) speaks if routing collapses."""
    if resolver_for(section).key == "model.spec":
        return None, None
    shape = model_shape(section)
    if shape is None or shape.moe is None:
        return None, None
    coef = AUX_LOSS_COEF
    if resolver_for(section).key == "model.hf":
        from disttrain.models.hf.shape import read_config

        own = read_config(section.hf).get("router_aux_loss_coef")
        coef = float(own) if own is not None else AUX_LOSS_COEF
    return (coef if compute_dtype != "fp16" else 0.0), 0.0


def _registry_shape(section) -> ModelShape:
    """The registry shape of `model.name` with the section's non-empty shape keys over it (none on a published
    model: its architecture is its config.json's)."""
    moe = getattr(section, "moe", None)
    shape = {k: getattr(section, k) for k in SHAPE_KEYS if getattr(section, k, None) is not None}
    if section.name in PUBLISHED_CONFIGS:
        moe_keys = [k for k in MOE_SHAPE_KEYS if getattr(moe, k, None) is not None]
        if shape or moe_keys:
            key = next(iter(shape), None) or f"moe.{moe_keys[0]}"
            value = shape[key] if key in shape else getattr(moe, moe_keys[0])
            raise UserError(f"model.{key}={value}: model.name={section.name} is the published model's shape and "
                            "takes no shape keys (allowed: none; or model.hf=DIR with an edited config.json)")
        return MODEL_SHAPES[section.name]
    return resolve_shape(section.name, shape, {k: getattr(moe, k) for k in MOE_SHAPE_KEYS
                                               if getattr(moe, k, None) is not None})


def _user_spec(section):
    from disttrain.core.user_code import call_user
    from disttrain.models.spec import ModelSpec

    spec = call_user("model.spec", section.spec, ModelSpec, "a disttrain.models.spec.ModelSpec")
    return replace(spec, family=f"user spec {spec.name}", label=spec.name)


def _hf_shape(section) -> ModelShape:
    from disttrain.models.hf.shape import hf_shape

    return hf_shape(section.hf)


def _hf_spec(section):
    from disttrain.models.hf.spec import hf_spec

    spec = hf_spec(section.hf, _routing(section), getattr(section, "attn_implementation", "auto"))
    return replace(spec, family=f"Hugging Face {spec.name}", label=section.hf)


def _registry_spec(section):
    shape = _registry_shape(section)
    if section.name in PUBLISHED_CONFIGS:  # transformers' architecture, from the model card's config.json
        from disttrain.models.hf.spec import hf_spec

        spec = hf_spec(section.name, _routing(section), getattr(section, "attn_implementation", "auto"),
                       config=PUBLISHED_CONFIGS[section.name])
        return replace(spec, family=f"Hugging Face {spec.name}", label=section.name)
    if shape.moe is not None:
        from disttrain.models.moe import moe_spec

        spec = moe_spec(shape, _routing(section))
    else:
        from disttrain.models.llama import llama_spec

        spec = llama_spec(shape)
    return replace(spec, family=BUILT_IN, label=section.name)


@dataclass(frozen=True)
class Resolver:
    """One kind of model a config section can name."""

    key: str  # the config key that names it
    applies: Callable[[object], bool]
    shape: Callable[[object], ModelShape | None]
    spec: Callable[[object], object]  # -> ModelSpec (torch side)


RESOLVERS = (
    Resolver("model.spec", lambda s: bool(getattr(s, "spec", "")), lambda s: model_spec(s).shape, _user_spec),
    Resolver("model.hf", lambda s: bool(getattr(s, "hf", "")), _hf_shape, _hf_spec),
    Resolver("model.name", lambda s: True, _registry_shape, _registry_spec),
)


def resolver_for(section) -> Resolver:
    return next(r for r in RESOLVERS if r.applies(section))


def model_shape(section) -> ModelShape | None:
    """The decoder dimensions the section describes: a user ModelSpec's own shape (None when it has none), a
    Hugging Face directory's config.json, or the built-in registry shape with its overrides."""
    return resolver_for(section).shape(section)


def model_spec(section):
    """The ModelSpec (torch side) of the configured model, its `family` and `label` set."""
    return resolver_for(section).spec(section)


def model_tokenizer(section) -> str | None:
    """The tokenizer.json that comes with the model (a Hugging Face directory's), or None."""
    if resolver_for(section).key != "model.hf":
        return None
    from disttrain.core.hub import local_directory

    own = Path(local_directory(section.hf)) / "tokenizer.json"
    return str(own) if own.is_file() else None


def model_source(section) -> str:
    """The model as the config names it, `key=value`: `model.name=debug`, `model.hf=DIR`, `model.spec=FILE:fn`."""
    key = resolver_for(section).key
    return f"{key}={getattr(section, key.split('.')[1])}"


def saved_model(section: dict) -> tuple[str | None, dict | None]:
    """(family, shape as a dict) of the model a saved config's `model` section describes, for checkpoints written
    before the train state recorded them (built-in and Hugging Face models; None where unknown)."""
    from types import SimpleNamespace

    moe = SimpleNamespace(**{k: section.get("moe", {}).get(k) for k in MOE_SHAPE_KEYS})
    names = SimpleNamespace(**{k: section.get(k) for k in SHAPE_KEYS}, name=section.get("name"), moe=moe,
                            hf=section.get("hf", ""), spec=section.get("spec", ""))
    resolver = resolver_for(names)
    if resolver.key == "model.spec":
        return None, None
    try:
        family = None if resolver.key == "model.hf" or names.name in PUBLISHED_CONFIGS else BUILT_IN
        return family, asdict(resolver.shape(names))
    except (OSError, KeyError, ValueError):
        return None, None
