"""Hand-written DDP loop on the HF workload: the baseline."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_common import RandomWindows, loss_fn, make_model, make_optimizer, parse_args


def main():
    steps = parse_args().steps
    dist.init_process_group("gloo")
    model = DDP(make_model())
    opt = make_optimizer(model)
    data = RandomWindows(dist.get_rank())
    for _ in range(steps):
        x, y = data.micro_batch()
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
