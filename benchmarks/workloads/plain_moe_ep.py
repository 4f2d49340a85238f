"""A hand-written expert-parallel loop on torch.distributed alone: the baseline for disttrain's `parallel.ep=2`
with `parallel.zero_stage=3` on 2 processes.

The model is disttrain's single-device `debug-moe` (so only the training framework differs). By hand: each
rank keeps its half of every layer's experts as plain parameters; token rows go to their expert's rank and
back through the same all-to-all exchange disttrain uses (`AllToAllDispatch`: counts, one host sync, two
uneven `all_to_all_single_autograd`), experts run as grouped GEMMs; every other parameter is sharded by
`fully_shard` per block and at the root (the experts left out: `ignored_params`), gradients reduced once per
step (no sync on the first micro-batch); expert gradients divided by the data-parallel size; AdamW with
global-norm clipping at 1.0 over both kinds. No balancing loss or bias, no routing statistics reduced.
Global batch 16 x 128, micro-batches of 4 (2 per rank), fp32. `--size tiny` runs a `tiny`-sized MoE instead
(dim 256, 4 layers, 16 experts of width 256, top-2: SIZES, the same overrides disttrain's side gives).

Its batches are the very ones disttrain's run reads (`SameBatches`: disttrain's data loader over the built-in
corpus with train.seed 0): routing depends on the tokens, and the rank holding the busier experts sets both
ranks' pace. With the shared benchmark's random windows instead (workloads/common.py), rank 0 received 134,917
rows in 12 steps here against 142,967 in disttrain's run: 6% more expert work on the slower rank.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import LR, SEQ_LEN, loss_fn, parse_args
from disttrain.models.moe import MoEFeedForward, moe_spec
from disttrain.models.registry import MODEL_SHAPES
from disttrain.models.spec import build_model
from disttrain.parallel.expert import AllToAllDispatch

GLOBAL_BATCH = 16
# Model sizes, as disttrain config overrides of `debug-moe` (moe_vs_handwritten.py passes the same to disttrain).
SIZES = {"debug": {},
         "tiny": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden_dim": 768,
                  "moe.num_experts": 16, "moe.moe_intermediate_size": 256}}


class SameBatches:
    """This rank's micro-batches of each step as disttrain's run of configs/bench.yaml reads them (its loader,
    sampler and seed), so that both loops route the same tokens."""

    def __init__(self, rank: int, world: int, micro_batch: int):
        from disttrain.data.loader import DistributedBatchLoader
        from disttrain.data.source import load_samples, make_sampler

        _, samples, _ = load_samples("builtin", "byte", SEQ_LEN)
        self.loader = DistributedBatchLoader(samples, make_sampler(samples, "builtin", GLOBAL_BATCH, seed=0), rank,
                                             world, micro_batch)

    def step(self) -> list:
        return next(self.loader)


def shape_of(size: str):
    """debug-moe with SIZES[size] applied: the model both loops train."""
    base = MODEL_SHAPES["debug-moe"]
    top = {k: v for k, v in SIZES[size].items() if not k.startswith("moe.")}
    moe = {k[4:]: v for k, v in SIZES[size].items() if k.startswith("moe.")}
    return dataclasses.replace(base, **top, moe=dataclasses.replace(base.moe, **moe))


def train(steps: int, micro_batch: int = 4, size: str = "debug") -> None:
    """`steps` optimizer steps in the running process group (benchmarks/step_counts.py calls it under its
    profiler)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build_model(moe_spec(shape_of(size)), torch.device("cpu"), seed=0)
    experts = []
    for layer in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
        for name, p in list(layer.experts.named_parameters(recurse=False)):
            per_rank = p.shape[0] // world
            mine = torch.nn.Parameter(p.detach()[rank * per_rank:(rank + 1) * per_rank].clone())
            layer.experts.register_parameter(name, mine)
            experts.append(mine)
        layer.expert_dispatch = AllToAllDispatch(dist.group.WORLD, world)
    ignored = set(experts)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    dense = [p for p in model.parameters() if p not in ignored]
    opts = [torch.optim.AdamW(group, lr=LR, betas=(0.9, 0.95), weight_decay=0.1) for group in (dense, experts)]
    data = SameBatches(rank, world, micro_batch)
    micro = GLOBAL_BATCH // world // micro_batch
    for _ in range(steps):
        for i, (x, y) in enumerate(data.step()):
            model.set_requires_gradient_sync(i == micro - 1)
            (loss_fn(model(x), y) / micro).backward()
        expert_grads = [p.grad for p in experts]
        torch._foreach_div_(expert_grads, world)  # FSDP averages the others over data parallel
        dense_sq = torch.nn.utils.get_total_norm([p.grad for p in dense]).full_tensor() ** 2
        expert_sq = torch.stack([g.norm() for g in expert_grads]).square().sum()
        dist.all_reduce(expert_sq)
        coef = min(1.0, 1.0 / (float((dense_sq + expert_sq).sqrt()) + 1e-6))
        for grads in ([p.grad for p in dense], expert_grads):
            torch._foreach_mul_(grads, coef)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


def main():
    args = parse_args(lambda parser: parser.add_argument("--size", choices=sorted(SIZES), default="debug"))
    dist.init_process_group("gloo")
    train(args.steps, args.micro_batch, args.size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
