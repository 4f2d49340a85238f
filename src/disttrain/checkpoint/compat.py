"""What may change between a checkpoint's config and the resuming run's.

- the model shape: never (the parameters would not fit) -> refused with a one-line error;
- layout, logging, checkpointing, run length, process count: safe, reported;
- anything else (data, seed, batch, optimizer, precision): allowed, reported as a warning,
  because the resumed run will no longer follow the interrupted run's trajectory.
"""

from __future__ import annotations

SAFE_PREFIXES = ("metrics.", "checkpoint.", "run.", "distributed.", "parallel.", "train.steps", "train.eval_every",
                 "train.eval_batches", "train.sample_tokens", "train.sample_prompt", "train.micro_batch_size")


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(safe changes, trajectory-changing changes) as `key: old -> new` strings; model keys excluded."""
    old, new = flatten(saved), flatten(current)
    safe, trajectory = [], []
    for key in sorted(set(old) | set(new)):
        if key.startswith("model.") or old.get(key) == new.get(key):
            continue
        line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        (safe if key.startswith(SAFE_PREFIXES) else trajectory).append(line)
    return safe, trajectory
