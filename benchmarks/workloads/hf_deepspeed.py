"""DeepSpeed ZeRO-3 on the HF workload (its own engine and partitioning, gloo on CPU)."""

import deepspeed
import torch.distributed as dist

from hf_common import MICRO_BATCH, RandomWindows, loss_fn, make_model, make_optimizer, parse_args


def main():
    steps = parse_args().steps
    dist.init_process_group("gloo")
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1 << 30}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config,
                                           dist_init_required=False)
    data = RandomWindows(dist.get_rank())
    for _ in range(steps):
        x, y = data.micro_batch()
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()  # a worker that exits with the group alive can abort in teardown



if __name__ == "__main__":
    main()
