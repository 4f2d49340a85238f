"""Where a step's time goes, per rank.

`StepBreakdown` splits each step into data wait, forward, backward, exposed communication and
optimizer. On CPU it reads the clock at each boundary; on GPU it records CUDA events there and
reads them only when a step is logged (one synchronisation per logging step, none per step).
Exposed communication is the gradient reduction that backward compute did not hide: the time from
the last backward computation (the gradient reaching the input embedding's output, marked by a
tensor hook) to the end of `backward()`, which is where DDP and FSDP wait for their last all-reduce or
reduce-scatter. Collectives inside forward and backward (FSDP all-gathers, tensor-parallel
all-reduces) are part of those phases; `CommProfiler` reports their time per collective kind.

`CommProfiler` profiles one step every `metrics.comm_profile_every` steps with `torch.profiler`
and sums the collectives' own records (`gloo:all_reduce`, `nccl:all_gather`, ... from launch to
completion; NCCL kernels' device time on GPU) by kind. Cost: the profiled step runs slower
(measured in docs/benchmarks/metrics.md); the other steps pay nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

PARTS = ("data", "forward", "backward", "comm_exposed", "optimizer")
KINDS = {"all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather", "allgather": "all_gather",
         "reduce_scatter": "reduce_scatter", "reducescatter": "reduce_scatter", "send": "send_recv",
         "recv": "send_recv", "sendrecv": "send_recv", "broadcast": "broadcast", "alltoall": "all_to_all",
         "all_to_all": "all_to_all", "barrier": "barrier", "reduce": "reduce", "gather": "gather", "scatter": "scatter"}


def _cuda_mark():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def device_clock(device: torch.device):
    """A function returning a time mark: the host clock on CPU, a recorded CUDA event on GPU (read later,
    so marking costs no host sync)."""
    return _cuda_mark if device.type == "cuda" else time.perf_counter


class StepBreakdown:
    """Also a subscriber of the engine's phases (train/phases.py): forward, backward (its tail after the
    last gradient computation is exposed reduction), reduce (exposed), optimizer; a pipeline's chunks on the
    host clock, the rest of its schedule counted as exposed transfer time. Evaluation is not step time."""

    STEP_PARTS = {"forward": "forward", "backward": "backward", "reduce": "comm_exposed", "optimizer": "optimizer"}

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.now = device_clock(device)
        self.totals = dict.fromkeys(PARTS, 0.0)
        self.pending: list[tuple[str, object, object]] = []
        self.compute_end = None
        self._marks: dict[str, object] = {}
        self._schedule: list[float] | None = None  # [start, seconds in its chunks] inside a pipeline schedule

    def enter(self, event) -> None:
        if event.step is None:
            return
        if event.name == "pipeline":
            self._schedule = [time.perf_counter(), 0.0]
        elif self._schedule is not None:
            self._marks[event.name] = time.perf_counter()
        elif event.name in self.STEP_PARTS:
            self._marks[event.name] = self.now()

    def exit(self, event) -> None:
        if event.step is None or (event.name not in self.STEP_PARTS and event.name != "pipeline"):
            return
        if event.name == "pipeline":
            start, busy = self._schedule
            self._schedule = None
            self.add_seconds("comm_exposed", max(0.0, time.perf_counter() - start - busy))
        elif self._schedule is not None:  # a pipeline chunk: host clock (the schedule waits on transfers anyway)
            seconds = time.perf_counter() - self._marks.pop(event.name)
            self._schedule[1] += seconds
            self.add_seconds(event.name, seconds)
        else:
            start, end = self._marks.pop(event.name), self.now()
            compute_end = self.take_compute_end() if event.name == "backward" else None
            if event.last and compute_end is not None:  # what follows the last gradient is reduction wait
                self.add("backward", start, compute_end)
                self.add("comm_exposed", compute_end, end)
            else:
                self.add(self.STEP_PARTS[event.name], start, end)

    def add(self, part: str, start, end) -> None:
        if self.cuda:
            self.pending.append((part, start, end))
        else:
            self.totals[part] += end - start

    def add_seconds(self, part: str, seconds: float) -> None:
        """Host-measured time (data loading; pipeline schedules, which wait on transfers anyway)."""
        self.totals[part] += seconds

    def mark_compute_end(self) -> None:
        self.compute_end = self.now()

    def take_compute_end(self):
        end, self.compute_end = self.compute_end, None
        return end

    def collect(self, steps: int) -> dict[str, float]:
        """Mean seconds per step of each part since the last call, as `time_<part>_s`."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for part, start, end in self.pending:
                self.totals[part] += start.elapsed_time(end) / 1000.0
            self.pending.clear()
        out = {f"time_{part}_s": value / max(steps, 1) for part, value in self.totals.items()}
        self.totals = dict.fromkeys(PARTS, 0.0)
        return out

    def watch_input_module(self, model: torch.nn.Module) -> None:
        """Mark the end of backward compute when the gradient reaches the output of the first module
        holding parameters (a language model's input embedding): after it only that module's own
        weight gradient and the data-parallel reduction remain."""
        embedding = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
        if embedding is None:
            return

        def forward_hook(module, inputs, output):
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._on_grad)

        embedding.register_forward_hook(forward_hook)

    def _on_grad(self, grad):
        self.mark_compute_end()
        return None


def collective_kind(name: str) -> str | None:
    """'gloo:all_reduce' -> 'all_reduce'; NCCL kernels ('ncclDevKernel_AllGather_...') -> 'all_gather'."""
    lowered = name.lower()
    if lowered.startswith(("gloo:", "nccl:", "mpi:", "ucc:")):
        op = lowered.split(":", 1)[1]
        return KINDS.get(op.replace("_base", "").replace("_coalesced", "").replace("_into_tensor", ""), op)
    if lowered.startswith("nccl") and "kernel" in lowered:
        core = lowered.split("_")[1] if "_" in lowered else lowered
        return KINDS.get(core, core)
    return None


class CommProfiler:
    """Profiles one step in `every` (0: never) and returns seconds per collective kind for it."""

    def __init__(self, every: int, device: torch.device):
        self.every = every
        self.cuda = device.type == "cuda"
        self.last: dict[str, float] = {}
        self.active = None
        self.overhead_s = 0.0  # starting the profiler and reading its events: not step time

    def start(self, step: int) -> None:
        if not self.every or step % self.every:
            return
        from torch.profiler import ProfilerActivity, profile

        t0 = time.perf_counter()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.active = profile(activities=activities)
        with _native_stderr_silenced():
            self.active.__enter__()
        self.overhead_s += time.perf_counter() - t0

    def take_overhead(self) -> float:
        spent, self.overhead_s = self.overhead_s, 0.0
        return spent

    def stop(self) -> None:
        if self.active is None:
            return
        t0 = time.perf_counter()
        try:
            self._read()
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _read(self) -> None:
        prof, self.active = self.active, None
        with _native_stderr_silenced():
            prof.__exit__(None, None, None)
        totals: dict[str, float] = {}
        for name, seconds, is_kernel in _records(prof):
            kind = collective_kind(name)
            if kind is None:
                continue
            if self.cuda and not is_kernel and name.lower().startswith("nccl:"):
                continue  # on GPU the kernels' device time is the communication; the CPU record is the launch
            totals[kind] = totals.get(kind, 0.0) + seconds
        self.last = totals

    def take(self) -> dict[str, float]:
        """`comm_<kind>_s` of the last profiled step (empty until one was profiled)."""
        out = {f"comm_{k}_s": v for k, v in sorted(self.last.items())}
        self.last = {}
        return out


def _records(prof):
    """(name, seconds, is a GPU kernel) per profiled record, as `prof.events()` lists them: an op inside a
    same-named op on its thread (an overload's dispatch) is dropped, as `events()` drops it. Reads kineto's raw records: `events()`
    builds a Python object tree of every op first (0.1-0.6 s per profiled step on a CPU, 20-50x the raw
    read), which was most of the periodic sample's cost."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None:  # a profiler without the raw results
        for event in prof.events():
            kernel = event.name.lower().startswith("nccl") and "kernel" in event.name.lower()
            yield event.name, ((event.device_time_total or 0) if kernel else event.cpu_time_total) / 1e6, kernel
        return
    enclosing: dict[tuple, int] = {}  # (name, thread) -> end of the last kept record
    for event in sorted(raw.events(), key=lambda e: e.start_ns()):
        name, start, duration = event.name(), event.start_ns(), event.duration_ns()
        key = (name, event.start_thread_id())
        if start < enclosing.get(key, -1):
            continue  # inside a record of the same name on the same thread
        enclosing[key] = start + duration
        yield name, duration / 1e9, name.lower().startswith("nccl") and "kernel" in name.lower()


@contextlib.contextmanager
def _native_stderr_silenced():
    """Kineto writes `USDT:... profiler_start/profiler_stop` lines to file descriptor 2 from C++ at
    every profiler start and stop; the console stays clean if fd 2 points at /dev/null meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)
