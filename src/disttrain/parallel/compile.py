"""torch.compile per repeated block: the blocks share one compiled graph and compile fast."""

from torch import nn


def apply_compile(blocks: nn.Module) -> None:
    for block in blocks.children():
        block.compile()
