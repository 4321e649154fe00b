"""Normalized mutual information between original and reconstructed images (PriPrune, Sec. 4.2.1).

PriPrune (Chu et al., Sec. 4.2.1, "Privacy Metrics"): "we use the Normalized Mutual Information
(NMI) between the training data and the reconstructed data. For two vectors U, V in R^N, NMI is
computed as follows. The entropy of U is calculated by H(U) = -sum_i P(i) log(P(i)), where
P(i) = |U_i|/N. The Mutual Information between U and V [is] ... NMI is then measured as ..."

The MI and NMI equations are OCR-garbled in our copy; what survives ("|U_i ∩ V_j|",
"N |U_i ∩ V_j|", sums over i and j, "/N") is the clustering (contingency-table) definition,
the one scikit-learn's ``mutual_info_score`` documents in the same words:
MI(U, V) = sum_i sum_j |U_i ∩ V_j|/N log(N |U_i ∩ V_j| / (|U_i| |V_j|)), U_i being the set of
the N entries of U that carry value i. For the lost normalisation we take scikit-learn's
``normalized_mutual_info_score`` default, the arithmetic mean:
NMI = MI(U, V) / ((H(U) + H(V)) / 2), in [0, 1] (1 when V determines U and vice versa).
``average`` selects the other common normalisations (geometric, min, max).

Readings we take: U and V are an image's C*H*W pixel values (per image pair); the "values" i
are its 8-bit intensity levels (``levels=256`` uniform bins of [0, 1]: ``round(255 x)``), the
form in which the images are stored and viewed. As in scikit-learn, two constant images score
1 and a constant image against a non-constant one 0. NMI is invariant to any one-to-one
relabelling of intensities (an inverted image scores 1). Higher NMI = more leakage.

This plug-in estimate is biased upward when pixels are few for the number of levels: on
28x28 Fashion-MNIST with 256 levels, unrelated images (or uniform noise) score about 0.45,
slightly noised copies about 0.65, exact copies 1. Compare NMI only at equal image size and
``levels``; fewer levels lower the floor (16 levels: noise about 0.06).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gp.metrics.image_quality import check_image_pair, check_pixel_range
from lightning_gp.validation import check_choice, check_int

_AVERAGES = ("arithmetic", "geometric", "min", "max")


def _entropy(p: Tensor) -> Tensor:
    """``-sum p log p`` over the last dim (0 log 0 = 0), natural log."""
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(dim=-1)


def _code_entropy(codes: Tensor) -> Tensor:
    """``[B]`` entropy of the empirical distribution of each row of ``codes`` ``[B, N]`` (integers): the
    rows sorted, each run of equal values one outcome with its count."""
    ordered = codes.sort(dim=1).values
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run = starts.long().cumsum(dim=1) - 1
    counts = torch.zeros(ordered.shape, dtype=torch.float64, device=codes.device)
    counts.scatter_add_(1, run, torch.ones_like(counts))
    return _entropy(counts / codes.shape[1])


def nmi(x: Tensor, y: Tensor, levels: int = 256, average: str = "arithmetic") -> Tensor:
    """PriPrune's NMI per image pair: ``[B, C, H, W]`` pixel images in [0, 1] -> ``[B]`` in [0, 1].

    Args:
        levels: intensity levels the [0, 1] range is quantised to (256: 8-bit pixels).
        average: normaliser of MI: "arithmetic" (default, ``(H(U) + H(V)) / 2``), "geometric",
            "min" or "max" of the two entropies.
    """
    check_image_pair(x, y)
    check_pixel_range(x, "x")
    check_pixel_range(y, "y")
    check_int(levels, "levels", low=2)
    check_choice(average, "average", _AVERAGES)
    # clamp: values within the rounding slack of check_pixel_range fall into the end levels.
    qx = (x.detach().double().clamp(0, 1) * (levels - 1)).round().long().flatten(1)
    qy = (y.detach().double().clamp(0, 1) * (levels - 1)).round().long().flatten(1)
    # MI = H(U) + H(V) - H(U, V), each entropy from the counts of the values that occur (exact integer
    # counts: a constant image has entropy exactly 0; no levels x levels table per pair)
    h_u, h_v, h_uv = _code_entropy(qx), _code_entropy(qy), _code_entropy(qx * levels + qy)
    # 0 <= MI <= min(H(U), H(V)); clamping removes rounding residue (e.g. against a constant image).
    mi = torch.minimum((h_u + h_v - h_uv).clamp_min(0), torch.minimum(h_u, h_v))
    if average == "arithmetic":
        norm = (h_u + h_v) / 2
    elif average == "geometric":
        norm = (h_u * h_v).sqrt()
    elif average == "min":
        norm = torch.minimum(h_u, h_v)
    else:
        norm = torch.maximum(h_u, h_v)
    score = torch.where(norm > 0, mi / norm.clamp_min(1e-300), torch.zeros_like(mi)).clamp(0, 1)
    both_constant = (h_u == 0) & (h_v == 0)
    score = torch.where(both_constant, torch.ones_like(score), score)
    return score.to(x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32)
