"""DeepSpeed as a second engine: the same RunConfig, trained through `deepspeed.initialize`.

DeepSpeed is an optional extra. `deepspeed_config` is pure Python (used by
`disttrain config export-deepspeed` without DeepSpeed installed); the rest imports it lazily.

What maps onto what:
  parallel.zero_stage           -> zero_optimization.stage (0-3, DeepSpeed's own partitioning)
  parallel.cpu_offload          -> offload_optimizer (stages 1-3) and offload_param (stage 3) to CPU
  precision.compute_dtype       -> bf16.enabled / fp16.enabled (dynamic loss scaling) - DeepSpeed keeps
                                   bf16/fp16 parameters with fp32 master weights in the optimizer
  optim.grad_clip               -> gradient_clipping
  train.micro_batch_size etc.   -> train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size
  optim.* / schedule            -> disttrain's own AdamW (decay on matrices only) and LambdaLR, passed
                                   to deepspeed.initialize, so both engines follow the same update rule
Checkpoints use DeepSpeed's own format inside disttrain's committed step directories; they resume
only under engine=deepspeed with the same ZeRO stage (DeepSpeed's loader unpickles, unlike DCP).
"""

from __future__ import annotations

INSTALL_HINT = ("engine=deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install -c constraints.txt "
                "--no-build-isolation 'disttrain[deepspeed]'")


def deepspeed_config(cfg, world_size: int, cuda: bool = False) -> dict:
    t, p = cfg.train, cfg.parallel
    dp = world_size  # DeepSpeed data parallel spans the world (tp = pp = 1 in this version)
    micro = t.micro_batch_size or t.global_batch_size // dp
    zero: dict = {"stage": p.zero_stage}
    if p.zero_stage >= 1:
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_scatter=True)
    if p.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        if p.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    out = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": t.global_batch_size // (dp * micro),
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision.compute_dtype == "bf16"},
        "fp16": {"enabled": cfg.precision.compute_dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return out


def import_deepspeed():
    from disttrain.config import ConfigError

    try:
        import deepspeed
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return deepspeed


def initialize(model, optimizer, scheduler, cfg, world_size: int, cuda: bool):
    deepspeed = import_deepspeed()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, world_size, cuda), dist_init_required=False)
    return engine


def is_engine(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


def train_step(engine, micro_batches, loss_fn, device):
    """DeepSpeed owns accumulation (it divides each micro-batch loss by the step count),
    gradient averaging, clipping, loss scaling, the optimizer and the LR schedule step."""
    loss_sum = None
    local_tokens = sum(y.numel() for _, y in micro_batches)
    for x, y in micro_batches:
        x, y = x.to(device), y.to(device)
        loss = loss_fn(engine(x), y)
        engine.backward(loss * len(micro_batches) / local_tokens)  # mean over the rank's tokens after DS's 1/gas
        engine.step()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    norm = engine.get_global_grad_norm()
    return loss_sum, norm if norm is not None else float("nan")


TAG = "deepspeed"


def save(engine, path) -> None:
    engine.save_checkpoint(str(path), tag=TAG, save_latest=False)


def load(engine, path) -> None:
    engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
