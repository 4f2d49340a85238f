"""`scaled_dot_product_attention` as a CUDA rank runs it, for the dry run's fake tensors on this CPU.

torch picks an SDPA kernel per call and device (aten's `_fused_sdp_choice`). On the CPU there are two: the flash
kernel (`_scaled_dot_product_flash_attention_for_cpu`: output and fp32 log-sum-exp) and the math path, which keeps
the attention probabilities for the backward, heads x queries x keys a call. The CPU's flash kernel refuses query,
key and value head dims that differ (DeepSeek's latent attention: 192 for queries and keys, 128 for values) and
dropout, so such calls take the math path here.

On CUDA (torch 2.13's rules for an sm80-sm90 GPU, `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`) the
order is cuDNN (first where torch prefers it: sm90 with cuDNN newer than 9.15), flash, memory-efficient, math.
Flash too needs one head dim for queries, keys and values. The memory-efficient kernel takes a value head dim of
its own: query and key dims equal, both dims multiples of 8 for 16-bit inputs (4 for fp32), last-dim stride 1,
storage offsets aligned the same way, and q, k, v with the same head count. cuDNN takes 192/128 on sm90 too.
Either keeps the output and an fp32 log-sum-exp (the efficient kernel's padded to whole blocks of 32 queries), and
its backward makes the gradients of q, k and v. They differ in one tensor: the efficient kernel writes its output
as (batch, seq, heads, dim), which transformers' transpose before the output projection reads as it is, where
cuDNN's follows the query's layout and that transpose copies it (one output-sized tensor a layer more, 128 MiB a
DeepSeek-V3 layer and micro-batch of 4,096 tokens; cuDNN is only tried first with a cuDNN newer than 9.15). So a
call the CPU would serve with the math path and the efficient kernel would take runs here as that kernel
(`aten._scaled_dot_product_efficient_attention`, whose meta kernel gives the CUDA shapes and strides and whose
autograd formula calls the backward's meta kernel). Where the GPU would take flash (equal head dims with dropout),
the efficient kernel holds the same memory but for that copy.

Left to torch's own choice: real tensors (the function is only swapped in on fake ones), calls the CPU serves with
its flash kernel already, and calls the efficient kernel would refuse (grouped-query calls with fewer key/value
heads and differing head dims; misaligned head dims), which take the math path on CUDA too.
"""

from __future__ import annotations

import math

import torch


def _alignment(dtype: torch.dtype) -> int:
    """The efficient kernel's head-dim alignment on sm80 and newer (torch's `minimum_gemm_alignment`): 128-bit
    tensor-core loads, 8 elements in 16 bits, 4 in fp32."""
    return 8 if dtype in (torch.bfloat16, torch.float16) else 4


def cpu_takes_math(query, key, value, dropout_p: float) -> bool:
    """Whether this CPU serves the call with the math path (torch's `use_flash_attention_cpp`, for the dense 4-D
    calls a model makes): head dims that differ, or dropout."""
    return query.size(-1) != key.size(-1) or query.size(-1) != value.size(-1) or dropout_p > 0.0


def efficient_takes(query, key, value) -> bool:
    """Whether CUDA's memory-efficient kernel takes these tensors (torch's `can_use_mem_efficient_attention`,
    dense inputs on sm80-sm90, and the same head count for queries, keys and values)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not query.dtype == key.dtype == value.dtype:
        return False
    align = _alignment(query.dtype)
    dq, dv = query.size(-1), value.size(-1)
    return (dq == key.size(-1) and dq % align == 0 and dv % align == 0 and dq > 0 and dv > 0
            and query.size(1) == key.size(1) == value.size(1)
            and all(t.stride(-1) == 1 and t.storage_offset() % align == 0 for t in (query, key, value)))


def _as_bias(attn_mask, query, key):
    """The mask as the efficient kernel takes it (torch's `convert_boolean_attn_mask` and `preprocess_mask`): a
    boolean mask becomes 0 / -inf in the query's dtype, expanded to (batch, heads, queries, keys), its rows stored
    padded to a multiple of 16 keys."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(), -math.inf)
    shape = (query.size(0), query.size(1), query.size(2), key.size(2))
    keys = key.size(2)
    if keys % 16:
        padded = torch.empty(*shape[:-1], keys + 16 - keys % 16, dtype=attn_mask.dtype, device=attn_mask.device)
        return padded[..., :keys].copy_(attn_mask.expand(shape))
    return attn_mask.expand(shape)


def sdpa_as_on_cuda(original):
    """`original` (torch's SDPA) with the calls CUDA would give the memory-efficient kernel, where this CPU would
    take the math path, sent to that kernel; on fake tensors only."""
    from torch._subclasses.fake_tensor import FakeTensor

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not (all(type(t) is FakeTensor for t in (query, key, value))
                and cpu_takes_math(query, key, value, dropout_p) and efficient_takes(query, key, value)):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        # torch's `should_compute_logsumexp`: the log-sum-exp is kept for a backward
        logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, _as_bias(attn_mask, query, key), logsumexp, dropout_p, is_causal, scale=scale)[0]

    return sdpa
