"""What a checkpoint holds besides model and optimizer, and how a run picks one up again."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
import torch.distributed as dist

from disttrain.checkpoint.run_changes import config_changes
from disttrain.checkpoint.run_identity import NEW_NAME, another_run, format_problem, lora_settings_problem, model_problem
from disttrain.core.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """The loop's position: what train_state.pt records next to the engine's own state."""

    step: int = 0
    tokens_seen: int = 0
    resumed_from: str | None = None
    config_changes: dict = field(default_factory=dict)
    skipped_checkpoints: list[str] = field(default_factory=list)


def train_state(run, progress: Progress) -> dict:
    """What a checkpoint holds besides the engine's tensors (`run`: train/run.py's TrainingRun)."""
    spec = run.model.spec
    return {"step": progress.step, "tokens_seen": progress.tokens_seen, **run.engine.state_dict(),
            "loader": run.data.loader.state_dict(), "balance": run.balancer.state_dict(),
            "model_fingerprint": spec.fingerprint, "lora_base": run.model.lora_base,
            "tokenizer": run.resolved.tokenizer, "model": {"family": spec.family,
                      "shape": asdict(spec.shape) if spec.shape is not None else None},
            "config": run.cfg.model_dump(mode="json", by_alias=True)}


def maybe_resume(run, progress: Progress) -> None:
    """Collective: choose a checkpoint (`checkpoint.resume`), check it fits, and load it."""
    mode, ckpt = run.cfg.checkpoint.resume, run.checkpoints
    if mode == "none":
        return
    ckpt.remove_uncommitted()
    dist.barrier()
    if mode == "auto":
        path, progress.skipped_checkpoints = ckpt.choose_resume()
        if path is None:
            if progress.skipped_checkpoints:
                log.info("no committed checkpoint in %s could be loaded: starting fresh", ckpt.dir)
            return
    else:
        path = mode
        problem = ckpt.verify(path) or ckpt.verify_checksums(path)
        if problem:
            raise UserError(f"checkpoint.resume={mode}: {problem}")
    progress.config_changes = check_compatible(run, path)
    state = ckpt.load(path, run.engine)
    progress.step, progress.tokens_seen = int(state["step"]), int(state["tokens_seen"])
    run.engine.load_state_dict(state)
    try:
        run.data.loader.load_state_dict(state["loader"])
    except ValueError as exc:
        raise UserError(f"checkpoint.resume: {path}: {exc}") from None
    if run.layout.balanced:
        run.balancer.load_state_dict(state.get("balance"))
        run.data.loader.set_shares(run.balancer.shares)
    progress.resumed_from = str(path)
    log.info("resumed from %s at %.3f", path, time.time())


def check_compatible(run, path) -> dict:
    """Refuse another model shape or another engine's format before touching any tensor; report every
    other change."""
    problem = format_problem(run.cfg, path, run.checkpoints.format_of(path), run.engine.checkpoint_format)
    if problem:
        raise UserError(problem)
    saved, spec, lora_base = run.checkpoints.read_train_state(path), run.model.spec, run.model.lora_base
    problem = model_problem(saved, spec.family, spec.shape, spec.fingerprint) or \
        lora_settings_problem(saved, run.cfg)
    if not problem and lora_base and saved.get("lora_base") != lora_base:
        problem = (f"the frozen base differs from the one its LoRA adapters were trained on (fingerprint "
                   f"{saved.get('lora_base')} when saved, {lora_base} now: other weights or train.seed)")
    if problem:
        raise UserError(f"checkpoint.resume={run.cfg.checkpoint.resume}: {path} holds a model that cannot load into "
                        f"this one ({problem}); {NEW_NAME}, or resume with the saved model settings")
    problem = another_run(run.cfg, saved)
    if problem:  # the launcher refuses it first; here for runs assembled without the CLI
        raise UserError(problem)
    before = saved.get("config", {}).get("optim", {}).get("name", "adamw")
    if before != run.cfg.optim.name:  # the states of one optimizer mean nothing to the other
        raise UserError(f"checkpoint.resume={run.cfg.checkpoint.resume}: {path} was trained with optim.name={before}, "
                        f"this run has optim.name={run.cfg.optim.name}: its optimizer states cannot carry over; resume "
                        f"with optim.name={before}, or start from its weights (disttrain convert, then model.init_from)")
    free, changing = config_changes(saved.get("config", {}), run.cfg.model_dump(mode="json", by_alias=True))
    for line in changing:
        log.info("resuming with a changed setting, the run will differ from the interrupted one: %s", line)
    return {"safe": free, "trajectory": changing}
