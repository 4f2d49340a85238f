"""What a check run inside a test launch leaves behind: each rank's results as JSON beside `out` (the test reads
them), or, run as a script under torchrun, printed."""

from __future__ import annotations

import json
from typing import Callable

import torch.distributed as dist


def write(out: str, results: dict) -> None:
    with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)


def run_as_script(results: Callable[[], dict]) -> None:
    dist.init_process_group("gloo")
    for case, result in results().items():
        print(case, result, flush=True)
    dist.destroy_process_group()
