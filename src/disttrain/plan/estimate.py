"""One estimate: memory per rank, FLOPs, and (given a cluster) step time, for a model and layout."""

from __future__ import annotations

from dataclasses import dataclass, replace

from disttrain.models.registry import MODEL_SHAPES, ModelShape
from disttrain.models import flops as F
from disttrain.layout.layout import Layout
from disttrain.plan.memory import MemoryEstimate, estimate_memory, rank_params
from disttrain.plan.frozen_time import with_frozen_forward
from disttrain.plan.objective import ObjectiveTerms
from disttrain.plan.timing import Cluster, StepTime, step_time


@dataclass
class Estimate:
    model: str
    shape: ModelShape
    layout: Layout
    memory: MemoryEstimate
    time: StepTime | None = None
    accounting: str = "runtime"
    routing_skew: float = 1.0  # MoE: the busiest expert-parallel rank's share over a balanced one (plan/moe.py)
    optimizer: str = "adamw"  # optim.name the memory was counted for
    state_dtype: str = "fp32"  # optim.state_dtype the moments were counted in
    objective: ObjectiveTerms = ObjectiveTerms()  # train.objective's rows and frozen model (plan/objective.py)

    @property
    def tokens_per_step(self) -> int:
        """Tokens the trained model sees a step (a preference pair's two sequences count twice, as logged)."""
        return self.layout.global_batch_size * self.layout.seq_len * self.objective.rows

    @property
    def flops_per_token(self) -> float:
        return F.model_flops_per_token(self.shape, self.layout.seq_len)

    @property
    def hardware_flops_per_token(self) -> float:
        return F.hardware_flops_per_token(self.shape, self.layout.seq_len, self.layout.activation_checkpointing)

    def as_dict(self) -> dict:
        out = {
            "model": self.model,
            "params": self.shape.num_params(),
            "active_params": self.shape.num_params(active=True),
            "params_per_rank": self.memory.params_per_rank,
            "trainable_params_per_rank": self.memory.trainable_per_rank or self.memory.params_per_rank,
            "accounting": self.accounting,
            "layout": self.layout.as_dict(),
            "bytes_per_rank": self.memory.as_dict(),
            "pipeline_stages": self.memory.per_stage,
            "flops_per_token": self.flops_per_token,
            "hardware_flops_per_token": self.hardware_flops_per_token,
            "tokens_per_step": self.tokens_per_step,
            "flops_per_step": self.flops_per_token * self.tokens_per_step,
        }
        if self.objective.name != "lm":
            out["objective"] = self.objective.describe()
        if self.time is not None:
            out["time"] = self.time.as_dict()
        if self.shape.moe is not None:
            from disttrain.plan.moe import summary
            out["moe"] = summary(self.shape, self.layout, rank_params(self.shape, self.layout).experts, self.routing_skew)
        return out


def estimate(shape: ModelShape, layout: Layout, cluster: Cluster | None = None, *, model: str = "custom",
             accounting: str = "runtime", fused_norm: bool = True, lora_rank: int = 0,
             routing_skew: float = 1.0, muon: bool = False, state_dtype: str = "fp32",
             objective: ObjectiveTerms = ObjectiveTerms()) -> Estimate:
    """`lora_rank` > 0: LoRA adapters train on a frozen base (memory only; the step time is the full one's).
    `routing_skew`: an MoE router's load on the busiest expert-parallel rank, 1 = balanced (plan/moe.py).
    `muon`: optim.name=muon (plan/optimizer.py: its states, temporaries, iterations and traffic); `state_dtype`:
    optim.state_dtype (the moments' bytes); `objective`: train.objective's terms, in memory and step time (pairs,
    a frozen model's parameters and forward: plan/objective.py, plan/frozen_time.py)."""
    memory = estimate_memory(shape, layout, accounting, fused_norm, lora_rank=lora_rank, routing_skew=routing_skew,
                             muon=muon, state_dtype=state_dtype, objective=objective)
    timing = None
    if cluster is not None:
        timing = with_frozen_forward(step_time(shape, layout, cluster, routing_skew, muon, objective), objective,
                                     layout, cluster, routing_skew)
    return Estimate(model, shape, layout, memory, timing, accounting, routing_skew, "muon" if muon else "adamw",
                    state_dtype, objective)


def shape_for_params(n_params: float) -> tuple[str, ModelShape]:
    """A Llama shape of about `n_params` parameters: the registry shape nearest in size, with its
    depth changed to match (width and vocabulary kept, so the per-layer terms stay realistic)."""
    if n_params <= 0:
        raise ValueError(f"--params={n_params}: must be positive")
    name, base = min(((k, v) for k, v in MODEL_SHAPES.items() if k not in ("debug", "tiny") and v.moe is None),
                     key=lambda kv: abs(kv[1].num_params() - n_params))
    per_layer = base.num_params() - replace(base, n_layers=base.n_layers - 1).num_params()
    fixed = base.num_params() - base.n_layers * per_layer  # embeddings, output, final norm
    layers = max(1, round((n_params - fixed) / per_layer))
    return f"{name}-shaped", replace(base, n_layers=layers)
