"""ResNet-18 image classification as a disttrain ModelSpec: the minimal contract for any nn.Module.

    model.spec=examples/vision/resnet.py:resnet18_spec
    data.source=py:examples/vision/resnet.py:fake_images
"""

from __future__ import annotations

import torch
from torch import nn

from disttrain.models.spec import ModelSpec

NUM_CLASSES = 10
IMAGE_SIZE = 32


class BasicBlock(nn.Module):
    """ResNet's two-convolution residual block (He et al. 2016), as torchvision builds it."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


def resnet18_stages() -> nn.ModuleList:
    widths = (64, 128, 256, 512)
    stages, cin = [], 64
    for i, w in enumerate(widths):
        stride = 1 if i == 0 else 2
        stages.append(nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
        cin = w
    return nn.ModuleList(stages)


class Classifier(nn.Module):
    """ResNet-18 (torchvision's layout: stem, four stages of two BasicBlocks, pooled linear head). The four
    stages sit in one ModuleList: the repeated blocks disttrain shards (FSDP units) and checkpoints one by
    one. torchvision's own `resnet18` is the same network; its wheel on PyPI is built against CUDA torch and
    does not import with the CPU build this project pins, so the example spells the network out."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.stages = resnet18_stages()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, NUM_CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """The same weights on every rank and layout: PyTorch's default initialisation under a fixed seed
    (built on CPU here, then copied into the materialised model)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        with torch.device("cpu"):
            reference = Classifier()
    model.load_state_dict(reference.state_dict())


def resnet18_spec() -> ModelSpec:
    return ModelSpec(name="resnet18", build=Classifier, init_weights=init_weights, blocks=lambda m: m.stages,
                     sync_batchnorm=True)


class FakeImages(torch.utils.data.Dataset):
    """Seeded random images whose class is written into them (a learnable toy task): item i is always the
    same tensor, so every layout and resume reads the same samples."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(NUM_CLASSES, (), generator=gen))
        image = torch.randn(3, IMAGE_SIZE, IMAGE_SIZE, generator=gen) * 0.5
        image[label % 3, :, label * 3:label * 3 + 3] += 2.0  # a class-dependent stripe
        return image, label


def fake_images() -> dict:
    return {"train": FakeImages(512, seed=0), "val": FakeImages(64, seed=1)}
