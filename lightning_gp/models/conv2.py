"""FEMNIST CNN of "LEAF: A Benchmark for Federated Settings" (Caldas et al., 2018)."""

import torch
from torch import nn

from .convnet import ImageSize, check_model_args, trace_hw


class Conv2(nn.Module):
    """LEAF's two-conv FEMNIST reference model.

    Conv(in, 32, 5, pad 2) ReLU MaxPool2, Conv(32, 64, 5, pad 2) ReLU MaxPool2, flatten,
    Linear(->2048) ReLU, Linear(2048 -> num_classes). Defaults fit FEMNIST (1x28x28, 62 classes).
    """

    def __init__(self, num_classes: int = 62, in_channels: int = 1, image_size: ImageSize = 28) -> None:
        super().__init__()
        hw = check_model_args(num_classes, in_channels, image_size)
        h, w = trace_hw(hw, [(5, 1, 2), (2, 2, 0), (5, 1, 2), (2, 2, 0)], image_size, "Conv2")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * h * w, 2048),
            nn.ReLU(),
            nn.Linear(2048, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
