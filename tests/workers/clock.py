"""A train_many check that swaps the clock the runs after it read (`time.perf_counter`, which the loop, the step
breakdown and the phase timers call) for this process's CPU time, or back: on CPU time a process that the machine's
load keeps waiting for a core is not charged for the wait, so what such a run measures does not depend on the
other processes of the machine.

    {"call": "clock:use", "args": ["cpu"]}   ...runs...   {"call": "clock:use", "args": ["wall"]}
"""

import time

_WALL = time.perf_counter


def use(kind: str) -> None:
    time.perf_counter = {"cpu": time.process_time, "wall": _WALL}[kind]


def job(kind: str) -> dict:
    return {"call": "clock:use", "args": [kind]}
