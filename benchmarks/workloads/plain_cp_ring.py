"""A hand-written context-parallel loop on torch.distributed alone: the baseline for disttrain's `parallel.cp=2`.

Two ranks share each sequence (head-tail chunks), the model's attention kernel replaced by the same ring
(`disttrain.parallel.ring_attention`), gradients all-reduced and averaged by hand, AdamW with global-norm
clipping at 1.0; what disttrain adds around it (sharded data, the loss's global divisor, metrics) is what
the comparison measures. `--seq-len`, global batch 1 sequence, the `tiny` model in fp32.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from common import RandomWindows, make_optimizer, parse_args
from disttrain.models.llama import llama_spec
from disttrain.models.registry import MODEL_SHAPES
from disttrain.models.spec import build_model
from disttrain.parallel.context import ContextParallel
from dataclasses import replace


def main():
    args = parse_args(lambda p: p.add_argument("--seq-len", type=int, default=4096))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    shape = replace(MODEL_SHAPES["tiny"], max_seq_len=args.seq_len)
    model = build_model(llama_spec(shape), torch.device("cpu"), seed=0)
    cp = ContextParallel(mesh, "ring", args.seq_len)
    for block in model.layers.values():
        block.attention.attend = cp.attention
    model.attention_mask = lambda documents: documents
    opt = make_optimizer(model)
    data = RandomWindows(0, seq_len=args.seq_len, micro_batch=1)  # every rank reads the same sequence
    params = list(model.parameters())
    for _ in range(args.steps):
        x, y = data.micro_batch()
        x, positions, _ = cp.inputs(x)
        logits = model(x, positions=positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), cp.shard(y).flatten(), reduction="sum")
        (loss / y.numel()).backward()
        for p in params:  # the sum over ranks of each rank's share of the mean
            dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
