"""PriPrune's defense mask: Gumbel-softmax sampling (Eq. 18) and the privacy loss (Eq. 16-17).

The mask of a client is parameterised by one logit per weight, ``alpha = sigmoid(logit)`` being
the probability of NOT sharing that weight. A sample is the hard Gumbel-softmax over the two
categories ``[alpha, 1 - alpha]`` (not share, share) with the straight-through trick: its value is
exactly 0 or 1, its gradient that of the soft sample. The final mask of a round shares the weights
with ``alpha < 0.5`` (Alg. 3 line 12).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gp.named_tensors import flatten_named


def logit(probability: float) -> float:
    """``log(p / (1 - p))``: the logit whose ``sigmoid`` is ``probability`` (in (0, 1))."""
    return math.log(probability / (1 - probability))


def withhold_probability(logits: Tensor) -> Tensor:
    """``alpha = sigmoid(logits)``: the probability of NOT sharing each weight."""
    return torch.sigmoid(logits)


def final_share_mask(logits: Tensor) -> Tensor:
    """The mask a client applies to its upload: share where ``alpha < 0.5`` (Alg. 3 line 12)."""
    return withhold_probability(logits.detach()) < 0.5


def sample_share_mask(logits: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    """A hard Gumbel-softmax sample of the share mask (Eq. 18), 1 = share, straight-through.

    ``y_soft = softmax((log [alpha, 1 - alpha] + G) / temperature)`` with Gumbel noise
    ``G = -log(-log U)`` from ``generator``; the value is the one-hot ``y_hard`` exactly (written
    ``y_hard + (y_soft - y_soft.detach())``, which adds an exact zero) and the gradient is
    ``d y_soft / d logits``.
    """
    log_probs = torch.stack([F.logsigmoid(logits), F.logsigmoid(-logits)], dim=-1)  # [not share, share]
    uniform = torch.rand(log_probs.shape, generator=generator, dtype=log_probs.dtype, device=generator.device)
    tiny = torch.finfo(log_probs.dtype).tiny
    gumbel = -torch.log(-torch.log(uniform.clamp(tiny, 1.0 - torch.finfo(log_probs.dtype).eps)))
    soft = ((log_probs + gumbel.to(log_probs.device)) / temperature).softmax(dim=-1)
    hard = F.one_hot(soft.argmax(dim=-1), 2).to(soft.dtype)
    return (hard + (soft - soft.detach()))[..., 1]


def layer_shares(tensors: Mapping[str, Tensor]) -> Tensor:
    """``N_l / N`` for every entry, in :func:`~lightning_gp.named_tensors.flatten_named` order."""
    total = sum(t.numel() for t in tensors.values())
    device = next(iter(tensors.values())).device
    return torch.cat([torch.full((t.numel(),), t.numel() / total, device=device) for t in tensors.values()])


def privacy_loss(
    gradients: Mapping[str, Tensor] | Tensor, alphas: Mapping[str, Tensor] | Tensor, shares: Tensor | None = None
) -> Tensor:
    """``L_pri = sum_l (N_l / N) sum_j |g_lj| (1 - alpha_lj)`` (Eq. 17, with the per-layer share ``N_l / N``).

    Sharing a weight with a large gradient costs privacy, so minimising ``L_pri`` raises
    ``alpha`` (the probability of withholding) where ``|g|`` is large. ``gradients`` are
    constants (detached); ``N_l`` is the size of tensor ``l`` and ``N`` the total. Takes named
    tensors, or flat vectors with ``shares`` (:func:`layer_shares`).
    """
    if isinstance(alphas, Mapping):
        if not isinstance(gradients, Mapping):
            raise TypeError("privacy_loss: named alphas need named gradients")
        shares = layer_shares(alphas)
        gradients = flatten_named({n: gradients[n] for n in alphas})
        alphas = flatten_named(dict(alphas))
    if shares is None or isinstance(gradients, Mapping):
        raise ValueError("flat gradients and alphas need the flat layer shares (layer_shares)")
    return (shares * gradients.detach().abs() * (1 - alphas)).sum()
