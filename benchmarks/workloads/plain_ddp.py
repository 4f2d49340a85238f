"""A plain hand-written PyTorch DDP loop (the baseline disttrain's overhead is measured against)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import GLOBAL_BATCH, RandomWindows, ddp_accumulate, make_model, make_optimizer, parse_args


def main():
    args = parse_args()
    steps = args.steps
    dist.init_process_group("gloo")
    accum = GLOBAL_BATCH // dist.get_world_size() // args.micro_batch
    model = DDP(make_model())
    opt = make_optimizer(model)
    data = RandomWindows(dist.get_rank(), micro_batch=args.micro_batch)
    for _ in range(steps):
        ddp_accumulate(model, data, accum)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
