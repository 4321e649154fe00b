"""The learned inverter (Wu et al., UAI 2023): what it recovers, what it trains on, its cache and
the server's replay of a setting's defense."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_rows_are_their_own_problems
from torch import nn

from lightning_gp.attacks import (
    InverterCache,
    InverterConfig,
    LearnedInversion,
    RefinedLearnedInversion,
    ServerView,
    parameter_gradients,
)
from lightning_gp.audit import (
    AttackBudget,
    DefenseSetting,
    audit_setting,
    defense_catalog,
    learned_inversion_attacks,
    setting_simulator,
    simulation_refusal,
    tap_defended_round,
)
from lightning_gp.audit.rounds import public_batch
from lightning_gp.callbacks import DPSGD, GaussianNoise
from lightning_gp.data import ArrayDataModule
from lightning_gp.metrics.image_quality import psnr
from lightning_gp.models import LeNetZhu

#: small enough to train in seconds on one thread, large enough to learn LeNetZhu's undefended inverse
TINY = InverterConfig(feature_dim=1024, hidden=256, max_epochs=15, patience=3, batch=32)


def _view(model: nn.Module, image: torch.Tensor, label: torch.Tensor, datamodule) -> ServerView:
    gradients = parameter_gradients(model, nn.CrossEntropyLoss(), image[None], label[None], create_graph=False)
    return ServerView(
        model=model,
        gradients=gradients,
        batch_size=1,
        input_shape=tuple(image.shape),
        num_classes=10,
        mean=tuple(datamodule.mean),
        std=tuple(datamodule.std),
    )


def _public(datamodule, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    datamodule.setup("test")
    images = public_batch(datamodule, size)
    labels = torch.as_tensor([int(datamodule.test_dataset[i][1]) for i in range(images.shape[0])])
    return images, labels


def test_learned_inverter_beats_the_mean_image_on_training_images_it_never_saw(data, one_thread):
    """16 training images of an undefended LeNetZhu: the paired PSNR gain of the inverter over the
    public mean image has a mean above t(0.99, 15 dof) = 2.60 standard errors, i.e. the inverter is
    better than the blank guess at the 1% level (a one-sided paired t-test)."""
    torch.manual_seed(0)
    model = LeNetZhu()
    images, labels = _public(data, 600)
    attack = LearnedInversion(
        setting_simulator(DefenseSetting("undefended")),
        images,
        labels,
        defense_key="undefended",
        config=TINY,
        cache=InverterCache(),
        seed=0,
    )
    mean_pixels = data_pixels(images, data).mean(0, keepdim=True)
    gains = []
    for index in range(16):
        image, label = data.train_dataset[index]
        view = _view(model, image, torch.as_tensor(label), data)
        reconstruction = attack.reconstruct(view)
        original = view.denormalize(image[None])
        learned = psnr(view.denormalize(reconstruction.images), original)
        blank = psnr(mean_pixels, original)
        gains.append(float(learned - blank))
    gains_array = np.asarray(gains)
    standard_error = gains_array.std(ddof=1) / math.sqrt(len(gains))
    assert gains_array.mean() > 2.60 * standard_error, gains


def data_pixels(images: torch.Tensor, datamodule) -> torch.Tensor:
    mean = torch.as_tensor(datamodule.mean).reshape(1, -1, 1, 1)
    std = torch.as_tensor(datamodule.std).reshape(1, -1, 1, 1)
    return (images * std + mean).clamp(0, 1)


def _marked_datamodule() -> ArrayDataModule:
    """Training images with a white top-left corner (pixel 1.0), test images darker than 0.5 everywhere:
    any training image that reaches the inverter is recognisable by its corner."""
    g = torch.Generator().manual_seed(0)
    train = torch.rand(80, 1, 28, 28, generator=g) * 0.5
    train[:, :, :4, :4] = 1.0
    test = torch.rand(200, 1, 28, 28, generator=g) * 0.5
    return ArrayDataModule(
        x=train,
        y=torch.arange(80) % 10,
        x_test=test,
        y_test=torch.arange(200) % 10,
        mean=(0.3,),
        std=(0.3,),
        num_classes=10,
        val_fraction=0.0,
    )


def test_the_budget_s_refined_decoys_set_the_refined_inverter_s_control():
    """``AttackBudget.refined_decoys`` reaches the refined inverter the audit builds (its prior-only
    control's guesses), 31 by default; a count below 1 is refused by name."""
    from lightning_gp.audit.setting_audit import _learned_attacks

    setting = defense_catalog(["GaussianNoise"])[0].build(0, 1)
    for budget, expected in ((AttackBudget(learned_inversion=True), 31), (AttackBudget(refined_decoys=255), 255)):
        attacks = _learned_attacks(setting, _marked_datamodule(), budget, [], 0, print)
        refined = [a for a in attacks if isinstance(a, RefinedLearnedInversion)]
        assert [a.refined_decoys for a in refined] == [expected]
    with pytest.raises(ValueError, match="refined_decoys"):
        AttackBudget(refined_decoys=0)


def test_the_inverter_never_trains_on_a_training_image(one_thread):
    """The audit's learned inverter trains on the public (test) split only: every image the server's
    simulation sees lacks the white corner every training image has."""
    datamodule = _marked_datamodule()
    setting = defense_catalog(["GaussianNoise"])[0].build(0, 1)
    torch.manual_seed(0)
    model = LeNetZhu()
    config = InverterConfig(feature_dim=256, hidden=32, max_epochs=1, batch=32)
    attack = learned_inversion_attacks(setting, datamodule, config=config, cache=InverterCache(), seed=0)[0]
    seen: list[torch.Tensor] = []
    simulate = attack.simulate

    def recording(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, seed: int) -> dict:
        seen.append(images.detach().clone())
        return simulate(model, images, labels, seed)

    attack.simulate = recording
    records, sent, _ = tap_defended_round(setting, model, datamodule, indices=[[3]], num_clients=2, seed=0)
    view = ServerView.from_tap(records[0], sent, num_classes=10, mean=tuple(datamodule.mean), std=tuple(datamodule.std))
    attack.reconstruct(view)
    corners = data_pixels(torch.cat([s.flatten(0, 1) for s in seen]), datamodule)[:, :, :4, :4]
    assert len(seen) > 0
    assert corners.amax().item() <= 0.5 + 1e-5  # no white corner: no training image
    # the attacked image itself has it (the check can fail)
    assert data_pixels(records[0].inputs, datamodule)[:, :, :4, :4].amin().item() >= 1.0 - 1e-5


def test_the_cache_trains_once_per_setting_and_again_for_another(data, one_thread):
    torch.manual_seed(0)
    model = LeNetZhu()
    images, labels = _public(data, 200)
    cache = InverterCache()
    config = InverterConfig(feature_dim=256, hidden=32, max_epochs=1, batch=32)
    simulate = setting_simulator(DefenseSetting("undefended"))
    first = LearnedInversion(simulate, images, labels, defense_key="a", config=config, cache=cache, seed=0)
    views = [
        _view(model, image, torch.as_tensor(label), data) for image, label in (data.train_dataset[i] for i in range(2))
    ]
    first.reconstruct(views[0])
    again = RefinedLearnedInversion(
        simulate, images, labels, defense_key="a", config=config, cache=cache, seed=0, refine_iterations=2
    )
    again.reconstruct(views[1])
    assert cache.trainings == 1
    assert first.inverter(views[0]) is again.inverter(views[1])
    other = LearnedInversion(simulate, images, labels, defense_key="b", config=config, cache=cache, seed=0)
    other.reconstruct(views[0])
    assert cache.trainings == 2
    assert other.inverter(views[0]) is not first.inverter(views[0])


def test_the_cache_reloads_a_trained_inverter_from_disk(data, one_thread, tmp_path):
    torch.manual_seed(0)
    model = LeNetZhu()
    images, labels = _public(data, 200)
    config = InverterConfig(feature_dim=256, hidden=32, max_epochs=1, batch=32)
    simulate = setting_simulator(DefenseSetting("undefended"))
    image, label = data.train_dataset[0]
    view = _view(model, image, torch.as_tensor(label), data)
    first = LearnedInversion(simulate, images, labels, defense_key="a", config=config, cache=InverterCache(tmp_path))
    expected = first.reconstruct(view).images
    later = InverterCache(tmp_path)
    again = LearnedInversion(simulate, images, labels, defense_key="a", config=config, cache=later)
    torch.testing.assert_close(again.reconstruct(view).images, expected)
    assert later.trainings == 0


def test_the_server_replays_the_settings_noise_with_its_own_randomness(data, one_thread):
    """GaussianNoise(0.01) replayed: defended minus raw gradient has standard deviation 0.01 (to 5%,
    over 13,426 x 4 draws the relative standard error of a std estimate is 0.3%), a seed gives the
    same draw again, another seed another draw."""
    torch.manual_seed(0)
    model = LeNetZhu()
    setting = DefenseSetting("noise", callbacks=[GaussianNoise(scale=0.01, seed=0)])
    simulate = setting_simulator(setting, num_clients=2)
    images = torch.stack([data.train_dataset[i][0] for i in range(4)]).reshape(4, 1, 1, 28, 28)
    labels = torch.as_tensor([int(data.train_dataset[i][1]) for i in range(4)]).reshape(4, 1)
    plain = setting_simulator(DefenseSetting("undefended"))(model, images, labels, 0)
    noisy = simulate(model, images, labels, 1)
    residual = torch.cat([(noisy[n] - plain[n]).flatten() for n in plain])
    assert residual.std().item() == pytest.approx(0.01, rel=0.05)
    again = simulate(model, images, labels, 1)
    other = simulate(model, images, labels, 2)
    for name in plain:
        torch.testing.assert_close(again[name], noisy[name])
    assert not torch.equal(other["fc.weight"], noisy["fc.weight"])


def test_the_server_replays_dp_sgd_as_opacus_computes_it(data, one_thread):
    """Without noise the replay of DP-SGD equals, to float precision, the gradient Opacus let out in
    a real client step (per-example clip to 0.05, far below these gradients' norms, so every example
    is clipped); with noise multiplier 1 the residual has std ``sigma * C / B`` (to 5%: 61,706 draws
    give a relative standard error of 0.3%)."""
    torch.manual_seed(0)
    model = LeNetZhu()
    indices = [[0, 1, 2, 3]]
    images = torch.stack([data.train_dataset[i][0] for i in indices[0]])[None]
    labels = torch.as_tensor([int(data.train_dataset[i][1]) for i in indices[0]])[None]
    clip = 0.05
    exact = DefenseSetting("clip", callbacks=[DPSGD(noise_multiplier=0.0, max_grad_norm=clip, poisson_sampling=False)],
                           runner="trainer")  # fmt: skip
    tapped, _, _ = tap_defended_round(exact, model, data, indices=indices, num_clients=1)
    replayed = setting_simulator(exact)(model, images, labels, 0)
    for name, gradient in tapped[0].gradients.items():
        torch.testing.assert_close(replayed[name][0], gradient, rtol=1e-4, atol=1e-7)
    noisy = DefenseSetting("dp", callbacks=[DPSGD(noise_multiplier=1.0, max_grad_norm=clip)], runner="trainer")
    shared = setting_simulator(noisy)(model, images, labels, 0)
    residual = torch.cat([(shared[n] - replayed[n]).flatten() for n in shared])
    assert residual.std().item() == pytest.approx(clip / 4, rel=0.05)


def test_a_batch_inverter_returns_one_image_per_slot(data, one_thread):
    torch.manual_seed(0)
    model = LeNetZhu()
    images, labels = _public(data, 200)
    config = InverterConfig(feature_dim=256, hidden=32, max_epochs=1, batch=16)
    attack = LearnedInversion(
        setting_simulator(DefenseSetting("undefended")), images, labels, defense_key="u", config=config,
        cache=InverterCache(),
    )  # fmt: skip
    batch = torch.stack([data.train_dataset[i][0] for i in range(3)])
    targets = torch.as_tensor([int(data.train_dataset[i][1]) for i in range(3)])
    gradients = parameter_gradients(model, nn.CrossEntropyLoss(), batch, targets, create_graph=False)
    view = ServerView(model, gradients, 3, (1, 28, 28), 10, mean=tuple(data.mean), std=tuple(data.std))
    reconstruction = attack.reconstruct(view)
    assert reconstruction.images.shape == (3, 1, 28, 28)
    assert reconstruction.meta["training"]["samples"] == (200 - 20) // 3


def test_settings_the_server_cannot_replay_are_named_with_the_reason():
    refiner_like = DefenseSetting("wrapped", wrap=lambda model: model)
    assert "wraps the model" in simulation_refusal(refiner_like)
    assert simulation_refusal(defense_catalog(["DPSGD"])[0].build(0, 1)) is None
    by_epsilon = DefenseSetting("eps", callbacks=[DPSGD(target_epsilon=3.0)], runner="trainer")
    assert "target epsilon" in simulation_refusal(by_epsilon)
    beside = DefenseSetting(
        "dp+noise", callbacks=[DPSGD(noise_multiplier=1.0), GaussianNoise(scale=0.1)], runner="trainer"
    )
    assert "only DP-SGD alone" in simulation_refusal(beside)
    assert simulation_refusal(defense_catalog(["TopKPruning"])[0].build(0, 1)) is None
    with pytest.raises(ValueError, match="setting: wrapped wraps the model"):
        setting_simulator(refiner_like)


def test_bad_arguments_name_the_argument(data):
    images, labels = _public(data, 50)
    simulate = setting_simulator(DefenseSetting("undefended"))
    with pytest.raises(ValueError, match="public_labels"):
        LearnedInversion(simulate, images, labels[:-1], defense_key="u")
    with pytest.raises(ValueError, match="defense_key"):
        LearnedInversion(simulate, images, labels, defense_key="")
    with pytest.raises(TypeError, match="simulate"):
        LearnedInversion("not callable", images, labels, defense_key="u")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="val_fraction"):
        InverterConfig(val_fraction=1.5)
    with pytest.raises(ValueError, match="hidden"):
        InverterConfig(hidden=0)
    with pytest.raises(ValueError, match="refine_iterations"):
        RefinedLearnedInversion(simulate, images, labels, defense_key="u", refine_iterations=0)
    with pytest.raises(ValueError, match="learned_max_epochs"):
        AttackBudget(learned_max_epochs=0)
    torch.manual_seed(0)
    model = LeNetZhu()
    image, label = data.train_dataset[0]
    few = LearnedInversion(simulate, images[:2], labels[:2], defense_key="u", cache=InverterCache())
    with pytest.raises(ValueError, match="too few"):
        few.reconstruct(_view(model, image, torch.as_tensor(label), data))


def test_the_audit_runs_the_learned_inverter_and_logs_its_training_cost(one_thread):
    datamodule = _marked_datamodule()
    setting = defense_catalog(["GaussianNoise"])[0].build(0, 1)
    budget = AttackBudget(ig_iterations=2, lbfgs_iterations=1, learned_inversion=True, learned_max_epochs=1)
    lines: list[str] = []
    torch.manual_seed(0)
    audit = audit_setting(
        setting, LeNetZhu(), datamodule, indices=[[0], [1]], published=[], budget=budget, log=lines.append
    )
    learned = audit.cell("adaptive:LearnedInversion")
    refined = audit.cell("adaptive:RefinedLearnedInversion")
    assert learned.status == "ok" and refined.status == "ok"
    assert learned.means["psnr"] is not None
    cost_lines = [
        line for line in lines if "LearnedInversion on GaussianNoise" in line and "inverter trained in" in line
    ]
    assert len(cost_lines) == 2 and "training pairs, 1 epochs" in cost_lines[0]
    # both clients were attacked by the one inverter, trained once
    keys = {r.reconstruction.meta["inverter_key"] for r in audit.results["adaptive:LearnedInversion"]}
    assert len(keys) == 1 and len(audit.results["adaptive:LearnedInversion"]) == 2
    # the data-prior attacks are scored against their prior-only control, the others are not
    for name in ("adaptive:LearnedInversion", "adaptive:RefinedLearnedInversion"):
        for result in audit.results[name]:
            assert result.report.prior_only is not None and "psnr" in result.report.prior_only[0]
    assert all(r.report.prior_only is None for r in audit.results["adaptive:DefenseAwareInversion"])


@pytest.mark.parametrize("knowing", [False, True], ids=["published IG refines", "top-k-aware IG refines"])
def test_the_refined_inverter_s_decoys_refined_side_by_side_each_follow_their_own_objective(
    data, one_thread, monkeypatch, knowing
) -> None:
    """The refined inverter's prior-only guesses: its decoys' refinements share one vmapped
    optimisation (InvertingGradients.stacked_objective and the defense-aware one through the match plan)
    whose row ``k`` is decoy ``k``'s own objective, checked to float32 precision where both are
    evaluated at the same images (the inverter's outputs, where both paths start, and the guesses made
    one decoy at a time). The trajectories themselves are not compared pixel by pixel: signed Adam
    turns the kernels' rounding into a full step wherever a gradient entry is within rounding of
    zero, so in float32 they part by amounts that depend on the CPU (on one AVX-512 CPU the published
    IG's agree exactly and the top-k-aware one's differ by up to 1e-2 in 6 of these 3,920 pixels; on
    others up to 1.2e-3); float64 runs of the shared optimiser agree exactly (test_attack_batching)."""
    from lightning_gp.attacks import DefenseAwareInversion, InvertingGradients, defense_knowledge
    from lightning_gp.attacks.optimization import known_or_recovered_labels
    from lightning_gp.defenses import TopKPruning

    torch.manual_seed(0)
    model = LeNetZhu()
    images, labels = _public(data, 300)
    pruning = TopKPruning(0.8, error_feedback=False)
    image, label = data.train_dataset[3]
    view = _view(model, image, torch.as_tensor(label), data)
    view = ServerView(**{**view.__dict__, "gradients": pruning(dict(view.gradients), 0)}) if knowing else view
    matching = (
        DefenseAwareInversion(defense_knowledge(pruning), iterations=60)
        if knowing
        else InvertingGradients(iterations=60)
    )

    def simulate(model, x, y, seed):
        grads = [parameter_gradients(model, nn.CrossEntropyLoss(), xi, yi, create_graph=False) for xi, yi in zip(x, y)]
        if knowing:
            grads = [pruning(dict(g), 0) for g in grads]
        return {n: torch.stack([g[n] for g in grads]) for n in grads[0]}

    attack = RefinedLearnedInversion(
        simulate, images, labels, defense_key=f"topk={knowing}", config=TINY, cache=InverterCache(), seed=0,
        matching=matching, refine_iterations=40, refined_decoys=5,
    )  # fmt: skip
    built: list[tuple[list[ServerView], Any]] = []  # each stacked objective the refinement builds
    build_stacked = type(matching).stacked_objective

    def record(self, views, labels):
        objective = build_stacked(self, views, labels)
        built.append((list(views), objective))
        return objective

    monkeypatch.setattr(type(matching), "stacked_objective", record)
    groups: list[list[ServerView]] = []  # the decoys handed to each optimisation side by side
    refine = attack._refined_side_by_side
    monkeypatch.setattr(attack, "_refined_side_by_side", lambda decoys: groups.append(decoys) or refine(decoys))
    side_by_side = attack._prior_only_guesses(view, 255)
    ((_, stacked),) = built
    (decoys,) = groups  # the five decoys in one optimisation
    assert stacked is not None and len(decoys) == 5
    alone = [matching.objective(decoy, known_or_recovered_labels(decoy)) for decoy in decoys]
    starts = torch.stack([LearnedInversion.reconstruct(attack, decoy).images for decoy in decoys])
    monkeypatch.setattr(type(matching), "stacked_objective", lambda self, views, labels: None)
    one_by_one = attack._prior_only_guesses(view, 255)
    assert side_by_side.shape == one_by_one.shape == (5, 1, 1, 28, 28)
    for at in (starts, one_by_one):
        assert_rows_are_their_own_problems(stacked, alone, at)
    unrefined = LearnedInversion._prior_only_guesses(attack, view, 5)
    assert (side_by_side - unrefined).abs().amax(dim=(1, 2, 3, 4)).gt(1e-2).any()  # some refinement was kept


def _local_sgd(model: nn.Module, steps: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> dict[str, torch.Tensor]:
    """``w_global - w_local`` after plain SGD at ``lr`` over ``steps``, by hand."""
    import copy

    local = copy.deepcopy(model)
    for x, y in steps:
        local.zero_grad()
        nn.CrossEntropyLoss()(local(x), y).backward()
        with torch.no_grad():
            for p in local.parameters():
                p -= lr * p.grad
    return {n: p.detach() - q.detach() for (n, p), q in zip(model.named_parameters(), local.parameters())}


def test_the_server_replays_fedavg_local_training_for_the_inverter():
    """Under FedAvg the simulated client shares ``w_global - w_local`` of its local SGD: 3 epochs over the
    whole batch are 3 steps on it; 1 epoch in batches of 1 is one step per image, in one of the two
    orders; to float32 rounding. A local batch that does not divide the batch is an error naming it."""
    torch.manual_seed(0)
    model, lr = LeNetZhu(), 0.05
    images, labels = torch.rand(1, 2, 1, 28, 28), torch.tensor([[3, 7]])
    whole = setting_simulator(DefenseSetting("fedavg", algorithm="fedavg", local_epochs=3, local_lr=lr))
    shared = whole(model, images, labels, 0)
    expected = _local_sgd(model, [(images[0], labels[0])] * 3, lr)
    for name, value in expected.items():
        torch.testing.assert_close(shared[name][0], value, rtol=1e-4, atol=1e-6)
    single = DefenseSetting("fedavg b=1", algorithm="fedavg", local_batch_size=1, local_lr=lr)
    shared = setting_simulator(single)(model, images, labels, 0)
    orders = [[0, 1], [1, 0]]
    candidates = [_local_sgd(model, [(images[0, [i]], labels[0, [i]]) for i in order], lr) for order in orders]
    assert any(all(torch.allclose(shared[n][0], c[n], rtol=1e-4, atol=1e-6) for n in c) for c in candidates), (
        "the update is not local SGD over the two images one at a time"
    )
    uneven = DefenseSetting("fedavg b=2", algorithm="fedavg", local_batch_size=2, local_lr=lr)
    with pytest.raises(ValueError, match="local_batch_size=2 must divide the 3 images"):
        setting_simulator(uneven)(model, torch.rand(1, 3, 1, 28, 28), torch.tensor([[1, 2, 3]]), 0)
