"""A train_many check that sets (or, with None, clears) DISTTRAIN_FAULT in the launch's processes for the jobs after
it: each run's FaultInjector reads it when the run is built (train/faults.py), so one launch can slow a rank in some
of its runs and not in others.

    {"call": "fault_env:use", "args": ["slow:rank=1:step=0:seconds=0.25"]}
"""

import os


def use(spec: str | None = None) -> None:
    if spec:
        os.environ["DISTTRAIN_FAULT"] = spec
    else:
        os.environ.pop("DISTTRAIN_FAULT", None)


def job(spec: str | None = None) -> dict:
    return {"call": "fault_env:use", "args": [spec]}
