"""Expert parallelism, applied from outside to the MoE layers a ModelSpec names (`spec.moe_layers`).

Every layout (one process included) sets each MoE layer's routing statistics to be summed over the
gradient ranks (data parallel x context parallel: every token of the global batch once) and the balancing
loss's gradient scale (models/moe/layer.py). With `parallel.ep` > 1 the experts are split over `ep` of
those ranks (contiguous ones, inside dp_shard x cp: the layer is token-wise, so a context rank's chunk of
a sequence is more tokens to dispatch):
- the fused expert weights become DTensors sharded on the expert dimension over the `ep` mesh; where no
  FSDP unit takes them they are then held as plain tensors that state dicts and the global gradient norm see
  whole (parallel/expert_shards.py), so that checkpoints (DCP) reshard them to any other layout and the norm
  counts each once;
- the token rows go to the rank owning their expert and back through
  `all_to_all_single_autograd` with uneven splits (one exchange of per-expert counts, one host sync for
  the split sizes, two all-to-alls per layer and micro-batch);
- gradients: each expert's gradient is the sum over every token source, so it is reduced over the
  ranks holding the same experts (`efsdp`) and divided by the gradient ranks (dp x cp). Under ZeRO-2/3
  the experts are their own FSDP unit on the `efsdp` mesh with that divide factor (and forced sum
  reduction when efsdp > 1: gloo has no PREMUL_SUM; never with efsdp == 1, where torch 2.13 would then
  divide twice); under DDP and ZeRO-1 they are left out of DDP and reduced by `ExpertGradients` before
  clipping (ZeRO-1 steps their optimizer states beside its own: parallel/zero1.py).
Nothing here is written by torch for us: its MoE pieces (torchtitan's) are not part of torch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from disttrain.layout.layout import Layout
from disttrain.models.moe.experts import local
from disttrain.models.moe.layer import reduce_routing_statistics
from disttrain.parallel.expert_shards import hold_locally, shard_of


class AllToAllDispatch:
    """Runs rows sorted by (global) expert on the ranks that own those experts and brings the outputs back."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        ep, per_rank = self.ep, counts.numel() // self.ep
        # (source rank, local expert); functional, so that selective checkpointing keeps it for the recomputation
        received_counts = wait_tensor(all_to_all_single(counts, None, None, self.group))
        both = torch.stack([counts, received_counts]).view(2, ep, per_rank)
        sent, got = self.host_counts(both)
        send_splits, recv_splits = [sum(c) for c in sent], [sum(c) for c in got]
        received = wait_tensor(all_to_all_single_autograd(rows, recv_splits, send_splits, self.group))
        # rows arrive grouped by source rank, then expert; the experts want them grouped by expert. The
        # permutation is computed from the counts already on the device: a tensor built from the host lists
        # would be a blocking copy on a GPU, waiting for the all-to-all just queued.
        got_t = both[1]  # (source, expert)
        lengths = got_t.t().reshape(-1)  # segments in (expert, source) order
        starts = (torch.cumsum(got_t.reshape(-1), 0) - got_t.reshape(-1)).view(ep, per_rank).t().reshape(-1)
        out_starts = torch.cumsum(lengths, 0) - lengths
        total = int(sum(recv_splits))
        perm = torch.arange(total, device=rows.device) + torch.repeat_interleave(starts - out_starts, lengths,
                                                                                output_size=total)
        per_expert = [sum(got[s][e] for s in range(ep)) for e in range(per_rank)]
        y = experts(received[perm], got_t.sum(0), per_expert)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(total, device=rows.device)
        return wait_tensor(all_to_all_single_autograd(y[back].contiguous(), send_splits, recv_splits, self.group))


    @staticmethod
    def host_counts(counts: torch.Tensor) -> list:
        """The host sync: rows (sent to, received from) each rank per local expert, as lists. The dry run's
        fake tensors have no values: it substitutes its stated routing here (dryrun/routing.py)."""
        return counts.tolist()


def pipeline_shape_inference() -> bool:
    """torch.distributed.pipelining runs each stage forward and backward once on example data to learn the
    shapes it exchanges (the first step, before the micro-batches); its routing must not count. torch marks
    that pass nowhere but on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("_forward_metadata_inference", "_backward_metadata_inference"):
            return True
        frame = frame.f_back
    return False


def apply_expert_parallel(model: nn.Module, spec, layout: Layout, meshes) -> list[nn.Module]:
    """Configure every MoE layer for this layout; with ep > 1 split its experts. Returns the experts
    modules split (for FSDP), empty when none are."""
    layers = spec.moe_layers(model) if spec.moe_layers is not None else {}
    split = []
    for layer in layers.values():
        layer.stats_group = meshes.dp_cp.get_group() if layout.gradient_ranks > 1 else None
        layer.aux_grad_scale = layout.gradient_ranks / layout.microbatches
        layer.trial_pass = pipeline_shape_inference if layout.pp > 1 else None
        if layout.ep > 1:
            experts = layer.experts
            for name, param in list(experts.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.data, meshes.ep, [Shard(0)])
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            layer.expert_dispatch = AllToAllDispatch(meshes.ep.get_group(), layout.ep)
            split.append(experts)
    return split


def experts_need_fsdp(experts: list[nn.Module], layout: Layout, param_dtype: torch.dtype | None) -> bool:
    """FSDP on a one-rank expert mesh (ep equal to dp x cp: every rank holds other experts) shards nothing: it
    only copies the experts into and out of its buffers for every forward and backward (CPU: about an eighth of
    a tiny-sized MoE's step at ep=2 on 2 ranks, benchmarks/moe_vs_handwritten.py). The layout says when
    (`Layout.experts_outside_fsdp`, which the planner counts by); experts stored in another dtype than the one
    FSDP would give them keep it for the cast (`param_dtype` None: FSDP casts nothing)."""
    return not layout.experts_outside_fsdp or (param_dtype is not None and any(
        p.dtype != param_dtype for module in experts for p in module.parameters()))


def shard_experts(experts: list[nn.Module], layout: Layout, meshes, fsdp_kwargs: dict) -> set:
    """ZeRO-2/3: each experts module its own FSDP unit on the expert data-parallel mesh, where that mesh has
    something to shard or cast (`experts_need_fsdp`). Returns the expert parameters left unwrapped, for the
    other FSDP units to ignore (their gradients are divided by ExpertGradients, nothing to reduce)."""
    from torch.distributed.fsdp import fully_shard

    if not experts_need_fsdp(experts, layout, fsdp_kwargs["mp_policy"].param_dtype):
        for module in experts:
            hold_locally(module)
        return {p for module in experts for p in module.parameters()}
    mesh = meshes.efsdp(layout)
    for module in experts:
        fully_shard(module, mesh=mesh, shard_placement_fn=split_experts_evenly(mesh), **fsdp_kwargs)
        # FSDP only sums: ExpertGradients divides by dp x cp. torch 2.13 divides a one-rank mesh's gradient by
        # the divide factor AND by its pre/post factors (fp64, or forced sum), so any factor but 1 is wrong
        # there; forced sum also spares gloo the PREMUL_SUM it lacks.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return set()


def split_experts_evenly(mesh):
    """FSDP2's `shard_placement_fn` for a unit on `mesh`. FSDP2 splits a tensor on its first dimension and pads
    each rank's share to the largest, so a stack of experts ([experts, rows, cols], or their biases [experts, rows])
    whose expert count is not a multiple of the ranks leaves whole experts on the first ranks and none on the last
    (4 experts over 8 ranks: twice the even share on rank 0). Such a tensor (a 3-D stack, or any with fewer rows
    than ranks) is split along its second dimension instead where that divides evenly: every rank holds the same
    share. Sizes are the local ones (under expert parallelism, this rank's experts), as FSDP splits them; a tensor
    tensor parallelism already splits along its second dimension keeps FSDP's own split."""
    ranks = mesh.shape[-1]  # HSDP: the shard dimension

    def choose(param: nn.Parameter):
        local = param.to_local() if isinstance(param, DTensor) else param
        placements = param.placements if isinstance(param, DTensor) else ()
        split_already = any(isinstance(p, Shard) and p.dim == 1 for p in placements)
        uneven = local.dim() >= 2 and local.shape[0] % ranks and local.shape[1] % ranks == 0 and not split_already
        if uneven and (local.dim() == 3 or local.shape[0] < ranks):
            return Shard(1)
        return None  # FSDP's own: the first dimension
    return choose


def is_expert_shard(param: torch.Tensor) -> bool:
    """An expert parameter split by expert parallelism and held by no FSDP unit: a plain tensor with its
    place in the whole (parallel/expert_shards.py; FSDP's own parameters are DTensors)."""
    return shard_of(param) is not None


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Any expert parameter split by expert parallelism: a plain shard, or FSDP's DTensor on the experts'
    (efsdp, ep) mesh."""
    return is_expert_shard(param) or (isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ()))


def expert_parameter_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if is_expert_shard(p)]


class ExpertGradients:
    """Expert gradients summed over the ranks that hold the same experts (under DDP here; FSDP sums them
    itself), then divided by the gradient ranks, dp x cp (what DDP and FSDP do for every other gradient).
    Called once per step, before clipping."""

    def __init__(self, model: nn.Module, layout: Layout, meshes):
        self.params = [p for p in model.parameters() if is_expert_parameter(p)]
        reduce = layout.gradient_wrapper == "ddp" and layout.efsdp > 1
        self.group = meshes.same_experts.get_group() if reduce else None
        self.ranks = layout.gradient_ranks

    @torch.no_grad()
    def __call__(self) -> None:
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return
        if self.group is None:  # nothing to sum: divide in place (no flat copy of every expert gradient)
            torch._foreach_div_(grads, self.ranks)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.ranks)
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])


def finish_routing_step(layers: dict):
    """After each optimizer step: the MoE layers' step statistics and balancing bias (models/moe/layer.py).
    The statistics are summed over the gradient ranks here only when a balancing bias moves by them;
    otherwise when a logging step reads them (observe/moe.py): no collective on the other steps."""
    layers = list(layers.values())
    bias = any(layer.routing.bias_update_rate for layer in layers)

    @torch.no_grad()
    def finish(updated: bool) -> None:
        if updated and bias:
            reduce_routing_statistics(layers)
        for layer in layers:
            layer.finish_step(updated)
    return finish
