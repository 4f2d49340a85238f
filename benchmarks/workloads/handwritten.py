"""Hand-written training loops for each layout, in an existing process group (benchmarks/step_counts.py):
what a user writes with torch.distributed alone, on the same model, batch and optimizer as the workload."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel as DDP

from common import GLOBAL_BATCH, RandomWindows, loss_fn, make_model, make_optimizer
from plain_fsdp import shard


def _step(opt, params) -> None:
    """Clip to a global norm of 1, step, clear. With tensor parallel some gradients are DTensors and some
    (norm weights) plain tensors, which one foreach call refuses: norm each kind apart, as torchtitan does."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    groups = [[p for p in params if isinstance(p.grad, DTensor) == kind] for kind in (True, False)]
    groups = [g for g in groups if g]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in g], foreach=True) for g in groups]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    for g in groups:
        torch.nn.utils.clip_grads_with_norm_(g, 1.0, total, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train(layout: str, steps: int, micro_batch: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout == "tp2":
        return _tensor_parallel(steps, micro_batch)
    if layout.startswith("pp2"):
        return _pipeline(steps, micro_batch)
    model = make_model()
    model = DDP(model) if layout == "ddp" else shard(model, reshard_after_forward=layout == "zero3")
    opt = make_optimizer(model)
    data = RandomWindows(rank, micro_batch=micro_batch)
    accum = GLOBAL_BATCH // world // micro_batch
    for _ in range(steps):
        for i in range(accum):
            x, y = data.micro_batch()
            last = i == accum - 1
            if layout == "ddp":
                if last:
                    (loss_fn(model(x), y) / accum).backward()
                else:
                    with model.no_sync():
                        (loss_fn(model(x), y) / accum).backward()
            else:
                model.set_requires_gradient_sync(last)
                (loss_fn(model(x), y) / accum).backward()
        _step(opt, model.parameters())


def _tensor_parallel(steps: int, micro_batch: int) -> None:
    """Both ranks hold the whole batch; the model's own plan (disttrain's Llama TP plan, as torchtitan's
    models ship theirs) splits heads and FFN width; vocabulary-sharded logits go to loss_parallel."""
    from disttrain.models.llama.parallel_plan import tensor_parallel

    model = make_model()
    tensor_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)), False)
    opt = make_optimizer(model)
    data = RandomWindows(0, micro_batch=micro_batch)
    accum = GLOBAL_BATCH // micro_batch
    for _ in range(steps):
        for _ in range(accum):
            x, y = data.micro_batch()
            with loss_parallel():
                (loss_fn(model(x), y) / accum).backward()
        _step(opt, model.parameters())


def _pipeline(steps: int, micro_batch: int) -> None:
    """Two stages (the model's own split: embedding first, norm and output last), 1F1B over the global batch
    in micro-batches; the gradient norm adds both stages' squares."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from disttrain.models.llama.parallel_plan import pipeline_split

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    n = len(model.layers)
    ranges = [range(0, n // 2), range(n // 2, n)]
    stage_module = pipeline_split(model, ranges, [rank])[0]
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    microbatches = GLOBAL_BATCH // micro_batch
    schedule = Schedule1F1B(stage, microbatches, loss_fn=lambda out, y: loss_fn(out, y) / microbatches)
    opt = make_optimizer(stage_module)
    data = RandomWindows(0, micro_batch=GLOBAL_BATCH)
    params = list(stage_module.parameters())
    for _ in range(steps):
        x, y = data.micro_batch()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        local = torch.stack([p.grad.norm() for p in params if p.grad is not None]).square().sum()
        dist.all_reduce(local)
        scale = torch.clamp(1.0 / (local.sqrt() + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
