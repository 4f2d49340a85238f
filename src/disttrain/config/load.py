"""Loading a config: a YAML file and dotted ``key=value`` overrides into one RunConfig, validated before any
process starts.

Every user mistake becomes a `UserError` (core/errors.py) whose message is one line naming the key, the value
and what is allowed; the CLI prints it and exits with status 2. The checks of the config alone (checks.py) run
here; the rules that need the model, the world size or the machine run when the config is resolved
(resolve.py). No torch here: loading is instant and runs in the launcher.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import ValidationError

from disttrain.config.checks import config_problems
from disttrain.config.overrides import merge_trees, parse_overrides
from disttrain.config.schema import RunConfig
from disttrain.config.sections import show
from disttrain.core.errors import UserError
from disttrain.models.registry import default_balancing, model_tokenizer

SECTIONS = ("model.", "data.", "train.", "optim.", "parallel.", "precision.", "checkpoint.", "metrics.",
            "distributed.", "run.")


def format_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        if msg.startswith(SECTIONS):
            return msg
    if err["type"] == "extra_forbidden":
        section = RunConfig
        for part in loc[:-1]:
            section = section.model_fields[part].annotation
        allowed = ", ".join(f.alias or n for n, f in section.model_fields.items())
        return f"{key}: unknown key (allowed in {'.'.join(loc[:-1]) or 'the top level'}: {allowed})"
    return f"{key}={show(err.get('input'))}: {msg[0].lower() + msg[1:]}"


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Load, override and validate; raises UserError with a one-line message."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise UserError(f"config file {p}{where} is not valid YAML") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UserError(f"config file {p} must hold a mapping of sections, not {type(loaded).__name__}")
        data = loaded or {}
    data = merge_trees(data, parse_overrides(overrides or []))
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_error(exc)) from None
    if not cfg.run.name:
        cfg.run.name = Path(path).stem if path is not None else "run"
    _prefer_the_models_tokenizer(cfg, path, "tokenizer" in parse_overrides(overrides or []).get("data", {}))
    _balance_the_experts(cfg)
    problems = config_problems(cfg)
    if problems:
        raise UserError(str(problems[0]))
    return cfg


def _balance_the_experts(cfg: RunConfig) -> None:
    """An MoE model balances its experts unless told otherwise: the unset balancing keys take the model's defaults
    (models/registry.py's default_balancing), so the run's config.yaml states the balancing in force. Given one key
    (non-zero), that is the balancing chosen and the other stays off."""
    moe = cfg.model.moe
    if moe.aux_loss_coef is not None and moe.bias_update_rate is not None:
        return
    try:
        aux, bias = default_balancing(cfg.model, cfg.engine, cfg.precision.compute_dtype)
    except UserError:  # a model that cannot be read: resolving the run says why, in its own words
        return
    if aux is None:  # a dense model: nothing to balance
        return
    chosen = bool(moe.aux_loss_coef or moe.bias_update_rate)
    if moe.aux_loss_coef is None:
        moe.aux_loss_coef = 0.0 if chosen else aux
    if moe.bias_update_rate is None:
        moe.bias_update_rate = 0.0 if chosen else bias


def _prefer_the_models_tokenizer(cfg: RunConfig, path, on_command_line: bool) -> None:
    """model.hf=DIR with DIR/tokenizer.json trains with that tokenizer unless `data.tokenizer` is given on
    the command line: a config file's value (`byte` in a config written for the built-in model) gives way
    to `auto`, named in a warning. Shard directories carry their own tokenizer, so only `builtin` is affected."""
    tok, own = cfg.data.tokenizer, model_tokenizer(cfg.model)
    if own is None or on_command_line or tok == "auto" or cfg.data.source != "builtin":
        return
    cfg.data.tokenizer = "auto"
    if tok == "byte" or not Path(tok).is_file() or not Path(tok).samefile(own):
        cfg.warnings.append(f"data.tokenizer={tok} from {path} is not used: model.hf={cfg.model.hf} has its own "
                            f"tokenizer ({own}), which trains instead; give data.tokenizer={tok} on the command "
                            "line to keep it")
