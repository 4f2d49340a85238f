"""Run under torchrun: per-rank model-state bytes for ZeRO stages 0-3 on the `tiny` model.

Prints one JSON line per rank and stage: bytes at rest (after the optimizer step, gradients kept
by measuring before zero_grad), and parameter bytes visible between forward and backward.
"""

import contextlib
import gc
import json
import sys

import torch
import torch.distributed as dist

from disttrain.config import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import init_distributed
from disttrain.observe.memory import model_state_bytes
from disttrain.train.trainer import Trainer


def measure(stage: int, run_dir: str) -> dict:
    cfg = load_config("configs/debug.yaml", ["model.name=tiny", "train.global_batch_size=4", "data.seq_len=32",
                                             f"parallel.zero_stage={stage}", f"run.dir={run_dir}",
                                             f"run.name=stage{stage}"])
    trainer = Trainer(cfg, RT)
    x, y = next(trainer.loader)[0]
    logits = trainer.model(x)
    after_forward = model_state_bytes(trainer.model)["params"]
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    trainer.optimizer.step()
    rest = model_state_bytes(trainer.model, trainer.optimizer)  # gradients still held: no zero_grad yet
    out = {"stage": stage, "rank": dist.get_rank(), "world": dist.get_world_size(),
           "params_after_forward": after_forward, **rest}
    del trainer, logits
    gc.collect()
    return out


if __name__ == "__main__":
    RT = init_distributed(detect_env(), "gloo", 60)
    for stage in range(4):
        print("MEM " + json.dumps(measure(stage, sys.argv[1])), flush=True)
    gc.collect()
    dist.destroy_process_group()
