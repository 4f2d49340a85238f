"""Hand-written FSDP2 loop on the HF workload: `fully_shard` per decoder layer, then the root (what Fabric's
ModelParallelStrategy runs with that parallelize function); the sharded-mode baseline."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hf_common import RandomWindows, loss_fn, make_model, make_optimizer, parse_args


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def train(steps: int) -> None:
    """In an existing process group (benchmarks/step_counts.py --hf)."""
    model = shard(make_model())
    opt = make_optimizer(model)
    data = RandomWindows(dist.get_rank())
    for _ in range(steps):
        x, y = data.micro_batch()
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def main():
    steps = parse_args().steps
    dist.init_process_group("gloo")
    train(steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
