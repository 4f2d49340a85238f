"""transformers' eager attention, which a model with attention sinks runs (gpt-oss): the attention probabilities it
keeps and the score-sized tensors its backward holds (plan/activations.py counts them in a layer, plan/moe.py beside
a mixture of experts)."""

from __future__ import annotations

from disttrain.layout.layout import Layout
from disttrain.models.shape import ModelShape
from disttrain.plan.dtypes import dtype_bytes


def eager_held_scores(mode: str) -> int:
    """Score-sized tensors eager attention holds beside the saved ones at its fullest moment: its forward keeps three
    at once (the scaled product plus the mask, its concatenation with the sink column, the shifted logits), and its
    backward as many (the probabilities' gradient padded by the sink column, the row maximum's scattered gradient,
    softmax's input gradient, the layer's own probabilities freed by then). Without checkpointing the layer's own
    probabilities, among the saved ones, do not exist yet at that moment (two beyond the saved); selective
    checkpointing keeps the q·kᵀ product through it (three); full recomputes the probabilities, counted with the
    layer's recomputed tensors (two more). Listed op by op on real tensors, and checked by the dry run on a tiny
    gpt-oss whose scores dominate (tests/test_plan_published.py): four had put gpt-oss-20b's plan (pp=16,
    selective) 5.2% over its dry run."""
    return 3 if mode == "selective" else 2


def eager_scores_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """The attention probabilities transformers' eager attention keeps for its backward (micro_batch x heads x
    s x s in the residual dtype; a sink adds a column): the kernel a model with attention sinks runs (gpt-oss: sdpa
    cannot take them, models/hf/kernels.py), a sliding window masking the scores, not shrinking them. 0 for the
    flash-style kernels, which keep none, and under context parallelism, whose kernels (parallel/ring_attention.py,
    sink_attention.py, gathered_attention.py) take the sinks through the log-sum-exp and keep no probabilities."""
    if shape.extras is None or not shape.extras.attention_sinks or layout.cp > 1:
        return 0.0
    _, er = dtype_bytes(layout)  # under autocast the fp32 mask makes the scores fp32 from the product on
    return er * micro_batch * (shape.n_heads // layout.tp) * seq_len * (seq_len + 1)


def eager_mask_bytes(shape: ModelShape, micro_batch: int, seq_len: int, layout: Layout) -> float:
    """The additive masks transformers makes once per stage forward for eager attention (micro_batch x 1 x s x s in the
    residual dtype; one causal, one sliding-window where layers of both kinds alternate), which each checkpointed
    layer takes as an input: kept with every micro-batch in flight on the stage until its backward. Listed by the dry
    run's tracker under full checkpointing: a tiny gpt-oss in two interleaved pipeline stages, and gpt-oss-120b's
    last pipeline rank, 18 of them (0.56 GiB) at its fullest backward."""
    if not eager_scores_bytes(shape, micro_batch, seq_len, layout) or layout.activation_checkpointing == "none":
        return 0.0
    _, er = dtype_bytes(layout)
    x = shape.extras
    masks = 2 if 0 < x.sliding_layers < shape.n_layers else 1
    return masks * er * micro_batch * seq_len * seq_len
