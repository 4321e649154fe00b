"""The audit's recognisable-image tests for the user's own data, calibrated on the datamodule's public split.

:func:`recognition_tests` builds :class:`~lightning_gp.metrics.RecognitionTests` for one
datamodule from the images a server may hold (the test split, :func:`~lightning_gp.audit.rounds.public_examples`,
never a client's training data):

- the **identification test** (:class:`~lightning_gp.metrics.identification.IdentificationTest`) on
  those images and labels, by SSIM and, given an LPIPS module, the LPIPS feature distance;
- the **semantic test**: the shipped Fashion-MNIST classifier and line for the Fashion-MNIST datamodules
  (:func:`~lightning_gp.metrics.semantic_test.shipped_semantic_test`, the cached result for that data);
  for any other data a classifier trained and calibrated on the public split at audit time
  (:func:`~lightning_gp.metrics.semantic_test.fit_semantic_test`, cached by a fingerprint of the data).
  Digits, faces or X-rays of Fashion-MNIST's shape are never judged by the garment classifier.

A test the public split cannot calibrate (too few images per class) is kept as the reason why: the
audit's verdict then names it and is never "private". Public images outside the declared pixel range
(a datamodule whose ``mean``/``std`` do not undo its normalisation) are refused with an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from torch import Tensor, nn

from lightning_gp.metrics.identification import IdentificationCalibrationError, IdentificationTest
from lightning_gp.metrics.recognition import RecognitionTests
from lightning_gp.metrics.semantic_test import (
    SemanticCalibrationError,
    SemanticTest,
    fit_semantic_test,
    shipped_semantic_test,
)
from lightning_gp.normalization import denormalize

#: Pixels may stray this far outside [0, 1] after undoing the normalisation (float round-off).
PIXEL_TOLERANCE = 1e-3


def public_pixels(inputs: Tensor, mean: Sequence[float], std: Sequence[float], name: str = "mean, std") -> Tensor:
    """Public ``inputs`` (normalised with ``mean``/``std`` like the clients' inputs) as pixels in [0, 1];
    an error naming ``name`` where ``mean``/``std`` put them outside that range."""
    images = denormalize(inputs.detach().float().cpu(), tuple(mean), tuple(std), clamp=False)
    low, high = float(images.min()), float(images.max())
    if low < -PIXEL_TOLERANCE or high > 1 + PIXEL_TOLERANCE:
        raise ValueError(
            f"{name}: the public images are outside the pixel range [0, 1] once their normalisation is undone "
            f"(x * std + mean with mean={tuple(mean)}, std={tuple(std)} gives [{low:.3g}, {high:.3g}]); "
            "the audit scores reconstructions as [0, 1] pixels, so the images must be scaled to [0, 1] before "
            "normalising and mean/std must be the ones used"
        )
    return images.clamp(0, 1)


def uses_shipped_semantic_test(datamodule: L.LightningDataModule) -> bool:
    """Whether ``datamodule`` serves Fashion-MNIST, the data the shipped semantic classifier was trained on."""
    from lightning_gp.data.builtin_sample import FashionMNISTSampleDataModule
    from lightning_gp.data.mnist import FashionMNISTDataModule

    return isinstance(datamodule, (FashionMNISTDataModule, FashionMNISTSampleDataModule))


def recognition_tests(
    public: tuple[Tensor, Tensor],
    mean: Sequence[float],
    std: Sequence[float],
    *,
    shipped_semantic: bool = False,
    lpips_fn: nn.Module | None = None,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    source: str = "the public split",
    name: str = "mean, std",
) -> RecognitionTests:
    """The semantic and identification tests (module docstring) calibrated on ``public`` = ``(inputs,
    labels)``, public images normalised with ``mean``/``std`` like the clients' inputs.
    ``shipped_semantic``: the data is Fashion-MNIST, judged by the shipped semantic test (else one is
    fitted on ``public``); ``name``: the argument a pixel-range error names; ``lpips_fn`` adds the LPIPS distance to the identification test;
    ``cache_dir`` keeps a fitted semantic test on disk (it is always kept in memory for the process)."""
    pixels = public_pixels(public[0], mean, std, name)
    labels = public[1].detach().cpu().long()
    unavailable: dict[str, str] = {}
    semantic: SemanticTest | None = None
    if shipped_semantic:
        semantic = shipped_semantic_test()
    else:
        try:
            semantic = fit_semantic_test(pixels, labels, cache_dir=cache_dir)
            log(f"[audit] semantic test calibrated on {len(labels)} images of {source}: line {semantic.line:.3g}")
        except SemanticCalibrationError as err:
            unavailable["semantic"] = f"{source} cannot calibrate it: {err}"
    identification: IdentificationTest | None = None
    try:
        identification = IdentificationTest(pixels, labels, lpips_fn=lpips_fn)
    except IdentificationCalibrationError as err:
        unavailable["identification"] = f"{source} cannot calibrate it: {err}"
    return RecognitionTests(
        semantic=semantic,
        identification=identification,
        unavailable=unavailable,
        source=f"calibrated on {len(labels)} images of {source}",
    )


def check_served_normalization(datamodule: Any, argument: str) -> None:
    """Refuse a datamodule whose ``mean``/``std`` are not what its images were standardised with: one
    built with ``normalize=False`` serves raw pixels, and undoing its mean/std would put every
    reconstruction and every public image on a wrong pixel range."""
    if getattr(datamodule, "normalize", True) is False:
        raise ValueError(
            f"{argument}: {type(datamodule).__name__}(normalize=False) serves raw pixels, but its mean/std "
            f"({tuple(datamodule.mean)}, {tuple(datamodule.std)}) are what the audit undoes to read them; build it "
            "with normalize=True, or pass the identity (mean=(0.0,) * channels, std=(1.0,) * channels) to the audit"
        )


def datamodule_recognition_tests(
    datamodule: L.LightningDataModule,
    public: tuple[Tensor, Tensor] | None = None,
    *,
    lpips_fn: nn.Module | None = None,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> RecognitionTests:
    """:func:`recognition_tests` of ``datamodule``'s data: calibrated on ``public`` (default: its public
    split, :func:`~lightning_gp.audit.rounds.public_examples`), with its normalisation, and the shipped
    semantic test exactly where it serves Fashion-MNIST."""
    from lightning_gp.audit.rounds import public_examples

    data: Any = datamodule
    check_served_normalization(datamodule, "datamodule")
    public = public_examples(datamodule) if public is None else public
    return recognition_tests(
        public,
        data.mean,
        data.std,
        shipped_semantic=uses_shipped_semantic_test(datamodule),
        lpips_fn=lpips_fn,
        cache_dir=cache_dir,
        log=log,
        source=f"the public split of {type(datamodule).__name__}",
        name=f"datamodule ({type(datamodule).__name__}: mean, std)",
    )
