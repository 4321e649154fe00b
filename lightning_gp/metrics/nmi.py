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

from lightning_gp.metrics.image_quality import check_image_pair, check_pair_batches, check_pixel_range, pair_indices
from lightning_gp.validation import check_choice, check_int

_AVERAGES = ("arithmetic", "geometric", "min", "max")


def _plogp_table(n: int, device: torch.device) -> Tensor:
    """``[n + 1]`` float64: entry ``c`` is ``-p log p`` at ``p = c / n`` (0 at ``c = 0``)."""
    p = torch.arange(n + 1, dtype=torch.float64, device=device) / n
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p)))


def _code_entropy(codes: Tensor) -> Tensor:
    """``[B]`` entropy (natural log) of the empirical distribution of each row of ``codes`` ``[B, N]``
    (integers): each run of equal values of the sorted row is one outcome, its count read at the run's
    last entry, its ``-p log p`` from a table (no logarithm per entry; a constant row has entropy 0)."""
    n = codes.shape[1]
    ordered = codes.sort(dim=1).values
    position = torch.arange(n, device=codes.device).expand_as(ordered)
    changes = ordered[:, 1:] != ordered[:, :-1]
    starts = torch.cat([torch.ones_like(changes[:, :1]), changes], dim=1)
    ends = torch.cat([changes, torch.ones_like(changes[:, :1])], dim=1)
    run_start = torch.where(starts, position, torch.zeros_like(position)).cummax(dim=1).values
    terms = _plogp_table(n, codes.device)[position - run_start + 1]
    return torch.where(ends, terms, torch.zeros_like(terms)).sum(dim=1)


def _levels(x: Tensor, levels: int) -> Tensor:
    """``[B, N]`` integer intensity levels of ``[B, ...]`` pixels in [0, 1] (``round((levels - 1) x)``;
    clamped: values within the rounding slack of ``check_pixel_range`` fall into the end levels)."""
    return (x.detach().double().clamp(0, 1) * (levels - 1)).round().long().flatten(1)


def _normalised(h_u: Tensor, h_v: Tensor, h_uv: Tensor, average: str) -> Tensor:
    """NMI from the two marginal entropies and the joint one: ``MI = H(U) + H(V) - H(U, V)`` over the
    ``average`` of the two entropies, in [0, 1]; two constant images score 1."""
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
    return torch.where((h_u == 0) & (h_v == 0), torch.ones_like(score), score)


def _output_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


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
    qx, qy = _levels(x, levels), _levels(y, levels)
    # each entropy from the counts of the values that occur (exact integer counts; no levels x levels
    # table per pair)
    h_uv = _code_entropy(qx * levels + qy)
    return _normalised(_code_entropy(qx), _code_entropy(qy), h_uv, average).to(_output_dtype(x))


def nmi_pairwise(
    reconstructed: Tensor, original: Tensor, levels: int = 256, average: str = "arithmetic", chunk: int = 1024
) -> Tensor:
    """``[B_orig, B_rec]``: :func:`nmi` of every reconstruction against every original (pixels in [0, 1]).

    Each image's own entropy is computed once and each pair only its joint entropy (one sort a pair, not
    three), in chunks of ``chunk`` pairs bounding memory. Equal to :func:`nmi` pair by pair.
    """
    check_pair_batches(reconstructed, original)
    check_pixel_range(reconstructed, "reconstructed")
    check_pixel_range(original, "original")
    check_int(levels, "levels", low=2)
    check_choice(average, "average", _AVERAGES)
    check_int(chunk, "chunk", low=1)
    q_rec, q_orig = _levels(reconstructed, levels), _levels(original, levels)
    h_rec, h_orig = _code_entropy(q_rec), _code_entropy(q_orig)
    rows, cols = pair_indices(original.shape[0], reconstructed.shape[0], original.device)
    values = []
    for start in range(0, rows.numel(), chunk):
        r, c = rows[start : start + chunk], cols[start : start + chunk]
        h_joint = _code_entropy(q_rec[c] * levels + q_orig[r])
        values.append(_normalised(h_rec[c], h_orig[r], h_joint, average))
    table = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    return table.view(original.shape[0], reconstructed.shape[0]).to(_output_dtype(reconstructed))
