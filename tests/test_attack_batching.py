"""Batched attacks (issue 15, part 3): several clients' Inverting Gradients problems, and the restarts
of one, in one vmapped optimisation give each problem the trajectory it gets alone.

The equivalence tests run in float64: there the batched kernels' rounding (~1e-17) never flips the
sign of a gradient entry within a short run, so signed Adam makes identical steps and the images
agree to float64 precision. (In float32 a sign flip of a near-zero entry eventually parts the
trajectories; benchmarks/attack_throughput.py reports that the quality does not change.)
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lightning_gp.attacks import DLG, GradInversion, InvertingGradients, ServerView, parameter_gradients
from lightning_gp.attacks.batched import check_batchable
from lightning_gp.attacks.optimization import optimize_image_batch, optimize_images
from lightning_gp.models import LeNetZhu

SHAPE = (1, 12, 12)
CLASSES = 4


@pytest.fixture(autouse=True)
def float64(one_thread):
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def make_view(model: nn.Module, seed: int, batch: int = 1, mean: float = 0.0, std: float = 1.0) -> ServerView:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand((batch, *SHAPE), generator=g) * 2 - 1
    y = torch.randperm(CLASSES, generator=g)[:batch]
    grads = parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False)
    return ServerView(
        model=model, gradients=grads, batch_size=batch, input_shape=SHAPE, num_classes=CLASSES, mean=(mean,), std=(std,)
    )


def lenet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return LeNetZhu(num_classes=CLASSES, image_size=12)


def assert_same(batched, sequential) -> None:
    assert len(batched) == len(sequential)
    for b, s in zip(batched, sequential):
        torch.testing.assert_close(b.images, s.images, rtol=0, atol=1e-12)
        assert torch.equal(b.labels, s.labels)
        assert b.meta["best_restart"] == s.meta["best_restart"]
        assert b.meta["objectives"] == pytest.approx(s.meta["objectives"], rel=1e-10, abs=1e-14)
        assert b.loss_trace == pytest.approx(s.loss_trace, rel=1e-10, abs=1e-14)
        assert b.meta["batched"] is True and "batched" not in s.meta


def test_batched_clients_follow_their_sequential_trajectories() -> None:
    # One round's model (shared weights), clients with their own gradients, labels and data box.
    model = lenet()
    views = [make_view(copy.deepcopy(model), seed, batch=2, mean=0.1 * seed, std=1 + seed) for seed in range(3)]
    attack = InvertingGradients(iterations=12, restarts=2, seed=5)
    assert_same(attack.reconstruct_many(views), attack.reconstruct_many(views, batched=False))
    # and the sequential path of reconstruct_many is reconstruct itself
    assert torch.equal(attack.reconstruct_many(views, batched=False)[1].images, attack.reconstruct(views[1]).images)


def test_clients_with_different_weights_batch_too() -> None:
    views = [make_view(lenet(seed), seed) for seed in range(3)]
    attack = InvertingGradients(iterations=10, seed=1)
    assert_same(attack.reconstruct_many(views), attack.reconstruct_many(views, batched=False))


def test_support_only_batches_with_each_clients_own_support() -> None:
    views = [make_view(lenet(), seed) for seed in range(2)]
    for i, view in enumerate(views):  # a different pruned support per client
        for g in view.gradients.values():
            g[g.abs() < g.abs().flatten().kthvalue(max(1, g.numel() // (2 + i))).values] = 0
    attack = InvertingGradients(iterations=10, support_only=True)
    assert_same(attack.reconstruct_many(views), attack.reconstruct_many(views, batched=False))


def test_chunks_give_the_same_results_as_one_batch() -> None:
    views = [make_view(lenet(), seed) for seed in range(3)]
    attack = InvertingGradients(iterations=8, restarts=2)
    whole = attack.reconstruct_many(views)
    for chunk_size in (1, 4):
        for a, b in zip(attack.reconstruct_many(views, chunk_size=chunk_size), whole):
            torch.testing.assert_close(a.images, b.images, rtol=0, atol=1e-12)
            assert a.meta["best_restart"] == b.meta["best_restart"]


def test_batched_restarts_pick_the_lowest_objective_like_the_sequential_ones() -> None:
    view = make_view(lenet(), 0, batch=2)
    batched = InvertingGradients(iterations=15, restarts=3, seed=3, batch_restarts=True).reconstruct(view)
    sequential = InvertingGradients(iterations=15, restarts=3, seed=3).reconstruct(view)
    assert_same([batched], [sequential])
    objectives = batched.meta["objectives"]
    assert len(set(objectives)) == 3  # distinct starts: the pick is not vacuous
    assert batched.meta["objective"] == min(objectives)
    assert batched.meta["best_restart"] == objectives.index(min(objectives))


def capped(limit: torch.Tensor):
    """``sum (x - 5)^2``, which is NaN once the mean pixel passes ``limit`` (the ``0 * sqrt`` term adds
    nothing while finite). Rows ``[P, C, H, W] -> [P]`` or one ``[C, H, W]`` image -> scalar."""

    def objective(x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-3)
        return (flat - 5).pow(2).sum(-1) + 0 * (limit - flat.mean(-1)).sqrt()

    return objective


def test_a_problem_whose_objective_blows_up_stops_alone() -> None:
    init = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(0))
    limits = torch.tensor([1e6, float(init[1].mean()) + 0.25])  # row 1 passes it at step 4 (pixels move by lr)
    options = dict(iterations=10, lr=0.1, signed=True, bounds=None, lr_decay=False, report=lambda *a: None)
    images, traces = optimize_image_batch(capped(limits), init, **options)
    for row in range(2):
        alone, trace = optimize_images(capped(limits[row]), init[row], **options)
        torch.testing.assert_close(images[row], alone, rtol=0, atol=1e-15, equal_nan=True)
        assert len(traces[row]) == len(trace)
        assert traces[row] == pytest.approx(trace, nan_ok=True)
    assert len(traces[0]) == 10 and all(math.isfinite(v) for v in traces[0])
    assert len(traces[1]) == 4 and math.isnan(traces[1][-1])  # stopped, and row 0 ran on untouched


def test_batchnorm_in_training_mode_batches_with_per_client_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Sigmoid(), nn.Flatten(), nn.Linear(3 * 12 * 12, CLASSES)
    ).train()
    views = [make_view(copy.deepcopy(model), seed, batch=2) for seed in range(2)]
    attack = InvertingGradients(iterations=6)
    assert_same(attack.reconstruct_many(views), attack.reconstruct_many(views, batched=False))
    assert torch.equal(views[0].model[1].running_mean, model[1].running_mean)  # the attack never updates the model


def test_views_that_cannot_share_an_optimisation_are_refused_by_name() -> None:
    model = lenet()
    good = make_view(copy.deepcopy(model), 0)
    attack = InvertingGradients(iterations=2)
    with pytest.raises(ValueError, match=r"views\[1\].*batch_size"):
        attack.reconstruct_many([good, make_view(copy.deepcopy(model), 1, batch=2)])
    other = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(2 * 10 * 10, CLASSES))
    with pytest.raises(ValueError, match=r"views\[1\].*model"):
        attack.reconstruct_many([good, make_view(other, 1)])
    smoothed = make_view(copy.deepcopy(model), 1)
    smoothed.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"views\[1\].*loss_fn"):
        attack.reconstruct_many([good, smoothed])
    with pytest.raises(ValueError, match="views is empty"):
        attack.reconstruct_many([])
    with pytest.raises(TypeError, match=r"views\[1\] must be a ServerView"):
        attack.reconstruct_many([good, good.gradients])
    with pytest.raises(TypeError, match="views must be a sequence"):
        attack.reconstruct_many(good)
    with pytest.raises(ValueError, match="chunk_size"):
        attack.reconstruct_many([good], chunk_size=0)
    with pytest.raises(TypeError, match="batched"):
        attack.reconstruct_many([good], batched="yes")
    with pytest.raises(TypeError, match="batch_restarts"):
        InvertingGradients(batch_restarts=1)
    with pytest.raises(TypeError, match="observer"):
        InvertingGradients(observer="print")
    check_batchable([good, make_view(copy.deepcopy(model), 1)])  # the same setting passes


def test_attacks_with_their_own_objective_run_one_view_at_a_time() -> None:
    model = lenet()
    views = [make_view(copy.deepcopy(model), seed) for seed in range(2)]
    attack = GradInversion(iterations=4, bn_weight=0, restarts=2, batch_restarts=True)
    many = attack.reconstruct_many(views)
    for result, view in zip(many, views):
        assert result.meta["batched"] is False and "overrides objective" in result.meta["not_batched_because"]
        assert torch.equal(result.images, attack.reconstruct(view).images)


def test_dlg_reconstruct_many_is_reconstruct_per_view() -> None:
    # L-BFGS shares its line search and curvature history across variables: summing problems
    # would change each one's trajectory, so DLG keeps the per-view loop.
    views = [make_view(lenet(), seed) for seed in range(2)]
    attack = DLG(iterations=2, max_iter=3)
    for result, view in zip(attack.reconstruct_many(views), views):
        assert torch.equal(result.images, attack.reconstruct(view).images)


def test_the_observer_sees_every_step_of_every_problem() -> None:
    views = [make_view(lenet(), seed) for seed in range(3)]
    seen: dict[str, list[tuple[int, tuple[int, ...]]]] = {"batched": [], "sequential": []}
    for mode, steps in seen.items():
        attack = InvertingGradients(iterations=4, restarts=2, observer=lambda i, x, out=steps: out.append((i, x.shape)))
        last = attack.reconstruct_many(views, batched=mode == "batched")
    assert seen["batched"] == [(i, (6, 1, *SHAPE)) for i in range(4)]
    assert seen["sequential"] == [(i, (1, 1, *SHAPE)) for _ in range(6) for i in range(4)]
    unobserved = InvertingGradients(iterations=4, restarts=2).reconstruct_many(views, batched=False)
    assert all(torch.equal(a.images, b.images) for a, b in zip(last, unobserved))


def test_frozen_layers_keep_each_clients_own_weights() -> None:
    views = [make_view(lenet(seed), seed) for seed in range(2)]
    for view in views:
        view.model.body[0].weight.requires_grad_(False)
        del view.gradients["body.0.weight"]
    attack = InvertingGradients(iterations=6)
    assert_same(attack.reconstruct_many(views), attack.reconstruct_many(views, batched=False))


# ------------------------------------------------------------------ one attack object per client
def test_clients_attacked_side_by_side_each_follow_their_own_attacks_reconstruct() -> None:
    # the audit builds one attack per client (its own seed): each client's starts are its attack's draws
    model = lenet()
    views = [make_view(copy.deepcopy(model), seed, batch=2, mean=0.1 * seed) for seed in range(3)]
    attacks = [InvertingGradients(iterations=12, restarts=2, seed=10 + c) for c in range(3)]
    together = attacks[0].reconstruct_side_by_side(attacks, views)
    assert together is not None
    assert_same(together, [attack.reconstruct(view) for attack, view in zip(attacks, views)])
    # not one seed for all: the second client's result is not what the first attack would give it
    assert not torch.allclose(together[1].images, attacks[0].reconstruct(views[1]).images)


def test_defense_aware_inversion_side_by_side_is_its_reconstruct_marks_included() -> None:
    from lightning_gp.attacks import DefenseAwareInversion, defense_knowledge
    from lightning_gp.defenses import TopKPruning

    pruning = TopKPruning(0.6, error_feedback=False)
    views = []
    for seed in range(3):
        view = make_view(lenet(), seed)
        views.append(ServerView(**{**view.__dict__, "gradients": pruning(dict(view.gradients), 0)}))
    attacks = [DefenseAwareInversion(defense_knowledge(pruning), iterations=10, seed=c) for c in range(3)]
    together = attacks[0].reconstruct_side_by_side(attacks, views)
    assert together is not None
    alone = [attack.reconstruct(view) for attack, view in zip(attacks, views)]
    assert_same(together, alone)
    marks = ("fallback", "defense", "support_fraction", "matched_layers")
    for a, b in zip(together, alone):
        assert set(a.meta) - {"batched"} == set(b.meta)
        assert {k: a.meta[k] for k in marks} == {k: b.meta[k] for k in marks}
        assert a.meta["fallback"] is False and 0 < a.meta["support_fraction"] < 1


def test_attacks_that_cannot_share_an_optimisation_are_left_to_run_one_by_one() -> None:
    model = lenet()
    views = [make_view(copy.deepcopy(model), seed) for seed in range(2)]
    ig = InvertingGradients(iterations=4)
    assert ig.reconstruct_side_by_side([ig, InvertingGradients(iterations=5)], views) is None  # other settings
    assert ig.reconstruct_side_by_side([ig, GradInversion(iterations=4, bn_weight=0)], views) is None  # other class
    assert ig.reconstruct_side_by_side([ig], views) is None  # not one attack per view
    gi = GradInversion(iterations=4, bn_weight=0)
    assert gi.reconstruct_side_by_side([gi, gi], views) is None  # its own objective
    observed = InvertingGradients(iterations=4, observer=lambda i, x: None)
    assert observed.reconstruct_side_by_side([observed, observed], views) is None
    other_batch = [views[0], make_view(copy.deepcopy(model), 1, batch=2)]
    assert ig.reconstruct_side_by_side([ig, ig], other_batch) is None
    assert DLG(iterations=2).reconstruct_side_by_side([DLG(iterations=2)] * 2, views) is None


def test_defense_aware_clients_whose_knowledge_clips_otherwise_run_one_by_one() -> None:
    from lightning_gp.attacks import DefenseAwareInversion, DefenseKnowledge, coordinate_clip

    views = [make_view(lenet(), seed) for seed in range(2)]

    def clipping(clip: float) -> DefenseAwareInversion:
        return DefenseAwareInversion(DefenseKnowledge(support=False, transform=coordinate_clip(clip)), iterations=3)

    # both describe "transform": only the value at the starts tells the second client's clip from the first's
    # (a per-entry clip turns the gradient; a clip of its norm would not change the cosine at all)
    other = [clipping(1.0), clipping(0.01)]
    assert other[0].reconstruct_side_by_side(other, views) is None
    same = [clipping(0.01), clipping(0.01)]
    assert same[0].reconstruct_side_by_side(same, views) is not None
