"""Shared helpers: run the real CLI in subprocesses and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "configs" / "debug.yaml"
LR = 3e-3  # configs/debug.yaml
# The parity setting for the debug model: 20 steps of a global batch of 4; replicas compared every 5 steps.
# Parity runs in double precision, where every layout must give one process's numbers to EXACT (relative):
# another reduction order moves an fp64 result by ~1e-16, far below it, while any real error (a wrong
# scale, a missed reduction, a wrong data slice) moves it by more than 1e-6. PARITY_FP32 is what users run.
# The output head's loss in chunks that do not divide a sequence (64 tokens) against references with the
# whole logits (WHOLE_LOGITS): every layout compared with them checks the chunked loss too.
SMALL_CHUNKS = "train.loss_chunk_tokens=40"
WHOLE_LOGITS = "train.loss_chunk_tokens=0"
PARITY_FP32 = ("train.steps=20", "train.global_batch_size=4", f"optim.lr={LR}", "checkpoint.save_final=true",
               "metrics.sync_check_every=5", SMALL_CHUNKS)
FP64 = "precision.compute_dtype=fp64"
PARITY = (*PARITY_FP32, FP64)
EXACT = 1e-10


def free_ports(count: int = 1) -> int:
    """The first of `count` adjacent free TCP ports on loopback, for a server a test starts (a rendezvous, an S3
    server, metrics endpoints). Drawn outside the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range,
    32768-60999 here): a port the kernel hands out for outgoing connections (the suite's other processes open
    many) could be taken between this check and the server's bind."""
    import random
    import socket

    low, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        first = random.randrange(10000, low - count)
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} adjacent free ports below {low}")


def cli_env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["DISTTRAIN_WORKER_START"] = "fork"  # half the CPU time per launch (docs/troubleshooting.md)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def run_cli(*args: str, nproc: int | None = None, timeout: float = 300, check: bool = True,
            env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m disttrain ARGS` as a separate process (forked from this worker's pre-imported interpreter,
    tests/zygote.py), its output captured."""
    args = (*args, *(("--nproc-per-node", str(nproc)) if nproc is not None else ()))
    proc = run_module("disttrain", args, env={**cli_env(), **(env or {})}, cwd=cwd or REPO, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


_ZYGOTE: list = []  # this pytest worker's tests/zygote.py server, started at its first command


def _zygote() -> subprocess.Popen | None:
    if os.environ.get("DISTTRAIN_TEST_FORK", "1") == "0":
        return None
    if not _ZYGOTE or _ZYGOTE[0].poll() is not None:
        import atexit

        _ZYGOTE[:] = [subprocess.Popen([sys.executable, str(REPO / "tests" / "zygote.py")], cwd=REPO, env=cli_env(),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)]
        atexit.register(_stop_zygote, _ZYGOTE[0])
    return _ZYGOTE[0]


def _starts_differently(env: dict) -> bool:
    """An environment that changes how an interpreter starts (PYTHONPATH with a sitecustomize hook, say) needs
    a fresh one."""
    started = cli_env()
    return any(env.get(k) != started.get(k) for k in {*env, *started} if k.startswith("PYTHON"))


def _stop_zygote(server: subprocess.Popen) -> None:
    """End of the worker: the server's input closes, it leaves its loop and is waited for."""
    server.stdin.close()
    server.wait(timeout=60)


def run_module(module: str, args, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` run to completion in its own process: a fork of the pre-imported server (the
    command sees its own arguments, environment, working directory and standard streams), or a fresh
    interpreter with DISTTRAIN_TEST_FORK=0."""
    import tempfile
    import threading

    cmd = [sys.executable, "-m", module, *args]
    server = _zygote()
    if server is None or _starts_differently(env):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        server.stdin.write(json.dumps({"module": module, "args": list(args), "env": env, "cwd": str(cwd),
                                       "stdout": str(out), "stderr": str(err)}) + "\n")
        server.stdin.flush()
        pid = json.loads(server.stdout.readline())["pid"]
        reply: list = []
        reader = threading.Thread(target=lambda: reply.append(server.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            os.kill(pid, 9)
            reader.join()
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
        code = json.loads(reply[0])["code"]
        return subprocess.CompletedProcess(cmd, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def run_main(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the CLI run in this process: for commands that start no processes
    (prepare-data, convert, a refusal before training), at no interpreter start-up."""
    import contextlib
    import io

    from disttrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def train(run_dir: Path, *overrides: str, nproc: int | None = None, config: Path = DEBUG_CONFIG,
          timeout: float = 300, launch: tuple[str, ...] = (), env: dict | None = None) -> Path:
    """Train into run_dir (its parent is run.dir, its name run.name); returns run_dir."""
    run_cli("train", str(config), f"run.dir={run_dir.parent}", f"run.name={run_dir.name}",
            "distributed.timeout_s=60", *overrides, *launch, nproc=nproc, timeout=timeout, env=env)
    return run_dir


def train_many(jobs: dict[str, tuple], nproc: int, config: Path = DEBUG_CONFIG,
               timeout: float = 600, env: dict | None = None) -> dict[str, Path]:
    """Train each job (name -> (run_dir, overrides) or (run_dir, overrides, its own config)) in turn, in ONE
    launch of `nproc` real gloo processes running the same builder and loop as `disttrain train`; returns
    name -> run_dir. For tests whose subject is a layout's numbers, not launching (tests of the CLI use `train`).
    A job given as a dict ({"call": "module:function", "args": [...]}, tests/workers/train_many.py) runs a check
    in the same processes instead, and maps to itself."""
    spec = [job if isinstance(job, dict) else
            {"config": str(job[2] if len(job) > 2 else config),
             "overrides": [f"run.dir={job[0].parent}", f"run.name={job[0].name}", "distributed.timeout_s=60",
                           *job[1]]} for job in jobs.values()]
    first = next(job for job in jobs.values() if not isinstance(job, dict))[0]
    first.parent.mkdir(parents=True, exist_ok=True)
    job_file = first.parent / f"jobs_{first.name}.json"
    job_file.write_text(json.dumps(spec))
    proc = run_module("disttrain.launch.agent", ["--standalone", f"--nproc-per-node={nproc}",
                                                      str(REPO / "tests" / "workers" / "train_many.py"), str(job_file)],
                      env={**cli_env(), **(env or {})}, cwd=REPO, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return {name: job if isinstance(job, dict) else job[0] for name, job in jobs.items()}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir: Path) -> dict[int, dict]:
    """Step -> its step record in metrics.jsonl; a step logged twice (redone after a restart) keeps its last."""
    return {r["step"]: r for r in records(run_dir) if "loss" in r and "event" not in r}


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (redone after a restart) keeps its last value."""
    return {step: r["loss"] for step, r in step_records(run_dir).items()}


def events(run_dir: Path, name: str) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == name]


def load_checkpoint_state(checkpoint: Path) -> dict:
    """Everything a DCP checkpoint holds, unsharded ({"model": ..., "optim": ...}), read without a process group."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(checkpoint, out)
        return torch.load(out, weights_only=True)


def load_model_params(checkpoint: Path) -> dict:
    """The full (unsharded) model parameters of a DCP checkpoint, read without a process group."""
    return load_checkpoint_state(checkpoint)["model"]


def final_params(run_dir: Path, step: int = 20) -> dict:
    return load_model_params(run_dir / "checkpoints" / f"step_{step:08d}")


def assert_parity(run: Path, reference: Path, rel: float = EXACT, step: int = 20, after: int = 0) -> None:
    """Same per-step losses, gradient norms and learning rates (metrics.jsonl's step records) and same final
    parameters (the checkpoint of `step`) as the reference run: fp64 runs to `rel` (EXACT) on losses, on gradient
    norms (the global norm before clipping, which every layout reduces over its shards, stages and replicas: the
    clip factor) and on every element of every parameter; fp32 runs within assert_params_close's bounds; learning
    rates exactly equal (the schedule is the same arithmetic on the same step count everywhere).
    `after`: a run resumed from the reference's checkpoint of step `after`, which logs only the steps after it."""
    import torch

    ours = step_records(run)
    theirs = {s: r for s, r in step_records(reference).items() if s > after}
    assert_losses_close({s: r["loss"] for s, r in ours.items()}, {s: r["loss"] for s, r in theirs.items()}, rel=rel)
    assert_losses_close({s: r["grad_norm"] for s, r in ours.items()},
                        {s: r["grad_norm"] for s, r in theirs.items()}, rel=rel, what="gradient norm")
    lrs, expected_lrs = {s: r["lr"] for s, r in ours.items()}, {s: r["lr"] for s, r in theirs.items()}
    assert lrs == expected_lrs, f"learning rates differ: {lrs} vs {expected_lrs}"
    mine, reference_params = final_params(run, step), final_params(reference, step)
    if next(iter(reference_params.values())).dtype == torch.float64:
        assert_params_exact(mine, reference_params, rel=rel)
    else:
        assert_params_close(mine, reference_params, rel=rel, lr=LR)


def assert_params_exact(actual: dict, expected: dict, rel: float = EXACT) -> None:
    """fp64: each tensor within `rel` of the reference in norm, and each element within `rel` of the tensor's
    largest magnitude (a relative bound on every element that a parameter near zero cannot slip through)."""
    import torch

    assert actual.keys() == expected.keys()
    for name in expected:
        a, b = actual[name].detach(), expected[name].detach()
        assert a.dtype == b.dtype == torch.float64, f"{name}: {a.dtype} vs {b.dtype}"
        scale = float(b.abs().max()) or 1.0
        norm_rel = float((a - b).norm() / (b.norm() or 1.0))
        worst = float((a - b).abs().max()) / scale
        assert norm_rel <= rel and worst <= rel, f"{name}: relative difference {norm_rel:.2e} (worst element " \
                                                 f"{worst:.2e}) > {rel:.0e}"


def assert_losses_close(actual: dict[int, float], expected: dict[int, float], rel: float, what: str = "loss") -> None:
    """Step -> value (a loss, or another per-step number: `what`), the same steps, each within `rel` (relative)."""
    assert sorted(actual) == sorted(expected), f"logged steps differ: {sorted(actual)} vs {sorted(expected)}"
    worst = max(abs(actual[s] - expected[s]) / abs(expected[s]) for s in expected)
    assert worst <= rel, f"largest relative {what} difference {worst:.3e} > {rel:.0e}"


def assert_params_close(actual: dict, expected: dict, rel: float | dict, lr: float,
                        zero_gradient: tuple[str, ...] = ()) -> None:
    """Each tensor within `rel` of the reference in norm, and no element off by 1/100 of an Adam step.

    Why not elementwise rtol: another fp32 summation order (all-reduce vs local accumulation,
    reduce-scatter, batch-4 vs batch-1 kernels) changes gradients by ~1e-7 relative, and far more for
    the rare element whose gradient is a sum of nearly cancelling terms (an embedding row of a rare
    byte). Twenty Adam steps carry that into parameters: measured worst elements are 7e-4 x lr
    (2 ranks) and 1.04e-3 x lr (4 ranks, embedding) while whole tensors agree to ~1e-6 in norm.
    A real bug (wrong data slice, a missed all-reduce, a shard not updated) moves elements by a
    sizeable fraction of lr per step, i.e. >= 10x this bound after a single step.

    `zero_gradient`: name suffixes of parameters whose exact gradient is zero, e.g. attention's key bias
    (adding one vector to every key shifts each query's scores by a constant, which softmax ignores).
    They move only by rounding noise that Adam normalises, so their norm-relative difference compares
    noise with noise; the element bound still holds for them (measured: <= 1.7e-6 with lr 3e-3).

    `rel` may be a dict (parameter name -> bound).
    """
    assert actual.keys() == expected.keys()
    for name in expected:
        a, b = actual[name].detach().double(), expected[name].detach().double()
        norm_rel, bound = float((a - b).norm() / b.norm()), rel[name] if isinstance(rel, dict) else rel
        assert norm_rel <= bound or name.endswith(zero_gradient), f"{name}: relative difference {norm_rel:.2e} > {bound:.1e}"
        worst = float((a - b).abs().max())
        assert worst <= 1e-2 * lr, f"{name}: an element differs by {worst:.2e} > 1e-2 x lr"
