"""Sigmoid LeNet of "Deep Leakage from Gradients" (Zhu, Liu & Han, NeurIPS 2019)."""

from typing import Literal

import torch
from torch import nn

from .convnet import ImageSize, check_model_args, trace_hw

_INIT_BOUND = 0.5


class LeNetZhu(nn.Module):
    """LeNet variant used by DLG, iDLG and Inverting Gradients.

    Three 5x5 convs (12 channels, strides 2, 2, 1, padding 2) each followed by Sigmoid, then one
    linear layer. The smooth, twice-differentiable Sigmoid is what makes gradient matching easy.
    ``init="uniform"`` reproduces DLG's init (every weight and bias ~ U[-0.5, 0.5]);
    ``init="default"`` keeps PyTorch's initialisation. Defaults fit Fashion-MNIST (1x28x28).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: ImageSize = 28,
        init: Literal["uniform", "default"] = "uniform",
    ) -> None:
        super().__init__()
        hw = check_model_args(num_classes, in_channels, image_size)
        if init not in ("uniform", "default"):
            raise ValueError(f"init must be 'uniform' or 'default', got {init!r}")
        h, w = trace_hw(hw, [(5, 2, 2), (5, 2, 2), (5, 1, 2)], image_size, "LeNetZhu")
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 12, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, padding=2, stride=1),
            nn.Sigmoid(),
        )
        self.fc = nn.Linear(12 * h * w, num_classes)
        if init == "uniform":
            with torch.no_grad():
                for p in self.parameters():
                    p.uniform_(-_INIT_BOUND, _INIT_BOUND)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.body(x), 1))
