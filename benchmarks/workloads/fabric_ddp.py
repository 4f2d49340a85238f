"""The same workload through Lightning Fabric (strategy="ddp" on CPU under torchrun)."""

import lightning as L

from common import GLOBAL_BATCH, MICRO_BATCH, RandomWindows, loss_fn, make_model, make_optimizer, parse_steps


def main():
    steps = parse_steps()
    fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    accum = GLOBAL_BATCH // fabric.world_size // MICRO_BATCH
    model = make_model()
    opt = make_optimizer(model)
    model, opt = fabric.setup(model, opt)
    data = RandomWindows(fabric.global_rank)
    for _ in range(steps):
        for i in range(accum):
            x, y = data.micro_batch()
            with fabric.no_backward_sync(model, enabled=i < accum - 1):
                fabric.backward(loss_fn(model(x), y) / accum)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
