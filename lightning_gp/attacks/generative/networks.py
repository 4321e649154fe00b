"""The generative prior's networks: a small DCGAN (Radford, Metz, Chintala, ICLR 2016) for
``C x 28 x 28`` and ``C x 32 x 32`` images.

GGL (Li et al., CVPR 2022) searches the latent space of a GAN trained on public data of the task;
for 32x32 data they train a DCGAN-style generator. Ours follows the DCGAN guidelines at a size that
trains in minutes on two CPU cores:

- **Generator** ``G: z in R^d -> [0, 1]^{C x S x S}``: a linear layer to ``4w`` feature maps of
  ``S/4 x S/4``, two stride-2 transposed convolutions (``4w -> 2w -> w`` channels) with BatchNorm
  and ReLU, a 3x3 convolution to ``C`` channels and a sigmoid (pixels, not the model's normalised
  space: the attack normalises ``G(z)`` with the view's mean and std).
- **Discriminator**: two stride-2 convolutions (``C -> w -> 2w``) with LeakyReLU(0.2) (BatchNorm on
  the second), a linear layer to one logit.

``S`` is 28 or 32 (``S/4`` = 7 or 8); any other image shape is refused
(:func:`check_image_shape`), naming the shape.
"""

from __future__ import annotations

from torch import Tensor, nn

from lightning_gp.validation import check_positive_int

#: The image sizes (height = width) the networks are built for.
SUPPORTED_SIZES = (28, 32)


def check_image_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``shape`` as ``(C, S, S)`` with ``S`` in :data:`SUPPORTED_SIZES` and ``C >= 1``, else a
    ``ValueError`` naming the shape (the attack turns it into
    :class:`~lightning_gp.attacks.AttackNotApplicable`)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or shape[0] < 1 or shape[1] != shape[2] or shape[1] not in SUPPORTED_SIZES:
        raise ValueError(
            f"the generative prior is built for images C x 28 x 28 or C x 32 x 32, got input_shape {shape}"
        )
    return shape[0], shape[1], shape[2]


class Generator(nn.Module):
    """DCGAN generator ``z [N, latent_dim] -> pixels [N, C, S, S]`` in [0, 1] (module docstring).

    Args:
        image_shape: ``(C, S, S)``, ``S`` in 28 or 32.
        latent_dim: ``d``, the size of ``z`` (its prior is ``N(0, I_d)``).
        width: ``w``, the channels of the last hidden layer (``4w`` at the first).
    """

    def __init__(self, image_shape: tuple[int, ...], latent_dim: int, width: int) -> None:
        super().__init__()
        channels, size, _ = check_image_shape(image_shape)
        self.image_shape = (channels, size, size)
        self.latent_dim = check_positive_int(latent_dim, "latent_dim")
        self.width = check_positive_int(width, "width")
        base = size // 4
        self.net = nn.Sequential(
            nn.Linear(latent_dim, 4 * width * base * base),
            nn.Unflatten(1, (4 * width, base, base)),
            nn.BatchNorm2d(4 * width),
            nn.ReLU(),
            nn.ConvTranspose2d(4 * width, 2 * width, 4, stride=2, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, channels, 3, padding=1),
            nn.Sigmoid(),
        )

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    """DCGAN discriminator ``pixels [N, C, S, S] -> logits [N]`` (module docstring)."""

    def __init__(self, image_shape: tuple[int, ...], width: int) -> None:
        super().__init__()
        channels, size, _ = check_image_shape(image_shape)
        width = check_positive_int(width, "width")
        base = size // 4
        self.net = nn.Sequential(
            nn.Conv2d(channels, width, 4, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(width, 2 * width, 4, stride=2, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.Linear(2 * width * base * base, 1),
        )

    def forward(self, pixels: Tensor) -> Tensor:
        return self.net(pixels).squeeze(1)


__all__ = ["SUPPORTED_SIZES", "Discriminator", "Generator", "check_image_shape"]
