"""Where one CPU process pretending to be a GPU rank of a large job differs from the real thing, and what
stands in: fake tensors in place of storage, a fake process group in place of the network, and torch's
GPU defaults where the CPU's would differ. Each stand-in says why it is needed."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from disttrain.core.dtypes import DTYPES, at_least_fp32
from disttrain.layout.layout import Layout
from disttrain.models.output_head import statistics_dtype


def materialize_fake(module, mode) -> None:
    """Meta tensors -> fake tensors on this CPU. `to_empty` gives every registration its own tensor, so
    what the module registers more than once (tied embeddings, a rotary table each pipeline stage holds)
    is made one tensor again, as in the model it came from (`init_weights` re-ties a real one). The new
    parameters keep what was set on the old ones (an expert shard's place: parallel/expert_shards.py)."""
    holders: dict[int, list[tuple]] = {}
    marks: dict[int, dict] = {}
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, kind).items():
                if tensor is not None:
                    holders.setdefault(id(tensor), []).append((sub, kind, name))
                    if vars(tensor):
                        marks[id(tensor)] = dict(vars(tensor))
    with mode:
        module.to_empty(device=torch.device("cpu"))
    for key, shared in holders.items():
        first = getattr(shared[0][0], shared[0][1])[shared[0][2]]
        vars(first).update(marks.get(key, {}))
        for owner, kind, name in shared[1:]:
            getattr(owner, kind)[name] = first


def stage_shapes(spec, layout: Layout, chunked_loss, rows: int = 1, hands_over: bool = False):
    """Each pipeline stage's example input and output, given up front (torch's static mode): in a real run
    the stages exchange them at the first step, which a fake group cannot carry. Pipeline parallelism is for
    decoder-only language models (validation), whose stages pass hidden states (micro-batch, sequence,
    hidden) - in the parameters' compute dtype under FSDP2's mixed-precision policy, else the fp32
    residual stream - and whose last stage returns logits over the vocabulary, or the loss sum from a chunked
    output head (`chunked_loss()`, asked when the stages are built: whether the loss took the model's head).
    `rows`: sequences a sample holds (a preference pair's two); `hands_over`: a distillation teacher's pipeline,
    whose last stage returns its final hidden states for the student's head."""
    mp = layout.gradient_wrapper == "fsdp" and layout.param_dtype != "fp32"
    dtype = DTYPES[layout.param_dtype] if mp else torch.float32
    logits_dtype = DTYPES[layout.param_dtype if mp else layout.compute_dtype]
    b, t, shape = layout.micro_batch * rows, layout.seq_len // layout.cp, spec.shape  # a context rank's tokens
    hidden = t // layout.tp if layout.sequence_parallel else t  # sequence parallelism: each rank's slice

    def example(stage: int, module=None):
        inputs = (torch.zeros(b, layout.seq_len, dtype=torch.long) if stage == 0  # the full sequences' ids
                  else torch.empty(b, hidden, shape.dim, dtype=dtype, requires_grad=True))
        # what a stage passes besides hidden states (Gemma 4's per-layer inputs and shared keys and values)
        carried = getattr(module, "carried_examples", None)
        received, sent = carried(b, t, layout.tp, dtype) if carried is not None else ([], [])
        inputs = (inputs, *received) if received else inputs
        last = stage == layout.n_stages - 1
        if last and chunked_loss():  # the output head returns the loss sum (models/output_head.py)
            return inputs, torch.empty((), dtype=statistics_dtype(logits_dtype), requires_grad=True)
        if last and hands_over:
            return inputs, torch.empty(b, t, shape.dim, dtype=dtype)
        outputs = torch.empty(b, t if last else hidden, shape.vocab_size if last else shape.dim,
                              dtype=logits_dtype if last else dtype, requires_grad=True)
        return inputs, (outputs, *sent) if sent else outputs

    return example



class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm keeping for backward what torch's CUDA kernel (`_fused_rms_norm`) keeps: the input and the
    fp32 reciprocal RMS. On the CPU, `F.rms_norm` is decomposed into ops that keep an fp32 copy of the
    input and the fp32 normalised input besides (counted on both devices by benchmarks/dryrun_vs_real.py
    --saved-by-device: 9 bytes per element per norm on the CPU for bf16, 2 on CUDA).

    On fake tensors the backward is torch's own `_fused_rms_norm_backward`, whose meta kernel allocates
    what the CUDA kernel does, its two outputs; the CPU decomposition (real tensors: its values) holds up
    to five fp32 input-sized temporaries at once, which under tensor parallelism without sequence
    parallelism (norms over the whole hidden size, the rest split) made a block's backward the peak."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        dims = tuple(range(-len(normalized_shape), 0))
        xf = at_least_fp32(x)
        eps = torch.finfo(xf.dtype).eps if eps is None else eps
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
        y = xf * rstd
        if weight is not None:
            y = y * weight
        ctx.dims, ctx.normalized_shape = dims, list(normalized_shape)
        ctx.save_for_backward(x, rstd, weight)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        from torch._subclasses.fake_tensor import is_fake

        x, rstd, weight = ctx.saved_tensors
        wants_weight = weight is not None and ctx.needs_input_grad[2]
        if is_fake(x) and is_fake(grad):
            dx, dweight = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.normalized_shape, rstd, weight,
                                                                  [True, wants_weight])
            return dx, None, dweight if wants_weight else None, None
        xhat = at_least_fp32(x) * rstd
        g = at_least_fp32(grad)
        gw = g * weight if weight is not None else g
        dx = rstd * (gw - xhat * (gw * xhat).mean(ctx.dims, keepdim=True))
        dweight = None
        if wants_weight:
            lead = tuple(range(g.dim() - len(ctx.dims)))
            dweight = (g * xhat).sum(lead).to(weight.dtype)
        return dx.to(x.dtype), None, dweight, None


def _fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    return FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)


@contextlib.contextmanager
def gpu_defaults():
    """What torch picks by itself on a GPU but not for tensors on this CPU: AdamW's foreach kernels
    (whose temporaries span every parameter at once, the optimizer step's own peak), the fused
    RMSNorm kernel (`FusedRMSNorm`), and the memory-efficient attention kernel where the CPU's SDPA
    would keep the probabilities (dryrun/cuda_attention.py)."""
    from torch.nn import functional
    from torch.optim import adam

    from disttrain.dryrun.cuda_attention import sdpa_as_on_cuda

    saved = adam._default_to_fused_or_foreach, functional.rms_norm, functional.scaled_dot_product_attention
    adam._default_to_fused_or_foreach = lambda params, differentiable, use_fused=False: (False, not differentiable)
    functional.rms_norm = _fused_rms_norm
    functional.scaled_dot_product_attention = sdpa_as_on_cuda(saved[2])
    try:
        yield
    finally:
        adam._default_to_fused_or_foreach, functional.rms_norm, functional.scaled_dot_product_attention = saved


@contextlib.contextmanager
def grouped_mm_in_every_dtype():
    """torch's shape rule for `_grouped_mm` (what fake tensors run) checks the dtype its fast CUDA kernel
    takes, bf16 only, while the real op runs fp32 too (the CPU kernel, CUDA's fallback) with outputs of the
    same shapes. Apply the rule to bf16 stand-ins of the inputs (meta tensors inside the rule: nothing is
    allocated) and give the output the dtype asked for."""
    from torch import _meta_registrations as meta

    saved = meta._meta_grouped_mm_common

    def any_dtype(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                  use_fast_accum=False):
        if scale_a is not None or mat_a.dtype == mat_b.dtype == torch.bfloat16:
            return saved(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)
        out = saved(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), None, None, offs, bias, scale_result, None,
                    use_fast_accum)
        return out.to(out_dtype or mat_a.dtype)

    meta._meta_grouped_mm_common = any_dtype
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = saved


@contextlib.contextmanager
def groups_on_the_fake_backend(active: bool):
    """A group asked for on gloo (the fp16 step's host-side control group) on the fake backend instead:
    gloo would need a real store to connect through."""
    saved = dist.new_group
    if active:
        dist.new_group = lambda *args, backend=None, **kwargs: saved(*args, **kwargs)
    try:
        yield
    finally:
        dist.new_group = saved


@contextlib.contextmanager
def scaler_finds_no_overflow():
    """fp16's loss scaler reads whether any gradient overflowed before it lets the optimizer step; fake
    gradients have no values, so the step is taken (the common case, and the one with the optimizer's peak)."""
    saved = torch.amp.GradScaler._maybe_opt_step
    torch.amp.GradScaler._maybe_opt_step = lambda self, optimizer, state, *args, **kwargs: optimizer.step(*args, **kwargs)
    try:
        yield
    finally:
        torch.amp.GradScaler._maybe_opt_step = saved


@contextlib.contextmanager
def propagation_in_its_own_fake_mode():
    """DTensor computes each op's output shape on global-shape fake tensors, in the active fake mode if
    there is one. Under the dry run's mode the memory tracker would count those (whole, unsharded
    weight-sized) tensors as this rank's, as long as garbage collection leaves them alive; a real run
    has no active fake mode, so DTensor makes its own, which the tracker ignores. Do the same here."""
    from torch.distributed.tensor import _sharding_prop

    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


@contextlib.contextmanager
def positions_read_as_real_ones(document_masking: bool):
    """transformers reads a model's `position_ids` to find packed sequences (positions restarting) and, finding none,
    leaves causality to the attention kernel (SDPA's `is_causal`: no mask made or kept). It cannot read fake tensors,
    so it assumes packing and makes a seq x seq mask, which every SDPA layer keeps converted to the compute dtype:
    memory a real run does not hold (a tiny DeepSeek-V3 at 512 tokens: 16% of its peak). Without document masking
    the positions the runtime gives never restart: answer for the fake ones as a real run finds."""
    try:
        from transformers import masking_utils
    except ImportError:  # no Hugging Face model to run
        masking_utils = None
    saved = getattr(masking_utils, "find_packed_sequence_indices", None)
    if document_masking or saved is None:
        yield
        return
    from torch._subclasses.fake_tensor import is_fake

    masking_utils.find_packed_sequence_indices = lambda positions: None if is_fake(positions) else saved(positions)
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved


@contextlib.contextmanager
def static_pipeline():
    """Every stage takes its shapes from `stage_shapes` (torch's STATIC mode): the schedule's first-step
    vote on that reads a tensor sent between stages, which a fake group never delivers."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    saved = schedules._PipelineSchedule._warmup_p2p

    def static(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = static
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = saved


@contextlib.contextmanager
def ddp_on_fake(mode):
    """Wrap in DDP inside the fake mode, so that its reducer's gradient buckets are fake too (outside
    it they would be real memory of the whole model's size). DDP's start-up checks read parameter
    values across ranks, which fake tensors and a fake group do not have: skipped here."""
    from torch.nn.parallel import distributed

    saved = distributed._verify_param_shape_across_processes, distributed._sync_module_states
    distributed._verify_param_shape_across_processes = lambda *a, **k: None
    distributed._sync_module_states = lambda *a, **k: None
    try:
        with mode:
            yield
    finally:
        distributed._verify_param_shape_across_processes, distributed._sync_module_states = saved


def forget_previous_world() -> None:
    """Before the next simulated rank in this process: DTensor caches sharding decisions by mesh, and a
    new mesh of equal shape compares equal to the last rank's, whose cached specs name that rank's
    process groups (the group names are reused after the fake world is torn down). Without this, the
    second rank's tensor-parallel collectives ran on the first rank's groups."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._planner_cache.clear()  # keyed by a weak reference to the mesh, equal to an equal mesh's
    for value in vars(_redistribute).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
