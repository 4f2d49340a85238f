"""Which model family a `model` config section names, and its pure-Python shape.

Pure Python until `model_spec` is asked: the planner reads shapes only. The torch side of a family
(its ModelSpec) is resolved once per process, by `resolve.resolve_run`; everything after reads that.
"""

from __future__ import annotations

from disttrain.models.llama.shapes import MODEL_SHAPES, resolve_shape
from disttrain.models.shape import ModelShape

__all__ = ["MODEL_SHAPES", "ModelShape", "model_shape", "model_spec"]


def model_shape(model_cfg) -> ModelShape | None:
    """The decoder dimensions the config describes: a Hugging Face directory's config.json, a user
    ModelSpec's own shape (None when it has none), or the built-in registry shape with its overrides."""
    if getattr(model_cfg, "spec", ""):
        return model_spec(model_cfg).shape
    if getattr(model_cfg, "hf", ""):
        from disttrain.models.hf.shape import hf_shape

        return hf_shape(model_cfg.hf)
    return resolve_shape(model_cfg)


def model_spec(model_cfg):
    """The ModelSpec (torch side) of the configured model."""
    if getattr(model_cfg, "spec", ""):
        from disttrain.models.spec import ModelSpec
        from disttrain.core.user_code import call_user

        return call_user("model.spec", model_cfg.spec, ModelSpec, "a disttrain.models.spec.ModelSpec")
    if getattr(model_cfg, "hf", ""):
        from disttrain.models.hf.spec import hf_spec
        from disttrain.models.moe.layer import MoERouting

        moe = model_cfg.moe
        return hf_spec(model_cfg.hf, MoERouting(moe.aux_loss_coef, moe.bias_update_rate, moe.capacity_factor))
    from disttrain.models.llama import llama_spec

    shape = model_shape(model_cfg)
    if shape.moe is not None:
        from disttrain.models.moe import MoERouting, moe_spec

        moe = model_cfg.moe
        return moe_spec(shape, MoERouting(moe.aux_loss_coef, moe.bias_update_rate, moe.capacity_factor))
    return llama_spec(shape)
