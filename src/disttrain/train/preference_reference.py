"""The reference model of DPO: the policy as it was before training, run forward only.

With LoRA the reference is the policy itself with its adapters switched off (peft's per-layer switch): the
base weights are frozen, so the base is the starting model, and no second copy exists. Otherwise the reference
is a second model built exactly as the policy was (same spec, seed or `model.init_from` weights, so it equals
the policy's starting point on every layout and after every resume) and parallelised like it (tensor, expert
and FSDP sharding), with no gradients, no optimizer state and no DDP wrapper (it has nothing to synchronise).
"""

from __future__ import annotations

import contextlib

from torch import nn


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """peft's adapter-holding layers of `model` (found once, switched every step)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_off(layers: list[nn.Module]):
    """peft's LoRA layers compute their base layer alone. The flag is flipped directly: peft's
    `enable_adapters` would also change the adapters' requires_grad, which the optimizer and FSDP hold."""
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def lora_reference(policy: nn.Module):
    """inputs -> the outputs of the policy with its adapters off."""
    layers = lora_layers(policy)

    def forward(inputs):
        with adapters_off(layers):
            return policy(inputs)
    return forward


def frozen_copy(model: nn.Module, spec, layout, meshes, device, parallel_options, document_eos: int | None):
    """inputs -> the outputs of `model` (a freshly built copy of the starting policy, or a teacher), frozen and
    parallelised like the policy. Under ZeRO-2 each block is resharded after its forward all the same: ZeRO-2
    keeps a block's gathered parameters for its backward, which a frozen model never runs, so they would stay
    gathered for the whole run (a whole unsharded copy on every rank). Uneven shares keep them gathered, as for
    the policy: every rank must issue the same all-gathers."""
    from dataclasses import replace

    from disttrain.parallel.parallelize import parallelize

    model.requires_grad_(False)
    frozen = replace(layout, activation_checkpointing="none")
    if layout.zero_stage == 2 and not layout.balanced:
        frozen = replace(frozen, zero_stage=3)
    return parallelize(model, spec, frozen, meshes, device, parallel_options, document_eos, frozen=True)


def run_frozen(model: nn.Module, inputs):
    """A frozen model's forward. FSDP keeps the root's parameters (embeddings, output layer) gathered after a
    forward, for the backward that a frozen model never runs: they are resharded at once (125m under ZeRO-3:
    94 MiB a rank, by the dry run; a reshard inside the forward's own hooks is ignored by FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    outputs = model(inputs)
    if isinstance(model, FSDPModule):
        model.reshard()
    return outputs


class PipelinePass:
    """What a frozen model's forward-only pass through a pipeline leaves on the last stage, by micro-batch (DPO's
    reference log-probabilities, a teacher's logits): the loss keeps one value per call while `collecting()`
    (the schedule calls it micro-batch 0 first), and the policy's pass reads them back by index."""

    def __init__(self):
        self._collecting: list | None = None
        self._kept: list = []

    @property
    def active(self) -> bool:
        return self._collecting is not None

    @contextlib.contextmanager
    def collecting(self):
        self._collecting = []
        try:
            yield
        finally:
            self._kept, self._collecting = self._collecting, None

    def keep(self, value):
        self._collecting.append(value)

    def get(self, microbatch: int | None):
        """The value kept for `microbatch`, or None (not on a pipeline, or no pass kept it)."""
        if microbatch is None or self.active or microbatch >= len(self._kept):
            return None
        return self._kept[microbatch]
