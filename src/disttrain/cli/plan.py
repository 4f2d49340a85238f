"""`disttrain estimate` and `disttrain plan`: arguments, the offline planner, and its output. Pure Python."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from disttrain.core.errors import UserError
from disttrain.core.gpus import GPUS, find_gpu
from disttrain.layout.layout import RECOMPUTE, SCHEDULES, VIRTUAL_STAGES, Layout
from disttrain.layout.rules import layout_problems
from disttrain.layout.world_rules import world_problems
from disttrain.models.registry import MODEL_SHAPES, ModelShape, search_limits
from disttrain.plan import moe, render as report
from disttrain.plan.estimate import estimate, shape_for_params
from disttrain.plan.memory import ACCOUNTINGS
from disttrain.cli.plan_options import add_objective_args, lora_rank_option, objective_flags, optimizer_option
from disttrain.plan.objective import ObjectiveTerms, objective_terms
from disttrain.plan.search import (SearchSpace, drop_disproved, global_batch, gpu_memory, memory_budget,
                                   parse_count, parse_counts, scaling_table, search, why_winner)
from disttrain.plan.timing import Cluster, single_gpu_tokens_per_s


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"registry shape ({', '.join(MODEL_SHAPES)})")
    p.add_argument("--params", default=None, help="parameter count instead of --model, e.g. 13e9 or 6.7B")
    p.add_argument("--hf", default=None, help="a local Hugging Face model directory (its config.json) instead of --model")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="compute dtype (default bf16)")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (for --time and plan)")
    g.add_argument("--gpu", default="h100", help=f"GPU type ({', '.join(GPUS)})")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--nodes", type=int, default=None, help="default: --gpus / --gpus-per-node")
    g.add_argument("--intra-node-bw", type=float, default=None, help="GB/s per GPU and direction (NVLink)")
    g.add_argument("--inter-node-bw", type=float, default=None, help="GB/s per GPU and direction (network)")
    g.add_argument("--compute-efficiency", type=float, default=0.5, help="fraction of peak FLOP/s reached (0-1]")
    g.add_argument("--overlap-efficiency", type=float, default=0.9,
                   help="share of overlapped communication that is really hidden behind compute [0-1]")
    g.add_argument("--hardware", default=None, help="a `disttrain bench hardware` profile instead of --gpu")
    g.add_argument("--tokens", default=None, help="training tokens, for days to train (e.g. 300e9)")


def add_parsers(sub) -> None:
    est = sub.add_parser("estimate", help="memory per GPU, FLOPs and (with --time) step time for one layout")
    est.add_argument("config", nargs="?", default=None,
                     help="a RunConfig YAML (key=value overrides after it; flags override both)")
    add_model_args(est)
    est.add_argument("--gpus", type=int, default=None, help="world size (default: the layout's product)")
    est.add_argument("--dp-replicate", type=int, default=None)
    est.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None)
    est.add_argument("--tp", type=int, default=None)
    est.add_argument("--pp", type=int, default=None)
    moe.add_args(est, search=False)
    est.add_argument("--pp-schedule", choices=SCHEDULES, default=None)
    est.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches per step")
    est.add_argument("--micro-batch-size", type=int, default=None)
    est.add_argument("--global-batch-size", type=int, default=None, help="sequences per step")
    est.add_argument("--activation-checkpointing", choices=RECOMPUTE, default=None)
    est.add_argument("--sequence-parallel", action="store_true", default=None)
    est.add_argument("--cpu-offload", action="store_true", default=None)
    est.add_argument("--gradient-accumulation", choices=("unsharded", "sharded"), default=None,
                     help="ZeRO-2/3: whole gradients until the last micro-batch, or reduce-scattered every micro-batch")
    est.add_argument("--accounting", choices=ACCOUNTINGS, default="runtime",
                     help="runtime: what disttrain allocates; zero-paper: the ZeRO paper's mixed-precision Adam")
    est.add_argument("--time", action="store_true", help="also predict step time, tokens/s and MFU")
    est.add_argument("--headroom", type=float, default=0.1, help="fraction of GPU memory kept free (as plan)")
    est.add_argument("--lora-rank", type=int, default=None, help="LoRA adapters of this rank on a frozen base "
                     "(default: the config's model.lora.rank, else none)")
    est.add_argument("--optimizer", choices=("adamw", "muon"), default=None, help="optim.name whose states to count "
                     "(default: the config's, else adamw)")
    est.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default=None, help="optim.state_dtype of the "
                     "moments (default: the config's, else fp32)")
    add_objective_args(est)
    est.add_argument("--json", action="store_true")
    add_cluster_args(est)

    plan = sub.add_parser("plan", help="search layouts for a model and cluster; write the fastest as a config "
                                       "(or --show-schedule: a pipeline schedule as a time x stage table)")
    add_model_args(plan)
    plan.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (required unless --show-schedule "
                      "or --cluster)")
    plan.add_argument("--cluster", default=None, help="a mixed cluster instead of --gpus/--gpu, in rank order, "
                      "e.g. 8xa100-80g,8xv100-32g: uneven batch shares by GPU speed")
    sched = plan.add_argument_group("pipeline schedule table (--show-schedule)")
    sched.add_argument("--show-schedule", action="store_true")
    sched.add_argument("--pp", type=int, default=4)
    sched.add_argument("--microbatches", type=int, default=8)
    sched.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    sched.add_argument("--virtual-stages", type=int, default=VIRTUAL_STAGES, help="stages per rank (interleaved, zero-bubble)")
    sched.add_argument("--run", default=None, help="a pipeline run directory: print its measured bubble beside")
    plan.add_argument("--global-batch-tokens", default=None,
                      help="tokens per optimizer step; K/M are powers of two (4M = 1024 x 4096; default 4M)")
    plan.add_argument("--global-batch-size", type=int, default=None, help="sequences per step instead")
    plan.add_argument("--headroom", type=float, default=0.1, help="fraction of GPU memory kept free")
    plan.add_argument("--zero-stages", default="0,1,2,3", help="comma-separated stages to consider")
    moe.add_args(plan, search=True)
    plan.add_argument("--allow-offload", action="store_true", help="consider CPU offload (slow; off by default)")
    plan.add_argument("--top", type=int, default=5)
    plan.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on a frozen base")
    plan.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw", help="optim.name to plan for "
                      "(muon: one moment for the block matrices)")
    plan.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32", help="optim.state_dtype to plan "
                      "for (bf16: the moments take half the bytes)")
    plan.add_argument("--scaling", default=None, help="also plan these GPU counts, e.g. 2,4,8,16,32, and print "
                                                      "the scaling efficiency of each")
    plan.add_argument("--out", default=None, help="write the winner as a config to this path (default: none)")
    plan.add_argument("--verify", type=int, default=0, help="dry-run the best N layouts (disttrain dryrun) and "
                                                            "show where they disagree with the plan")
    add_objective_args(plan)
    plan.add_argument("--json", action="store_true")
    add_cluster_args(plan)


def _shape(args, configured: tuple[str, ModelShape] | None = None) -> tuple[str, ModelShape]:
    """The model the flags name, else the config's (`configured`: its name and resolved shape)."""
    if sum(bool(x) for x in (args.model, args.params, args.hf)) > 1:
        raise UserError("--model, --params and --hf: give one of them")
    if args.hf:
        from disttrain.models.hf.shape import hf_shape

        return args.hf, hf_shape(args.hf)
    if args.params:
        return shape_for_params(parse_count("--params", args.params))
    if args.model:
        if args.model not in MODEL_SHAPES:
            raise UserError(f"--model={args.model}: unknown model (allowed: {', '.join(MODEL_SHAPES)})")
        return args.model, MODEL_SHAPES[args.model]
    if configured is not None:
        return configured
    raise UserError("give a CONFIG, --model NAME, --params N or --hf DIR")


def _cluster(args, gpus: int, name: str = "custom", shape: ModelShape | None = None) -> Cluster:
    if getattr(args, "hardware", None):
        from disttrain.plan.profile import load_profile, profile_cluster
        return profile_cluster(load_profile(args.hardware), gpus, name, shape or MODEL_SHAPES["tiny"], args.overlap_efficiency)
    try:
        gpu = find_gpu(args.gpu)
    except KeyError as exc:
        raise UserError(f"--gpu={exc.args[0]}") from None
    per_node = min(args.gpus_per_node, gpus)
    if per_node < 1:
        raise UserError(f"--gpus-per-node={args.gpus_per_node}: must be positive")
    nodes = args.nodes if args.nodes is not None else math.ceil(gpus / per_node)
    if per_node * nodes != gpus:
        raise UserError(f"--gpus={gpus} is not --gpus-per-node={per_node} x --nodes={nodes}")
    if not 0 < args.compute_efficiency <= 1:
        raise UserError(f"--compute-efficiency={args.compute_efficiency}: must be in (0, 1]")
    if not 0 <= args.overlap_efficiency <= 1:
        raise UserError(f"--overlap-efficiency={args.overlap_efficiency}: must be in [0, 1]")
    for flag, value in (("--intra-node-bw", args.intra_node_bw), ("--inter-node-bw", args.inter_node_bw)):
        if value is not None and value <= 0:
            raise UserError(f"{flag}={value}: must be positive (GB/s)")
    return Cluster(gpu, per_node, nodes, args.intra_node_bw, args.inter_node_bw,
                   compute_efficiency=args.compute_efficiency, overlap_efficiency=args.overlap_efficiency)


def _positive(flag: str, value) -> None:
    if value is not None and value < 1:
        raise UserError(f"{flag}={value}: must be at least 1")


def build_layout(args) -> tuple[str, ModelShape, Layout]:
    cfg = resolved = None
    args.objective = ObjectiveTerms()  # a config's train.objective: its terms (plan/objective.py)
    if args.config:
        from disttrain.cli.dryrun import refuse_unmodelled
        from disttrain.config.load import load_config
        from disttrain.config.resolve import resolve_run
        cfg = refuse_unmodelled(load_config(args.config, getattr(args, "overrides", [])))
        resolved = resolve_run(cfg, None, "cpu" if args.hardware else "cuda")
        args.objective = objective_terms(cfg, resolved.shape)
    name, shape = _shape(args, (resolved.model_name, resolved.shape) if cfg is not None else None)
    flagged = objective_flags(args, shape, bool(args.lora_rank) or (cfg is not None and cfg.model.lora is not None))
    args.objective = flagged or args.objective
    for flag in ("gpus", "dp_replicate", "tp", "pp", "microbatches", "micro_batch_size", "global_batch_size", "seq_len"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if resolved is not None:  # the degrees as configured; dp_shard follows from --gpus below
        layout = resolved.layout
    else:
        layout = Layout(seq_len=min(2048, shape.max_seq_len), param_dtype=args.dtype or "bf16")
    changes = {k: v for k, v in {
        "dp_replicate": args.dp_replicate, "zero_stage": args.zero_stage, "tp": args.tp, "pp": args.pp,
        "pp_schedule": args.pp_schedule, "pp_microbatches": args.microbatches, "seq_len": args.seq_len,
        "activation_checkpointing": args.activation_checkpointing, "sequence_parallel": args.sequence_parallel,
        "cpu_offload": args.cpu_offload, "param_dtype": args.dtype, "ep": args.ep,
        "gradient_accumulation": args.gradient_accumulation}.items() if v is not None}
    layout = layout.replace(**changes)
    fixed = layout.dp_replicate * layout.tp * layout.pp * layout.cp
    gpus = args.gpus or (layout.world_size if cfg is not None else fixed)
    if world_problems(layout.dp_replicate, -1, layout.tp, layout.pp, gpus, layout.cp):
        raise UserError(f"--gpus={gpus} is not divisible by dp_replicate x tp x pp = {fixed}")
    layout = layout.replace(dp_shard=gpus // fixed)
    mbs = args.micro_batch_size or (layout.micro_batch_size if cfg is not None else 1)
    gbs = args.global_batch_size or (layout.global_batch_size if cfg is not None else
                                     layout.dp * mbs * max(1, args.microbatches or (layout.pp if layout.pp > 1 else 1)))
    layout = layout.replace(micro_batch_size=mbs, global_batch_size=gbs)
    if layout.seq_len > shape.max_seq_len:
        shape = replace(shape, max_seq_len=layout.seq_len)
    problems = layout_problems(shape, layout)
    if problems:
        raise UserError(str(problems[0]))
    return name, shape, layout


def _headroom(args) -> float:
    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom={args.headroom}: must be in [0, 1)")
    return args.headroom


def cmd_estimate(args) -> None:
    name, shape, layout = build_layout(args)
    headroom, (optimizer, state_dtype) = _headroom(args), optimizer_option(args)
    cluster = _cluster(args, layout.world_size, name, shape) if args.time else None
    est = estimate(shape, layout, cluster, model=name, accounting=args.accounting, lora_rank=moe.no_lora(
        lora_rank_option(args), shape), routing_skew=moe.routing_skew(args.routing_skew, shape),
        muon=optimizer == "muon", state_dtype=state_dtype, objective=args.objective)
    gpu_name, memory = gpu_memory(args.gpu, getattr(args, "hardware", None))
    tokens = parse_count("--tokens", args.tokens) if args.tokens else None
    if args.json:
        out, budget = est.as_dict(), memory_budget(memory, headroom)
        out["fits"] = {"gpu": gpu_name, "budget_bytes": budget, "headroom": headroom,
                       "fits": est.memory.total <= budget}
        if tokens and est.time:
            out["time"]["days"] = tokens / est.time.tokens_per_s / 86400
        print(json.dumps(out, indent=1))
        return
    lines = [f"Model: {name}, {shape.num_params():,} parameters ({moe.size_text(shape, short=True)})",
             report.layout_line(layout), ""] + report.memory_table(est) + \
        [report.fit_line(est, gpu_name, memory, headroom), ""] + report.flops_lines(est)
    if est.time:
        lines += [""] + report.time_lines(est, tokens)
    print("\n".join(lines))


def cmd_plan(args) -> None:
    if args.show_schedule:
        from disttrain.cli.schedule import cmd_show_schedule

        return cmd_show_schedule(args)
    if args.cluster:
        return cmd_plan_mixed(args)
    if args.gpus is None:
        raise UserError("--gpus is required (or use --show-schedule, or --cluster for mixed GPU types)")
    name, shape = _shape(args)
    _positive("--gpus", args.gpus)
    if args.out and Path(args.out).is_dir():  # before the search: it takes a while
        raise UserError(f"--out={args.out} is a directory: give the config file to write (e.g. {args.out}/plan.yaml)")
    seq_len = args.seq_len or min(4096, shape.max_seq_len)
    if seq_len > shape.max_seq_len:
        shape = replace(shape, max_seq_len=seq_len)
    objective = objective_flags(args, shape, args.lora_rank > 0) or ObjectiveTerms()
    if args.verify and objective.name == "distill":  # the dry run builds the teacher the config names
        raise UserError("--verify with --objective=distill: a dry run builds the teacher from the run's "
                        "distill.teacher (a model with weights and the student's tokenizer); write the winner with "
                        "--out, set its data and teacher, then `disttrain dryrun` it")
    gbs = global_batch(args.global_batch_size, args.global_batch_tokens, seq_len)
    if not args.global_batch_size:  # tokens count both sequences of a pair
        gbs = max(1, gbs // objective.rows)
    _headroom(args)
    try:
        stages = tuple(sorted({int(s) for s in args.zero_stages.split(",")}))
    except ValueError:
        raise UserError(f"--zero-stages={args.zero_stages}: expected a comma-separated subset of 0,1,2,3") from None
    if not set(stages) <= {0, 1, 2, 3}:
        raise UserError(f"--zero-stages={args.zero_stages}: allowed stages are 0, 1, 2, 3")
    cluster = _cluster(args, args.gpus, name, shape)
    if args.lora_rank < 0:
        raise UserError(f"--lora-rank={args.lora_rank}: must be > 0 (leave it out for full training)")
    space = SearchSpace(seq_len=seq_len, global_batch_size=gbs, zero_stages=stages, allow_offload=args.allow_offload,
                        param_dtype=args.dtype or "bf16", lora_rank=moe.no_lora(args.lora_rank, shape),
                        ep=moe.expert_degrees(args.ep, shape, args.gpus), state_dtype=args.state_dtype,
                        routing_skew=moe.routing_skew(args.routing_skew, shape), optimizer=args.optimizer,
                        objective=objective, **search_limits(name, args.hf))
    result = search(shape, cluster, space, args.headroom, model=name)
    tokens = parse_count("--tokens", args.tokens) if args.tokens else None
    if not result.ranked:
        raise UserError(f"no layout of {name} fits {args.gpus} x {cluster.gpu.name} "
                        f"({result.considered} considered; try more GPUs, --allow-offload or a smaller --headroom)")
    header = (f"Model: {name}, {moe.size_text(shape)}; {args.gpus} x {cluster.gpu.description} "
              f"({cluster.nodes} node(s) x {cluster.gpus_per_node}); global batch {gbs} "
              f"{'pairs of 2 ' if objective.rows > 1 else ''}x {seq_len} tokens" + (
                  f"; {objective.describe()}" if objective.name != "lm" else ""))
    if not args.json:  # the ranking first: dry runs take minutes
        print("\n".join([header, "", *report.plan_table(result.ranked, args.top)]), flush=True)
    verified = _verify(args, result, cluster.gpu.name) if args.verify > 0 else []
    if verified:
        result = drop_disproved(result, {i: r["peak_bytes"] for i, r in enumerate(verified) if "peak_bytes" in r})
        if not result.ranked:
            raise UserError(f"no layout of {name} fits {args.gpus} x {cluster.gpu.name}: the dry runs of the "
                            f"{len(verified)} best need more than the {result.budget_bytes / 2**30:.1f} GiB budget "
                            "(try more GPUs or --verify with more layouts)")
    win = result.ranked[0]
    baseline = single_gpu_tokens_per_s(shape, seq_len, cluster, space.param_dtype)
    counts = parse_counts(args.scaling)
    clusters = {gpus: _cluster(argparse.Namespace(**{**vars(args), "nodes": None}), gpus, name, shape) for gpus in counts}
    scaling = scaling_table(shape, space, args.headroom, name, clusters) if counts else []
    out = Path(args.out) if args.out else None
    if out is not None:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(report.winner_yaml(win, tokens))
        tmp.replace(out)
    if args.json:
        print(json.dumps({"winner": win.as_dict(), "top": [e.as_dict() for e in result.ranked[:args.top]],
                          "considered": result.considered, "fitting": result.fitting,
                          "budget_bytes": result.budget_bytes,
                          "baseline_tokens_per_s_per_gpu": baseline, "scaling": scaling, "verified": verified,
                          "days": tokens / win.time.tokens_per_s / 86400 if tokens else None,
                          "config": str(out) if out else None}, indent=1))
        return
    lines = []
    if verified:
        from disttrain.cli.dryrun import verify_lines

        dropped = [r["layout"] for r in verified if r.get("fits") is False]
        lines += [""] + verify_lines(verified)
        if dropped:
            lines += [f"Dropped (a dry run needs more than the {result.budget_bytes / 2**30:.1f} GiB budget): "
                      + "; ".join(dropped), "", "Ranking after the dry runs:",
                      *report.plan_table(result.ranked, args.top)]
    lines += ["", "Winner: " + win.layout.describe(micro_batch=True), *("  " + r for r in why_winner(result)), ""]
    lines += report.memory_table(win, cluster.gpus_per_node) + [""] + report.time_lines(win, tokens, baseline)
    lines.append("  (scaling baseline: one GPU with enough memory, no communication, no recomputation)")
    if scaling:
        lines += ["", f"Scaling at {gbs} x {seq_len} tokens per step:", *report.scaling_lines(scaling)]
    lines += ["", f"Wrote {out} (run it with: disttrain train {out})" if out else
              "Pass --out FILE.yaml to write the winner as a config."]
    print("\n".join(lines))


def _verify(args, result, gpu_name: str) -> list[dict]:
    """Dry-run the best `--verify` layouts one by one, saying which and what it found as it goes (each takes
    seconds to minutes); fits / does not fit against the plan's own budget."""
    from disttrain.cli.dryrun import verify_plan

    rows, chosen = [], result.ranked[:args.verify]
    for i, est in enumerate(chosen, 1):
        def progress(message: str, i=i, est=est) -> None:
            print(f"[{i}/{len(chosen)}] {est.layout.describe(micro_batch=True)}: {message}", file=sys.stderr, flush=True)

        (row,) = verify_plan([est], args.gpus, gpu_name, progress)
        if "peak_bytes" in row:
            row["fits"] = row["peak_bytes"] <= result.budget_bytes
            row["headroom_bytes"] = result.budget_bytes - row["peak_bytes"]
            progress(f"{row['peak_bytes'] / 2**30:.1f} GiB by dry run (planned {est.memory.total / 2**30:.1f}): "
                     f"{'fits' if row['fits'] else 'does NOT fit'} the {result.budget_bytes / 2**30:.1f} GiB budget, "
                     f"{row['seconds']:.0f} s")
        else:
            progress(row["error"])
        rows.append(row)
    return rows


def cmd_plan_mixed(args) -> None:
    from disttrain.plan.mixed_gpus import parse_cluster, plan_mixed, render_plans

    if args.gpus is not None:
        raise UserError("--cluster and --gpus: give one of them (--cluster names every GPU)")
    if args.objective_name not in (None, "lm"):
        raise UserError(f"--objective={args.objective_name} with --cluster: the mixed-cluster plan models a "
                        "language-model step (allowed: --objective lm, or --gpus N)")
    try:
        groups = parse_cluster(args.cluster)
    except (KeyError, ValueError) as exc:
        raise UserError(f"--cluster={args.cluster}: {exc.args[0]}") from None
    name, shape = _shape(args)
    seq_len = args.seq_len or min(4096, shape.max_seq_len)
    if seq_len > shape.max_seq_len:
        shape = replace(shape, max_seq_len=seq_len)
    dtype = args.dtype or "bf16"
    space = SearchSpace(seq_len=seq_len, global_batch_size=global_batch(
        args.global_batch_size, args.global_batch_tokens, seq_len), allow_offload=args.allow_offload,
                        param_dtype=dtype)
    plans = plan_mixed(shape, groups, space, args.gpus_per_node, args.headroom, name, dtype, args.compute_efficiency)
    if not plans:
        raise UserError(f"no layout of {name} fits {args.cluster} (try more GPUs, --allow-offload or a smaller --headroom)")
    out = Path(args.out) if args.out else None
    if out is not None:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(report.winner_yaml(plans[0].estimate))
        tmp.replace(out)
    if args.json:
        print(json.dumps({"winner": plans[0].as_dict(), "top": [p.as_dict() for p in plans[:args.top]],
                          "fitting": len(plans), "config": str(out) if out else None}, indent=1))
        return
    header = (f"Model: {name}, {moe.size_text(shape)}; cluster {args.cluster} ({dtype}); global "
              f"batch {space.global_batch_size} x {seq_len} tokens")
    print("\n".join([header, "", *render_plans(plans, args.top), "",
                     f"Wrote {out} (run it with: disttrain train {out})" if out else
                     "Pass --out FILE.yaml to write the winner as a config."]))
