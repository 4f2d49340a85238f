"""Each context-parallel attention method against single-device SDPA (fp64): output and q/k/v gradients of
this rank's shard, grouped-query heads, with and without document masking (and a window within the documents); every method also with attention
sinks (gpt-oss: against the eager softmax with the sink logit concatenated, the sinks' gradient too), a sliding
window, and values of another head dim than the keys (DeepSeek's latent attention). `check(out)` runs in a launch's
process group (a `train_many` job, tests/workers/train_many.py) and writes each case's result, "ok" or the
mismatch, to `out`.rank<r>.json; run alone it prints them:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/cp_kernels.py
"""


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from disttrain.models.documents import block_causal_mask
from disttrain.parallel.context import ContextParallel

import rank_results


def results() -> dict[str, str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(0)
    b, h, hk, s, d = 2, 4, 2, 16, 8
    q, go = (torch.randn(b, h, s, d, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, dtype=torch.float64, generator=g) for _ in range(2))
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 3 + [1] * 13])
    out_of = {}
    positions = torch.arange(s)
    for docs, window in ((None, None), (documents, None), (documents, 6)):
        mask = None if docs is None else block_causal_mask(docs)
        if window is not None:  # the window within each document
            mask = mask & (positions[None, :] > positions[:, None] - window)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=mask is None, enable_gqa=True).backward(go)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        for method in ("ring", "allgather", "ulysses"):
            cp = ContextParallel(mesh, method, s)
            idx = cp.index(s, "cpu")
            local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
            out = cp.attention(*local, docs, window=window)
            out.backward(go[:, :, idx])
            case = f"{method} documents={docs is not None}" + (" window" if window else "")
            try:
                torch.testing.assert_close(out, ref[:, :, idx], rtol=1e-12, atol=1e-12)
                for name, mine, whole in zip("qkv", local, full):
                    torch.testing.assert_close(mine.grad, whole.grad[:, :, idx], rtol=1e-12, atol=1e-12,
                                               msg=lambda m, name=name: f"d{name}: {m}")
                out_of[case] = "ok"
            except AssertionError as exc:
                out_of[case] = str(exc).splitlines()[0]
    out_of.update(_sink_results(mesh, g))
    return out_of


def _sink_reference(q, k, v, sinks, mask, scale):
    """gpt-oss's eager attention: softmax over the logits with each head's sink concatenated, the sink dropped."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = (q @ k.transpose(2, 3) * scale).masked_fill(~mask, torch.finfo(q.dtype).min)
    logits = torch.cat([logits, sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)], dim=-1)
    probs = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return probs @ v


def _sink_results(mesh, g) -> dict[str, str]:
    b, h, hk, s, d, dv, window = 2, 4, 2, 16, 8, 6, 5
    q = torch.randn(b, h, s, d, dtype=torch.float64, generator=g)
    k = torch.randn(b, hk, s, d, dtype=torch.float64, generator=g)
    v, go = torch.randn(b, hk, s, dv, dtype=torch.float64, generator=g), torch.randn(b, h, s, dv, dtype=torch.float64,
                                                                                      generator=g)
    sinks = torch.randn(h, dtype=torch.float64, generator=g)
    positions = torch.arange(s)
    mask = (positions[None] <= positions[:, None]) & (positions[None] > positions[:, None] - window)
    full = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    ref = _sink_reference(*full, mask, 0.3)
    ref.backward(go)
    out_of = {}
    for method in ("ring", "allgather", "ulysses"):
        cp = ContextParallel(mesh, method, s)
        idx = cp.index(s, "cpu")
        local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)] + [sinks.clone().requires_grad_()]
        out = cp.attention(*local[:3], None, scale=0.3, window=window, sinks=local[3])
        out.backward(go[:, :, idx])
        if method == "ring":  # chunks of 4: a neighbour's block loses its far chunk (forward and backward)
            out_of["ring work"] = "ok" if cp.ring_work == [0, 2 * (64 + 16)] else f"ring work {cp.ring_work}"
            plain = ContextParallel(mesh, method, s)
            plain.attention(*(x.detach() for x in local[:3]), None, scale=0.3)
            out_of["ring work"] += "" if plain.ring_work == [0, 64 + 32] else f"; without window {plain.ring_work}"
        sink_grad = local[3].grad.clone()
        dist.all_reduce(sink_grad)  # each rank's part: its queries (all-gather) or its heads (Ulysses)
        case = f"{method} sinks window dv"
        try:
            torch.testing.assert_close(out, ref[:, :, idx], rtol=1e-12, atol=1e-12)
            for name, mine, whole in zip("qkv", local, full):
                torch.testing.assert_close(mine.grad, whole.grad[:, :, idx], rtol=1e-12, atol=1e-12,
                                           msg=lambda m, name=name: f"d{name}: {m}")
            torch.testing.assert_close(sink_grad, full[3].grad, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"dsinks: {m}")
            out_of[case] = "ok"
        except AssertionError as exc:
            out_of[case] = str(exc).splitlines()[0]
    out_of["ring dv"] = _ring_dv(mesh, q, k, v, go)
    return out_of


def _ring_dv(mesh, q, k, v, go) -> str:
    """The ring with values of another head dim (padded to the keys' inside) against causal SDPA."""
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=0.3, enable_gqa=True)
    ref.backward(go)
    cp = ContextParallel(mesh, "ring", q.shape[2])
    idx = cp.index(q.shape[2], "cpu")
    local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    out = cp.attention(*local, None, scale=0.3)
    out.backward(go[:, :, idx])
    try:
        torch.testing.assert_close(out, ref[:, :, idx], rtol=1e-12, atol=1e-12)
        for name, mine, whole in zip("qkv", local, full):
            torch.testing.assert_close(mine.grad, whole.grad[:, :, idx], rtol=1e-12, atol=1e-12,
                                       msg=lambda m, name=name: f"d{name}: {m}")
        return "ok"
    except AssertionError as exc:
        return str(exc).splitlines()[0]


def check(out: str) -> None:
    rank_results.write(out, results())


if __name__ == "__main__":
    rank_results.run_as_script(results)
