"""Run `disttrain.dryrun.simulate.measure_step` on REAL tensors in a real gloo launch, for each of
several configs, so a test can compare the dry run's simulated bytes and collectives with a real run.

    python -m disttrain.launch.agent --standalone --nproc-per-node N tests/workers/measure_step.py JOBS.json OUT.json

JOBS.json: {name: [override, ...]}, or {name: {"overrides": [...], "routing_skew": 1}} for MoE layers routed as
the dry run states (dryrun/routing.py; balanced only: every rank's view of the split sizes agrees). OUT.json (written by rank 0): {name: [RankRun as a dict, one per rank]}.
"""

import dataclasses
import gc
import json
import sys

import torch.distributed as dist

from disttrain.config.load import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import init_distributed, shutdown
from disttrain.dryrun.routing import AssumedRouting
from disttrain.dryrun.simulate import measure_step
from disttrain.models.spec import build_model
from disttrain.launch.this_process import exit_now
from disttrain.config.resolve import resolve_run


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    runtime = init_distributed(detect_env(), "auto", 120)
    out = {}
    try:
        for name, job in jobs.items():
            overrides, routing = ((job, None) if isinstance(job, list)
                                  else (job["overrides"], AssumedRouting(job["routing_skew"])))
            cfg = load_config(None, overrides)
            resolved = resolve_run(cfg, runtime.world_size, "cpu")
            model = build_model(resolved.spec, runtime.device, cfg.train.seed)
            run = dataclasses.asdict(measure_step(cfg, resolved.layout, resolved.spec, model, routing=routing))
            out[name] = [None] * runtime.world_size
            dist.all_gather_object(out[name], run)
            gc.collect()
            dist.barrier()
        if runtime.rank == 0:
            open(sys.argv[2], "w").write(json.dumps(out))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
    exit_now(0)
