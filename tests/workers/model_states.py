"""disttrain.bench.model_states' per-rank measurement as a train_many check: the rows of the launch's
own processes, so a test module pays no launch (a fresh torchrun and its workers) of its own for them.

    {"call": "model_states:check", "args": [OUT, RUN_DIR, [stages], [overrides]]}

Each rank writes its rows (one per stage) to OUT.rank<R>.json; `rows(job)` reads them back as
`disttrain.bench.model_states.launch` returns them.
"""

import json
from pathlib import Path


def check(out: str, run_dir: str, stages: list, overrides: list, model: str = "tiny") -> None:
    import torch.distributed as dist

    from disttrain.bench.model_states import measure
    from disttrain.distributed.env import detect_env
    from disttrain.distributed.runtime import init_distributed

    runtime = init_distributed(detect_env(), "gloo", 60)  # the launch's process group, already up
    found = [measure(runtime, stage, model, run_dir, tuple(overrides)) for stage in stages]
    Path(f"{out}.rank{dist.get_rank()}.json").write_text(json.dumps(found))


def job(out: Path, stages=(0, 1, 2, 3), overrides=(), model: str = "tiny") -> dict:
    """The train_many job of `check`, its rows to go to OUT (a path prefix)."""
    return {"call": "model_states:check", "args": [str(out), str(out.parent / f"{out.name}_runs"), list(stages),
                                                   list(overrides), model]}


def rows(job: dict) -> list[dict]:
    """Every rank's rows of a finished `job`, by rank and stage."""
    out = Path(job["args"][0])
    found = [row for path in sorted(out.parent.glob(f"{out.name}.rank*.json")) for row in json.loads(path.read_text())]
    return sorted(found, key=lambda r: (r["rank"], r["stage"]))
