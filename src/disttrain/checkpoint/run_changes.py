"""What may change between a checkpoint's config and the resuming run's.

A run name is one run. Resuming may change how the run is cut and watched: the layout, the world size,
intervals, logging, checkpointing (`FREE`). A change to what is trained and how (the data, the
optimizer and its schedule, the batch, the seed, the precision) describes another run: auto-resume
refuses it unless `run.allow_changes=true`. The model is compared by its resolved shape
(run_identity.py), not by its config keys.
"""

from __future__ import annotations

FREE = ("parallel.", "distributed.", "checkpoint.", "metrics.", "run.", "engine", "model.", "data.prefetch",
        "train.micro_batch_size", "train.loss_chunk_tokens", "train.eval_every", "train.eval_batches",
        "train.sample_tokens", "train.sample_prompt")


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not (prefix == "data." and key == "source"):  # a mixture is one value
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(free changes, run-changing changes) as `key: old -> new` strings; model keys are compared by
    shape elsewhere and left out."""
    old, new = flatten(saved), flatten(current)
    free, changing = [], []
    for key in sorted(set(old) | set(new)):
        if key.startswith("model.") or old.get(key) == new.get(key):
            continue
        line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        (free if key.startswith(FREE) else changing).append(line)
    return free, changing


def run_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) for every change that makes another run. A key only one side has (a
    setting added or retired by another disttrain version) is no change."""
    old, new = flatten(saved), flatten(current)
    return [(k, old[k], new[k]) for k in sorted(set(old) & set(new)) if not k.startswith(FREE) and old[k] != new[k]]
