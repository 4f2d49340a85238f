"""What is alive at each moment of a step where a rank's peak can fall (the loss's backward, a block's, the
optimizer step, DDP's first step, a pipeline's last backward and deferred reduction, ZeRO-2's forward), by the
dry run's categories: `estimate_memory` (plan/memory.py) reports the fullest. Each term says which dry run's
tracker listing it came from."""

from __future__ import annotations

from disttrain.layout.layout import DTYPE_BYTES, Layout
from disttrain.plan.activations import FP32, StageActivations


def alive_at_moments(states, acts: StageActivations, layout: Layout, gathered: float, unit: float,
                     root: float, pipe: float, grad_unit: float | None = None,
                     grad_root: float | None = None, all_gathered: float = 0.0, mlp: float = 0.0,
                     product: float = 0.0, layers: int = 0, reduced: float = 0.0,
                     early_root: float | None = None, last_output: float = 0.0,
                     expert_unit: float = 0.0) -> dict[str, dict]:
    """What is alive at each moment, by category. `states`: plan/memory.py's ModelStates of the rank. `gathered`:
    FSDP's all-gathered parameters held through the step (ZeRO-2: every unit; ZeRO-3: the root unit); `unit`:
    one block's parameters; `grad_unit`, `grad_root`: those of them that get gradients (LoRA: the block's
    adapters, none of the root's); `pipe`: a pipeline's receive buffers and token ids, activations to the dry
    run's tracker (made outside any backward); `mlp`: the MLP backward's gradients
    (activations.mlp_backward_bytes); `product`: the gated product saved without checkpointing; `layers`: the rank's blocks; `reduced`: the parameters of the first FSDP
    unit whose reduce-scatter a pipeline defers to after its last backward; `early_root`: the root's parameters
    whose gradients exist while a block runs its backward (the output layer and final norm: the embedding's come
    after every block's); `last_output`: a pipeline stage's output of its last forward (the logits on the last stage);
    `expert_unit`: of `unit`, the routed experts in an FSDP unit of their own, reduced before the rest of their
    block."""
    grad_unit = unit if grad_unit is None else grad_unit
    grad_root = root if grad_root is None else grad_root
    s = states
    pb, rb = DTYPE_BYTES[layout.param_dtype], DTYPE_BYTES[layout.reduce_dtype]
    fsdp = layout.zero_stage >= 2 and layout.engine == "torch"
    # FSDP's sharded gradients appear at the last micro-batch's reduce-scatter (set to None after each
    # step); DDP's are its buckets, there from the start.
    grads = s.unsharded_grads if fsdp else s.grads
    first_backward = False
    if layout.pp > 1 and acts.at_block is None and acts.in_flight >= layout.microbatches:
        # Every micro-batch in flight (GPipe; 1F1B where the warmup's forwards are all of them, as on the first stage
        # when there are no more than pp): that happens before the rank's first backward, with no gradients yet.
        # 7b, pp=4 1F1B, 4 micro-batches: counting them there put the first stage +16.6% over the dry run.
        first_backward = fsdp
        grads = 0.0 if fsdp else grads
    if fsdp and layout.reduces_every_microbatch and not first_backward and (layout.microbatches > 1 or layout.pp > 1):
        # Reduce-scattered every micro-batch: the earlier micro-batches' sharded gradients (none on the device under
        # CPU offload) are there all through a later one, and no whole gradient outlives its backward.
        sharded_grads = s.grads
    else:
        sharded_grads = 0.0
    loss_grads, loss_acts, loss_pending, block_pending = grads + sharded_grads, acts.saved, 0.0, 0.0
    # One rank, one micro-batch, no pipeline: no gradient outlives a step (set to None after it) and none is a
    # bucket, so the loss's backward starts with none and a block's finds only the output layer's and final
    # norm's (7b at 4 x 4,096 tokens on one GPU: counting every gradient there put the planner 13% over the dry run)
    made_in_backward = not fsdp and layout.gradient_wrapper == "none" and layout.microbatches == 1 and layout.pp == 1
    if made_in_backward:
        loss_grads = 0.0
    loss_gathered = block_gathered = 0.0
    if acts.at_block is not None:  # several stages per rank: what the schedule's order holds at each moment
        if fsdp:  # FSDP's accumulated gradients exist for the stages that have run a backward
            grads, loss_grads = acts.at_block.grads, acts.at_loss.grads
        # zero-bubble's weight-pass inputs, its loose gradients and the input gradients kept: temporaries to the tracker
        loss_acts, loss_pending, block_pending = acts.saved_at_loss, acts.at_loss.temporary, acts.at_block.temporary
        loss_gathered, block_gathered = acts.at_loss.gathered, acts.at_block.gathered
    copies = 0.0 if fsdp else s.buffers  # autocast's low-precision weight copies, kept as activations
    moments = {}
    if acts.logits:  # the loss's backward: its gradient and the logits' (loss_parallel keeps one more shard)
        moments["loss"] = {"parameters": s.params + s.tables, "gradients": loss_grads, "optimizer": s.optimizer,
                           "activations": loss_acts + copies - (0.0 if fsdp else s.block_copies) + pipe,
                           "temporary": (3 if layout.tp > 1 else 2) * acts.logits + loss_pending,
                           "communication": gathered + loss_gathered}
    elif acts.chunk:  # a chunked head's forward: one chunk's temporaries, which the dry run's tracker files with
        # the forward's activations; the gradients there are the loss backward's (none made yet by this micro-batch)
        moments["loss"] = {"parameters": s.params + s.tables, "gradients": loss_grads, "optimizer": s.optimizer,
                           "activations": loss_acts + copies - (0.0 if fsdp else s.block_copies) + pipe + acts.chunk,
                           "temporary": loss_pending, "communication": gathered + loss_gathered}
    # The root's unsharded gradients made before the blocks' backwards, pending until the root's post-backward (13b
    # ZeRO-3, full checkpointing: +2.8% against the dry run; counting the embedding's too, +5.7%).
    # Without a pipeline a block's one-micro-batch gradients are counted as temporaries below, as the dry run files them.
    early_root = grad_root if early_root is None else min(early_root, grad_root)
    block_grads = grads if s.unsharded_grads or not fsdp else (0.0 if layout.pp == 1 else pb * early_root)
    if made_in_backward:
        block_grads = pb * early_root
    # The block gathered (ZeRO-3: and the next one prefetched) and its unsharded gradients, unless those
    # are already counted among the accumulated ones.
    gathers = 2 * pb * unit if layout.reshard_after_forward else 0.0
    in_use = gathers + (0.0 if s.unsharded_grads else (pb + rb) * grad_unit) if fsdp else 0.0
    block_acts, block_temp = acts.saved - acts.logits - acts.block_freed + copies + pipe, acts.layer + block_pending
    if fsdp and not s.unsharded_grads:
        # One micro-batch: the output layer's unsharded gradients, pending until the end of the backward, and of
        # the block's only those made by its fullest moment (acts.grad_share), temporaries to the dry run's
        # tracker; from the second block on, the previous block's reduce-scatter input too (rb) and its sharded
        # gradients, while that block's saved activations are freed and, under ZeRO-2, its gathered parameters
        # (pb, among `gathered`): the fuller of the first and a later block. Torch's tracker on the dry run,
        # `debug` and `debug-moe` at seq 128, cp=2, ZeRO-2: the block moment counted both at once, 28-29% over
        # the fullest block measured, and was taken for the peak (+9% and +17%); `tiny` cp=4 ZeRO-3: +12.6%.
        # The experts' own unit is reduced mid-block, and its input freed by the block's own reduce-scatter: a block's
        # experts find only the block before's other parameters' input (DeepSeek-V3 at 4,096 tokens, ZeRO-3, 64 ranks:
        # +15.3% against the dry run counting the experts' fp32 input there too, 5.3 GiB).
        previous = (rb - (0 if layout.reshard_after_forward else pb)) * (grad_unit - expert_unit)
        if layout.pp == 1:
            # that block's sharded gradients (copied to the host at once under CPU offload)
            sharded = 0.0 if layout.cpu_offload else FP32 * grad_unit / layout.shard_ranks
            later = previous + sharded > acts.layer_saved
            in_use = gathers + (previous if later else 0.0)
            block_acts -= acts.layer_saved if later else 0.0
            block_grads = sharded if later else 0.0
            block_temp += pb * (grad_root + acts.grad_share * grad_unit)
        else:  # pipelines: their schedules' terms (plan/activations.py schedule_peak)
            in_use = gathers + pb * grad_unit + max(0.0, previous - acts.layer_saved)
    elif fsdp and layout.pp == 1 and FP32 * grad_unit / layout.shard_ranks > acts.layer_saved:
        # Accumulating: in the last micro-batch's backward each finished block's gradients become its reduce-scatter
        # input and a sharded gradient, fuller than a first block when its saved tensors are fewer (checkpointing).
        block_grads += FP32 * grad_unit / layout.shard_ranks - rb * grad_unit
        in_use += rb * grad_unit
        block_acts -= acts.layer_saved
    if fsdp and layout.pp == 1 and expert_unit and layout.reshard_after_forward:
        # Attention's backward comes after its block's experts' own unit has been reduced and resharded: their gathered
        # parameters and the next block's (not prefetched yet) are gone, and their gradients of this micro-batch
        # are their fp32 reduce-scatter input (counted above when accumulating). Only what attention holds beyond
        # that counts (DeepSeek-V3 at 131,072 tokens, cp=8 ring: the ring's backward had been counted beside the
        # experts, +5.8% over the dry run, whose peak stays in the experts' backward; a tiny one accumulating, +9%).
        gone = 2 * pb * expert_unit + (0.0 if s.unsharded_grads else (pb - rb) * expert_unit)
        block_temp -= min(acts.attention_excess, max(0.0, gone))
    block = {"parameters": s.params + s.tables, "gradients": block_grads + sharded_grads, "optimizer": s.optimizer,
             "activations": block_acts, "temporary": block_temp + (acts.at_block.fresh if acts.at_block else 0.0),
             "communication": gathered + in_use + block_gathered}
    moments["block"] = block
    # Without a pipeline the MLP backward's gradients are in acts.layer (block_backward_bytes); zero-bubble's schedule
    # counts them in its whole backwards (plan/schedule_memory.py), its other passes run none.
    if layout.pp > 1 and layout.pp_schedule != "zero_bubble":
        moments["block"] = max(block, _mlp_backward(block, acts, layout, mlp, product, gathered + gathers + block_gathered,
                                                    s.grads if not fsdp and layout.gradient_ranks > 1 else 0.0,
                                                    s.unsharded_grads if first_backward else block["gradients"]),
                               key=lambda m: sum(m.values()))
    if first_backward:
        # That backward frees one micro-batch's activations block by block while the gradients accumulate: its
        # last block (a recomputation, under checkpointing) runs beside the other micro-batches and the gradients of
        # every unit but itself and the root, whose post-backwards come after (the root's: "backward end" below).
        # 70b pp=4 1F1B, first stage: counting all of them there made this the planned peak, with no temporaries,
        # where the dry run peaks in the next backward's first MLP (temporaries 1.09 GiB; _mlp_backward).
        others = acts.saved * (acts.in_flight - 1) / acts.in_flight
        done = s.unsharded_grads - rb * (grad_unit + grad_root - early_root) if layers else s.unsharded_grads
        late = {**block, "gradients": max(done, 0.0), "activations": others + acts.layer_saved + copies + pipe}
        moments["block"] = max(moments["block"], late, key=lambda m: sum(m.values()))
    if fsdp and not layout.reshard_after_forward and layout.pp == 1:
        # ZeRO-2's forward gathers every unit and keeps it; each all-gather's output buffer lives until the next one
        # is waited for: two buffers at a block's start (the blocks before it saved), one after the last block (all
        # saved). The dry run's peak there for `tiny` at seq 512 (cp 2 and 4, each checkpointing mode).
        base = acts.saved - acts.logits - acts.loss_inputs
        moments["forward"] = max(({"parameters": s.params + s.tables, "gradients": s.unsharded_grads + sharded_grads,
                                   "optimizer": s.optimizer, "activations": act, "temporary": 0.0,
                                   "communication": gathered + buffers * pb * unit}
                                  for act, buffers in ((base - acts.layer_saved, 2), (base + acts.loss_inputs, 1))),
                                 key=lambda m: sum(m.values()))
    if fsdp and layout.pp > 1 and not layout.reduces_every_microbatch:  # reduced every micro-batch: nothing deferred
        # A backward done, before the deferred reduce-scatter: every unsharded gradient; and torch's schedules keep
        # the parameters gathered after every backward but the last (`set_reshard_after_backward(False)`), so the
        # end of the one before the last holds the stage's whole parameters and the other in-flight micro-batches.
        others = acts.saved * max(acts.in_flight - 1, 0.0) / acts.in_flight if layout.microbatches > 1 else 0.0
        # The root unit's gradients, in the parameter dtype, until its post-backward (the backward's very end) casts
        # them into the accumulated ones (7b pp=4 1F1B, first stage: the embedding's, 0.24 GiB by the dry run).
        root_grads = pb * grad_root if pb != rb and acts.at_block is None else 0.0
        moments["backward end"] = {"parameters": s.params + s.tables, "gradients": s.unsharded_grads + root_grads,
                                   "optimizer": s.optimizer, "activations": others + pipe,
                                   "temporary": acts.input_grads,
                                   "communication": all_gathered if layout.microbatches > 1 else gathered}
        if layout.microbatches > 1 and layout.reshard_after_forward and acts.at_block is None:
            # The same backward's last blocks: the stage is gathered by then (the last block's all-gather prefetched),
            # while this micro-batch still holds its first two blocks' saved tensors and the MLP backward's gradients.
            # The dry run's peak of 13b, HSDP 4 x 4, pp=2 1F1B, ZeRO-3 (the second block's MLP backward, 32 ranks).
            late = {**moments["backward end"], "temporary": acts.layer + mlp,
                    "activations": others + min(layers, 2) * acts.layer_saved + pipe}
            if layout.microbatches <= acts.in_flight:
                # No steady state (every micro-batch in flight at the first backward): the first backward's late blocks
                # hold the other micro-batches but only the gradients of the blocks done (none of the root's); a later
                # backward holds every gradient and one micro-batch fewer (tiny, 8 blocks, m=2: +3.8% counting both).
                done = (s.unsharded_grads - rb * grad_root) * max(layers - 2, 0) / max(layers, 1)
                late = max({**late, "gradients": done},
                           {**late, "activations": late["activations"] - acts.saved / acts.in_flight},
                           key=lambda m: sum(m.values()))
            moments["gathered block"] = late
        # After the last backward, torch's `perform_reduce_grad` reduces unit by unit (the root first) with the rest of
        # the stage still gathered and every unsharded gradient alive: the first unit's parameters resharded, its
        # reduce-scatter input and output beside them, activations to the dry run's tracker (made outside any
        # backward). 125m at seq 256, HSDP 2 x 2, pp=2 1F1B, ZeRO-3: where the dry run peaks (−7.3% without it).
        # The root's gradients in the parameter dtype are gone by then (cast at the backward's end; `tiny` with a
        # 16k vocabulary, pp=2 1F1B, first stage: +12.8% counting them).
        # Zero-bubble: each stage's last weight pass left its gradients in the parameter dtype beside the accumulated
        # ones (plan/schedule_memory.py `loose`; temporaries to the tracker), for the reduction to add in, and every
        # micro-batch's input gradient is still on its receive buffer (to the next step). The schedule's step holds the
        # output of this rank's last forward (a local of torch's `_step_microbatches`, `return_outputs=False` or not):
        # the last stage's logits (7b pp=4 GPipe, one micro-batch: -2.1% without them).
        loose = s.unsharded_grads * pb / rb if layout.pp_schedule == "zero_bubble" and pb != rb else 0.0
        moments["reduce"] = {**moments["backward end"], "gradients": s.unsharded_grads,
                             "temporary": acts.input_grads + loose,
                             "activations": pipe + last_output + rb * reduced * (1 + 1 / layout.shard_ranks),
                             "communication": all_gathered - pb * reduced}
    moments["step"] = {"parameters": s.params + s.tables, "gradients": s.grads,
                       "optimizer": s.optimizer + s.step_temporary,
                       "activations": pipe, "temporary": acts.input_grads, "communication": 0.0}  # receive buffers stay
    if s.forward_copies > copies and acts.logits and layout.pp == 1 and layout.tp == 1:
        # The loss's forward, under autocast with checkpointing: every weight's cached copy, and beside the fp32
        # log-softmax it keeps, the logits in the compute dtype and their fp32 copy (the dry run's peak at 125m and
        # 1b, DDP and ZeRO-1 with full checkpointing and two micro-batches: all of it activations to its tracker).
        ec = DTYPE_BYTES[layout.param_dtype]
        logits = acts.logits * (1 + (1 + ec / FP32 if ec < FP32 else 1))
        moments["loss forward"] = {**moments["loss"], "temporary": 0.0, "activations":
                                   loss_acts - acts.logits + logits + s.forward_copies + pipe}
    # DDP's first step: no optimizer states yet, autograd's gradients beside the buckets. With one micro-batch the
    # reducer copies each into its bucket as it is made, and they never all coexist (the dry run, which counts the
    # buckets from the start: 13b ZeRO-1 without checkpointing, 32 ranks, peaks at the loss's backward; counting both
    # there reads +4.2%, gradients +100%; `tiny` at seq 64, 8 ranks: +14.6% counting both, −1.4% as here).
    if s.first_step_grads and layout.microbatches > 1:
        moments["first step"] = {"parameters": s.params + s.tables, "gradients": s.grads + s.first_step_grads,
                                 "optimizer": 0.0, "activations": copies, "temporary": 0.0, "communication": 0.0}
        if "loss" in moments:  # accumulated outside the buckets, through the next loss
            loss = max((moments[k] for k in ("loss", "loss forward") if k in moments), key=lambda m: sum(m.values()))
            moments["first step"] = {**loss, "optimizer": 0.0, "gradients": loss["gradients"] + s.first_step_grads}
    return moments


def _mlp_backward(block: dict, acts: StageActivations, layout: Layout, mlp: float, product: float, communication: float,
                  first_grads: float, accumulated: float) -> dict:
    """The first block's MLP backward: its gradients beside the recomputed tensors (activations.mlp_backward_bytes),
    before that block's other weight gradients or any reduce-scatter input exist (which the block moment counts at
    a later block's end: counted on top of those, the dry run never holding both, they made `tiny` ZeRO-3 with
    full checkpointing +12% and 13b ZeRO-3 selective fp32 +5.6%). A pipeline rank whose first backward comes with
    every micro-batch of the step in flight (no steady state: m <= in flight) holds none of the step's gradients
    yet there (set to None after each step; DDP's buckets, `first_grads`, stay), and one micro-batch fewer at the
    next backward (tiny, tp=2+sp x pp=4, 4 micro-batches: the first rank +6.5% counting both at once), which holds
    the gradients the first one `accumulated` (FSDP's: 70b pp=4 1F1B, the first stage's peak by the dry run)."""
    # Without checkpointing the gated product is a saved tensor until w2's backward frees it: the dry run's tracker
    # files it as a temporary there (`tiny` pp=2 1F1B, no checkpointing: temporaries -28.6% counting it saved).
    moment = {**block, "temporary": block["temporary"] + mlp + product, "activations": block["activations"] - product,
              "communication": communication}
    if not mlp or acts.at_block is not None or layout.microbatches > acts.in_flight:
        return moment
    first = {**moment, "gradients": first_grads}
    one = (acts.saved - acts.logits) / acts.in_flight
    later = {**moment, "activations": moment["activations"] - one, "gradients": accumulated} \
        if layout.microbatches > 1 else first
    return max(first, later, key=lambda m: sum(m.values()))
