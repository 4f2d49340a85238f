"""`torchrun` with a bounded exit barrier: `python -m disttrain.distributed.agent [torchrun arguments]`.

When its workers finish, torchrun's agent waits for every other node's agent in an exit barrier of
300 s that no flag changes; a node that vanished after training finished keeps the survivors waiting
those 300 s. This runs torchrun's own `main` with its agent class swapped for one whose barrier lasts
DISTTRAIN_EXIT_BARRIER_S seconds (set by `disttrain train --exit-barrier-timeout`, default 30): long
enough for nodes that finish together (the end of a run is a collective), short for a lost node.
"""

from __future__ import annotations

import os
import traceback

from torch.distributed import run
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher import api

from disttrain.process import exit_now


class BoundedExitBarrierAgent(LocalElasticAgent):
    def __init__(self, *args, **kwargs):
        kwargs["exit_barrier_timeout"] = float(os.environ.get("DISTTRAIN_EXIT_BARRIER_S", "30"))
        super().__init__(*args, **kwargs)


def run_agent(argv: list[str] | None = None) -> int:
    """torchrun's own `main` on `argv` in this process; its exit status (`disttrain train` calls this)."""
    api.LocalElasticAgent = BoundedExitBarrierAgent  # what torchrun's launch_agent constructs
    try:
        run.main(argv)
    except SystemExit as exc:  # torchrun's argument errors
        return exc.code if isinstance(exc.code, int) else 2
    except Exception:  # a failed worker group or a handled signal: torchrun's report, as when it dies of it
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    exit_now(run_agent())


if __name__ == "__main__":
    main()
