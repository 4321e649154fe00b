"""CNN6 of "R-GAP: Recursive Gradient Attack on Privacy" (Zhu & Blaschko, ICLR 2021)."""

import torch
from torch import nn

from .convnet import ImageSize, check_model_args, trace_hw

# (kernel, stride, padding) of the six convs and their output channels
_CONVS = [(4, 2, 2), (3, 2, 1), (3, 1, 1), (3, 1, 1), (3, 2, 1), (3, 1, 1)]
_WIDTHS = [12, 36, 36, 36, 64, 128]
_SLOPE = 0.2


class CNN6(nn.Module):
    """Six-conv LeakyReLU(0.2) network with no pooling and, by default, no biases (R-GAP's CNN6).

    Convs: in->12 (k4, s2, p2), 12->36 (k3, s2, p1), 36->36 (k3, s1, p1), 36->36 (k3, s1, p1),
    36->64 (k3, s2, p1), 64->128 (k3, s1, p1), each followed by LeakyReLU(0.2), then flatten and one
    linear layer (128*5*5 = 3200 features at 32x32). R-GAP solves each layer as a linear system in
    the weights, so its reference model has ``bias=False`` everywhere; pass ``bias=True`` otherwise.
    The reference head is a single logit trained with a logistic loss; here it has ``num_classes``
    outputs for cross-entropy training. Defaults fit CIFAR-10 (3x32x32).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: ImageSize = 32,
        bias: bool = False,
    ) -> None:
        super().__init__()
        hw = check_model_args(num_classes, in_channels, image_size)
        h, w = trace_hw(hw, _CONVS, image_size, "CNN6")
        layers: list[nn.Module] = []
        channels = in_channels
        for (kernel, stride, padding), width in zip(_CONVS, _WIDTHS):
            layers.append(nn.Conv2d(channels, width, kernel, stride=stride, padding=padding, bias=bias))
            layers.append(nn.LeakyReLU(negative_slope=_SLOPE))
            channels = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * h * w, num_classes, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
