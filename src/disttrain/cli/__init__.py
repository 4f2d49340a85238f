"""disttrain: train a model on one or many GPUs (or CPU processes) from one YAML config, and plan the run
before you reserve a cluster. Start with `disttrain train configs/debug.yaml`; `disttrain COMMAND --help`
lists a command's options. A mistake in a config or a flag prints one line naming it and exits with 2."""

from __future__ import annotations

import argparse
import sys

from disttrain.cli import dryrun as dryrun_cli
from disttrain.cli import plan as plan_cli
from disttrain.cli import tools
from disttrain.launch.this_process import exit_now
from disttrain.observe.quiet import quiet_third_party
from disttrain.cli import train as train_cli
from disttrain.core.errors import EXIT_USAGE, UserError


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (no usage block) and exit 2."""

    def error(self, message: str):
        command = self.prog.removeprefix("disttrain").strip()  # _fail says "disttrain: error:" once
        raise UserError(f"{command + ': ' if command else ''}{message} (see {self.prog} --help)")


def _fail(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"disttrain: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="disttrain", description=__doc__,
                           epilog="Docs: README.md, docs/guide.md (every feature), docs/config.md (every key).")
    sub = parser.add_subparsers(dest="command", required=True)

    train_cli.add_parser(sub)

    config = sub.add_parser("config", help="write a config as DeepSpeed JSON (config export-deepspeed)")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    export = config_sub.add_parser("export-deepspeed", help="write the DeepSpeed JSON config a RunConfig maps to")
    export.add_argument("config", help="YAML config file")
    export.add_argument("--world-size", type=int, default=1, help="processes the JSON is for (sets accumulation)")
    export.add_argument("--out", default=None, help="output file (default: stdout)")

    bench = sub.add_parser("bench", help="measure this machine: collectives (comm), scaling, GPU speed (hardware)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bcomm = bench_sub.add_parser("comm", help="collective bandwidth (algbw/busbw as NCCL's tests define them)")
    bcomm.add_argument("--sizes", default=None, help="comma-separated buffer sizes, e.g. 1K,1M,64M (default 1K..64M)")
    bcomm.add_argument("--ops", default=None, help="comma-separated subset of: all_reduce, all_gather, "
                                                   "reduce_scatter, broadcast, all_to_all")
    bcomm.add_argument("--iters", type=int, default=20)
    bcomm.add_argument("--warmup", type=int, default=5)
    bcomm.add_argument("--json", action="store_true", help="print JSON (rank 0) instead of a table")
    bcomm.add_argument("--nproc-per-node", "--nproc_per_node", default=None, help="self-launch N processes ('auto': GPUs, or 2 on CPU)")

    bhw = bench_sub.add_parser("hardware", help="measure this machine for the planner (--hardware FILE of "
                                                "estimate --time and plan): matmul FLOP/s, element-wise bytes/s, "
                                                "all-reduce latency and bandwidth")
    bhw.add_argument("--models", default="tiny,125m", help="comma-separated registry shapes whose matmuls to time")
    bhw.add_argument("--micro-batch", type=int, default=8)
    bhw.add_argument("--seq-len", type=int, default=256)
    bhw.add_argument("--out", default="hardware.json", help="profile to write (JSON)")
    bhw.add_argument("--nproc-per-node", "--nproc_per_node", default="auto", help="processes measuring at once, as they will train "
                                                              "('auto': GPUs, or 2 on CPU)")

    bscale = bench_sub.add_parser("scaling", help="weak scaling: the config at 1, 2, 4, ... processes, fixed per-rank "
                                                   "batch; tokens/s, speedup, efficiency, table + PNG")
    bscale.add_argument("config", help="YAML config (key=value overrides after it)")
    bscale.add_argument("--max-procs", type=int, default=2, help="largest process count (powers of two up to it)")
    bscale.add_argument("--steps", type=int, default=30, help="steps per run (the first 5 are not timed)")
    bscale.add_argument("--out", default=None, help="output folder (default: runs/scaling-<config name>)")
    bscale.add_argument("--json", action="store_true")

    rep = sub.add_parser("report", help="plots (PNG + one HTML page) and a summary of a run directory, or of "
                                        "several runs overlaid")
    rep.add_argument("run_dir", nargs="+", help="a run directory; several: their curves on shared axes")
    rep.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report; several runs: "
                                                 "compare/ beside the first)")

    conv = sub.add_parser("convert", help="export a checkpoint as one torch/safetensors file or a HF Llama folder")
    conv.add_argument("checkpoint", help="a run directory (its newest committed checkpoint) or a step directory")
    conv.add_argument("--to", choices=["safetensors", "torch", "hf", "peft"], default="safetensors",
                      help="peft: a LoRA run's adapters, for peft.PeftModel.from_pretrained(base, OUT)")
    conv.add_argument("--merge-lora", action="store_true",
                      help="a LoRA run: fold the adapters into the base and write ordinary weights")
    conv.add_argument("--out", default=None, help="output file (folder for hf); default: <run>/export/...")

    plan_cli.add_parsers(sub)
    dryrun_cli.add_parser(sub)

    prep = sub.add_parser("prepare-data", help="tokenize text, JSONL, Parquet or saved datasets into token shards")
    prep.add_argument("inputs", nargs="+", help=".txt (documents split on blank lines), .jsonl(.gz/.zst), .parquet, "
                                                "a datasets.save_to_disk directory, a folder of such files, or a "
                                                "Hugging Face Hub dataset id (its train split); "
                                                "records with 'messages' or 'prompt'/'completion' are chat and "
                                                "instruction data (loss on the answers only)")
    prep.add_argument("--out", required=True, help="output directory (use it as data.source)")
    prep.add_argument("--tokenizer", default="byte", help="byte, bpe (train one), a tokenizer.json path, or a "
                                                          "Hugging Face model directory or Hub id (its tokenizer.json; chat "
                                                          "and instruction data: its chat template too)")
    prep.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: every core)")
    prep.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    prep.add_argument("--val-fraction", type=float, default=0.05,
                      help="every round(1/F)-th document goes to validation (default 0.05: every 20th; 0: none)")
    prep.add_argument("--seq-len", type=int, default=2048,
                      help="validation holds at least 4 sequences of this many tokens, taken from the end of the "
                           "training text when those documents hold fewer; chat data: longer conversations are cut "
                           "to it (default 2048)")
    prep.add_argument("--text-key", default="text", help="JSONL field / Parquet or dataset column holding the text")
    prep.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return parser


def _dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    args, extra = parser.parse_known_args(argv)
    takes_overrides = args.command in ("train", "config", "dryrun") or (args.command == "bench" and args.bench_command == "scaling") \
        or (args.command == "estimate" and args.config is not None)
    bad = [e for e in extra if "=" not in e or e.startswith("-")] if takes_overrides else extra
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}{_missing_equals(extra) if takes_overrides else ''}")
    args.overrides = extra
    if args.command == "train":
        train_cli.cmd_train(args, extra)
    elif args.command == "config":
        tools.cmd_config(args, extra)
    elif args.command == "bench":
        {"scaling": lambda a: tools.cmd_bench_scaling(a, extra), "comm": tools.cmd_bench_comm,
         "hardware": tools.cmd_bench_hardware}[args.bench_command](args)
    elif args.command == "dryrun":
        dryrun_cli.cmd_dryrun(args, extra)
    elif args.command in ("estimate", "plan"):
        (plan_cli.cmd_estimate if args.command == "estimate" else plan_cli.cmd_plan)(args)
    else:
        {"convert": tools.cmd_convert, "prepare-data": tools.cmd_prepare_data, "report": tools.cmd_report}[args.command](args)


def _missing_equals(extra: list[str]) -> str:
    """A config key followed by its value without `=` (`train.steps 50`): the fix, as a hint."""
    for key, value in zip(extra, extra[1:]):
        if "." in key and "=" not in key and not key.startswith("-") and "=" not in value:
            return f" (did you mean {key}={value}? overrides are key=value)"
    return ""


def main(argv: list[str] | None = None) -> None:
    from disttrain.distributed.env import detect_env

    quiet_third_party()
    try:
        _dispatch(build_parser(), argv)
    except UserError as exc:  # under torchrun every rank validates; one of them speaks
        _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, quiet=detect_env().rank != 0)
    except KeyboardInterrupt:  # Ctrl-C: whatever was being written has been cleaned up on the way out
        if detect_env().rank == 0:
            print("disttrain: interrupted", file=sys.stderr)
        sys.exit(130)


def run() -> None:
    """The `disttrain` command and `python -m disttrain`: `main`, then a quick exit."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    exit_now(code)


if __name__ == "__main__":
    run()
