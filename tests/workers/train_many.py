"""Train several configs one after another in one launch of real processes (one gloo process group),
so that a test module pays the start-up of N processes once rather than once per layout.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/train_many.py JOBS.json

JOBS.json: [{"config": PATH, "overrides": [...]}, ...]. Each job goes through the same builder and
loop as `disttrain train` (only the process group is shared). A job {"call": "module:function", "args": [...]}
instead calls a check of this directory that needs the launch's process group (e.g. cp_kernels:check), so a
test module pays no launch of its own for it.
"""

import gc
import importlib
import json
import os
import sys
import time

import torch.distributed as dist
from torch._dynamo.utils import counters

from disttrain.config.load import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import init_distributed, shutdown
from disttrain.train.builder import build_run
from disttrain.train.loop import Trainer
from disttrain.launch.this_process import exit_now


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    runtime = init_distributed(detect_env(), "auto", 120)
    try:
        for job in jobs:
            if "call" in job:
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (forked workers run it by path)
                module, function = job["call"].split(":")
                getattr(importlib.import_module(module), function)(*job.get("args", []))
                dist.barrier()
                continue
            started = time.perf_counter()
            cfg = load_config(job["config"], job["overrides"])
            counters.clear()
            Trainer(build_run(cfg, runtime)).fit()
            if runtime.rank == 0:  # what torch.compile did in this job: tests check compile really ran
                (cfg.run_dir / "dynamo_stats.json").write_text(json.dumps(dict(counters["stats"])))
            gc.collect()  # DDP reducers and FSDP state of the finished run go before the next one starts
            dist.barrier()
            timing = os.environ.get("DISTTRAIN_TEST_TIMING")  # a file: where a test module's time goes
            if runtime.rank == 0 and timing:
                with open(timing, "a") as f:
                    f.write(f"{cfg.run_dir.name}: {time.perf_counter() - started:.1f} s\n")
    finally:
        shutdown()


if __name__ == "__main__":
    main()
    exit_now(0)  # skip the interpreter teardown (see disttrain.launch.this_process)
