"""Korthikanti et al. 2022 (*Reducing Activation Recomputation in Large Transformer Models*): activation bytes
per GPT layer and the micro-batches a pipeline's first stage keeps in flight (the reference the planner's own
tensor-by-tensor count in plan/activations.py is compared with, and its in-flight factor)."""

from __future__ import annotations


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes per transformer layer, Korthikanti et al. 2022 (fp16, GPT with dropout):
    sbh(34 + 5as/h) without parallelism; tensor parallel sbh(10 + 24/t + 5as/ht); with sequence
    parallel sbh(34/t + 5as/ht); selective recomputation drops the 5as/h term; full keeps 2sbh."""
    sbh = s * b * h
    attention = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if sequence_parallel:
        return sbh * (34 / t + attention)
    return sbh * (10 + 24 / t + attention)


def korthikanti_in_flight_factor(pp: int, microbatches: int, schedule: str, virtual_stages: int = 1) -> float:
    """How many micro-batches' worth of its layers the first stage holds, relative to one: 1F1B
    keeps p in flight (so L/p layers × p = L layers in all), interleaving (v chunks) multiplies
    that by 1 + (p−1)/(p·v) (Korthikanti et al. 2022, section 4.2.3), GPipe keeps all m."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    in_flight = float(min(pp, microbatches))
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        in_flight *= 1 + (pp - 1) / (pp * virtual_stages)
    return min(in_flight, float(microbatches))
