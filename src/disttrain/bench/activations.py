"""Measure the activation bytes a forward pass leaves for backward, on any device.

CPU has no `torch.cuda.max_memory_allocated`, so this counts what autograd actually holds after
forward + loss: every tensor packed by a saved-tensor hook (unique storages, parameters and buffers
excluded) plus, with selective checkpointing, the outputs its caching mode stored. Recomputed
tensors that live only during backward are not counted (the planner reports them separately).

    python -m disttrain.bench.activations --model tiny --micro-batch 2 --seq-len 128 --recompute none
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
import torch.nn.functional as F

from disttrain.models.llama.model import Transformer
from disttrain.models.output_head import chunk_output_head, targets_for
from disttrain.models.registry import MODEL_SHAPES, ModelShape
from disttrain.observe.model_bytes import iter_tensors
from disttrain.parallel import activation_checkpoint as ac


def saved_activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, recompute: str = "none",
                           dtype: torch.dtype = torch.float32, seed: int = 0, loss_chunk_tokens: int = 0) -> int:
    """`loss_chunk_tokens` > 0: the output head computes the loss in chunks (models/output_head.py), as training
    does by default."""
    torch.manual_seed(seed)
    model = Transformer(shape).to(dtype)
    if loss_chunk_tokens:
        chunk_output_head(model.output, loss_chunk_tokens)
    caches = []
    if recompute == "selective":
        def capture():
            forward_ctx, recompute_ctx = ac.selective_context()
            caches.append(forward_ctx.storage)
            return forward_ctx, recompute_ctx

        for key, block in list(model.layers.items()):
            model.layers[key] = ac.checkpoint_wrapper(block, preserve_rng_state=False, context_fn=capture)
    else:
        ac.apply_activation_checkpointing(model.layers, recompute)
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    held: dict[int, int] = {}

    def count(t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key not in excluded:
            held.setdefault(key, t.untyped_storage().nbytes())

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    tokens = torch.randint(0, shape.vocab_size, (micro_batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if loss_chunk_tokens:
            with targets_for([model.output], tokens):
                loss = logits = model(tokens)
        else:
            logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(), reduction="sum")
    del logits
    for storage in caches:
        for t in iter_tensors(storage):
            count(t)
    loss.backward()  # proves the counted graph is the one training uses
    return sum(held.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=list(MODEL_SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    args = parser.parse_args()
    shape = MODEL_SHAPES[args.model]
    if args.layers:
        shape = replace(shape, n_layers=args.layers)
    print(json.dumps({"model": args.model, "recompute": args.recompute,
                      "bytes": saved_activation_bytes(shape, args.micro_batch, args.seq_len, args.recompute)}))


if __name__ == "__main__":
    main()


def peak_activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, recompute: str = "none",
                          dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, int]:
    """Activations and temporaries at the step's memory peak, from torch's `MemTracker` (tensor
    accounting through a dispatch mode: works on CPU, where there is no allocator peak to read).
    The second of two steps is tracked, so the optimizer states exist as they do in training."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(seed)
    model = Transformer(shape).to(dtype)
    ac.apply_activation_checkpointing(model.layers, recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, shape.vocab_size, (micro_batch, seq_len))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for step in range(2):
            loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten(), reduction="sum")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 0:
                tracker.reset_mod_stats()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_kind = {str(getattr(k, "value", k)): int(v) for k, v in peak.items()}
    return {"activations": by_kind.get("Activation", 0), "temporary": by_kind.get("Temp", 0),
            "total": by_kind.get("Total", 0)}
