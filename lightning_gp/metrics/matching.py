"""Align reconstructions to originals when the batch order is unknown (linear assignment).

An attacker recovers a batch in its own order. Before scoring, each original gets the
reconstruction that fits it, one-to-one, maximising the total similarity (Hungarian algorithm,
``scipy.optimize.linear_sum_assignment`` on the pairwise cost), so scores do not depend on the
order the attack happened to produce.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from lightning_gp.metrics.image_quality import (
    check_image_pair,
    check_pair_batches,
    check_pixel_range,
    pair_indices,
    ssim_pairwise,
    unchecked_mse,
    unchecked_psnr,
)

MATCH_METRICS = ("mse", "psnr", "ssim", "lpips")
# Pairs scored per call when filling the B x B matrix (bounds memory for LPIPS).
_CHUNK = 1024


def pairwise_scores(
    reconstructed: Tensor,
    original: Tensor,
    metric: str = "mse",
    lpips_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """``[B_orig, B_rec]`` matrix of ``metric(reconstructed[j], original[i])`` for every pair.

    Args:
        reconstructed, original: pixel images in [0, 1] (checked), ``[B, C, H, W]``.
        metric: "mse", "psnr", "ssim" or "lpips".
        lpips_fn: the LPIPS callable for ``metric="lpips"`` (default: a new
            :class:`~lightning_gp.metrics.lpips.LPIPS`).
    """
    if metric not in MATCH_METRICS:
        raise ValueError(f"metric must be one of {MATCH_METRICS}, got {metric!r}")
    check_pair_batches(reconstructed, original)
    check_pixel_range(reconstructed, "reconstructed")
    check_pixel_range(original, "original")
    fn: Callable[[Tensor, Tensor], Tensor]
    if metric == "lpips":
        if lpips_fn is None:
            from lightning_gp.metrics.lpips import LPIPS

            lpips_fn = LPIPS()
        pairwise = getattr(lpips_fn, "pairwise", None)
        if callable(pairwise):  # LPIPS: each image through the network once, not once per pair
            with torch.no_grad():
                return pairwise(reconstructed, original).detach().float().cpu()
        fn = lpips_fn
    elif metric == "ssim":  # each image filtered once, each pair only its cross moment
        with torch.no_grad():
            return ssim_pairwise(reconstructed, original).detach().float().cpu()
    else:
        fn = {"mse": unchecked_mse, "psnr": unchecked_psnr}[metric]  # the batches were checked above
    n_orig, n_rec = original.shape[0], reconstructed.shape[0]
    rows, cols = pair_indices(n_orig, n_rec, original.device)
    values = []
    with torch.no_grad():
        for start in range(0, rows.numel(), _CHUNK):
            r, c = rows[start : start + _CHUNK], cols[start : start + _CHUNK]
            x, y = reconstructed[c], original[r]
            check_image_pair(x, y, names=("reconstructed", "original"))
            values.append(fn(x, y).detach().float().cpu())
    return torch.cat(values).view(n_orig, n_rec)


def _cost(scores: Tensor, metric: str) -> np.ndarray:
    """Assignment cost (lower = better match) from a score matrix."""
    if metric == "psnr":
        # Sum of PSNRs (a sum of -log MSE); inf (exact copies) capped so the solver stays finite.
        return -scores.clamp(max=1e6).double().numpy()
    if metric == "ssim":
        return -scores.double().numpy()
    return scores.double().numpy()


def match_reconstructions(
    reconstructed: Tensor,
    original: Tensor,
    metric: str = "mse",
    lpips_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    *,
    unusable: Tensor | None = None,
) -> Tensor:
    """The permutation ``perm`` such that ``reconstructed[perm]`` aligns with ``original``.

    Minimises the summed pairwise cost (MSE, LPIPS) or maximises the summed similarity (PSNR,
    SSIM) over one-to-one assignments. ``reconstructed`` may hold more images than
    ``original`` (the extra ones stay unmatched), not fewer. ``unusable`` (``[B_rec]`` bool)
    marks reconstructions that failed (e.g. non-finite pixels, replaced by a placeholder before
    the call): they cost more than any usable one, so an original gets one only when no usable
    reconstruction is left. Returns a ``[B_orig]`` long tensor on ``reconstructed``'s device.
    """
    if reconstructed.ndim != 4 or original.ndim != 4:
        raise ValueError(
            f"reconstructed and original must be [B, C, H, W], got {tuple(reconstructed.shape)} and {tuple(original.shape)}"
        )
    if reconstructed.shape[0] < original.shape[0]:
        raise ValueError(
            f"reconstructed has {reconstructed.shape[0]} images, fewer than original's {original.shape[0]}: "
            "every original needs a reconstruction to match"
        )
    if unusable is not None and (unusable.dtype != torch.bool or tuple(unusable.shape) != (reconstructed.shape[0],)):
        raise ValueError(
            f"unusable must be a bool tensor of shape ({reconstructed.shape[0]},), got {unusable.dtype} "
            f"{tuple(unusable.shape)}"
        )
    scores = pairwise_scores(reconstructed, original, metric, lpips_fn)
    cost = _cost(scores, metric)
    if not np.isfinite(cost).all():
        raise ValueError(f"pairwise {metric} has non-finite values (NaN in the images?); cannot match")
    if unusable is not None and bool(unusable.any()):
        columns = unusable.cpu().numpy()
        usable_cost = cost[:, ~columns]
        worst = float(usable_cost.max()) if usable_cost.size else 0.0
        cost[:, columns] = worst + 1.0 + abs(worst)
    row_ind, col_ind = linear_sum_assignment(cost)
    perm = torch.empty(original.shape[0], dtype=torch.long)
    perm[torch.as_tensor(row_ind, dtype=torch.long)] = torch.as_tensor(col_ind, dtype=torch.long)
    return perm.to(reconstructed.device)
