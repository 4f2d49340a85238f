"""Dotted ``key=value`` command-line overrides, as the nested tree a YAML config file gives."""

from __future__ import annotations

import yaml

from disttrain.core.errors import ConfigError


def parse_overrides(items: list[str]) -> dict:
    """Turn ``a.b=c`` strings into a nested dict; values are parsed as YAML scalars."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key part")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is a value, not a section")
        node[parts[-1]] = value
    return tree


def merge_trees(base: dict, extra: dict) -> dict:
    """`extra` over `base`, section by section."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_trees(out[key], value)
        else:
            out[key] = value
    return out
