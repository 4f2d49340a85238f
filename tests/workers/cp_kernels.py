"""Each context-parallel attention method against single-device SDPA (fp64): output and q/k/v gradients of
this rank's shard, grouped-query heads, with and without document masking. Prints one "ok" per case.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/cp_kernels.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from disttrain.models.documents import block_causal_mask
from disttrain.parallel.context import ContextParallel


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(0)
    b, h, hk, s, d = 2, 4, 2, 16, 8
    q, go = (torch.randn(b, h, s, d, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, dtype=torch.float64, generator=g) for _ in range(2))
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 3 + [1] * 13])
    for docs in (None, documents):
        mask = None if docs is None else block_causal_mask(docs)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=mask is None, enable_gqa=True).backward(go)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        for method in ("ring", "allgather", "ulysses"):
            cp = ContextParallel(mesh, method, s)
            idx = cp.index(s, "cpu")
            local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
            out = cp.attention(*local, docs)
            out.backward(go[:, :, idx])
            torch.testing.assert_close(out, ref[:, :, idx], rtol=1e-12, atol=1e-12)
            for mine, whole in zip(local, full):
                torch.testing.assert_close(mine.grad, whole.grad[:, :, idx], rtol=1e-12, atol=1e-12)
            print("ok", method, docs is not None, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
