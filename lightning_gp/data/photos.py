"""The public-domain / CC0 photographs bundled in the scikit-image wheel, read without importing it.

Shared by :class:`~lightning_gp.data.photo_crops.PhotoCropsDataModule` (labelled RGB crops for tests
and examples) and Refiner's evaluation network (:mod:`lightning_gp.refiner.training`, which trains on
:data:`TRAIN_PHOTOS` and holds out :data:`HELDOUT_PHOTOS`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from lightning_gp.data.base import CorruptDatasetError, DatasetNotFoundError

#: Photographs bundled in the scikit-image wheel (``skimage/data``), with their licences as
#: scikit-image's ``skimage.data`` docstrings state them. Grey ones are repeated to 3 channels.
TRAIN_PHOTOS: dict[str, str] = {
    "astronaut.png": "Eileen Collins, NASA Great Images; public domain",
    "rocket.jpg": "DSCOVR launch on Falcon 9, SpaceX; public domain",
    "hubble_deep_field.jpg": "Hubble eXtreme Deep Field, NASA; public domain",
    "retina.jpg": "human retina fundus photograph, Mikael Häggström, Wikimedia; CC0 1.0",
    "camera.png": "cameraman, Lav Varshney; CC0 (grey)",
    "brick.png": "brick wall, CC0Textures Bricks25; CC0 (grey)",
    "grass.png": "grass, CC0Textures; CC0 (grey)",
    "gravel.png": "gravel, CC0Textures Gravel04; CC0 (grey)",
    "clock_motion.png": "clock, Stefan van der Walt; public domain (grey)",
}
HELDOUT_PHOTOS: dict[str, str] = {
    "chelsea.png": "Chelsea the cat, Stefan van der Walt; CC0",
    "coffee.png": "coffee cup, Rachel Michetti (Pikolo Espresso Bar); CC0",
}


class PhotosNotFoundError(DatasetNotFoundError):
    """scikit-image (whose wheel bundles the photographs) is not installed, or a photograph is missing."""


def scikit_image_data_dir() -> Path | None:
    """``skimage/data`` of the installed scikit-image, found without importing it; None when it is not installed."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "data"


def read_photo(path: Path) -> np.ndarray:
    """A photograph as uint8 ``[3, H, W]`` (grey repeated to 3 channels).

    Raises:
        PhotosNotFoundError: the file does not exist.
        CorruptDatasetError: it cannot be decoded.
    """
    from PIL import Image

    if not path.is_file():
        raise PhotosNotFoundError(f"photograph {path} is missing")
    try:
        with Image.open(path) as image:
            array = np.array(image.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError) as err:
        raise CorruptDatasetError(f"photograph {path} cannot be read ({err})") from err
    return np.ascontiguousarray(array.transpose(2, 0, 1))


def pyramid(photo: np.ndarray, size: int) -> list[np.ndarray]:
    """The photo downsampled (antialiased) so its shorter side is size * 2^(k/2), up to its own size.

    Levels are uint8 ``[3, h, w]``, smallest first; the last is the photo itself. PIL's Lanczos
    filter makes a pixel of a level depend on the photo's pixels within 3 of that level's pixels.
    """
    from PIL import Image

    height, width = photo.shape[1:]
    short = min(height, width)
    image = Image.fromarray(photo.transpose(1, 2, 0))
    levels = []
    k = 0
    while size * 2 ** (k / 2) < short:
        side = size * 2 ** (k / 2)
        new = (max(size, round(width * side / short)), max(size, round(height * side / short)))
        levels.append(np.array(image.resize(new, Image.Resampling.LANCZOS), dtype=np.uint8).transpose(2, 0, 1))
        k += 1
    levels.append(photo)
    return levels
