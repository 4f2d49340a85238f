"""Host syncs of the optimizer step (train/engine.py `OptimizerStep`): with `metrics.nonfinite=stop` (the default) a
step reads nothing back to the host; a non-finite gradient norm is noted on the device and raised by the next
check (logging steps, the last step, before every save), naming the step it happened in. `skip_step` must decide
before the update: one read a step. Counted as `aten::_local_scalar_dense` calls (`.item()`, `float(t)`,
`bool(t)`: on a GPU each waits for the device), outside AdamW's own step, whose counters are CPU tensors."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from disttrain.observe.health import NonFiniteError
from disttrain.train.engine import OptimizerStep
from disttrain.train.precision import Precision


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _setup(nonfinite: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    inner = optimizer.step

    def step_uncounted(self, *args, **kwargs):  # its step counters are CPU tensors: no device sync on a GPU
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return inner(*args, **kwargs)

    optimizer.step = types.MethodType(step_uncounted, optimizer)
    return model, OptimizerStep(optimizer, scheduler, Precision("fp32", torch.device("cpu")), 1.0, nonfinite)


def _steps(model, step, bad_step: int | None, steps: int = 4) -> int:
    reads = _HostReads()
    for k in range(1, steps + 1):
        loss = model(torch.randn(4, 8)).square().sum() * (float("nan") if k == bad_step else 1.0)
        loss.backward()
        with reads:
            step(list(model.parameters()), k)
    return reads.count


def test_a_step_reads_nothing_back_and_a_nonfinite_one_is_raised_at_the_check():
    model, step = _setup("stop")
    assert _steps(model, step, bad_step=None) == 0
    step.check_finite()  # all finite: nothing raised
    model, step = _setup("stop")
    assert _steps(model, step, bad_step=2) == 0  # the NaN step is only noted
    with pytest.raises(NonFiniteError, match="non-finite gradient norm at step 2;"):
        step.check_finite()


def test_skip_step_reads_one_scalar_a_step():
    model, step = _setup("skip_step")
    assert _steps(model, step, bad_step=3) == 4
    assert step.skipped_steps == [3]
