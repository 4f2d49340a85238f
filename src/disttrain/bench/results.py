"""What every benchmark script records beside its figures: when, on what, and the command to repeat it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path


def write_results(path: str | Path, **fields) -> None:
    """`fields` (rows, summary, ...) as JSON at `path`, with the date, the machine and the command line."""
    script = Path(sys.argv[0])
    shown = script.relative_to(Path.cwd()) if script.is_absolute() and script.is_relative_to(Path.cwd()) else script
    record = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": " ".join(["python", str(shown), *sys.argv[1:]]), **fields}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1))
