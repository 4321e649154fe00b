"""CIFAR VGG-11 (Simonyan & Zisserman, "Very Deep Convolutional Networks", ICLR 2015)."""

import torch
from torch import nn

from .convnet import ImageSize, check_model_args, trace_hw

# configuration "A" of the VGG paper; "M" is a 2x2 max-pool
_CFG: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VGG11(nn.Module):
    """VGG-11 for small images: 3x3 convs (optionally BatchNorm) with ReLU and five 2x2 max-pools.

    Instead of the ImageNet 4096-4096 head it uses the single-linear classifier common in CIFAR
    code: Linear(512 * (H // 32) * (W // 32), num_classes), i.e. 512 features at 32x32. Needs
    images of at least 32x32. Defaults fit CIFAR-10 (3x32x32).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: ImageSize = 32,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        hw = check_model_args(num_classes, in_channels, image_size)
        shape_chain = [(3, 1, 1) if v != "M" else (2, 2, 0) for v in _CFG]
        h, w = trace_hw(hw, shape_chain, image_size, "VGG11")
        layers: list[nn.Module] = []
        channels = in_channels
        for v in _CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            assert isinstance(v, int)
            layers.append(nn.Conv2d(channels, v, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(v))
            layers.append(nn.ReLU())
            channels = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
