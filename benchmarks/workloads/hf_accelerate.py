"""HF Accelerate on the HF workload (DDP; its FSDP plugin is ignored on CPU, so DDP only)."""

from accelerate import Accelerator

from hf_common import RandomWindows, loss_fn, make_model, make_optimizer, parse_args


def main():
    steps = parse_args().steps
    acc = Accelerator(cpu=True)
    model = make_model()
    opt = make_optimizer(model)
    model, opt = acc.prepare(model, opt)
    data = RandomWindows(acc.process_index)
    for _ in range(steps):
        x, y = data.micro_batch()
        acc.backward(loss_fn(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    acc.end_training()


if __name__ == "__main__":
    main()
