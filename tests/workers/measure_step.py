"""Run `disttrain.dryrun.simulate.measure_step` on REAL tensors in a real gloo launch, for each of
several configs, so a test can compare the dry run's simulated bytes and collectives with a real run.

    python -m disttrain.launch.agent --standalone --nproc-per-node N tests/workers/measure_step.py JOBS.json OUT.json

JOBS.json: {name: [override, ...]}, or {name: {"overrides": [...], "routing_skew": 1}} for MoE layers routed as
the dry run states (dryrun/routing.py; balanced only: every rank's view of the split sizes agrees). OUT.json (written by rank 0): {name: [RankRun as a dict, one per rank]}.
Each RankRun dict also holds `freed_by_other_threads`: how many buffers the tracker counted were freed by a thread
other than the step's (0 when the measurement did not depend on thread scheduling; see GlooHoldsNoCounted).

Measured with gloo, whose worker threads keep buffers the tracker counts: a collective's tensors until its thread
comes back to it after completing it (a buffer its caller dropped meanwhile is freed then, by that thread), and
buffers of its own (the reduce-scatter's copy of its input, split into the output inside `Work.wait()`, in the
tracker's sight). How long they stay depends on when the thread gets a CPU: on a loaded machine the real peak and
temporaries read a few MB high, now and then. GlooHoldsNoCounted keeps the tracker to what the training code
allocates and frees, as the fake process group (and NCCL, whose buffers the dry run models) has it.
"""

import dataclasses
import gc
import json
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only

from disttrain.config.load import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import init_distributed, shutdown
from disttrain.dryrun.collectives import collective_kind
from disttrain.dryrun.routing import AssumedRouting
from disttrain.dryrun.simulate import measure_step
from disttrain.models.spec import build_model
from disttrain.launch.this_process import exit_now
from disttrain.config.resolve import resolve_run


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory under a storage that does not own it: holding it keeps nothing alive."""
    st = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


class GlooHoldsNoCounted(TorchDispatchMode):
    """Below the tracker (entered first): each collective reaches gloo with tensors the tracker never counts.

    - eager collectives (c10d: FSDP2's, DDP's, the loss and norm reductions): unowned views of their tensors (their
      callers keep them until the collective completed, as they must to read its result), and a copy of what a
      point-to-point send sends (a pipeline may drop it before its send completes);
    - functional collectives (tensor parallelism's, the experts' all-to-all): completed here, their results copied
      into tensors gloo does not hold, in-place ones written through unowned views;
    - `Work.wait()` (see `install`) with no mode in sight, so gloo's own buffers stay uncounted.
    The tensors gloo is given here are made below every mode: the tracker sees none of them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            return NotImplemented  # as the tracker does: DTensor's local ops come back here
        kind = collective_kind(func.__name__)
        if kind is None or func.namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        originals: dict[int, torch.Tensor] = {}

        def hand_over(t: torch.Tensor) -> torch.Tensor:
            given = t.clone() if kind == "send" else _unowned(t)
            originals[id(given)] = t
            return given

        result = func(*tree_map_only(torch.Tensor, hand_over, args), **tree_map_only(torch.Tensor, hand_over, kwargs))
        if func.namespace == "_c10d_functional":
            tree_map_only(torch.Tensor, torch.ops._c10d_functional.wait_tensor.default, result)
            return tree_map_only(torch.Tensor, lambda t: originals[id(t)] if id(t) in originals else t.clone(), result)
        return tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), result)

    @staticmethod
    def install() -> None:
        """`Work.wait()` out of the modes' sight: what gloo computes in it (the reduce-scatter's split of its own
        copy of the input into the output) is gloo's, not the step's."""
        wait = dist.Work.wait

        def unseen(work, *args, **kwargs):
            with _disable_current_modes():
                return wait(work, *args, **kwargs)

        dist.Work.wait = unseen


class OtherThreadFrees:
    """Counts the tracked buffers whose release the tracker learns of on a thread other than this one (a gloo
    worker's): a measurement that depended on thread scheduling."""

    def __init__(self):
        self.count, self.main = 0, threading.get_ident()
        release = MemTracker._delete_callback

        def counted(tracker, winfo, w_st):
            if threading.get_ident() != self.main:
                self.count += 1
            return release(tracker, winfo, w_st)

        MemTracker._delete_callback = counted


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    runtime = init_distributed(detect_env(), "auto", 120)
    GlooHoldsNoCounted.install()
    frees = OtherThreadFrees()
    out = {}
    try:
        for name, job in jobs.items():
            overrides, routing = ((job, None) if isinstance(job, list)
                                  else (job["overrides"], AssumedRouting(job["routing_skew"])))
            cfg = load_config(None, overrides)
            resolved = resolve_run(cfg, runtime.world_size, "cpu")
            model = build_model(resolved.spec, runtime.device, cfg.train.seed)
            frees.count = 0
            with GlooHoldsNoCounted():
                run = dataclasses.asdict(measure_step(cfg, resolved.layout, resolved.spec, model, routing=routing))
            run["freed_by_other_threads"] = frees.count
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
