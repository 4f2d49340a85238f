"""A measured hardware profile (`disttrain bench hardware`) as the planner's cluster: `--hardware FILE`.

The profile's rates are what this machine reaches, not datasheet peaks, so compute and communication
efficiencies are 1; the element-wise rate turns on the step-time terms a GPU table folds into its
compute efficiency (norms, activations, the loss and the optimizer, see `timing.step_time`).
"""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.core.errors import UserError
from disttrain.core.gpus import GPUSpec
from disttrain.models.shape import ModelShape
from disttrain.plan.timing import Cluster

PROFILE_KIND = "disttrain-hardware-profile"


def load_profile(path: str | Path) -> dict:
    try:
        profile = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--hardware={path}: no such file (write one with `disttrain bench hardware --out {path}`)") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"--hardware={path}: not a readable JSON profile ({exc})") from None
    if not isinstance(profile, dict) or profile.get("kind") != PROFILE_KIND:
        raise UserError(f"--hardware={path}: not a hardware profile (write one with `disttrain bench hardware`)")
    return profile


def _nearest(measured: dict, model: str, shape: ModelShape):
    """`measured[model]`, else the entry of the measured model nearest in width (None: not measured)."""
    if model in measured:
        return measured[model]
    dims = {name: entry.get("dim", 0) for name, entry in measured.items() if entry}
    return measured[min(dims, key=lambda name: abs(dims[name] - shape.dim))] if dims else None


def profile_cluster(profile: dict, gpus: int, model: str, shape: ModelShape, overlap_efficiency: float = 0.9) -> Cluster:
    """Every rank on this one machine: one node of `gpus` ranks, links at the measured all-reduce α and β."""
    rates = _nearest(profile["matmul_flops"], model, shape)  # matmul rates depend on the shapes
    fsdp = _nearest(profile.get("fsdp_round_trip") or {}, model, shape) or {}
    tflops = {d: r / 1e12 for d, r in rates.items() if d in ("fp32", "bf16")}
    tflops.setdefault("bf16", tflops["fp32"])
    tflops.update(tf32=tflops["fp32"], fp16=tflops["bf16"])
    tp_rates = {int(tp): {"tf32": r["fp32"], "fp16": r.get("bf16", r["fp32"]), **r}
                for tp, r in rates.get("tp", {}).items()}
    fits = profile["collectives"]
    ar = fits["all_reduce"]
    bandwidth = ar["bandwidth_gbs"] or 1e9  # one rank: no collective ever runs
    latency = ar["latency_s"] or 0.0
    links = {op: (fit["bandwidth_gbs"] * 1e9, fit["latency_s"]) for op, fit in fits.items() if fit["bandwidth_gbs"]}
    spec = GPUSpec(f"profile:{profile.get('host', '?')}", f"measured {profile.get('machine', '')}", tflops,
                   profile["memory_gb_per_rank"], bandwidth, bandwidth, "disttrain bench hardware")
    # On a CPU the collectives run on the cores that compute (gloo's threads copy, reduce and move the
    # bytes), and FSDP2 without streams waits for each: nothing is hidden behind compute.
    if profile.get("device", "cpu") == "cpu":
        overlap_efficiency = 0.0
    return Cluster(spec, gpus_per_node=gpus, nodes=1, intra_latency_s=latency, inter_latency_s=latency,
                   compute_efficiency=1.0, comm_efficiency=1.0, overlap_efficiency=overlap_efficiency,
                   elementwise_bytes_per_s=profile["elementwise_bytes_per_s"],
                   op_overhead_s=profile.get("op_overhead_s", 0.0), dtensor_op_s=profile.get("dtensor_op_s", 0.0),
                   optimizer_s_per_param=profile.get("optimizer_s_per_param", 0.0),
                   collective_links=links, fsdp_gather_s_per_byte=fsdp.get("gather_s_per_byte"),
                   fsdp_reduce_s_per_byte=fsdp.get("reduce_s_per_byte"), fsdp_ranks=fsdp.get("ranks", 2),
                   tp_matmul_flops=tp_rates, tp_collective=_nearest(profile.get("tp_collective") or {}, model, shape),
                   attention_flops=profile.get("attention_flops", {}).get(model))
