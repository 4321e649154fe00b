"""SimpleConvNet of the optimal-defenses paper, plus the shape/argument helpers every model here uses."""

from collections.abc import Sequence

import torch
from torch import nn

ImageSize = int | tuple[int, int]


def image_hw(image_size: ImageSize) -> tuple[int, int]:
    """Return ``(H, W)`` from an int or a pair, raising ValueError naming ``image_size`` if invalid."""
    if isinstance(image_size, Sequence) and not isinstance(image_size, str):
        hw = tuple(image_size)
    else:
        hw = (image_size, image_size)
    if len(hw) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in hw):
        raise ValueError(f"image_size must be an int or a pair of ints (H, W), got {image_size!r}")
    if min(hw) < 1:
        raise ValueError(f"image_size must be positive, got {image_size!r}")
    return hw[0], hw[1]


def check_model_args(num_classes: int, in_channels: int, image_size: ImageSize) -> tuple[int, int]:
    """Validate the three arguments every model takes; return the input ``(H, W)``."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
    if isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels < 1:
        raise ValueError(f"in_channels must be an int >= 1, got {in_channels!r}")
    return image_hw(image_size)


def conv_out_size(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial output length of a conv or pooling layer (PyTorch floor convention)."""
    return (size + 2 * padding - kernel) // stride + 1


def trace_hw(
    hw: tuple[int, int], layers: Sequence[tuple[int, int, int]], image_size: ImageSize, model: str
) -> tuple[int, int]:
    """Follow ``(kernel, stride, padding)`` layers from ``hw``; raise if the map vanishes on the way."""
    h, w = hw
    for kernel, stride, padding in layers:
        h, w = conv_out_size(h, kernel, stride, padding), conv_out_size(w, kernel, stride, padding)
        if h < 1 or w < 1:
            raise ValueError(
                f"image_size {image_size!r} is too small for {model}: its conv/pool chain "
                f"shrinks the feature map to nothing"
            )
    return h, w


class ConvNet(nn.Module):
    """SimpleConvNet from "Optimal Defenses Against Gradient Reconstruction Attacks" (appendix D.2).

    Conv(in, 32, 3, pad 1) LeakyReLU MaxPool2, Conv(32, 64, 3, pad 1) LeakyReLU MaxPool2, flatten,
    Linear(->32) LeakyReLU, Linear(32 -> num_classes). LeakyReLU keeps PyTorch's default slope 0.01
    as in the paper's code snippet. Module names (``conv_layers.0``, ``conv_layers.3``,
    ``fc_layers.1``, ``fc_layers.3``) match the paper's Table 1; with the defaults (MNIST, 1x28x28)
    it has 119,530 parameters (the paper's "120k"). The paper does not give the architecture of its
    2.9M-parameter CIFAR-10 ConvNet; ``in_channels=3, image_size=32`` here gives this same
    SimpleConvNet with a wider first linear layer, not that model.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: ImageSize = 28) -> None:
        super().__init__()
        hw = check_model_args(num_classes, in_channels, image_size)
        h, w = trace_hw(hw, [(3, 1, 1), (2, 2, 0), (3, 1, 1), (2, 2, 0)], image_size, "ConvNet")
        self.conv_layers = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
            nn.LeakyReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.LeakyReLU(),
            nn.MaxPool2d(2),
        )
        self.fc_layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * h * w, 32),
            nn.LeakyReLU(),
            nn.Linear(32, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_layers(self.conv_layers(x))
