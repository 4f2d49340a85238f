"""Lightning Fabric on the HF workload: --strategy ddp, or fsdp (FSDP2 through ModelParallelStrategy;
Fabric's own strategy="fsdp" refuses CPU)."""

import lightning as L
from torch.distributed.fsdp import fully_shard

from hf_common import RandomWindows, loss_fn, make_model, make_optimizer, parse_args


def shard(model, device_mesh):
    mesh = device_mesh["data_parallel"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main():
    args = parse_args()
    if args.strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    fabric = L.Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    model = make_model()
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(make_optimizer(model))
    data = RandomWindows(fabric.global_rank)
    for _ in range(args.steps):
        x, y = data.micro_batch()
        fabric.backward(loss_fn(model(x), y))
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
