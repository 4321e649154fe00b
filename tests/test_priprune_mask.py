"""PriPrune's defense-mask sampler (Eq. 18) and the logits' step (Eq. 16) against their written forms:
the Gumbel-softmax sample drawn as a comparison and a sigmoid is the two-way softmax's, and the
closed-form gradient is autograd's through the local loss."""

from __future__ import annotations

import pytest
import torch
from helpers import softmax_share_sample

from lightning_gp.priprune import privacy_loss, sample_share_mask
from lightning_gp.priprune.mask import gumbel_share_sample, layer_shares, local_loss_logit_gradient
from lightning_gp.seeding import seeded_generator

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ the sampler and the mask step
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_the_sigmoid_sampler_draws_the_two_way_softmax_sample_and_gradient(temperature):
    logits = (4 * torch.randn(200_000, generator=torch.Generator().manual_seed(0))).requires_grad_(True)
    weights = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    expected = softmax_share_sample(logits, temperature, seeded_generator(5))
    got = sample_share_mask(logits, temperature, seeded_generator(5))
    assert torch.equal(got, expected)  # the same noise, the same hard sample: exactly
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    # float rounding (the softmax's cancellation in its tails is the larger error): |grad| <= |w| / (4 T)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-6)
    hard, _ = gumbel_share_sample(logits, temperature, seeded_generator(5))
    assert torch.equal(hard, expected.detach().bool())


def test_the_closed_form_mask_step_is_the_gradient_of_the_local_loss():
    g = torch.Generator().manual_seed(2)
    n = 5000
    logits = (2 * torch.randn(n, generator=g) - 1).requires_grad_(True)
    grads, moved = torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)
    shares = layer_shares({"a": torch.empty(1000), "b": torch.empty(4000)})
    lambdas = {"lambda_acc": 5.0, "lambda_pri": 15.0, "lambda_sha": 2e-5}
    share = sample_share_mask(logits, 0.7, seeded_generator(9))
    alphas = torch.sigmoid(logits)
    objective = (
        lambdas["lambda_acc"] * (grads * moved * share).sum()
        + lambdas["lambda_pri"] * privacy_loss(grads, alphas, shares)
        + lambdas["lambda_sha"] * alphas.sum()
    )
    (expected,) = torch.autograd.grad(objective, logits)
    _, z = gumbel_share_sample(logits, 0.7, seeded_generator(9))
    got = local_loss_logit_gradient(logits, z, grads, moved, shares, temperature=0.7, **lambdas)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
