"""CIFAR ResNet-18 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016)."""

from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from .convnet import ImageSize, check_model_args, trace_hw

Norm = Literal["batch", "group"]
_MAX_GROUPS = 32


def _groups_for(channels: int) -> int:
    """Largest divisor of ``channels`` that is at most 32 (GroupNorm needs an exact split)."""
    return max(g for g in range(1, min(_MAX_GROUPS, channels) + 1) if channels % g == 0)


def _norm(kind: Norm, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(_groups_for(channels), channels)


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (1x1 projection when the shape changes)."""

    def __init__(self, in_planes: int, planes: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = _norm(norm, planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), _norm(norm, planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 in its CIFAR form: 3x3 stride-1 stem, no max-pool, BasicBlocks [2, 2, 2, 2].

    Stage widths are ``width * (1, 2, 4, 8)`` (64..512 by default), followed by global average
    pooling and a linear layer; about 11.17M parameters with the defaults (CIFAR-10, 3x32x32).
    ``norm="group"`` swaps every BatchNorm for GroupNorm (the largest group count <= 32 that divides
    the width), which per-sample-gradient tools such as Opacus (DP-SGD) require.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: ImageSize = 32,
        norm: Norm = "batch",
        width: int = 64,
    ) -> None:
        super().__init__()
        hw = check_model_args(num_classes, in_channels, image_size)
        if norm not in ("batch", "group"):
            raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an int >= 1, got {width!r}")
        # stem + the three stride-2 stage entries; any positive size survives them
        trace_hw(hw, [(3, 1, 1), (3, 2, 1), (3, 2, 1), (3, 2, 1)], image_size, "ResNet18")
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = _norm(norm, width)
        stages = []
        in_planes = width
        for i, stride in enumerate((1, 2, 2, 2)):
            planes = width * 2**i
            stages.append(
                nn.Sequential(BasicBlock(in_planes, planes, stride, norm), BasicBlock(planes, planes, 1, norm))
            )
            in_planes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(torch.flatten(self.pool(out), 1))
