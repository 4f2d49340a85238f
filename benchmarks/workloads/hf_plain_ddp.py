"""Hand-written DDP loop on the HF workload: the baseline."""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_common import make_model, parse_args, train_loop


def main():
    steps = parse_args().steps
    dist.init_process_group("gloo")
    train_loop(DDP(make_model()), steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
