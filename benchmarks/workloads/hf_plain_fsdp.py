"""Hand-written FSDP2 loop on the HF workload: `fully_shard` per decoder layer, then the root (what Fabric's
ModelParallelStrategy runs with that parallelize function); the sharded-mode baseline."""

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hf_common import make_model, parse_args, train_loop


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def train(steps: int) -> None:
    """In an existing process group (benchmarks/step_counts.py --hf)."""
    train_loop(shard(make_model()), steps)


def main():
    steps = parse_args().steps
    dist.init_process_group("gloo")
    train(steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
