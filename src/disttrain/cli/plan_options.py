"""`disttrain estimate` and `disttrain plan`: what the run to plan for trains, beside its model and layout: the
objective (`--objective`, `--teacher`, `--precompute-reference`, as a config's train.objective, dpo and distill
sections set it), LoRA adapters and the optimizer."""

from __future__ import annotations

import argparse

from disttrain.core.errors import UserError
from disttrain.models.shape import ModelShape
from disttrain.plan.objective import ObjectiveTerms, terms


def add_objective_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training objective (default: a config's train.objective, else lm)")
    g.add_argument("--objective", dest="objective_name", choices=("lm", "dpo", "simpo", "orpo", "distill"),
                   default=None, help="dpo, simpo, orpo: preference pairs (--global-batch-size counts pairs); dpo also "
                   "runs a frozen reference; distill: a frozen --teacher")
    g.add_argument("--teacher", default=None, help="distill's teacher: a registry shape, a Hugging Face model "
                   "directory or a disttrain run directory")
    g.add_argument("--precompute-reference", action="store_true", help="dpo: the reference's values computed "
                   "once ahead (no reference model in the step)")


def objective_flags(args, shape: ModelShape, lora: bool) -> ObjectiveTerms | None:
    """The objective --objective names (None: not given), for a trained model of `shape`."""
    name = args.objective_name
    if name is None:
        if args.teacher or args.precompute_reference:
            raise UserError("--teacher and --precompute-reference go with --objective (distill, dpo)")
        return None
    if (name == "distill") != bool(args.teacher):
        raise UserError(f"--objective={name}: --teacher " + ("is required (a registry shape, a Hugging Face "
                        "directory or a run directory)" if name == "distill" else "goes with --objective distill"))
    if args.precompute_reference and name != "dpo":
        raise UserError(f"--objective={name}: --precompute-reference goes with --objective dpo")
    return terms(name, shape, args.teacher or "", args.precompute_reference, lora)


def lora_rank_option(args) -> int:
    """--lora-rank, else the config's model.lora.rank, else 0 (no adapters)."""
    if args.lora_rank is None:
        from disttrain.config.load import load_config

        lora = load_config(args.config, []).model.lora if args.config else None
        return lora.rank if lora is not None else 0
    if args.lora_rank <= 0:
        raise UserError(f"--lora-rank={args.lora_rank}: must be > 0 (leave it out for full training)")
    return args.lora_rank


def optimizer_option(args) -> tuple[str, str]:
    """(--optimizer, else the config's optim.name, else adamw; --state-dtype, else the config's, else fp32)."""
    name, dtype = args.optimizer, args.state_dtype
    if (name is None or dtype is None) and args.config:
        from disttrain.config.load import load_config
        optim = load_config(args.config, getattr(args, "overrides", [])).optim
        name, dtype = name or optim.name, dtype or optim.state_dtype
    if name == "muon" and dtype == "int8":
        raise UserError("--state-dtype=int8 with muon: 8-bit states are AdamW's (allowed with muon: fp32, bf16)")
    return name or "adamw", dtype or "fp32"
