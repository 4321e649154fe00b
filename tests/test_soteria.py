"""Soteria (issue 13, part 1): the feature scores, exactly the chosen columns zeroed, every path."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_gp.attacks import DefenseAwareIDLG, adaptive_attacks, has_adaptive_attack
from lightning_gp.audit import tap_fedsgd_round
from lightning_gp.callbacks import GradientTap
from lightning_gp.callbacks import Soteria as SoteriaCallback
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import Soteria, defended_layer, representation_scores
from lightning_gp.models import ImageClassifier, LeNetZhu


def test_scores_of_a_linear_feature_extractor_match_the_formula():
    torch.manual_seed(0)
    extractor, head = nn.Linear(4, 3, bias=False), nn.Linear(3, 2)
    model = nn.Sequential(extractor, head)
    x = torch.rand(5, 4)
    r = extractor(x).detach()
    # r_f = w_f . x, so d r_f / d x = w_f for every example
    expected = (extractor.weight.detach().norm(dim=1).unsqueeze(0) / (r + 0.1)).sum(dim=0)
    for method in ("jacobian", "loop"):
        torch.testing.assert_close(representation_scores(model, x, "1", method=method), expected)


def test_vmapped_jacobian_scores_equal_the_one_backward_per_feature_loop():
    torch.manual_seed(0)
    model = LeNetZhu()
    x = torch.rand(3, 1, 28, 28)
    fast = representation_scores(model, x, "fc", method="jacobian")
    reference = representation_scores(model, x, "fc", method="loop")
    assert fast.shape == (588,)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-6)


def test_exactly_the_lowest_scoring_columns_of_the_defended_weight_are_zeroed():
    generator = torch.Generator().manual_seed(0)
    gradients = {
        "body.weight": torch.randn(6, 3, generator=generator),
        "fc.weight": torch.randn(2, 10, generator=generator),
        "fc.bias": torch.randn(2, generator=generator),
    }
    scores = torch.tensor([5.0, 1.0, 9.0, 3.0, 3.0, 0.5, 7.0, 2.0, 8.0, 6.0])
    shared = Soteria(0.3, seed=0)(gradients, 0, scores=scores, layer="fc")
    zeroed = [j for j in range(10) if bool((shared["fc.weight"][:, j] == 0).all())]
    assert zeroed == [1, 5, 7]  # the 3 smallest scores (0.5, 1, 2)
    kept = [j for j in range(10) if j not in zeroed]
    torch.testing.assert_close(shared["fc.weight"][:, kept], gradients["fc.weight"][:, kept], rtol=0, atol=0)
    for name in ("body.weight", "fc.bias"):  # only the defended layer's weight changes
        torch.testing.assert_close(shared[name], gradients[name], rtol=0, atol=0)
    # ties are broken by feature index: scores 3, 3 at features 3 and 4, and only one more column fits
    shared = Soteria(0.4, seed=0)(gradients, 0, scores=scores, layer="fc")
    zeroed = [j for j in range(10) if bool((shared["fc.weight"][:, j] == 0).all())]
    assert zeroed == [1, 3, 5, 7]


def test_bad_inputs_name_the_argument():
    model = LeNetZhu()
    with pytest.raises(ValueError, match="'head' is not a module"):
        defended_layer(model, "head")
    with pytest.raises(ValueError, match="is a Conv2d"):
        defended_layer(model, "body.0")
    with pytest.raises(ValueError, match=r"has no nn\.Linear"):
        defended_layer(nn.Sequential(nn.Conv2d(1, 2, 3)), None)
    assert defended_layer(ImageClassifier(LeNetZhu()), "fc")[0] == "model.fc"  # a wrapper's prefix may be left out
    with pytest.raises(ValueError, match="rate"):
        Soteria(1.5)
    with pytest.raises(ValueError, match="rate"):
        SoteriaCallback(rate=-0.1)
    with pytest.raises(ValueError, match="method"):
        SoteriaCallback(method="fast")
    gradients = {"fc.weight": torch.ones(2, 4)}
    with pytest.raises(TypeError, match="data-dependent"):
        Soteria()(gradients, 0)
    with pytest.raises(ValueError, match=r"\[4\] tensor"):
        Soteria()(gradients, 0, scores=torch.ones(3), layer="fc")
    with pytest.raises(ValueError, match=r"no 'head\.weight'"):
        Soteria()(gradients, 0, scores=torch.ones(4), layer="head")


def _zero_columns(weight: torch.Tensor) -> int:
    return int((weight == 0).all(dim=0).sum())


def test_the_callback_defends_on_the_local_path_and_in_the_simulation():
    dm = FashionMNISTSampleDataModule(batch_size=4)
    L.seed_everything(0, verbose=False)
    tap = GradientTap(rounds=[0])
    module = ImageClassifier(LeNetZhu())
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SoteriaCallback(rate=0.8, layer="fc", seed=0), tap],
    )
    trainer.fit(module, datamodule=dm)
    shared = tap.latest().gradients
    assert _zero_columns(shared["model.fc.weight"]) == 470  # round(0.8 * 588)
    assert _zero_columns(shared["model.body.0.weight"].flatten(1)) == 0

    L.seed_everything(0, verbose=False)
    records, _, _ = tap_fedsgd_round(
        LeNetZhu(), FashionMNISTSampleDataModule(), defenses=[SoteriaCallback(rate=0.8, seed=0)], clients=[0, 1], seed=0
    )
    for record in records:
        assert _zero_columns(record.gradients["fc.weight"]) == 470
        assert record.meta["defenses"][0]["name"] == "Soteria"


def test_soteria_declares_a_support_matching_adaptive_attack():
    callback = SoteriaCallback(rate=0.8)
    assert has_adaptive_attack(callback)
    attacks = adaptive_attacks(callback, iterations=3)
    assert any(isinstance(a, DefenseAwareIDLG) and a.knowledge.support for a in attacks)


def test_the_default_layer_is_the_first_linear_after_the_feature_extractor_even_behind_an_imprint_block():
    from lightning_gp.attacks import RobbingTheFed

    torch.manual_seed(0)
    x = torch.rand(2, 1, 28, 28)
    assert defended_layer(LeNetZhu(), None, x)[0] == "fc"
    # Robbing the Fed puts a linear imprint layer in front of the convolutions: Soteria still
    # defends the model's own classifier (the imprint layer is what the attack reads, unprotected)
    imprinted, secrets = RobbingTheFed(num_bins=8).modify_model(LeNetZhu(), (1, 28, 28))
    name, _ = defended_layer(imprinted, None, x)
    assert name.endswith("fc") and not secrets["imprint"]["weight"].startswith(name)
    # without convolutions, the first linear layer called (not the first registered)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.ReLU(), nn.Linear(8, 10))
    assert defended_layer(mlp, None, x)[0] == "1"


def test_probe_scores_converge_to_the_exact_scores():
    # r = W x: every example's Jacobian row norms are ||w_f||; with 20000 Gaussian probes the
    # squared-norm estimate has relative std sqrt(2 / 20000) = 1%, its square root 0.5%: 5 sigma = 2.5%
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Linear(4, 2))
    x = torch.rand(3, 6)
    exact = representation_scores(model, x, "1", method="jacobian")
    generator = torch.Generator().manual_seed(1)
    estimate = representation_scores(model, x, "1", method="probes", probes=20000, generator=generator)
    torch.testing.assert_close(estimate, exact, rtol=0.025, atol=0.0)
    with pytest.raises(ValueError, match="probes"):
        representation_scores(model, x, "1", method="probes", probes=0)
    with pytest.raises(ValueError, match="method"):
        representation_scores(model, x, "1", method="hutchinson")  # type: ignore[arg-type]


def test_probe_squared_norms_are_unbiased_on_a_nonlinear_model():
    # the mean over 400 seeded runs of k = 10 probes is a 4000-probe estimate: relative std of the
    # squared norm 2.2% per entry; the median over LeNet's 588 features sits well inside 3 sigma
    torch.manual_seed(0)
    model = LeNetZhu()
    x = torch.rand(1, 1, 28, 28)
    exact = representation_scores(model, x, "fc", method="jacobian")
    runs = torch.stack(
        [
            representation_scores(
                model, x, "fc", method="probes", probes=10, generator=torch.Generator().manual_seed(seed)
            )
            for seed in range(400)
        ]
    )
    # scores are ||J_f|| / (r_f + 0.1) for one example: squared scores carry the unbiased squared norms
    relative = (runs.square().mean(dim=0) / exact.square() - 1).abs()
    assert relative.median() < 3 * (2 / 4000) ** 0.5


def test_soteria_scores_a_model_that_samples_before_the_defended_layer():
    from lightning_gp.models import PRECODE

    torch.manual_seed(0)
    model = PRECODE(LeNetZhu())
    x = torch.rand(3, 1, 28, 28)
    # the default layer is the bottleneck's encoder: nothing random runs before it
    assert defended_layer(model, None, x)[0] == "bottleneck.encoder"
    torch.testing.assert_close(
        representation_scores(model, x, method="jacobian"), representation_scores(model, x, method="loop")
    )
    # behind the sampling bottleneck the scores are those of one noise draw per example, not an error
    for method in ("jacobian", "probes", "loop"):
        scores = representation_scores(model, x, "model.fc", method=method)
        assert scores.shape == (588,) and bool(torch.isfinite(scores).all())
