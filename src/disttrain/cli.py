"""Command line: `disttrain train | estimate | plan | report | convert | config export-deepspeed | bench comm|scaling |
prepare-data`. User mistakes print one line and exit 2."""

from __future__ import annotations

import argparse
import os
import logging
import sys
import time

PROCESS_START = time.time()  # before torch is imported: recovery benchmarks split start-up time
from pathlib import Path

from disttrain.config import ConfigError, load_config, validate_world

EXIT_USAGE = 2
EXIT_HEALTH = 3  # a health check (non-finite values, diverged replicas) stopped the run


def _fail(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"disttrain: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _setup_logging(run_dir: Path, rank: int) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(logs / f"rank_{rank:05d}.log")
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    console.setFormatter(fmt)
    root = logging.getLogger("disttrain")
    root.setLevel(logging.INFO)
    root.handlers[:] = [file_handler, console]


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> None:
    from disttrain.distributed.env import detect_env, under_torchrun
    from disttrain.launch import LaunchOptions, max_world_size, relaunch

    env = detect_env()
    quiet = env.rank != 0  # under torchrun every rank validates; one of them speaks
    try:
        cfg = load_config(args.config, overrides)
        if args.nproc_per_node is not None and not under_torchrun():
            opts = LaunchOptions(args.nproc_per_node, args.nnodes, args.node_rank, args.max_restarts,
                                 args.rdzv_endpoint, args.rdzv_backend, args.rdzv_id)
            if opts.nproc_per_node != "auto" and (not opts.nproc_per_node.isdigit() or int(opts.nproc_per_node) < 1):
                raise ConfigError(f"--nproc-per-node={opts.nproc_per_node}: must be a positive integer or auto")
            if str(opts.nnodes) != "1" and not opts.rdzv_endpoint:
                raise ConfigError(f"--nnodes={opts.nnodes} needs --rdzv-endpoint HOST:PORT")
            validate_world(cfg, max_world_size(opts))
            sys.exit(relaunch(opts, ["train", args.config, *overrides]))
        validate_world(cfg, env.world_size)
    except ConfigError as exc:
        _fail(str(exc), quiet)

    from disttrain.distributed.runtime import init_distributed, shutdown
    from disttrain.observe.health import NonFiniteError, ReplicaDivergence
    from disttrain.train.resilience import EXIT_PREEMPTED
    from disttrain.train.trainer import Preempted, Trainer

    _setup_logging(cfg.run_dir, env.rank)
    logging.getLogger("disttrain.cli").info("process started at %.3f (restart %s)", PROCESS_START,
                                            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rt = init_distributed(env, cfg.distributed.backend, cfg.distributed.timeout_s)
    try:
        result = Trainer(cfg, rt).fit()
    except ConfigError as exc:  # found only once running, e.g. a checkpoint that does not fit the config
        _fail(str(exc), quiet)
    except Preempted:
        sys.exit(EXIT_PREEMPTED)
    except (NonFiniteError, ReplicaDivergence) as exc:  # a health check stopped the run
        logging.getLogger("disttrain.health").error("%s", exc)
        if not quiet:
            print(f"disttrain: stopped: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_HEALTH)
    finally:  # also on SystemExit from the two branches above
        shutdown()
    if env.rank == 0:
        loss = f"final loss {result.final_loss:.4f}, " if result.final_loss is not None else ""
        print(f"done: {result.final_step} steps, {loss}run directory {Path(result.run_dir).resolve()}", flush=True)


def cmd_prepare_data(args: argparse.Namespace) -> None:
    from disttrain.data.prepare import prepare

    paths = [Path(p) for p in args.inputs]
    for p in paths:
        if not p.is_file():
            _fail(f"input {p}: no such file")
    if args.tokenizer not in ("byte", "bpe") and not Path(args.tokenizer).is_file():
        _fail(f"--tokenizer={args.tokenizer}: no such file (allowed: byte, bpe, or a tokenizer.json path)")
    if not 0 <= args.val_fraction < 1:
        _fail(f"--val-fraction={args.val_fraction}: must be in [0, 1)")
    if args.tokenizer == "bpe" and args.vocab_size < 257:
        _fail(f"--vocab-size={args.vocab_size}: must be at least 257 for BPE (256 bytes + end-of-text)")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        _fail(f"--out={out}: directory is not empty (pass --force to overwrite)")
    try:
        meta = prepare(paths, out, args.tokenizer, args.vocab_size, args.val_fraction, args.text_key,
                       progress=sys.stderr.isatty())
    except (ValueError, UnicodeError) as exc:
        _fail(str(exc).splitlines()[0])
    splits = ", ".join(f"{k} {v:,} tokens" for k, v in meta["splits"].items())
    print(f"wrote {out}: {splits} (vocabulary {meta['vocab_size']}, {meta['dtype']})")


def cmd_config(args: argparse.Namespace, overrides: list[str]) -> None:
    import json

    from disttrain.train.deepspeed_engine import deepspeed_config

    try:
        cfg = load_config(args.config, [*overrides, "engine=torch"])  # exporting needs no DeepSpeed installed
        if args.world_size < 1:
            raise ConfigError(f"--world-size={args.world_size}: must be a positive integer")
        validate_world(cfg, args.world_size)
    except ConfigError as exc:
        _fail(str(exc))
    text = json.dumps(deepspeed_config(cfg, args.world_size), indent=2) + "\n"
    if args.out:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)


def cmd_convert(args: argparse.Namespace) -> None:
    from disttrain.checkpoint.export import export, resolve_checkpoint

    try:
        step_dir = resolve_checkpoint(args.checkpoint)
    except FileNotFoundError as exc:
        _fail(str(exc))
    default = {"torch": "model.pt", "safetensors": "model.safetensors", "hf": "hf"}[args.to]
    out = Path(args.out) if args.out else step_dir.parent.parent / "export" / default
    print(f"wrote {export(step_dir, args.to, out)} from {step_dir}")


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def cmd_bench_comm(args: argparse.Namespace) -> None:
    import json

    from disttrain.bench import comm
    from disttrain.distributed.env import detect_env, under_torchrun
    from disttrain.launch import LaunchOptions, relaunch

    try:
        sizes = [_parse_size(x) for x in args.sizes.split(",")] if args.sizes else list(comm.DEFAULT_SIZES)
    except ValueError:
        _fail(f"--sizes={args.sizes}: expected comma-separated sizes like 1K,1M,64M")
    ops = args.ops.split(",") if args.ops else list(comm.OPS)
    unknown = [op for op in ops if op not in comm.OPS]
    if unknown:
        _fail(f"--ops={args.ops}: unknown {unknown[0]} (allowed: {', '.join(comm.OPS)})")
    if args.nproc_per_node is not None and not under_torchrun():
        forwarded = ["bench", "comm", "--sizes", ",".join(map(str, sizes)), "--ops", ",".join(ops),
                     "--iters", str(args.iters), "--warmup", str(args.warmup)] + (["--json"] if args.json else [])
        sys.exit(relaunch(LaunchOptions(args.nproc_per_node), forwarded))
    from disttrain.distributed.runtime import init_distributed, shutdown

    env = detect_env()
    rt = init_distributed(env, "auto", 300)
    try:
        results = comm.run(rt.device, ops, sizes, args.iters, args.warmup)
    finally:
        shutdown()
    if env.rank == 0:
        print(json.dumps(comm.as_dicts(results)) if args.json else
              f"{rt.world_size} ranks, {rt.backend} on {rt.device.type}\n{comm.format_table(results)}")


def cmd_report(args: argparse.Namespace) -> None:
    from disttrain.observe.report import make_report

    run_dir = Path(args.run_dir)
    try:
        index, pngs, rows = make_report(run_dir, Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(f"\nwrote {len(pngs)} plots and {index}")


def cmd_bench_scaling(args: argparse.Namespace, overrides: list[str]) -> None:
    from disttrain.bench import scaling

    try:
        cfg = load_config(args.config, overrides)
        counts = scaling.process_counts(args.max_procs)
        for n in counts:
            validate_world(scaling.scaled_config(cfg, n), n)
    except ConfigError as exc:
        _fail(str(exc))
    rows = scaling.run(args.config, overrides, cfg, counts, args.steps, Path(args.out) if args.out else None)
    print(scaling.format_table(rows))
    if args.json:
        import json

        print(json.dumps(rows))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disttrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from a YAML config (key=value overrides after it)")
    train.add_argument("config", help="YAML config file, e.g. configs/demo.yaml")
    launch = train.add_argument_group("self-launch (ignored under torchrun)")
    launch.add_argument("--nproc-per-node", default=None,
                        help="processes per node; 'auto' = all GPUs, or 2 on a CPU-only machine")
    launch.add_argument("--nnodes", default="1", help="node count or elastic range MIN:MAX")
    launch.add_argument("--node-rank", type=int, default=None)
    launch.add_argument("--max-restarts", type=int, default=0, help="restart the worker group this often on failure")
    launch.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    launch.add_argument("--rdzv-backend", default="c10d")
    launch.add_argument("--rdzv-id", default=None)

    config = sub.add_parser("config", help="config utilities")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    export = config_sub.add_parser("export-deepspeed", help="write the DeepSpeed JSON config a RunConfig maps to")
    export.add_argument("config", help="YAML config file")
    export.add_argument("--world-size", type=int, default=1, help="processes the JSON is for (sets accumulation)")
    export.add_argument("--out", default=None, help="output file (default: stdout)")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bcomm = bench_sub.add_parser("comm", help="collective bandwidth (algbw/busbw as NCCL's tests define them)")
    bcomm.add_argument("--sizes", default=None, help="comma-separated buffer sizes, e.g. 1K,1M,64M (default 1K..64M)")
    bcomm.add_argument("--ops", default=None, help="comma-separated subset of: all_reduce, all_gather, "
                                                   "reduce_scatter, broadcast, all_to_all")
    bcomm.add_argument("--iters", type=int, default=20)
    bcomm.add_argument("--warmup", type=int, default=5)
    bcomm.add_argument("--json", action="store_true", help="print JSON (rank 0) instead of a table")
    bcomm.add_argument("--nproc-per-node", default=None, help="self-launch N processes ('auto': GPUs, or 2 on CPU)")

    bscale = bench_sub.add_parser("scaling", help="weak scaling: the config at 1, 2, 4, ... processes, fixed per-rank "
                                                   "batch; tokens/s, speedup, efficiency, table + PNG")
    bscale.add_argument("config", help="YAML config (key=value overrides after it)")
    bscale.add_argument("--max-procs", type=int, default=2, help="largest process count (powers of two up to it)")
    bscale.add_argument("--steps", type=int, default=30, help="steps per run (the first 5 are not timed)")
    bscale.add_argument("--out", default=None, help="output folder (default: runs/scaling-<config name>)")
    bscale.add_argument("--json", action="store_true")

    rep = sub.add_parser("report", help="plots (PNG + one HTML page) and a summary of a run directory")
    rep.add_argument("run_dir")
    rep.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report)")

    conv = sub.add_parser("convert", help="export a checkpoint as one torch/safetensors file or a HF Llama folder")
    conv.add_argument("checkpoint", help="a run directory (its newest committed checkpoint) or a step directory")
    conv.add_argument("--to", choices=["safetensors", "torch", "hf"], default="safetensors")
    conv.add_argument("--out", default=None, help="output file (folder for hf); default: <run>/export/...")

    from disttrain.plan.commands import add_parsers as add_plan_parsers

    add_plan_parsers(sub)

    prep = sub.add_parser("prepare-data", help="tokenize text/JSONL files into token shards")
    prep.add_argument("inputs", nargs="+", help=".txt (documents split on blank lines) or .jsonl files")
    prep.add_argument("--out", required=True, help="output directory (use it as data.source)")
    prep.add_argument("--tokenizer", default="byte", help="byte, bpe (train one), or a tokenizer.json path")
    prep.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    prep.add_argument("--val-fraction", type=float, default=0.05)
    prep.add_argument("--text-key", default="text", help="JSONL field holding the text")
    prep.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("train", "config") or (args.command == "bench" and args.bench_command == "scaling"):
        bad = [e for e in extra if "=" not in e or e.startswith("-")]
        if bad:
            parser.error(f"unrecognized arguments: {' '.join(bad)}")
        {"train": cmd_train, "config": cmd_config, "bench": cmd_bench_scaling}[args.command](args, extra)
    elif args.command in ("estimate", "plan"):
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from disttrain.plan.commands import run

        run(args.command, args)
    else:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        {"convert": cmd_convert, "bench": cmd_bench_comm, "prepare-data": cmd_prepare_data,
         "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
