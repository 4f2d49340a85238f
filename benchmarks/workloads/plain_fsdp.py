"""A plain hand-written FSDP2 loop (`fully_shard` per block and on the root): the baseline for
disttrain's ZeRO-3 (`--reshard-after-forward`, the default) and ZeRO-2 (`--no-reshard-after-forward`)."""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from common import GLOBAL_BATCH, RandomWindows, loss_fn, make_model, make_optimizer, parse_args


def shard(model, reshard_after_forward: bool):
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def train(model, opt, data, steps: int, accum: int) -> None:
    for _ in range(steps):
        for i in range(accum):
            x, y = data.micro_batch()
            model.set_requires_gradient_sync(i == accum - 1)  # accumulate unsharded, reduce-scatter once
            (loss_fn(model(x), y) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def main():
    args = parse_args(lambda p: p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                                               default=True))
    dist.init_process_group("gloo")
    model = shard(make_model(), args.reshard_after_forward)
    opt = make_optimizer(model)
    data = RandomWindows(dist.get_rank(), micro_batch=args.micro_batch)
    train(model, opt, data, args.steps, GLOBAL_BATCH // dist.get_world_size() // args.micro_batch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
