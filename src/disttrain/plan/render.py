"""Text tables for `disttrain estimate` / `disttrain plan`, and the winner as a ready config."""

from __future__ import annotations

from disttrain.plan.estimate import Estimate
from disttrain.layout.layout import Layout

GIB = 2 ** 30


def _row(label: str, nbytes: float) -> str:
    return f"  {label:<28}{nbytes:>18,.0f} B {nbytes / GIB:>10.2f} GiB"


MOMENTS = {"loss": "the loss's backward", "loss forward": "the loss's forward",
           "forward": "the forward (ZeRO-2's gathers)", "block": "a block's backward", "step": "the optimizer step",
           "first step": "DDP's first step", "backward end": "the last backward's end",
           "gathered block": "a block, stage gathered", "reduce": "the deferred reduction"}


def memory_table(est: Estimate, gpus_per_node: int = 0) -> list[str]:
    """`gpus_per_node` > 0: CPU offload's host memory for a whole node too (what its RAM must hold)."""
    m = est.memory.as_dict()
    stage = f" (pipeline rank {est.memory.pp_rank}, the fullest)" if est.layout.pp > 1 else ""
    lines = [f"Memory per GPU{stage}, {est.accounting} accounting, at its peak ({MOMENTS[m['peak_moment']]}):"]
    for key, nbytes in est.memory.categories().items():
        lines.append(_row(key, nbytes))
    lines.append("  " + "-" * 60)
    for key, parts in est.memory.moments.items():
        lines.append(_row(f"at {MOMENTS[key]}", sum(parts.values())))
    lines.append(_row("peak", m["total"]))
    if m["cpu_offloaded"]:
        lines.append(_row("host memory (CPU offload)", m["cpu_offloaded"]))
        if gpus_per_node > 1:
            lines.append(_row(f"  per node of {gpus_per_node} GPUs", gpus_per_node * m["cpu_offloaded"]))
    if est.objective.name != "lm":
        lines.append(f"  counted: {est.objective.describe()}")
    if est.shape.moe is not None:
        lines += moe_lines(est)
    if est.layout.pp > 1:
        lines.append("  by pipeline rank: " + ", ".join(
            f"{s['pp_rank']}: {s['total'] / GIB:.2f} GiB ({s['in_flight']:.1f} micro-batches in flight)"
            for s in est.memory.per_stage))
    return lines


def moe_lines(est: Estimate) -> list[str]:
    """Where an MoE model's experts are: per rank, and the group their states are spread over."""
    m = est.as_dict()["moe"]
    routing = "balanced routing" if est.routing_skew == 1 else f"routing skew {est.routing_skew:g}"
    return [f"  experts: {m['experts_per_rank']} of {m['num_experts']} per MoE layer on each rank (ep={m['ep']}, "
            f"{m['moe_layers']} MoE layers), {m['expert_params_per_rank']:,} expert parameters, their states over "
            f"{m['expert_data_parallel']} rank(s); {routing}"]


def plan_table(ranked: list[Estimate], top: int) -> list[str]:
    """The ranked layouts: speed, where the step time goes, where the memory goes."""
    lines = [f"{'':>2}  {'':>12}  {'':>6}  {'step s =':>8} {'compute':>8} {'+bubble':>8} {'+comm':>7}  "
             f"{'GiB/GPU =':>9} {'states':>7} {'+act':>6} {'+buf':>5}",
             f"{'#':>2}  {'tokens/s/GPU':>12}  {'MFU':>6}  {'':>8} {'':>8} {'':>8} {'':>7}  {'':>9} {'':>7} {'':>6} "
             f"{'':>5}  layout"]
    for i, e in enumerate(ranked[:top], 1):
        t, m = e.time, e.memory
        peak = m.categories()
        states = peak["parameters"] + peak["gradients"] + peak["optimizer"]
        acts = peak["activations"] + peak["temporary"]
        # a frozen model's forward (dpo's reference, a teacher) in each column
        compute, bubble = t.compute_s + t.frozen_compute_s, t.bubble_s + t.frozen_bubble_s
        comm = t.tp_comm_s + t.pp_comm_s + t.dp_exposed_s + t.ep_comm_s + t.frozen_s - t.frozen_compute_s - t.frozen_bubble_s
        lines.append(f"{i:>2}  {t.tokens_per_s_per_gpu:>12,.0f}  {t.mfu:>6.1%}  {t.step_s:>8.2f} {compute:>8.2f} "
                     f"{bubble:>8.2f} {comm:>7.2f}  {m.total / GIB:>9.1f} "
                     f"{states / GIB:>7.1f} {acts / GIB:>6.1f} {peak['communication'] / GIB:>5.1f}  {e.layout.describe(micro_batch=True)}")
    return lines


def fit_line(est: Estimate, gpu_name: str, memory_bytes: float, headroom: float) -> str:
    from disttrain.plan.search import memory_budget

    budget = memory_budget(memory_bytes, headroom)
    need, verdict = est.memory.total, est.memory.total <= memory_budget(memory_bytes, headroom)
    room = f"{(budget - need) / GIB:.1f} GiB to spare" if verdict else f"{(need - budget) / GIB:.1f} GiB over"
    return (f"Fits {gpu_name}: {'yes' if verdict else 'NO'} ({need / GIB:.1f} GiB of a {budget / GIB:.1f} GiB budget: "
            f"{memory_bytes / 1e9:.0f} GB less {headroom:.0%} kept free; {room})")


def scaling_lines(rows: list[dict]) -> list[str]:
    lines = [f"{'GPUs':>5}  {'tokens/s':>12}  {'per GPU':>9}  {'efficiency':>10}  layout"]
    for row in rows:
        if row["tokens_per_s"] is None:
            lines.append(f"{row['gpus']:>5}  {'-':>12}  {'-':>9}  {'-':>10}  does not fit")
        else:
            lines.append(f"{row['gpus']:>5}  {row['tokens_per_s']:>12,.0f}  {row['tokens_per_s_per_gpu']:>9,.0f}  "
                         f"{row['efficiency']:>10.1%}  {row['layout']}")
    return lines


def flops_lines(est: Estimate) -> list[str]:
    moe = est.shape.moe
    active = [f"  (N counts the {est.shape.num_params(active=True) / 1e9:.3g} B active parameters: router, "
              f"{'shared and ' if moe.n_shared_experts else ''}top-{moe.num_experts_per_tok} experts)"] if moe else []
    return active + [f"FLOPs per token: {est.flops_per_token:.4g} model (6N + 12·L·H·Q·T), "
            f"{est.hardware_flops_per_token:.4g} hardware (with recomputation)",
            f"FLOPs per step: {est.flops_per_token * est.tokens_per_step:.4g} "
            f"({est.tokens_per_step:,} tokens per step)"]


def time_lines(est: Estimate, tokens: float | None = None, baseline_tokens_per_s_per_gpu: float | None = None) -> list[str]:
    t = est.time
    if t is None:
        return []
    lines = ["Step time:",
             f"  compute {t.compute_s * 1e3:10.1f} ms   pipeline bubble {t.bubble_s * 1e3:8.1f} ms",
             *([f"    of which {t.cp_recurrence_s * 1e3:.1f} ms linear attention's recurrence waiting for the "
                f"context rank before (cp={est.layout.cp})"] if t.cp_recurrence_s else []),
             f"  tensor-parallel comm {t.tp_comm_s * 1e3:8.1f} ms   pipeline transfers {t.pp_comm_s * 1e3:8.1f} ms",
             f"  data-parallel comm {t.dp_comm_s * 1e3:8.1f} ms, exposed {t.dp_exposed_s * 1e3:8.1f} ms",
             *([f"  expert all-to-all {t.ep_comm_s * 1e3:8.1f} ms (ep={est.layout.ep}, routing skew "
                f"{est.routing_skew:g})"] if est.layout.ep > 1 else []),
             *([f"  {'teacher' if est.objective.name == 'distill' else 'reference'} forward {t.frozen_s * 1e3:8.1f} ms "
                f"(compute {t.frozen_compute_s * 1e3:.1f} ms)"] if t.frozen_s else []),
             f"  step {t.step_s:.3f} s -> {t.tokens_per_s:,.0f} tokens/s, {t.tokens_per_s_per_gpu:,.0f} per GPU, "
             f"MFU {t.mfu:.1%} (HFU {t.hfu:.1%})"]
    if baseline_tokens_per_s_per_gpu:
        lines.append(f"  scaling efficiency vs the baseline: {t.tokens_per_s_per_gpu / baseline_tokens_per_s_per_gpu:.1%}")
    if tokens:
        lines.append(f"  {tokens:.3g} tokens: {tokens / t.tokens_per_s / 86400:.1f} days")
    return lines


def layout_line(layout: Layout) -> str:
    return (f"Layout: {layout.describe(micro_batch=True)} on {layout.world_size} GPU(s), global batch "
            f"{layout.global_batch_size} x {layout.seq_len} tokens")


def winner_yaml(est: Estimate, tokens: float | None = None) -> str:
    """winner_config as the YAML `plan --out` writes, with a note on where its optimizer settings come from."""
    import yaml

    return (f"# written by `disttrain plan`: the fastest layout that fits. The optim section is a starting point for\n"
            f"# a model of {est.shape.num_params() / 1e9:.2f} B parameters (learning rate by size, from GPT-3's table; "
            "warmup 1% of\n# the steps, 100 to 2000; cosine to a tenth), not a tuned one.\n"
            + yaml.safe_dump(winner_config(est, tokens), sort_keys=False))


def winner_config(est: Estimate, tokens: float | None = None) -> dict:
    """The chosen layout as a RunConfig dictionary (loads with `disttrain train`)."""
    lay, shape = est.layout, est.shape
    from disttrain.models.registry import MODEL_SHAPES

    steps = max(1, round(tokens / est.tokens_per_step)) if tokens else 1000
    if est.model not in MODEL_SHAPES and not est.model.endswith("-shaped"):  # a user spec, or a Hugging Face directory
        return _config(est, {"spec" if ":" in est.model else "hf": est.model}, steps)
    # `--params` shapes are a registry shape with another depth, named "<base>-shaped".
    model: dict = {"name": est.model.removesuffix("-shaped")}
    base = MODEL_SHAPES[model["name"]]
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim"):
        if getattr(shape, key) != getattr(base, key):
            model[key] = getattr(shape, key)
    if lay.seq_len > base.max_seq_len:
        model["max_seq_len"] = lay.seq_len
    return _config(est, model, steps)


def _config(est: Estimate, model: dict, steps: int) -> dict:
    """The Layout's own config keys (`Layout.to_config`), less those at the schema's defaults; a pipeline's
    schedule length spelled out (`parallel.pp_microbatches`)."""
    from disttrain.config.schema import RunConfig

    lay = est.layout
    if lay.pp > 1:
        lay = lay.replace(pp_microbatches=lay.microbatches)
    if lay.balanced:  # a mixed cluster: shares by peak FLOP/s to start, then by measured speed
        lay = lay.replace(balance="auto")
    defaults = RunConfig().model_dump(mode="json", by_alias=True)
    sections = {name: {k: v for k, v in keys.items() if k in ("dp_shard", "zero_stage") or v != defaults[name][k]}
                for name, keys in lay.to_config().items() if isinstance(keys, dict)}
    sections["train"] = {"steps": steps, **sections["train"]}
    sections["optim"] = optimizer_section(est.shape.num_params(), steps)
    if est.optimizer != "adamw":
        sections["optim"] = {"name": est.optimizer, **sections["optim"]}
    if est.state_dtype != "fp32":
        sections["optim"] = {**sections["optim"], "state_dtype": est.state_dtype}
    objective = est.objective
    if objective.name != "lm":  # the data must suit it (pairs, a teacher's tokenizer): the user's to set
        sections["train"]["objective"] = objective.name
        sections["dpo"] = {"precompute_reference": True} if objective.name == "dpo" and \
            objective.forward_shape is None else {}
        sections["distill"] = {"teacher": objective.teacher} if objective.teacher else {}
    order = ("data", "train", "dpo", "distill", "optim", "parallel", "precision")
    return {"model": model, **({"engine": lay.engine} if lay.engine != "torch" else {}),
            **{name: sections[name] for name in order if sections.get(name)}}


# Peak AdamW learning rates by model size, from GPT-3's table of model sizes (Brown et al. 2020, table 2.1):
# (parameters, lr). Between two rows the rate is interpolated in log-log; beyond the ends it is the end's.
LR_BY_SIZE = ((125e6, 6.0e-4), (350e6, 3.0e-4), (760e6, 2.5e-4), (1.3e9, 2.0e-4), (2.7e9, 1.6e-4),
              (6.7e9, 1.2e-4), (13e9, 1.0e-4), (175e9, 0.6e-4))


def learning_rate_for(num_params: float) -> float:
    import math

    if num_params <= LR_BY_SIZE[0][0]:
        return LR_BY_SIZE[0][1]
    for (n0, lr0), (n1, lr1) in zip(LR_BY_SIZE, LR_BY_SIZE[1:]):
        if num_params <= n1:
            t = math.log(num_params / n0) / math.log(n1 / n0)
            return float(f"{math.exp(math.log(lr0) + t * math.log(lr1 / lr0)):.2g}")
    return LR_BY_SIZE[-1][1]


def optimizer_section(num_params: float, steps: int) -> dict:
    """A starting point for a run of this size, not a tuned one (the written config says so): AdamW at the size's
    rate (LR_BY_SIZE), linear warmup over 1% of the steps (at least 100, at most 2000: GPT-3 and Llama 2 warmed up
    for a few hundred to 2000 steps), cosine decay to a tenth of the peak, weight decay 0.1, gradients clipped at 1."""
    lr = learning_rate_for(num_params)
    warmup = min(2000, max(100, round(0.01 * steps)), max(steps - 1, 0))
    return {"lr": lr, "warmup_steps": warmup, "schedule": "cosine", "min_lr": float(f"{lr / 10:.2g}"),
            "weight_decay": 0.1, "grad_clip": 1.0}
