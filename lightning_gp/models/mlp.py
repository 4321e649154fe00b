"""A fully connected classifier: the model whose first layer the Cocktail Party attack unmixes."""

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from .convnet import ImageSize, check_model_args

Activation = Literal["relu", "leaky_relu", "sigmoid", "tanh"]
_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "leaky_relu": nn.LeakyReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
}


class MLP(nn.Module):
    """``Flatten -> [Linear -> activation] x len(hidden) -> Linear(num_classes)``, PyTorch's default init.

    The first layer is an ``nn.Linear`` on the flattened input, so its weight gradient is a linear
    mixture of the batch's images (what :class:`~lightning_gp.attacks.CocktailParty` unmixes). The
    default, one hidden layer of 256 units, is a two-layer fully connected network like the "FC-2" of
    Kariyappa et al. (ICML 2023), at Fashion-MNIST's size (1x28x28).

    Args:
        num_classes, in_channels, image_size: as every model here (defaults fit Fashion-MNIST).
        hidden: the width of each hidden layer (at least one layer, each >= 1 unit).
        activation: ``"relu"``, ``"leaky_relu"``, ``"sigmoid"`` or ``"tanh"`` after each hidden layer.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: ImageSize = 28,
        hidden: Sequence[int] = (256,),
        activation: Activation = "relu",
    ) -> None:
        super().__init__()
        h, w = check_model_args(num_classes, in_channels, image_size)
        widths = _check_hidden(hidden)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.hidden = widths
        self.activation = activation
        layers: list[nn.Module] = [nn.Flatten()]
        previous = in_channels * h * w
        for width in widths:
            layers += [nn.Linear(previous, width), _ACTIVATIONS[activation]()]
            previous = width
        layers.append(nn.Linear(previous, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _check_hidden(hidden: Sequence[int]) -> tuple[int, ...]:
    """``hidden`` as a tuple of positive ints, or a ValueError naming it."""
    if isinstance(hidden, (str, bytes)) or not isinstance(hidden, Sequence):
        raise ValueError(f"hidden must be a sequence of positive ints (the hidden layers' widths), got {hidden!r}")
    widths = tuple(hidden)
    if not widths or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in widths):
        raise ValueError(f"hidden must be a non-empty sequence of positive ints, got {hidden!r}")
    return widths
