"""`disttrain plan --show-schedule`: a pipeline schedule as a time x stage table, with its bubble in
theory, in the table, and (with --run) as measured by a pipeline run."""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.core.errors import UserError


def _positive(flag: str, value) -> None:
    if value is not None and value < 1:
        raise UserError(f"{flag}={value}: must be at least 1")


def cmd_show_schedule(args) -> None:
    from disttrain.plan.schedule import describe_schedule

    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches), ("--virtual-stages", args.virtual_stages)):
        _positive(flag, value)
    multi = args.schedule in ("interleaved_1f1b", "zero_bubble")
    if multi and args.microbatches % args.pp:
        raise UserError(f"--microbatches={args.microbatches} must be a multiple of --pp={args.pp} for {args.schedule}")
    if args.schedule != "gpipe" and args.microbatches < args.pp:
        raise UserError(f"--microbatches={args.microbatches} must be at least --pp={args.pp} for {args.schedule}")
    d = describe_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
    measured = _measured_bubble(args.run) if args.run else None
    if args.json:
        print(json.dumps({**d, "bubble_measured": measured}, indent=1))
        return
    chunks = f", {d['virtual_stages']} stages per rank (cell: micro-batch.chunk)" if multi else ""
    print(f"{args.schedule}: pp={args.pp}, {args.microbatches} micro-batches{chunks}; F = 1 unit, "
          f"B = 2 (zero-bubble: B = input gradient, W = weight gradient, 1 each)\n")
    print(d["table"])
    print(f"\nbubble: {d['bubble_theory']:.1%} theory, {d['bubble_simulated']:.1%} in this table"
          + (f", {measured:.1%} measured in {args.run}" if measured is not None else ""))


def _measured_bubble(run_dir: str) -> float:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"--run={run_dir}: no metrics.jsonl there")
    values = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "pp_bubble" in record and record.get("step", 0) > 1:  # step 1 includes set-up
            values.append(record["pp_bubble"])
    if not values:
        raise UserError(f"--run={run_dir}: no pp_bubble records (not a pipeline run, or only one step)")
    values.sort()
    return values[len(values) // 2]
