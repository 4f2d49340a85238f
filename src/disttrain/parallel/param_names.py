"""Parameter names as checkpoints spell them, whatever wrappers the layout added."""

WRAPPER_PARTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def clean_fqn(name: str) -> str:
    """`module.layers.0._checkpoint_wrapped_module.mlp.weight` -> `layers.0.mlp.weight`."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)
