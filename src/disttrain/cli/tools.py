"""The smaller commands: prepare-data, config export-deepspeed, convert, report, bench comm|scaling.
Each raises UserError for a user mistake; `cli.main` turns it into one line and exit 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disttrain.config.load import load_config
from disttrain.core.errors import UserError
from disttrain.config.resolve import resolve_run


def cmd_prepare_data(args: argparse.Namespace) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="disttrain-hub-") as scratch:
        _prepare_data(args, Path(scratch))


def _hub_dataset(name: str, scratch: Path) -> Path:
    """A Hub dataset id as an input: its repository's files from huggingface_hub's cache (fetched if online), read
    by `datasets` (which finds the splits in the file names), the train split saved to disk for the readers."""
    import datasets

    from disttrain.core.hub import local_directory

    snapshot = local_directory(name, key="input", repo_type="dataset")
    try:
        train = datasets.load_dataset(snapshot, split="train")
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(f"input {name}: datasets cannot read a train split from it ({str(exc).splitlines()[0]})") \
            from None
    where = scratch / name.replace("/", "--").replace("@", "--")
    train.save_to_disk(str(where))
    return where


def _prepare_data(args: argparse.Namespace, scratch: Path) -> None:
    from disttrain.core.hub import is_hub_id, local_directory
    from disttrain.data.prepare import prepare, resolve_tokenizer, split_warning
    from disttrain.data.readers import SUFFIXES, kind_of

    paths = [_hub_dataset(p, scratch) if not Path(p).exists() and is_hub_id(p) else Path(p) for p in args.inputs]
    if args.tokenizer not in ("byte", "bpe") and not Path(args.tokenizer).exists() and is_hub_id(args.tokenizer):
        args.tokenizer = local_directory(args.tokenizer, key="--tokenizer")  # a Hub model id: its tokenizer
    for p in paths:
        if not p.exists():
            raise UserError(f"input {p}: no such file or directory")
        if kind_of(p) is None:
            raise UserError(f"input {p}: not a corpus this reads (allowed: {', '.join(SUFFIXES)} files, a directory "
                            "written by datasets.Dataset.save_to_disk, or a folder of such files)")
    tok = args.tokenizer
    if tok not in ("byte", "bpe") and not Path(resolve_tokenizer(tok)).is_file():
        raise UserError(f"--tokenizer={tok}: no such file (allowed: byte, bpe, a tokenizer.json path, or a Hugging "
                        "Face model directory or Hub id holding tokenizer.json)")
    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val-fraction={args.val_fraction}: must be in [0, 1)")
    if args.tokenizer == "bpe" and args.vocab_size < 257:
        raise UserError(f"--vocab-size={args.vocab_size}: must be at least 257 for BPE (256 bytes + end-of-text)")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers={args.workers}: must be at least 1")
    if args.seq_len < 1:
        raise UserError(f"--seq-len={args.seq_len}: must be at least 1")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise UserError(f"--out={out}: directory is not empty (pass --force to overwrite)")
    try:
        meta = prepare(paths, out, args.tokenizer, args.vocab_size, args.val_fraction, args.text_key,
                       progress=sys.stderr.isatty(), workers=args.workers, seq_len=args.seq_len)
    except (ValueError, UnicodeError, OSError) as exc:
        raise UserError(str(exc).splitlines()[0]) from None
    splits = ", ".join(f"{k} {v:,} tokens" for k, v in meta["splits"].items())
    print(f"wrote {out}: {splits} (vocabulary {meta['vocab_size']}, {meta['dtype']})")
    if "chat" in meta or "preference" in meta:  # what carries loss: check it before a long run
        from disttrain.data.chat_prepare import describe
        from disttrain.data.preference_prepare import describe as describe_pairs

        describe = describe_pairs if "preference" in meta else describe

        for line in describe(meta):
            print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout)
        return
    warning = split_warning(meta, args.seq_len, args.val_fraction)
    if warning:
        print(f"warning: {out}: {warning}", file=sys.stderr)


def cmd_config(args: argparse.Namespace, overrides: list[str]) -> None:
    import json

    from disttrain.train.deepspeed_engine import deepspeed_config  # pure Python

    cfg = load_config(args.config, [*overrides, "engine=torch"])  # exporting needs no DeepSpeed installed
    if args.world_size < 1:
        raise UserError(f"--world-size={args.world_size}: must be a positive integer")
    layout = resolve_run(cfg, args.world_size, "cuda").layout
    text = json.dumps(deepspeed_config(layout, cfg.optim.grad_clip), indent=2) + "\n"
    if args.out:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)


def cmd_convert(args: argparse.Namespace) -> None:
    from disttrain.core import storage
    from disttrain.checkpoint.export import export, resolve_checkpoint

    storage.check_reachable(args.checkpoint, "convert")
    try:
        step_dir = resolve_checkpoint(args.checkpoint)
    except FileNotFoundError as exc:
        raise UserError(f"convert {args.checkpoint}: {exc}") from None
    default = {"torch": "model.pt", "safetensors": "model.safetensors", "hf": "hf", "peft": "peft"}[args.to]
    # A remote checkpoint's export lands locally (./export/...) unless --out says where.
    here = Path("export") if storage.is_url(step_dir) else Path(step_dir).parent.parent / "export"
    out = Path(args.out) if args.out else here / default
    print(f"wrote {export(step_dir, args.to, out, merge_lora=args.merge_lora)} from {step_dir}")


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def cmd_bench_comm(args: argparse.Namespace) -> None:
    import json

    from disttrain.bench import comm
    from disttrain.distributed.env import detect_env, under_torchrun
    from disttrain.launch.self_launch import LaunchOptions, relaunch

    try:
        sizes = [_parse_size(x) for x in args.sizes.split(",")] if args.sizes else list(comm.DEFAULT_SIZES)
    except (ValueError, IndexError):
        raise UserError(f"--sizes={args.sizes}: expected comma-separated sizes like 1K,1M,64M") from None
    ops = args.ops.split(",") if args.ops else list(comm.OPS)
    unknown = [op for op in ops if op not in comm.OPS]
    if unknown:
        raise UserError(f"--ops={args.ops}: unknown {unknown[0]} (allowed: {', '.join(comm.OPS)})")
    if args.nproc_per_node is not None and not under_torchrun():
        forwarded = ["bench", "comm", "--sizes", ",".join(map(str, sizes)), "--ops", ",".join(ops),
                     "--iters", str(args.iters), "--warmup", str(args.warmup)] + (["--json"] if args.json else [])
        sys.exit(relaunch(LaunchOptions(args.nproc_per_node), forwarded))
    from disttrain.distributed.runtime import init_distributed, shutdown

    env = detect_env()
    runtime = init_distributed(env, "auto", 300)
    try:
        results = comm.run(runtime.device, ops, sizes, args.iters, args.warmup)
    finally:
        shutdown()
    if env.rank == 0:
        print(json.dumps(comm.as_dicts(results)) if args.json else
              f"{runtime.world_size} ranks, {runtime.backend} on {runtime.device.type}\n{comm.format_table(results)}")


def cmd_bench_hardware(args: argparse.Namespace) -> None:
    import json

    from disttrain.distributed.env import detect_env, under_torchrun
    from disttrain.launch.self_launch import LaunchOptions, relaunch
    from disttrain.models.registry import MODEL_SHAPES

    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODEL_SHAPES]
    if unknown or not names:
        raise UserError(f"--models={args.models}: unknown model {unknown[0] if unknown else '(none)'} "
                        f"(allowed: {', '.join(MODEL_SHAPES)})")
    for flag, value in (("--micro-batch", args.micro_batch), ("--seq-len", args.seq_len)):
        if value < 1:
            raise UserError(f"{flag}={value}: must be at least 1")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UserError(f"--out={args.out}: folder {out.parent} does not exist")
    if args.nproc_per_node and not under_torchrun():
        forwarded = ["bench", "hardware", "--models", ",".join(names), "--micro-batch", str(args.micro_batch),
                     "--seq-len", str(args.seq_len), "--out", str(out.resolve())]
        sys.exit(relaunch(LaunchOptions(args.nproc_per_node), forwarded))
    from disttrain.bench import hardware
    from disttrain.distributed.runtime import init_distributed, shutdown

    env = detect_env()
    runtime = init_distributed(env, "auto", 300)
    try:
        profile = hardware.measure({m: MODEL_SHAPES[m] for m in names}, args.micro_batch, args.seq_len)
    finally:
        shutdown()
    if env.rank == 0:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(profile, indent=1))
        tmp.replace(out)
        print(hardware.summary(profile) + f"\nwrote {out}")


def cmd_report(args: argparse.Namespace) -> None:
    from disttrain.observe.run_compare import compare
    from disttrain.observe.run_report import make_report

    runs = [Path(r) for r in args.run_dir]
    try:
        if len(runs) == 1:
            index, pngs, rows = make_report(runs[0], Path(args.out) if args.out else None)
        else:
            index, pngs, rows = compare(runs, Path(args.out) if args.out else runs[0].parent / "compare")
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from None
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(f"\nwrote {len(pngs)} plots and {index}")


def cmd_bench_scaling(args: argparse.Namespace, overrides: list[str]) -> None:
    from disttrain.bench import scaling

    cfg = load_config(args.config, overrides)
    counts = scaling.process_counts(args.max_procs)
    for n in counts:
        resolve_run(scaling.scaled_config(cfg, n), n, "cuda")
    rows = scaling.run(args.config, overrides, cfg, counts, args.steps, Path(args.out) if args.out else None)
    print(scaling.format_table(rows))
    if args.json:
        import json

        print(json.dumps(rows))
