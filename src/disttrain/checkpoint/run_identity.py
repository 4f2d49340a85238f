"""Whether this command may write to a run directory, read before any worker starts (run_directory.py, the
directory's owner, asks):

- another live launch holds the run (lease.py): refused, naming the holder;
- `checkpoint.resume=none` where another run left checkpoints or metrics: refused, not mixed;
- the checkpoint auto-resume would continue holds a model this one cannot load (family, shape,
  vocabulary) or another engine's format: refused, with the saved and the new values;
- it holds another run (run_changes.py: data, optimizer, schedule, batch, seed, precision): refused with the
  two ways out, a new `run.name` or `run.allow_changes=true`.

Reads only: the launcher asks before spawning workers, the workers of a plain torchrun or srun launch before
their process group starts. Raises UserError (one line).
"""

from __future__ import annotations

from dataclasses import asdict

from disttrain.checkpoint import lease
from disttrain.core import storage
from disttrain.checkpoint.run_changes import run_changes
from disttrain.core.errors import UserError

NEW_NAME = "give this command its own run.name=NAME"


def saved_model(state: dict) -> tuple[str | None, dict | None]:
    """(family, resolved shape as a dict) of the model a train_state was saved with. Checkpoints written
    before the shape was recorded are resolved again from their config (built-in and Hugging Face models)."""
    if "model" in state:
        return state["model"].get("family"), state["model"].get("shape")
    from disttrain.models.registry import saved_model as from_section

    return from_section(state.get("config", {}).get("model", {}))


def model_problem(state: dict, family: str, shape, fingerprint: str) -> str | None:
    """What makes the saved model unloadable into this one, with the saved and new values; None if it loads.
    An empty `fingerprint` (a user ModelSpec before it is built) compares only what is known."""
    saved_family, saved_shape = saved_model(state)
    if saved_family and saved_family != family:
        return f"model family {saved_family} when saved, {family} now"
    if not fingerprint or state.get("model_fingerprint") == fingerprint:
        return None
    if saved_shape and shape is not None:
        new = asdict(shape)
        diff = [f"model.{k}={saved_shape.get(k)!r} when saved, {new[k]!r} now" for k in new
                if saved_shape.get(k) != new[k]]
        if diff:
            return ", ".join(diff)
    return "another model configuration (its fingerprint differs)"


def lora_settings_problem(state: dict, cfg) -> str | None:
    """LoRA settings that make the saved adapters unloadable (switched on or off, another rank or other
    targets) or make another run (alpha, dropout; allowed with run.allow_changes). None if they agree."""
    saved = state.get("config", {}).get("model", {}).get("lora")
    now = cfg.model.lora.model_dump(mode="json") if cfg.model.lora is not None else None
    if saved == now:
        return None
    if saved is None or now is None:
        return f"model.lora={'set' if saved else 'absent'} when saved, {'set' if now else 'absent'} now"
    keys = ("rank", "targets") + (() if cfg.run.allow_changes else ("alpha", "dropout"))
    diff = [f"model.lora.{k}={saved.get(k)!r} when saved, {now[k]!r} now" for k in keys if saved.get(k) != now[k]]
    return ", ".join(diff) or None


def newest_state(checkpoint_dir) -> tuple[str | None, dict | None]:
    """The newest committed checkpoint whose train_state reads, and that state (a local path or a URL)."""
    from disttrain.checkpoint.manager import CheckpointManager

    for path in reversed(CheckpointManager(checkpoint_dir, rank=-1).committed()):
        try:
            return path, CheckpointManager.read_train_state(path)
        except Exception:  # torn or foreign: the workers skip it and say why
            continue
    return None, None


def _show(value) -> str:
    return "empty" if value in ("", None) else str(value)


def held_by(cfg, holder: lease.Claim, where=None) -> str:
    return (f"run.name={cfg.run.name}: {where or cfg.run_dir} is being written by another launch "
            f"({holder.describe()}); wait for it to finish, or {NEW_NAME} (a claim not renewed for "
            f"{lease.TTL_S:.0f} s expires)")


def check_run_dir(cfg, resolved, key: str) -> None:
    """Refuse this command on cfg.run_dir when another live launch holds it, when it would mix runs, or
    when what it would resume cannot load or is another run. `key`: this job's claim key (lease.py)."""
    run_dir = cfg.run_dir
    check_stores(cfg)
    holder = lease.live_other(run_dir, key)
    if holder is not None:
        raise UserError(held_by(cfg, holder))
    if storage.is_url(cfg.checkpoint_dir):
        holder = lease.live_other(cfg.checkpoint_dir, key)
        if holder is not None:
            raise UserError(held_by(cfg, holder, cfg.checkpoint_dir))
    mode = cfg.checkpoint.resume
    if mode == "none":
        held = [what for what, there in (("checkpoints", newest_state(cfg.checkpoint_dir)[0] is not None),
                                         ("metrics.jsonl", (run_dir / "metrics.jsonl").is_file())) if there]
        last = lease.read(run_dir)
        if held and (last is None or last.key != key):
            raise UserError(f"checkpoint.resume=none: {run_dir} already holds a run ({' and '.join(held)}), and a "
                            f"new one there would mix with it; {NEW_NAME}, or remove {run_dir} first")
        return
    path, state = (newest_state(cfg.checkpoint_dir) if mode == "auto" else (mode, _read(mode)))
    if state is None:
        return
    spec = resolved.spec
    problem = model_problem(state, spec.family, resolved.shape, spec.fingerprint) or \
        lora_settings_problem(state, cfg)
    if problem:
        way = "or resume with the saved model settings" if mode == "auto" else "or resume another checkpoint"
        raise UserError(f"checkpoint.resume={mode}: {path} holds a model that cannot load into this one "
                        f"({problem}); {NEW_NAME}, {way}")
    from disttrain.checkpoint.manager import CheckpointManager

    engine_format = "deepspeed" if cfg.engine == "deepspeed" else "dcp"
    problem = format_problem(cfg, path, CheckpointManager.format_of(path), engine_format)
    if problem:
        raise UserError(problem)
    problem = another_run(cfg, state)
    if problem:
        raise UserError(problem)


def check_stores(cfg) -> None:
    """Remote checkpoint and data locations answer with the credentials at hand, before any worker starts."""
    storage.check_reachable(cfg.checkpoint_dir, "checkpoint.dir")
    if storage.is_url(cfg.checkpoint.resume):
        storage.check_reachable(cfg.checkpoint.resume, "checkpoint.resume")
    sources = cfg.data.source if isinstance(cfg.data.source, dict) else {cfg.data.source: 1}
    for source in sources:
        storage.check_reachable(source, "data.source")


def format_problem(cfg, path, saved_format: str, engine_format: str) -> str | None:
    """A checkpoint another engine wrote: why it cannot resume here."""
    if saved_format == engine_format:
        return None
    engine = "deepspeed" if saved_format == "deepspeed" else "torch"
    return (f"checkpoint.resume={cfg.checkpoint.resume}: {path} holds {saved_format} state, and engine={cfg.engine} "
            f"reads {engine_format} (resume it with the engine that saved it: engine={engine})")


def another_run(cfg, state: dict) -> str | None:
    """Auto-resume of a checkpoint saved by another run (run_changes.py) without run.allow_changes: why not."""
    if cfg.checkpoint.resume != "auto" or cfg.run.allow_changes:
        return None
    changes = run_changes(state.get("config", {}), cfg.model_dump(mode="json", by_alias=True))
    if not changes:
        return None
    diff = "; ".join(f"{k}={_show(old)} there, {_show(new)} here" for k, old, new in changes)
    return (f"run.name={cfg.run.name}: {cfg.run_dir} holds another run (step {state.get('step')}; {diff}); "
            f"{NEW_NAME}, or continue that run with the change: run.allow_changes=true")


def _read(path) -> dict | None:
    from disttrain.checkpoint.manager import CheckpointManager

    try:
        return CheckpointManager.read_train_state(path)
    except Exception:  # the workers verify it and name what is wrong
        return None
