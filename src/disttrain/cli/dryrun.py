"""`disttrain dryrun CONFIG [key=value ...] --world-size N`: the real training step of chosen ranks of
an N-rank job, simulated in this process (dryrun/simulate.py), beside the planner's figures for the
same config, and whether it fits a GPU of the planner's table."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings

from disttrain.core.errors import UserError
from disttrain.core.gpus import GPUS, find_gpu

GIB = 2 ** 30


def add_parser(sub) -> None:
    p = sub.add_parser("dryrun", help="run the real training step of one rank of an N-rank job on this CPU (fake "
                                      "process group, fake tensors): bytes by category, collectives, the planner's "
                                      "figures beside them")
    p.add_argument("config", help="YAML config (key=value overrides after it)")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the simulated job")
    p.add_argument("--rank", type=int, action="append", default=None,
                   help="rank to simulate (repeatable; default: one rank per distinct role)")
    p.add_argument("--gpu", default=None, help=f"fits on this GPU? ({', '.join(GPUS)})")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of GPU memory kept free, as estimate and plan (default 0.1)")
    p.add_argument("--steps", type=int, default=2, help="steps to run (the peak is over all; optimizer states exist "
                                                        "from the second)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="simulate this many micro-batches per rank instead of the config's (faster; the peak of "
                        "accumulation stops growing after 2, of 1F1B-like schedules after pp, but for a pipeline's receive "
                        "buffers, one per micro-batch; GPipe's does not)")
    p.add_argument("--routing-skew", type=float, default=1.0,
                   help="MoE: the routing assumed, as the planner's: the simulated rank receives this many times its "
                        "balanced share of routed rows (1: balanced; dryrun/routing.py)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def default_ranks(layout) -> list[int]:
    """One rank per distinct role: the first and last pipeline stage and one in between (they hold
    different layers, embeddings or head, and micro-batches in flight). Within a stage every rank
    holds the same shapes (FSDP pads shards to equal size; TP splits evenly, which validation checks), except
    the ring's context ranks under selective checkpointing (plan/context.py ring_selective_cache_bytes): the
    last context rank of the first stage holds the most, and is simulated too."""
    per_stage = layout.world_size // layout.pp
    ranks = [p * per_stage for p in sorted({0, layout.pp - 1} | ({1} if layout.pp > 2 else set()))]
    if layout.cp > 1 and layout.cp_method == "ring" and layout.activation_checkpointing == "selective":
        ranks.insert(1, (layout.cp - 1) * layout.tp)  # mesh order (pp, dp_replicate, dp_shard, cp, tp)
    return ranks


def pp_rank_of(layout, rank: int) -> int:
    return rank // (layout.world_size // layout.pp)


def with_microbatches(cfg, layout, n: int):
    """The config with `n` micro-batches per data-parallel rank (the global batch shrinks to match);
    `layout`: the config's own, resolved."""
    from disttrain.config.schema import RunConfig

    if n < 1:
        raise UserError(f"--microbatches={n}: must be at least 1")
    if layout.pp > 1 and layout.pp_schedule == "gpipe" and n < layout.microbatches:
        raise UserError(f"--microbatches={n} with parallel.pp_schedule=gpipe: GPipe keeps every micro-batch in "
                        f"flight, so fewer than the config's {layout.microbatches} would understate its peak")
    data = cfg.model_dump()
    data["train"]["global_batch_size"] = layout.dp * layout.micro_batch * n
    data["train"]["micro_batch_size"] = layout.micro_batch
    if layout.pp > 1:
        data["parallel"]["pp_microbatches"] = n
    return RunConfig.model_validate(data)


def dry_run(cfg, world_size: int, ranks: list[int] | None = None, gpu_name: str | None = None, steps: int = 2,
            progress=None, microbatches: int | None = None, headroom: float = 0.1, routing_skew: float = 1.0,
            data_planned: bool = False) -> dict:
    """Simulate each rank and compare with the planner; the JSON `disttrain dryrun --json` prints. MoE layers
    route as `routing_skew` states, in the simulation and the planner alike. `data_planned`: a planned config
    whose data the user has yet to set (resolve_run); the simulation takes random tokens in any case."""
    if world_size < 1:
        raise UserError(f"--world-size={world_size}: must be at least 1")
    from disttrain.dryrun.routing import AssumedRouting
    from disttrain.dryrun.simulate import simulate, unsupported
    from disttrain.plan.moe import routing_skew as checked_skew
    from disttrain.plan.memory import estimate_memory
    from disttrain.plan.objective import objective_terms
    from disttrain.plan.search import memory_budget
    from disttrain.config.resolve import resolve_run

    resolved = resolve_run(cfg, world_size, "cuda", data_planned)
    if microbatches is not None:  # another config: resolved (and checked) on its own
        cfg = with_microbatches(cfg, resolved.layout, microbatches)
        resolved = resolve_run(cfg, world_size, "cuda", data_planned)
    try:
        gpu = find_gpu(gpu_name) if gpu_name else None
    except KeyError as exc:
        raise UserError(f"--gpu={exc.args[0]}") from None
    layout = resolved.layout
    routing = AssumedRouting(checked_skew(routing_skew, resolved.shape))
    problem = unsupported(cfg, layout)
    if problem:  # before any progress line: a refusal is one line
        raise UserError(problem)
    ranks = ranks or default_ranks(layout)
    for r in ranks:
        if not 0 <= r < world_size:
            raise UserError(f"--rank={r}: not a rank of --world-size={world_size} (allowed: 0..{world_size - 1})")
    out = []
    for rank in ranks:
        planned = estimate_memory(resolved.shape, layout, pp_rank=pp_rank_of(layout, rank), routing_skew=routing.skew,
                                  muon=cfg.optim.name == "muon", state_dtype=cfg.optim.state_dtype,
                                  objective=objective_terms(cfg, resolved.shape),
                                  lora_rank=cfg.model.lora.rank if cfg.model.lora is not None else 0)
        planner = {**planned.categories(), "peak_bytes": planned.total}
        if progress:
            progress(f"dry run: rank {rank} of {world_size} ...")
        with _quiet():
            try:
                run = simulate(cfg, resolved, rank, steps, routing)
            except UserError:
                raise
            except Exception as exc:  # an op or feature the fake tensors or fake group cannot run
                reason = (str(exc).strip().splitlines() or [""])[-1].strip()[:300]
                raise UserError(f"rank {rank} of this layout cannot be dry-run: {type(exc).__name__}: {reason} "
                                "(a real run may still work; report it with the config)") from None
        entry = {"rank": rank, "role": run.role, "peak_bytes": run.peak_bytes, "bytes": run.bytes,
                 "planner": {k: int(v) for k, v in planner.items()},
                 "error": {k: _error(planner[k], v) for k, v in [*run.bytes.items(), ("peak_bytes", run.peak_bytes)]},
                 "collectives": run.collectives, "seconds": round(run.seconds, 2), "host_bytes": run.host_bytes,
                 "planner_host_bytes": int(planned.states.cpu)}
        if gpu is not None:
            entry.update(_fit(run, memory_budget(gpu.memory_bytes, headroom), layout.micro_batch))
        out.append(entry)
    worst = max(out, key=lambda e: e["peak_bytes"])
    result = {"world_size": world_size, "layout": layout.as_dict(), "gpu": gpu.name if gpu else None,
              **({"routing_skew": routing.skew} if resolved.shape.moe is not None else {}), **worst,
              "fits": worst.get("fits"), "ranks": out}
    return result


def _error(predicted: float, measured: int) -> float | None:
    """Planner relative to measured (+0.05: the planner says 5% more)."""
    return None if measured == 0 else round(predicted / measured - 1, 4)


def _fit(run, budget: float, micro_batch: int) -> dict:
    """Fits the memory budget (plan/search.py's memory_budget, the one estimate and plan use) with what
    to spare; the largest micro-batch (sequences per forward) from the measured bytes per sequence
    (activations and temporaries grow with it, the rest does not)."""
    per_sequence = (run.bytes["activations"] + run.bytes["temporary"]) / micro_batch
    fixed = run.peak_bytes - per_sequence * micro_batch
    largest = math.floor((budget - fixed) / per_sequence) if per_sequence > 0 else None
    return {"fits": run.peak_bytes <= budget, "budget_bytes": int(budget), "headroom_bytes": int(budget - run.peak_bytes),
            "largest_micro_batch": max(largest, 0) if largest is not None else None}


class _quiet:
    """torch's distributed warnings (one line per fake rank) would bury the report."""

    def __enter__(self):
        self.level = logging.getLogger("torch.distributed").level
        logging.getLogger("torch.distributed").setLevel(logging.ERROR)
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self.warnings.__exit__(*exc)
        logging.getLogger("torch.distributed").setLevel(self.level)


def refuse_unmodelled(cfg):
    """`cfg`, unless it holds what the dry run and the planner cannot model yet (one line, exit 2)."""
    if cfg.optim.state_dtype == "int8":
        raise UserError("optim.state_dtype=int8: the dry run does not simulate torchao's 8-bit states (`disttrain "
                        "estimate --state-dtype int8` and `plan` count them; allowed in a dry run: fp32, bf16)")
    return cfg


def cmd_dryrun(args: argparse.Namespace, overrides: list[str]) -> None:
    from disttrain.config.load import load_config

    cfg = refuse_unmodelled(load_config(args.config, overrides))
    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom={args.headroom}: must be in [0, 1)")
    result = dry_run(cfg, args.world_size, args.rank, args.gpu, args.steps,
                     progress=None if args.json else lambda m: print(m, file=sys.stderr, flush=True),
                     microbatches=args.microbatches, headroom=args.headroom, routing_skew=args.routing_skew)
    print(json.dumps(result, indent=2) if args.json else render(result))


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def render(result: dict) -> str:
    lines = [f"dry run: {result['world_size']} ranks, layout "
             + " ".join(f"{k}={v}" for k, v in result["layout"].items() if k in ("dp_replicate", "dp_shard", "cp", "tp", "pp",
                                                                                  "zero_stage", "micro_batch_size",
                                                                                  "ep"))]
    if "routing_skew" in result:
        lines[0] += (", balanced routing" if result["routing_skew"] == 1
                     else f", routing skew {result['routing_skew']:g} (this rank receives that many times its share)")
    for r in result["ranks"]:
        lines += ["", f"rank {r['rank']} ({r['role']}), {r['seconds']:.1f} s",
                  f"  {'bytes':<14}{'measured':>12}{'planner':>12}{'error':>9}"]
        for key in [*r["bytes"], "peak_bytes"]:
            measured = r["bytes"].get(key, r["peak_bytes"])
            err = r["error"][key]
            label = "peak" if key == "peak_bytes" else key
            lines.append(f"  {label:<14}{_size(measured):>12}{_size(r['planner'][key]):>12}"
                         f"{'' if err is None else f'{err:+.1%}':>9}")
        lines.append(f"  {'collective':<16}{'dim':<14}{'count':>6}{'bytes sent':>14}")
        for c in r["collectives"]:
            lines.append(f"  {c['kind']:<16}{c['dim']:<14}{c['count']:>6}{_size(c['bytes']):>14}")
        if r["host_bytes"]:
            lines.append(f"  host memory (CPU offload): {_size(r['host_bytes'])} (planner {_size(r['planner_host_bytes'])})")
        if "fits" in r:
            verdict = "fits" if r["fits"] else "does NOT fit"
            lines.append(f"  on {result['gpu']}: {verdict} its {r['budget_bytes'] / GIB:.1f} GiB budget (to spare "
                         f"{r['headroom_bytes'] / GIB:+.1f} GiB); largest "
                         f"micro-batch ~{r['largest_micro_batch']} (from the measured bytes per sequence)")
    return "\n".join(lines)


def verify_plan(estimates: list, gpus: int, gpu_name: str, progress=None) -> list[dict]:
    """`disttrain plan --verify N`: dry-run each of the best layouts on `gpus` simulated ranks and set
    the measured peak beside the planner's. Micro-batches are capped where that cannot lower the peak
    (see --microbatches), so a 13B check takes about a minute per stage. A pipeline's receive buffers are the
    exception (torch's `PipelineStage` allocates one per micro-batch and step, pytorch/pytorch#136380), and so
    are the step's token ids: those of the micro-batches left out are added to each rank's measured peak, and
    said so (`left_out_bytes`), and so are zero-bubble's input gradients, one per micro-batch and stage but the first,
    which the receive buffers keep to the next step."""
    from disttrain.config.schema import RunConfig
    from disttrain.plan.activations import input_grad_bytes, pipeline_batch_bytes, pipeline_recv_bytes
    from disttrain.plan.render import winner_config

    rows = []
    for est in estimates:
        cfg = RunConfig.model_validate(winner_config(est))
        lay = est.layout
        cap = None if lay.pp > 1 and lay.pp_schedule == "gpipe" else max(2, 2 * lay.pp)
        if cap is not None and cap >= lay.microbatches:
            cap = None
        try:
            result = dry_run(cfg, gpus, gpu_name=gpu_name, progress=progress, microbatches=cap, data_planned=True)
        except UserError as exc:
            rows.append({"layout": lay.describe(micro_batch=True), "planner_peak_bytes": est.memory.total, "error": str(exc)})
            continue
        left_out = {}
        for r in result["ranks"]:  # the receive buffers (and input gradients) of the micro-batches the cap left out
            p = pp_rank_of(lay, r["rank"])
            per_micro_batch = (pipeline_recv_bytes(est.shape, lay, p) + pipeline_batch_bytes(lay)) / lay.microbatches
            per_micro_batch += input_grad_bytes(est.shape, lay) * sum(s > 0 for s in lay.owned_stages(p))
            left_out[r["rank"]] = int(per_micro_batch * (lay.microbatches - cap)) if cap and lay.pp > 1 else 0
        worst = max(result["ranks"], key=lambda r: r["peak_bytes"] + left_out[r["rank"]])
        peak = worst["peak_bytes"] + left_out[worst["rank"]]
        budget = worst["budget_bytes"]
        rows.append({"layout": lay.describe(micro_batch=True), "planner_peak_bytes": est.memory.total, "peak_bytes": peak,
                     "rank": worst["rank"], "fits": peak <= budget, "headroom_bytes": int(budget - peak),
                     "planner_error": _error(est.memory.total, peak), "left_out_bytes": left_out[worst["rank"]],
                     "seconds": sum(r["seconds"] for r in result["ranks"])})
    return rows


def verify_lines(rows: list[dict]) -> list[str]:
    lines = ["Checked by dry run (the real step of the fullest ranks, fake tensors):",
             f"  {'planner':>10}  {'dry run':>10}  {'error':>7}  {'fits':>4}  layout"]
    for r in rows:
        if "error" in r and "peak_bytes" not in r:
            lines.append(f"  {_size(r['planner_peak_bytes']):>10}  {'-':>10}  {'':>7}  {'':>4}  {r['layout']}: {r['error']}")
            continue
        lines.append(f"  {_size(r['planner_peak_bytes']):>10}  {_size(r['peak_bytes']):>10}  {r['planner_error']:>+7.1%}  "
                     f"{'yes' if r['fits'] else 'NO':>4}  {r['layout']}"
                     + ("  <- the planner says it fits; the dry run does not" if not r["fits"] else "")
                     + (f" (with {_size(r['left_out_bytes'])} of receive buffers"
                        f"{' and input gradients' if 'zero_bubble' in r['layout'] else ''} for the micro-batches not "
                        "simulated)" if r.get("left_out_bytes") else ""))
    return lines
