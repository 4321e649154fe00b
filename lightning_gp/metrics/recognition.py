"""The recognisable-image tests of one data set, calibrated on its public split, as the audit scores them.

A pixel line (PSNR > 20 dB, SSIM > 0.5) says one thing on every data set; whether a reconstruction
shows its original does not. :class:`RecognitionTests` holds the two tests that are calibrated on the
user's own public images (:mod:`lightning_gp.metrics.identification`: does the output pick its
original out of public images of the same data; :mod:`lightning_gp.metrics.semantic_test`: does a
classifier trained on the public split name the original's class on it clearly more than on other-class
and trivial images) and scores every reconstruction against every original with both. A test that could
not be calibrated is held as the reason why (:attr:`RecognitionTests.unavailable`): the scores then say
"not computed", and an audit reads that as a gap, never as "private".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_gp.metrics.identification import IdentificationTest
from lightning_gp.metrics.semantic_test import SemanticTest

#: The tests a :class:`RecognitionTests` scores, by metric name.
RECOGNITION_METRICS = ("semantic", "identification")


@dataclass(frozen=True, eq=False)
class RecognitionTests:
    """The semantic and identification tests for one data set (module docstring).

    Attributes:
        semantic: the semantic test (``None``: see ``unavailable["semantic"]``).
        identification: the identification test (``None``: see ``unavailable["identification"]``).
        unavailable: test name -> why it is missing (too few public images, no labels, ...).
        source: where the tests come from, in words (for reports).
    """

    semantic: SemanticTest | None
    identification: IdentificationTest | None
    unavailable: Mapping[str, str] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        for name in RECOGNITION_METRICS:
            if getattr(self, name) is None and name not in self.unavailable:
                raise ValueError(f"{name}: a missing test needs its reason in unavailable")
        if self.semantic is not None and not isinstance(self.semantic, SemanticTest):
            raise TypeError(f"semantic must be a SemanticTest or None, got {type(self.semantic).__name__}")
        if self.identification is not None and not isinstance(self.identification, IdentificationTest):
            raise TypeError(
                f"identification must be an IdentificationTest or None, got {type(self.identification).__name__}"
            )
        object.__setattr__(self, "unavailable", dict(self.unavailable))

    def describe(self) -> str:
        """The tests in words, e.g. for report headers."""
        parts = []
        if self.semantic is not None:
            parts.append(
                f"semantic test ({self.semantic.source}; line {self.semantic.line:.3g} at a stated false alarm "
                f"of {self.semantic.false_alarm:g})"
            )
        if self.identification is not None:
            parts.append(self.identification.describe())
        parts += [f"{name} not run: {reason}" for name, reason in self.unavailable.items()]
        return "; ".join(parts) + (f" [{self.source}]" if self.source else "")

    def without(self, name: str, reason: str) -> RecognitionTests:
        """These tests without ``name`` (``"semantic"`` or ``"identification"``), ``reason`` saying why."""
        if name not in RECOGNITION_METRICS:
            raise ValueError(f"name must be one of {RECOGNITION_METRICS}, got {name!r}")
        kept: dict[str, Any] = {"semantic": self.semantic, "identification": self.identification, name: None}
        return dataclasses.replace(self, **kept, unavailable={**self.unavailable, name: reason})

    @torch.no_grad()
    def score_matrices(
        self, rec_px: Tensor, orig_px: Tensor, true_labels: Tensor | None
    ) -> tuple[dict[str, Tensor], dict[str, str]]:
        """Every reconstruction scored against every original by each test: metric -> ``[B_orig, B_rec]``
        (``semantic``: the lift of the original's class; ``identification``: the p-value), and metric ->
        why it is not available. ``rec_px``/``orig_px`` are pixels in [0, 1]."""
        scores: dict[str, Tensor] = {}
        unavailable = dict(self.unavailable)
        if self.semantic is not None:
            semantic = _semantic_or_reason(self.semantic, rec_px, true_labels)
            if isinstance(semantic, str):
                unavailable["semantic"] = semantic
            else:
                scores["semantic"] = semantic
        if self.identification is not None:
            identified = _identification_or_reason(self.identification, rec_px, orig_px, true_labels)
            if isinstance(identified, str):
                unavailable["identification"] = identified
            else:
                scores["identification"] = identified
        return scores, unavailable


def _semantic_or_reason(test: SemanticTest, rec_px: Tensor, true_labels: Tensor | None) -> Tensor | str:
    if true_labels is None:
        return "needs the originals' true labels"
    if tuple(rec_px.shape[1:]) != tuple(test.image_shape):
        return (
            f"the semantic test ({test.source}) is built for {'x'.join(map(str, test.image_shape))} images, these are "
            f"{'x'.join(map(str, rec_px.shape[1:]))}"
        )
    labels = true_labels.detach().cpu().long()
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= test.num_classes):
        return (
            f"the semantic test ({test.source}) knows {test.num_classes} classes, the labels reach {int(labels.max())}"
        )
    return test.score_matrix(rec_px, labels)


def _identification_or_reason(
    test: IdentificationTest, rec_px: Tensor, orig_px: Tensor, true_labels: Tensor | None
) -> Tensor | str:
    if tuple(orig_px.shape[1:]) != tuple(test.images.shape[1:]):
        return (
            f"the identification test is calibrated on {'x'.join(map(str, test.images.shape[1:]))} public images, "
            f"these are {'x'.join(map(str, orig_px.shape[1:]))}"
        )
    if test.labels is not None and true_labels is None:
        return "needs the originals' true labels (it compares each original with public images of its class)"
    short = test.uncalibrated(true_labels)
    if short:
        sizes = ", ".join(f"class {c}: {test.sizes.get(c, 0)}" for c in short)
        return (
            f"too few public images to calibrate it for the originals' classes ({sizes}; it needs at least "
            f"{test.min_pool} per class)"
        )
    pvalues = test.pvalues(rec_px, orig_px, true_labels)
    if bool(torch.isnan(pvalues).any()):
        return "no p-value for some originals (their class pool is too small)"
    return pvalues
