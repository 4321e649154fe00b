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
from typing import Any

import torch
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


def gumbel_share_sample(logits: Tensor, temperature: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """One Gumbel-softmax sample of the share mask (Eq. 18) as ``(hard, z)``, ``soft = sigmoid(z)``.

    The two categories are ``[not share, share]`` with log-probabilities ``[log alpha, log(1 - alpha)]``
    and Gumbel noise ``G_k = -log(-log U_k)`` (``U`` drawn as ``[..., 2]`` from ``generator``, clamped
    to ``[tiny, 1 - eps]``). A softmax over two entries is the sigmoid of their difference, and
    ``log(1 - alpha) - log alpha = -logit``, so with ``D = G_share - G_not = log(log U_not / log U_share)``:

    * ``z = (D - logit) / temperature``: the soft sample's share entry is ``sigmoid(z)``;
    * ``hard = D > logit``: its argmax (a tie goes to "not share", as ``argmax`` picks the first).

    ``hard`` is boolean; ``z`` is differentiable in ``logits`` when they require grad.
    """
    uniform = torch.rand((*logits.shape, 2), generator=generator, dtype=logits.dtype, device=generator.device)
    finfo = torch.finfo(logits.dtype)
    log_uniform = uniform.clamp_(finfo.tiny, 1.0 - finfo.eps).log_()  # [log U_not, log U_share], both < 0
    noise = (log_uniform[..., 0] / log_uniform[..., 1]).log_().to(logits.device)  # G_share - G_not
    return noise > logits.detach(), (noise - logits) / temperature


class _Sigmoid(torch.autograd.Function):
    """``sigmoid(z)`` with the derivative ``sigmoid(z) sigmoid(-z)``: exact in the tails, where
    ``s (1 - s)`` rounds to 0 (and the two-way softmax's ``s_0 s_1`` does not)."""

    @staticmethod
    def forward(ctx: Any, z: Tensor) -> Tensor:
        soft = torch.sigmoid(z)
        ctx.save_for_backward(z, soft)
        return soft

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        z, soft = ctx.saved_tensors
        return grad * soft * torch.sigmoid(-z)


def sample_share_mask(logits: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    """A hard Gumbel-softmax sample of the share mask (Eq. 18), 1 = share, straight-through.

    ``y_soft = softmax((log [alpha, 1 - alpha] + G) / temperature)`` with Gumbel noise
    ``G = -log(-log U)`` from ``generator``; the value is the one-hot ``y_hard`` exactly (written
    ``y_hard + (y_soft - y_soft.detach())``, which adds an exact zero) and the gradient is
    ``d y_soft / d logits``. Computed as a comparison and the sigmoid of the two perturbed logits'
    difference (:func:`gumbel_share_sample`): the two-way softmax's sample and gradient, without
    materialising it.
    """
    hard, z = gumbel_share_sample(logits, temperature, generator)
    soft = _Sigmoid.apply(z)
    return hard.to(soft.dtype) + (soft - soft.detach())


def local_loss_logit_gradient(
    logits: Tensor,
    z: Tensor,
    gradients: Tensor,
    moved: Tensor,
    shares: Tensor,
    *,
    lambda_acc: float,
    lambda_pri: float,
    lambda_sha: float,
    temperature: float,
) -> Tensor:
    """``d/d logit`` of the local loss (Eq. 16) on flat vectors, in closed form.

    The loss is ``lambda_acc sum(g (w - w_start) m) + lambda_pri L_pri(g, alpha) + lambda_sha sum(alpha)``
    with ``m`` the straight-through share sample of ``z`` (:func:`gumbel_share_sample`, so
    ``dm/dlogit = -sigmoid(z) sigmoid(-z) / temperature``), ``alpha = sigmoid(logit)``
    (``dalpha/dlogit = alpha (1 - alpha)``), ``L_pri`` of :func:`privacy_loss` with the layer
    ``shares`` and ``g = gradients``, ``w - w_start = moved`` taken as constants::

        (lambda_sha - lambda_pri shares |g|) alpha (1 - alpha) - (lambda_acc / temperature) g moved sigmoid(z) sigmoid(-z)

    (autograd through the same objective gives the same values to float rounding, in more than
    twice the time).
    """
    alpha = withhold_probability(logits.detach())
    z = z.detach()
    accuracy = gradients * moved * torch.sigmoid(z) * torch.sigmoid(-z)
    return (lambda_sha - lambda_pri * shares * gradients.abs()) * alpha * (1 - alpha) - (
        lambda_acc / temperature
    ) * accuracy


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
