"""The independent reference of the optimizer tests: the same model, starting weights and batches as a
one-process `disttrain train` of CONFIG + OVERRIDES, trained by a plain PyTorch loop written here
(torch.optim.AdamW, torch.optim.Muon, LambdaLR, clip_grad_norm_; bf16 states as fp32 ones rounded after
each step; 8-bit states by torchao's AdamW8bit), sharing nothing with disttrain's optimizer,
schedule or clipping code. Run as a job of tests/workers/train_many.py in a launch of one process:

    {"call": "optim_reference:train", "args": [CONFIG, OVERRIDES, OUT, FLOAT8]}

FLOAT8 (optional, false by default): the model's block Linear layers made float8 here, by torchao's own
`convert_to_float8_training` in its emulation mode (matmuls of the dequantized float8 values, no float8 kernel), by
the documented rule written out here (OVERRIDES then leave `precision.float8` off).
OUT (torch.save): {"loss", "lr", "grad_norm": one per step, "params": the final parameters}.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

from disttrain.config.load import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import Runtime
from disttrain.train.builder import build_run

BLOCK_MATRIX = re.compile(r"^layers\.\d+\.(attention|feed_forward)\.w\d?\w?\.weight$")  # the debug model's names


def factor(step: int, o, total: int) -> float:
    """The documented schedule (docs/config.md, optim.*): linear warmup to the peak, then the shape to
    min_lr / lr at the last step; written out here, not imported."""
    low = o.min_lr / o.lr
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    start = o.warmup_steps
    if o.schedule == "wsd":
        start = max(start, total - (o.decay_steps or round(o.decay_fraction * total)))
        if step < start:
            return 1.0
    p = min(1.0, (step - start) / (total - start))
    shape = o.decay_shape if o.schedule == "wsd" else o.schedule
    left = {"cosine": 0.5 * (1 + math.cos(math.pi * p)), "linear": 1 - p, "sqrt": 1 - math.sqrt(p)}[shape]
    return low + (1 - low) * left


def float8_by_hand(model: torch.nn.Module) -> None:
    """docs/guide.md's rule: Linear layers in layers.N with both dimensions multiples of 16, not a router's."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def chosen(module, name: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and re.match(r"^layers\.\d+\.", name) is not None
                and ".router." not in name and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=chosen)


def train(config: str, overrides: list[str], out: str, float8: bool = False) -> None:
    cfg = load_config(config, overrides)
    run = build_run(cfg, Runtime(detect_env(), torch.device("cpu"), "gloo"))
    model, o, total = run.model.module, cfg.optim, cfg.train.steps
    if float8:
        float8_by_hand(model)
    params = dict(model.named_parameters())
    muon_names = [n for n in params if o.name == "muon" and BLOCK_MATRIX.match(n)]
    rest = [n for n in params if n not in muon_names]
    adamw = torch.optim.AdamW
    if o.state_dtype == "int8":  # torchao's own, its step run uncompiled (below)
        from torchao.optim import AdamW8bit as adamw
    optimizers = [adamw([{"params": [params[n] for n in rest if params[n].ndim >= 2], "weight_decay": o.weight_decay},
                         {"params": [params[n] for n in rest if params[n].ndim < 2], "weight_decay": 0.0}],
                        lr=o.lr, betas=tuple(o.betas), eps=o.eps)]
    if muon_names:
        m = o.muon
        optimizers.append(torch.optim.Muon([params[n] for n in muon_names], lr=m.lr or o.lr,
                                           weight_decay=o.weight_decay if m.weight_decay is None else m.weight_decay,
                                           momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
                                           adjust_lr_fn=m.adjust_lr))
    schedules = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor(s, o, total)) for opt in optimizers]
    record = {"loss": [], "lr": [], "grad_norm": [], "muon": muon_names}
    for _ in range(total):
        batches = next(run.data.loader)
        valid = sum(int((y != -100).sum()) for _, y in batches)
        loss = 0.0
        for x, y in batches:
            part = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") / valid
            part.backward()
            loss += float(part)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip else math.inf)
        record["lr"].append(float(optimizers[0].param_groups[0]["lr"]))
        for opt, schedule in zip(optimizers, schedules):
            with torch.compiler.set_stance("force_eager"):
                opt.step()
            if o.state_dtype == "bf16":  # what a bf16 state keeps: the moments rounded after each step
                for entry in opt.state.values():
                    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                        if key in entry:
                            entry[key].copy_(entry[key].to(torch.bfloat16))
            opt.zero_grad(set_to_none=True)
            schedule.step()
        record["loss"].append(loss)
        record["grad_norm"].append(float(norm))
    record["params"] = {n: p.detach().clone() for n, p in params.items()}
    torch.save(record, out)
