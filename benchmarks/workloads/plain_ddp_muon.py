"""The naive distributed Muon (the baseline of benchmarks/muon.py): plain DDP with torch.optim.Muon over the
block matrices and torch.optim.AdamW over the rest, so that every rank orthogonalises every whole matrix."""

import re

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import GLOBAL_BATCH, LR, MODEL_SHAPES, RandomWindows, build_model, ddp_accumulate, llama_spec, \
    parse_args

BLOCK_MATRIX = re.compile(r"^module\.layers\.\d+\..*\.weight$")


def main():
    args = parse_args(lambda p: (p.add_argument("--shape", default="tiny"), p.add_argument("--seq-len", type=int)))
    dist.init_process_group("gloo")
    accum = GLOBAL_BATCH // dist.get_world_size() // args.micro_batch
    model = DDP(build_model(llama_spec(MODEL_SHAPES[args.shape]), torch.device("cpu"), seed=0))
    named = dict(model.named_parameters())
    muon = [p for n, p in named.items() if BLOCK_MATRIX.match(n) and p.ndim == 2]
    rest = [p for p in named.values() if not any(p is q for q in muon)]
    optimizers = [torch.optim.Muon(muon, lr=LR, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                  torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.1},
                                     {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                                    lr=LR, betas=(0.9, 0.95))]
    data = RandomWindows(dist.get_rank(), seq_len=args.seq_len, micro_batch=args.micro_batch)
    for _ in range(args.steps):
        ddp_accumulate(model, data, accum)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
