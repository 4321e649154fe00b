"""PriPrune's defense-mask sampler (Eq. 18), the logits' step (Eq. 16) and a client's round (Alg. 3)
against their written forms: the Gumbel-softmax sample drawn as a comparison and a sigmoid is the
two-way softmax's, the closed-form gradient is autograd's through the local loss, and a round on
flat vectors with the compact client state is Alg. 3's."""

from __future__ import annotations

import pytest
import torch
from helpers import RandomImages, small_cnn, softmax_share_sample
from torch.func import functional_call

from lightning_gp.named_tensors import flatten_named, unflatten_named
from lightning_gp.priprune import PriPruneModule, final_share_mask, privacy_loss, sample_share_mask
from lightning_gp.priprune.mask import gumbel_share_sample, layer_shares, local_loss_logit_gradient, logit
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


# ------------------------------------------------------------------ a client round against Alg. 3 as written
def reference_round(module, client_id, round, start, logits, inputs, targets, lr):
    """Alg. 3's local steps on flat vectors: the softmax sample, ``v = m w + (1 - m) w_start``, the base
    mask inside the model, and autograd through Eq. 16 for the logits' step."""
    like = module.global_weights()
    weights, shares = start.clone(), layer_shares(like)
    for step, (x, y) in enumerate(zip(inputs, targets)):
        live = logits.detach().requires_grad_(True)
        share = softmax_share_sample(live, module.temperature, seeded_generator(module.seed, client_id, round, step))
        kept = share.detach()
        mixed = (kept * weights + (1 - kept) * start).requires_grad_(True)
        loss = module.loss_fn(functional_call(module.module, module.pruned(unflatten_named(mixed, like)), (x,)), y)
        (g,) = torch.autograd.grad(loss, mixed)
        alphas = torch.sigmoid(live)
        objective = (
            module.lambda_acc * (g * (weights - start) * share).sum()
            + module.lambda_pri * privacy_loss(g, alphas, shares)
            + module.lambda_sha * alphas.sum()
        )
        (logit_grad,) = torch.autograd.grad(objective, live)
        weights = weights - lr * g
        logits = live.detach() - module.mask_lr * logit_grad
    return weights, logits


def test_two_rounds_of_a_client_follow_alg_3_as_written():
    torch.manual_seed(0)
    module = PriPruneModule(small_cnn(), mask_lr=30.0, alpha_init=0.4)
    module.prepare_clients(RandomImages(), num_clients=3)
    module.begin_round(0)
    g = torch.Generator().manual_seed(4)
    base = flatten_named(
        {n: module.masks.get(n, torch.ones_like(w, dtype=torch.bool)) for n, w in module.global_weights().items()}
    ).bool()
    start = flatten_named(module.global_weights())
    logits = torch.full_like(start, logit(0.4))
    for round in range(2):
        x, y = torch.randn(2, 4, 1, 12, 12, generator=g), torch.randint(0, 4, (2, 4), generator=g)
        weights, logits = reference_round(module, 1, round, start, logits, x, y, lr=0.1)
        update, _ = module.client_update(x, y, client_id=1, round=round, lr=0.1)
        keep = final_share_mask(logits)
        assert torch.equal(final_share_mask(module.clients[1]["logits"]), keep)
        torch.testing.assert_close(module.clients[1]["logits"], logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(flatten_named(module.client_withheld(1)), torch.where(keep, 0.0, weights))
        sent = flatten_named(module.global_weights()) - flatten_named(
            {n[len("module.") :]: u for n, u in update.items()}
        )
        torch.testing.assert_close(sent, torch.where(keep, weights, 0.0))
        # the server moves on; the client's next start merges its withheld weights back (pseudo-pruning)
        with torch.no_grad():
            for p in module.module.parameters():
                p.add_(0.01)
        module.begin_round(round + 1)
        now = flatten_named(module.global_weights())
        start = torch.where(base, torch.where(keep, now, weights), 0.0)
        torch.testing.assert_close(flatten_named(module.client_start(1)), start)
