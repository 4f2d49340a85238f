"""The Python entry point of docs/guide.md ("Ray Train"), as a user writes it: RayJob's parts in a TorchTrainer of
one's own. `python -m workers.ray_entry ADDRESS CONFIG [key=value ...]` (from tests/); prints where Ray's result
says the newest checkpoint is."""

from __future__ import annotations

import sys

import ray
from ray.train.torch import TorchTrainer

from disttrain.launch.ray_train import RayJob


def main() -> None:
    address, config, *overrides = sys.argv[1:]
    ray.init(address=address, logging_level="WARNING")
    try:
        job = RayJob(config, overrides, workers=(2, 2))
        trainer = TorchTrainer(job.train_loop, train_loop_config=job.loop_config, torch_config=job.torch_config,
                               scaling_config=job.scaling_config(), run_config=job.run_config())
        result = job.fit(trainer)
        assert result.error is None, result.error
        print(f"result checkpoint: {result.checkpoint.path}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
