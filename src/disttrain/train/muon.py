"""Muon for the matrices of the repeated blocks and AdamW for the rest, as one optimizer, on every layout.

Each matrix's update is torch.optim.Muon's, computed by torch's own Newton-Schulz iteration on the whole matrix
(so one process equals `torch.optim.Muon` exactly). torch's Muon has no distributed logic, so the split is done
here: the momentum is kept and updated where the gradient lives (a shard under FSDP or tensor parallelism), the
iteration of each matrix runs on one rank of the ranks that share it (its owner, chosen to balance the
iteration's FLOPs), and the owner's update reaches the others, which take their shard of it.

A fused projection is orthogonalised per logical matrix, told by its name (`FUSED`): transformers' fused
experts' `gate_up_proj` (gate and up, halves of its rows) and GPT-2's `c_attn` (q, k and v, thirds of its
columns). 3-D expert tensors are a stack of matrices, one per expert, each orthogonalised on its own.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

from disttrain.models.flops import newton_schulz_flops
from disttrain.parallel.expert import is_expert_shard
from disttrain.parallel.expert_shards import shard_of
from disttrain.parallel.param_names import clean_fqn
from disttrain.train.state_dtype import STATE_DTYPES, adamw_class, keep_states_in

BLOCK = re.compile(r"(^|\.)(layers|h)\.\d+\.")  # a repeated block's parameter (built-in, transformers, GPT-2)
ROUTER = re.compile(r"(^|\.)(router|gate|shared_expert_gate)(\.|$)")  # routers stay with AdamW
# Fused projections by name: (matrices, the dimension they are stacked along). transformers' fused experts keep
# gate and up as the two halves of their rows; GPT-2's Conv1D `c_attn` keeps q, k and v side by side in columns.
FUSED = {"gate_up_proj": (2, -2), "c_attn.weight": (3, -1)}
# Whole-matrix elements a step holds at once (gathered fp32 updates and bf16 results): the matrices are taken in
# buckets of about this size (at least one matrix each), each bucket's iterations running on all ranks at once.
BUCKET_ELEMENTS = 2 ** 25


def fused(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(pieces, dim) a parameter is cut into before orthogonalising: (1, -2) when it is not fused."""
    name = clean_fqn(name)
    for suffix, (pieces, dim) in FUSED.items():
        if name.endswith(suffix) and shape[dim] % pieces == 0:
            return pieces, dim
    return 1, -2


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """The matrices of the repeated blocks (attention, MLP, experts, shared experts), not routers."""
    name = clean_fqn(name)
    return param.ndim in (2, 3) and BLOCK.search(name) is not None and ROUTER.search(name) is None


def logical_matrices(name: str, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The (rows, cols) of each matrix Muon orthogonalises within a parameter of `shape`: one per expert of a
    3-D tensor, one per piece of a fused projection."""
    experts = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2:]
    pieces, dim = fused(name, shape)
    return [(rows // pieces, cols) if dim == -2 else (rows, cols // pieces)] * (experts * pieces)


@dataclass
class Placement:
    """Where a Muon matrix is orthogonalised: `owner` (a global rank) among `ranks` (those that share it), whose
    process group is `group` (None: this rank alone)."""

    owner: int
    ranks: tuple[int, ...]
    group: object = None


def sharing(param: torch.Tensor, replicas) -> tuple[tuple[int, ...], object]:
    """The ranks holding a share or a copy of `param`'s update and their group, if one exists already: its
    DTensor mesh, or `replicas` (the group plain parameters are replicated over, as under DDP; not expert
    shards, which differ by rank), or this rank alone."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        return ranks, mesh.get_group() if mesh.ndim == 1 else None
    if replicas is not None and dist.is_initialized() and not is_expert_shard(param):
        return tuple(dist.get_process_group_ranks(replicas)), replicas
    return (dist.get_rank() if dist.is_initialized() else 0,), None


def assign_owners(costs: list[tuple[float, tuple[int, ...]]]) -> list[int]:
    """One owner per matrix, balancing the summed cost per rank: the costliest first, each to the least loaded
    of its ranks (ties to the lowest rank). Every rank computes the same answer from the same list."""
    load: dict[int, float] = {}
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i][0], i)):
        cost, ranks = costs[i]
        owner = min(ranks, key=lambda r: (load.get(r, 0.0), r))
        load[owner] = load.get(owner, 0.0) + cost
        owners[i] = owner
    return owners


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over Muon groups and AdamW groups (each group's `algorithm`), so that the schedule, the
    clip, the scaler and checkpoints see one thing. The AdamW groups are stepped by a torch.optim.AdamW that
    shares their dicts and this optimizer's state; torch has no optimizer that chains two."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], adamw_kwargs: dict, names: dict,
                 replicas=None, adamw=torch.optim.AdamW, state_dtype: torch.dtype | None = None,
                 shard_states: bool = False):
        self.adamw = adamw([g for g in adamw_groups if g["params"]], **adamw_kwargs)
        self.state_dtype = state_dtype  # of the momentum (None: the parameter's)
        self.shard_states = shard_states  # ZeRO-1: a replicated matrix's momentum only on its owner
        for group in adamw_groups:
            group["algorithm"] = "adamw"
        for group in muon_groups:
            group.update(algorithm="muon", ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C), eps=EPS)
        super().__init__([g for g in self.adamw.param_groups] + [g for g in muon_groups if g["params"]],
                         {"lr": adamw_kwargs["lr"]})
        self.adamw.state = self.state
        self.names = names
        muon_params = [p for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        mine, groups = [], {}
        for p in muon_params:
            steps = muon_groups[0]["ns_steps"]
            cost = sum(newton_schulz_flops(r, c, steps) for r, c in logical_matrices(names[p], p.shape))
            ranks, group = sharing(p, replicas)
            mine.append((clean_fqn(names[p]), ranks, cost))
            groups.setdefault(ranks, group)
        owners, made = _agree(mine, [r for r, g in groups.items() if g is None and len(r) > 1])
        self.placements = {p: Placement(owners[(name, ranks)], ranks, groups[ranks] or made.get(ranks))
                           for p, (name, ranks, _) in zip(muon_params, mine)}
        self._update_squares, self._update_numel, self._seconds, self._adamw_lrs = None, 0, (0.0, 0.0), []

    def split(self) -> dict:
        """Which parameters each algorithm steps on this rank: names (as checkpoints spell them), parameters and
        bytes (whole tensors, however they are sharded)."""
        out = {}
        for group in self.param_groups:
            entry = out.setdefault(group["algorithm"], {"names": [], "params": 0, "bytes": 0})
            for p in group["params"]:
                numel = shard_of(p).shape.numel() if shard_of(p) is not None else p.numel()  # experts: all ranks'
                entry["names"].append(clean_fqn(self.names[p]))
                entry["params"] += numel
                entry["bytes"] += numel * p.element_size()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.adamw.param_groups = [g for g in self.param_groups if g["algorithm"] == "adamw"]
        self.adamw.state = self.state
        keep_states_in(self, self.state_dtype)  # torch's load gives states the parameters' dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        self._adamw_lrs = [group["lr"] for group in self.adamw.param_groups]  # the schedule moves them after the step
        self.adamw.step()
        adamw_done = time.perf_counter()
        self._update_squares, self._update_numel = None, 0
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_group(group)
        self._seconds = (adamw_done - started, time.perf_counter() - adamw_done)
        return loss

    def metrics(self) -> dict:
        """For a logging step, from the latest step on this rank: the RMS of Muon's orthogonalised update (each
        matrix's at its adjusted rate, weight decay apart) and Muon's share of the optimizer step's host time
        (on a GPU the host time of queued kernels: read it with the step breakdown)."""
        if self._update_squares is None:
            return {}
        adamw, muon = self._seconds
        return {"muon_update_rms": math.sqrt(float(self._update_squares) / max(1, self._update_numel)),
                "adamw_update_rms": self._adamw_update_rms(),
                "muon_optimizer_share": muon / (adamw + muon) if adamw + muon else 0.0}

    def _adamw_update_rms(self) -> float:
        """The RMS of AdamW's latest update on this rank's shards (lr x the bias-corrected m / (sqrt(v) + eps),
        weight decay apart), recomputed from its moments on logging steps only, in the parameters' dtype on the
        device with one host read."""
        squares, numel = None, 0
        for group, lr in zip(self.adamw.param_groups, self._adamw_lrs):
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state.get(p)
                if not state or "exp_avg" not in state:
                    continue
                step = float(state["step"])
                m, v = (t.to_local() if isinstance(t, DTensor) else t for t in (state["exp_avg"], state["exp_avg_sq"]))
                m, v = m.to(p.dtype), v.to(p.dtype)  # as the step computed it (bf16 states widened)
                update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + group["eps"])
                square = float(lr) ** 2 * torch.linalg.vector_norm(update) ** 2
                squares = square if squares is None else squares + square
                numel += update.numel()
        return math.sqrt(float(squares) / numel) if numel else 0.0

    def _muon_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        bucket, size = [], 0
        for p in params:
            if bucket and size + p.numel() > BUCKET_ELEMENTS:
                self._muon_bucket(bucket, group)
                bucket, size = [], 0
            bucket.append(p)
            size += p.numel()
        if bucket:
            self._muon_bucket(bucket, group)

    def _muon_bucket(self, bucket: list, group: dict) -> None:
        """Momentum and whole updates of every matrix of `bucket` first (the gathers, in one order on every rank),
        then each owner's iterations with their broadcasts in flight, so that the ranks orthogonalise at the same
        time instead of one after the other; then every update applied."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        fulls = [self._whole_update(p, group) if self._keeps_state(p, rank) else p.detach() for p in bucket]
        sent = [self._send(self._orthogonalise(p, full, group) if rank == self.placements[p].owner else None, full,
                           self.placements[p]) for p, full in zip(bucket, fulls)]
        for p, full, (ortho, work) in zip(bucket, fulls, sent):
            if work is not None:
                work.wait()
            self._apply(p, full, ortho, group)

    def _keeps_state(self, p, rank: int) -> bool:
        """Under ZeRO-1 (`shard_states`) a replicated matrix's gradient is whole on every rank, so only its owner
        keeps the momentum and makes the update; the others receive the result (and only need its shape)."""
        return not self.shard_states or isinstance(p, DTensor) or rank == self.placements[p].owner

    def _whole_update(self, p, group: dict) -> torch.Tensor:
        """torch.optim.Muon's momentum step on this rank's share, and the (Nesterov) update it gives, whole."""
        grad, state = p.grad, self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, dtype=self.state_dtype, memory_format=torch.preserve_format)
        stored = state["momentum_buffer"]
        buf = stored if stored.dtype == grad.dtype else stored.to(grad.dtype)  # bf16 states: computed at full width
        buf.lerp_(grad, 1 - group["momentum"])
        if buf is not stored:
            stored.copy_(buf)
        update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        return update.full_tensor() if isinstance(update, DTensor) else update

    def _send(self, ortho, full: torch.Tensor, placement: Placement):
        """(the owner's update on this rank, the broadcast's work in flight or None)."""
        if len(placement.ranks) == 1:
            return ortho, None
        if ortho is None:
            ortho = torch.empty(full.shape, dtype=torch.bfloat16, device=full.device)
        return ortho, dist.broadcast(ortho, src=placement.owner, group=placement.group, async_op=True)

    def _apply(self, p, full: torch.Tensor, ortho: torch.Tensor, group: dict) -> None:
        """Decoupled weight decay, then the orthogonalised update at the matrix's adjusted rate (this rank's
        shard of it); its square summed for the update RMS without a host sync."""
        lr = group["lr"]
        square = torch.linalg.vector_norm(ortho, dtype=torch.float32) ** 2  # no fp32 copy of the matrix
        if isinstance(p, DTensor):
            ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
        matrix = tuple(full.shape[-2:]) if p.ndim == 2 else self._expert_matrix(p, full)
        adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], torch.Size(matrix))
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-adjusted_lr)
        square = (adjusted_lr ** 2) * square
        self._update_squares = square if self._update_squares is None else self._update_squares + square
        self._update_numel += full.numel()

    def _expert_matrix(self, p, full) -> tuple[int, int]:
        return logical_matrices(self.names[p], tuple(full.shape))[0]

    def _orthogonalise(self, p, full: torch.Tensor, group: dict) -> torch.Tensor:
        """torch's Newton-Schulz on each logical matrix of the whole `full` (see the module's docstring)."""
        pieces, dim = fused(self.names[p], tuple(full.shape))
        stack = full.reshape(-1, *full.shape[-2:])  # one matrix per expert (one in all for a 2-D parameter)
        out = torch.stack([torch.cat([_zeropower_via_newtonschulz(piece, group["ns_coefficients"], group["ns_steps"],
                                                                  group["eps"]) for piece in m.chunk(pieces, dim)], dim)
                           for m in stack.unbind(0)])
        return out.reshape(full.shape)


def _agree(mine: list[tuple[str, tuple[int, ...], float]], needed: list[tuple[int, ...]]) -> tuple[dict, dict]:
    """Every rank's Muon matrices (name, sharing ranks, cost) pooled, so that each matrix gets one owner that
    all its ranks agree on, balanced over everything each rank orthogonalises (its own experts too); and the
    process groups over rank sets no existing group covers (a multi-dimensional mesh smaller than the world),
    which dist.new_group makes on every rank in one order."""
    everyone, needs = [mine], [needed]
    # the dry run simulates one rank on a fake group, which carries no objects: that rank's own view suffices
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, sorted(needed)))
        everyone, needs = [m for m, _ in gathered], [n for _, n in gathered]
    pooled = sorted({(name, ranks): cost for matrices in everyone for name, ranks, cost in matrices}.items())
    owners = assign_owners([(cost, ranks) for (_, ranks), cost in pooled])
    world = tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
    made = {ranks: dist.new_group(list(ranks)) for ranks in sorted({tuple(r) for n in needs for r in n} - {world})}
    return {key: owner for (key, _), owner in zip(pooled, owners)}, {**made, world: dist.group.WORLD}


def split_parameters(model: nn.Module) -> tuple[list, list, list, dict]:
    """(Muon matrices, AdamW matrices, AdamW vectors, parameter -> name) of the trainable parameters."""
    muon, matrices, vectors, names = [], [], [], {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        names[p] = name
        if takes_muon(name, p):
            muon.append(p)
        else:
            (matrices if p.ndim >= 2 else vectors).append(p)
    return muon, matrices, vectors, names


def build_muon(model: nn.Module, optim_cfg, replicas=None, shard_states: bool = False) -> MuonWithAdamW:
    """Muon over the block matrices (optim.muon.*), AdamW over the rest (optim.*); `replicas`: the group plain
    parameters are replicated over (DDP's), whose ranks share each matrix's iteration; `shard_states` (ZeRO-1):
    each matrix's momentum kept by its owner only (AdamW's states stay replicated)."""
    muon, matrices, vectors, names = split_parameters(model)
    m = optim_cfg.muon
    muon_group = {"params": muon, "lr": m.lr or optim_cfg.lr, "momentum": m.momentum, "nesterov": m.nesterov,
                  "ns_steps": m.ns_steps, "adjust_lr_fn": m.adjust_lr,
                  "weight_decay": optim_cfg.weight_decay if m.weight_decay is None else m.weight_decay}
    adamw_groups = [{"params": matrices, "weight_decay": optim_cfg.weight_decay},
                    {"params": vectors, "weight_decay": 0.0}]
    mixed = len({isinstance(p, DTensor) for p in matrices + vectors}) > 1  # see build_optimizer
    kwargs = {"lr": optim_cfg.lr, "betas": tuple(optim_cfg.betas), "eps": optim_cfg.eps,
              **({"foreach": False} if mixed else {})}
    return MuonWithAdamW([muon_group], adamw_groups, kwargs, names, replicas, adamw_class(optim_cfg),
                         STATE_DTYPES[optim_cfg.state_dtype], shard_states)
