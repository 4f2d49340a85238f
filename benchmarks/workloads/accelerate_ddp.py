"""The same workload through Hugging Face Accelerate (DDP over gloo under torchrun)."""

from accelerate import Accelerator

from common import GLOBAL_BATCH, MICRO_BATCH, RandomWindows, loss_fn, make_model, make_optimizer, parse_steps


def main():
    steps = parse_steps()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=GLOBAL_BATCH // 2 // MICRO_BATCH)
    model = make_model()
    opt = make_optimizer(model)
    model, opt = acc.prepare(model, opt)
    data = RandomWindows(acc.process_index)
    for _ in range(steps * acc.gradient_accumulation_steps):
        with acc.accumulate(model):
            x, y = data.micro_batch()
            acc.backward(loss_fn(model(x), y))
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    acc.end_training()


if __name__ == "__main__":
    main()
