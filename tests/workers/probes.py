"""Jobs of the training loop (`train.callbacks=[tests/workers/probes.py:NAME]`) that look inside a real run: what
the config built, read off the live objects of the run itself (its DDP module, its FSDP units, its Prometheus
endpoint), not off a second build. Each writes into the run directory, one file per rank (`read(run_dir, name)`
reads a JSON one back).

    WrapperProbe   after the last step (DDP has rebuilt its buckets by then): the gradient wrapper's settings
                   (DDP's attributes and its reducer's own logging data, its communication hooks; each FSDP unit's
                   offload policy and where its parameter shards live) -> wrapper.rank<R>.json
    ScrapeProbe    after each logged step (the metrics job, which feeds every sink, ran before any user job): the
                   text this rank's Prometheus endpoint serves -> scrape.rank<R>.step<S>.txt
"""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.train.jobs import Job


def read(run_dir: Path, name: str, rank: int = 0):
    return json.loads((Path(run_dir) / f"{name}.rank{rank}.json").read_text())


def _sizes(text) -> list[int]:
    return [int(x) for x in str(text or "").replace(",", " ").split()]


class _Probe(Job):
    label = "test probe"

    def __init__(self):
        self.found: dict = {}
        self.rank, self.run_dir = 0, None

    def start(self, trainer) -> None:
        self.rank, self.run_dir = trainer.run.runtime.rank, Path(trainer.run.cfg.run_dir)

    def write(self, name: str) -> None:
        (self.run_dir / f"{name}.rank{self.rank}.json").write_text(json.dumps(self.found, indent=1, sort_keys=True))


class WrapperProbe(_Probe):
    def finish(self, trainer) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.run.engine.model
        out = self.found = {"wrapper": type(model).__name__}
        if isinstance(model, DistributedDataParallel):
            logged = model._get_ddp_logging_data()  # what the C++ reducer was constructed with
            out["ddp"] = {
                "bucket_bytes_cap": model.bucket_bytes_cap, "broadcast_buffers": model.broadcast_buffers,
                "find_unused_parameters": model.find_unused_parameters, "static_graph": model.static_graph,
                "gradient_as_bucket_view": model.gradient_as_bucket_view,
                "reducer": {k: logged.get(k) for k in ("bucket_cap_bytes", "broadcast_buffers", "comm_hook",
                                                       "find_unused_parameters", "static_graph",
                                                       "gradient_as_bucket_view")},
                # bytes per gradient bucket: as first built, and as rebuilt in the order gradients came (step 2)
                "bucket_sizes": _sizes(logged.get("bucket_sizes")),
                "rebuilt_bucket_sizes": _sizes(logged.get("rebuilt_bucket_sizes")),
                # the reducer's buckets now: parameters per bucket
                "bucket_params": [len(b.parameters()) for b in model.reducer._get_zeros_like_grad_buckets()],
                "hooks": [{"hook": getattr(hook, "__name__", repr(hook)), "state": type(state).__name__,
                           **({"rank": state.matrix_approximation_rank, "start_iter": state.start_powerSGD_iter}
                              if hasattr(state, "matrix_approximation_rank") else {})}
                          for hook, state in model._comm_hooks],
            }
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if units:
            groups = [m._get_fsdp_state()._fsdp_param_group for m in units]
            groups = [g for g in groups if g is not None]
            out["fsdp"] = {
                "units": len(units),
                "offload_policies": sorted({type(g.offload_policy).__name__ for g in groups}),
                "cpu_offload": sorted({isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups}),
                "params_offload_to_cpu": sorted({p.offload_to_cpu for g in groups for p in g.fsdp_params}),
                "pin_memory": sorted({p.pin_memory for g in groups for p in g.fsdp_params}),
                "shard_devices": sorted({p.sharded_param.device.type for g in groups for p in g.fsdp_params}),
            }
        self.write("wrapper")


class ScrapeProbe(_Probe):
    def due(self, step: int) -> bool:
        return True

    def run(self, trainer) -> None:
        import urllib.request

        metrics, step = trainer.run.cfg.metrics, trainer.step
        if not metrics.log_every or step % metrics.log_every:
            return
        port = metrics.prometheus_port + trainer.run.runtime.env.local_rank
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        (self.run_dir / f"scrape.rank{self.rank}.step{step}.txt").write_text(text)
