"""The identification test: does a reconstruction pick its original out of public images of the same data?

A reconstruction can leak without crossing a pixel line: a noisy 11 dB copy of a face or an X-ray is
still *that* face. What makes it a leak is that it tells its original apart from other images of
the same data. Hayes et al. (NeurIPS 2023, "Bounding data reconstruction attacks with the
hypothesis testing interpretation of differential privacy") define reconstruction success against
the prior in this way: the reconstruction must point at its target rather than at the prior's
other candidates. This module turns that into a per-pair test that needs no classifier and works
on any images the user brings (any channel count and size, grey or RGB).

**The statistic.** For a reconstruction ``o``, an original ``x`` of class ``c`` and a distance,
the similarity ``s(o, x)`` (SSIM, and the negated LPIPS-AlexNet distance as the feature distance)
is compared with ``s(o, p)`` over a pool ``P`` of ``N`` public images (below: of class ``c``, and
all of them).

**The null.** If ``o`` carries no information about ``x`` beyond its class (it was made from a
gradient that says nothing about ``x``, from a data prior, or from the class label alone), then
``x`` and the pool images are exchangeable for ``o`` (the public split is drawn from the same data
as the attacked images): ``s(o, x)`` is one more draw from the distribution of ``s(o, P)``, and
its rank among the ``N + 1`` values is uniform. The rank alone cannot say less than ``1 / (N +
1)``, too coarse for an audit that runs many tests; a leak, however, is not just first, it is far
ahead. The p-value extrapolates the pool's upper tail with a generalised Pareto distribution
(peaks over threshold; Knijnenburg et al. 2009, "Fewer permutations, more accurate P-values",
Bioinformatics 25(12), with the probability-weighted-moment fit of Hosking and Wallis 1987,
Technometrics 29(3)): with the ``m`` largest pool values above a threshold ``t``,

    p(o, x) = (1 + #{p in P : s(o, p) >= s(o, x)}) / (N + 1)          (the exact rank p-value)
    p(o, x) = min(1 / (N + 1), m / (N + 1) * (1 - G(s(o, x) - t)))     where s(o, x) > max s(o, P)

where ``G`` is the Pareto fit to the ``m`` exceedances: the fit is used only beyond the pool's
largest value, where the rank says no more. A fitted *bounded* tail (shape ``k > 0``, typical of
SSIM) is replaced by the exponential tail (``k = 0``), and the shape is lowered by
:data:`SHAPE_MARGIN`: both make the tail heavier, so the extrapolated p-value errs upward. An
original far closer than every pool image gets a p-value far below ``1 / (N + 1)``; one that is
first by a common margin gets about ``1 / (N + 1)``. Similarities are ``-log(distance)`` (distance
``1 - SSIM`` or LPIPS), which spreads the close end where a leak sits.

**Two pools, two distances.** An original of class ``c`` is tested against the pool of class ``c``
(is ``o`` this individual rather than another ``c``?) and against every public image (an atypical
``c`` that looks like another class must stand out from that class too: without it, an output of
class ``c'`` "identifies" every ``c`` that resembles a ``c'``). The reconstruction may identify its
original on either distance: per pool the smaller p-value times the number of distances
(Bonferroni); the pair's p-value is the larger over the two pools. Each step keeps a valid p-value.

**The line and its level.** :data:`IDENTIFICATION_LINE`: a pair with ``p <= line`` identifies its
original. Under the null each pair passes with probability about ``line`` (the extrapolation is an
estimate; ``benchmarks/identification.py`` measures the rate on uninformed pairs of the public
split); an original judged by any of ``B`` outputs of an attack, at most ``B * line``.

**What it needs.** Public images of the same data as the attacked ones, in [0, 1] pixels, and at
least :data:`MIN_POOL` per class judged (fewer: :class:`IdentificationCalibrationError`, and an
audit reads the test as not run, never as private). What it does not see: a reconstruction that
shows the class and not the individual (the semantic test's job), or one that matches its
original only after a transformation the distances do not forgive (a shift, a flip).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gp.metrics.image_quality import check_pair_batches, check_pixel_range, ssim_pairwise
from lightning_gp.metrics.matching import pairwise_scores

#: A pair whose identification p-value is at most this identifies its original (per-pair level, see
#: the module docstring).
IDENTIFICATION_LINE: float = 1e-3
#: The fewest public images of a class (of the whole pool without labels) the test is calibrated on.
MIN_POOL: int = 40
#: The pool is capped at this many images per class (chosen evenly, seeded), bounding the cost.
MAX_POOL: int = 1000
#: Subtracted from the fitted Pareto shape (Hosking's sign), making the extrapolated tail heavier: the
#: shape from a few dozen exceedances is noisy (standard error about 0.3 at 25), and a tail fitted too
#: light gives p-values too small. With 0.1, on 20000 exchangeable draws of 101 values from normal,
#: exponential, beta and Student-t(3) distributions, P(p <= 1e-3) was 0.0000-0.0016 (t(3) the
#: highest: a heavier tail than image similarities have; ``tests/test_identification.py``).
SHAPE_MARGIN: float = 0.1
#: The smallest p-value reported (a pair far beyond the pool's tail).
PVALUE_FLOOR: float = 1e-30
DISTANCES = ("ssim", "lpips")
#: Distances (1 - SSIM, LPIPS) below this count as this (an exact copy), keeping ``-log`` finite.
DISTANCE_FLOOR: float = 1e-6


class IdentificationCalibrationError(ValueError):
    """The public images cannot calibrate the identification test (too few, or of other data)."""


def tail_pvalues(null: Tensor, observed: Tensor, exceedances: int | None = None) -> Tensor:
    """Upper-tail p-values of ``observed`` under the null sample of its row (module docstring).

    Args:
        null: ``[R, N]`` similarities of each row's output to the ``N`` pool images.
        observed: ``[R, M]`` similarities of the same output to ``M`` originals.
        exceedances: pool values the Pareto tail is fitted to (default ``max(10, min(N // 4, 100))``).

    Returns ``[R, M]`` float64 p-values in ``[PVALUE_FLOOR, 1]``.
    """
    if null.ndim != 2 or observed.ndim != 2 or null.shape[0] != observed.shape[0]:
        raise ValueError(
            f"null [R, N] and observed [R, M] must share R, got {tuple(null.shape)} and {tuple(observed.shape)}"
        )
    n = null.shape[1]
    m = max(10, min(n // 4, 100)) if exceedances is None else exceedances
    if not 3 <= m < n:
        raise ValueError(f"exceedances must be in [3, {n}) for a pool of {n}, got {m}")
    null, observed = null.double(), observed.double()
    ranks = (null[:, None, :] >= observed[:, :, None]).sum(dim=2)
    empirical = (1.0 + ranks) / (n + 1)
    top = null.sort(dim=1, descending=True).values
    threshold = (top[:, m - 1] + top[:, m]) / 2  # between the m-th and (m+1)-th largest
    excess = (top[:, :m] - threshold[:, None]).flip(1)  # ascending
    shape, scale = _pareto_pwm(excess)
    beyond = (observed - threshold[:, None]).clamp(min=0.0)
    survival = _pareto_survival(beyond, shape[:, None], scale[:, None])
    extrapolated = m / (n + 1) * survival
    # the rank is exact within the pool's range: the fit only ever lowers a p-value beyond the largest value
    usable = (scale > 0)[:, None] & (observed > top[:, :1])
    return torch.where(usable, torch.minimum(extrapolated, empirical), empirical).clamp(PVALUE_FLOOR, 1.0)


def _pareto_pwm(excess: Tensor) -> tuple[Tensor, Tensor]:
    """Generalised Pareto shape ``k`` (Hosking's sign: ``k > 0`` bounded) and scale per row of the
    ascending, positive ``excess`` ``[R, m]``, by probability-weighted moments (Hosking and Wallis
    1987, eq. 12-13), with a bounded fit replaced by the exponential (``k = 0``, scale = mean), and the
    shape then lowered by :data:`SHAPE_MARGIN` (a heavier tail: larger p-values)."""
    m = excess.shape[1]
    weights = (m - torch.arange(1, m + 1, dtype=excess.dtype)) / (m - 1)  # unbiased a_1 weights
    a0 = excess.mean(dim=1)
    a1 = (excess * weights).mean(dim=1)
    denominator = a0 - 2 * a1
    ok = denominator > 0
    safe = torch.where(ok, denominator, torch.ones_like(denominator))
    shape = torch.where(ok, a0 / safe - 2, torch.zeros_like(a0))
    scale = torch.where(ok, 2 * a0 * a1 / safe, a0)
    bounded = shape > 0
    return torch.where(bounded, torch.zeros_like(shape), shape) - SHAPE_MARGIN, torch.where(bounded, a0, scale)


def _pareto_survival(y: Tensor, shape: Tensor, scale: Tensor) -> Tensor:
    """``1 - G(y)`` for the generalised Pareto ``G`` (``shape <= 0``: exponential or heavy tail)."""
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    exponential = torch.exp(-y / safe_scale)
    safe_shape = torch.where(shape < 0, shape, -torch.ones_like(shape))
    heavy = (1 - safe_shape * y / safe_scale).pow(1 / safe_shape)
    return torch.where(shape < -1e-9, heavy, exponential)


class IdentificationTest:
    """The identification test calibrated on public images of the user's data (module docstring).

    Args:
        public_images: ``[N, C, H, W]`` public pixels in [0, 1], drawn from the same data as the
            attacked images and disjoint from them (the audit's public split).
        public_labels: ``[N]`` their classes; with them each original is compared with public
            images of its own class (the test is then of the individual beyond its class). ``None``:
            one pool of all images.
        lpips_fn: an LPIPS module (:class:`~lightning_gp.metrics.lpips.LPIPS`) for the feature
            distance; ``None``: SSIM alone.
        max_pool: images kept per class (chosen evenly with ``seed``).
        min_pool: the fewest images a class needs for the test to judge its originals.

    Raises :class:`IdentificationCalibrationError` when no class reaches ``min_pool`` images.
    """

    def __init__(
        self,
        public_images: Tensor,
        public_labels: Tensor | None = None,
        *,
        lpips_fn: torch.nn.Module | None = None,
        max_pool: int = MAX_POOL,
        min_pool: int = MIN_POOL,
        seed: int = 0,
    ) -> None:
        if not isinstance(public_images, Tensor) or public_images.ndim != 4:
            raise ValueError(
                f"public_images must be a [N, C, H, W] tensor, got {getattr(public_images, 'shape', type(public_images))}"
            )
        check_pixel_range(public_images, "public_images")
        if min(public_images.shape[-2:]) < 11:
            raise ValueError(
                f"public_images: SSIM needs images of at least 11x11, got {tuple(public_images.shape[-2:])}"
            )
        if isinstance(min_pool, bool) or not isinstance(min_pool, int) or min_pool < 13:
            raise ValueError(f"min_pool must be an int >= 13 (a tail fit needs 10 of its values), got {min_pool!r}")
        if isinstance(max_pool, bool) or not isinstance(max_pool, int) or max_pool < min_pool:
            raise ValueError(f"max_pool must be an int >= min_pool ({min_pool}), got {max_pool!r}")
        self.images = public_images.detach().float().cpu()
        self.labels = None if public_labels is None else _labels(public_labels, len(self.images), "public_labels")
        self.lpips_fn = lpips_fn
        self.min_pool = min_pool
        self.pools = _pools(self.labels, len(self.images), max_pool, seed)
        self.sizes = {c: len(idx) for c, idx in self.pools.items()}
        self.pool_of_all = torch.cat(list(self.pools.values())).sort().values
        if max(self.sizes.values(), default=0) < min_pool:
            raise IdentificationCalibrationError(
                f"public_images: the identification test needs at least {min_pool} public images "
                + ("of a class" if self.labels is not None else "")
                + f", got at most {max(self.sizes.values(), default=0)}"
                + (f" (per class: {self.sizes})" if self.labels is not None else "")
            )

    @property
    def distances(self) -> tuple[str, ...]:
        return DISTANCES if self.lpips_fn is not None else DISTANCES[:1]

    def describe(self) -> str:
        pools = sorted(self.sizes.values())
        per = "per class" if self.labels is not None else "in one pool"
        return (
            f"identification test by {' or '.join(d.upper() for d in self.distances)} against {pools[0]}-{pools[-1]} public "
            f"images {per} (a pair identifies its original at p <= {IDENTIFICATION_LINE:g})"
        )

    def uncalibrated(self, labels: Tensor | None) -> list[int]:
        """The classes among ``labels`` whose pool is under ``min_pool`` (their originals cannot be judged)."""
        if self.labels is None or labels is None:
            return []
        wanted = sorted({int(v) for v in _labels(labels, -1, "labels").tolist()})
        return [c for c in wanted if self.sizes.get(c, 0) < self.min_pool]

    @torch.no_grad()
    def pvalues(self, reconstructions: Tensor, originals: Tensor, labels: Tensor | None = None) -> Tensor:
        """``[B_orig, B_rec]`` identification p-values of every reconstruction for every original.

        ``reconstructions`` and ``originals``: pixels in [0, 1] of the public images' shape;
        ``labels``: the originals' classes (required when the test has per-class pools). NaN where
        an original's class has too few public images (:meth:`uncalibrated`).
        """
        check_pair_batches(reconstructions, originals)
        if tuple(originals.shape[1:]) != tuple(self.images.shape[1:]):
            raise ValueError(
                f"originals are {tuple(originals.shape[1:])} images, the public images "
                f"{tuple(self.images.shape[1:])}: the test compares images of one data set"
            )
        check_pixel_range(reconstructions, "reconstructions")
        check_pixel_range(originals, "originals")
        classes = torch.zeros(len(originals), dtype=torch.long)
        if self.labels is not None:
            if labels is None:
                raise ValueError("labels: the test compares each original with public images of its class; give them")
            classes = _labels(labels, len(originals), "labels")
        rec, orig = reconstructions.detach().float().cpu(), originals.detach().float().cpu()
        # each output against every public image once; a class's pool is a set of its columns
        similarities = [
            (self._similarity(d, rec, self.images[self.pool_of_all]), self._similarity(d, rec, orig))
            for d in self.distances
        ]
        out = torch.full((len(orig), len(rec)), math.nan, dtype=torch.float64)
        for c in sorted({int(v) for v in classes.tolist()}):
            pool = self.pools.get(c if self.labels is not None else 0)
            if pool is None or len(pool) < self.min_pool:
                continue
            rows = (classes == c).nonzero().flatten()
            pools = [torch.searchsorted(self.pool_of_all, pool)]
            if self.labels is not None:
                pools.append(torch.arange(len(self.pool_of_all)))
            by_pool = []
            for columns in pools:  # per pool the best distance, Bonferroni-corrected
                best = torch.stack(
                    [tail_pvalues(public[:, columns], observed[:, rows]) for public, observed in similarities]
                ).amin(dim=0)
                by_pool.append((best * len(similarities)).clamp(max=1.0))
            out[rows] = torch.stack(by_pool).amax(dim=0).t()
        return out

    def _similarity(self, distance: str, rec: Tensor, others: Tensor) -> Tensor:
        """``[B_rec, len(others)]`` similarity ``-log(distance)`` of each reconstruction to each image (higher:
        closer; the log spreads the close end, where a leak sits, for the tail fit)."""
        if distance == "ssim":
            gap = 1 - ssim_pairwise(others, rec).double()  # [B_rec, K]: ssim_pairwise(reconstructed, original)
        else:
            gap = pairwise_scores(others, rec, "lpips", self.lpips_fn).double()
        return -torch.log(gap.clamp(min=DISTANCE_FLOOR))


def _labels(labels: Tensor | Sequence[int], count: int, name: str) -> Tensor:
    """``labels`` as a ``[count]`` long tensor of non-negative classes (``count < 0``: any length)."""
    labels = torch.as_tensor(labels).detach().cpu()
    if labels.is_floating_point() or labels.ndim != 1 or (count >= 0 and len(labels) != count):
        raise ValueError(
            f"{name} must be a [{count if count >= 0 else 'B'}] integer tensor, got {tuple(labels.shape)} {labels.dtype}"
        )
    labels = labels.long()
    if labels.numel() and int(labels.min()) < 0:
        raise ValueError(f"{name} must be non-negative classes, got {int(labels.min())}")
    return labels


def _pools(labels: Tensor | None, count: int, max_pool: int, seed: int) -> dict[int, Tensor]:
    """Class -> indices of its public images (at most ``max_pool``, a seeded choice); one pool 0 without labels."""
    g = torch.Generator().manual_seed(seed)
    groups = (
        {0: torch.arange(count)}
        if labels is None
        else {int(c): (labels == c).nonzero().flatten() for c in labels.unique().tolist()}
    )
    return {c: idx[torch.randperm(len(idx), generator=g)[:max_pool]].sort().values for c, idx in groups.items()}
