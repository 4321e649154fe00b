"""Independent Adam searches side by side (lightning_gp.attacks.searches) and the row-wise gradient
match they run on (lightning_gp.attacks.batched.gradient_match_rows): problems searched together
follow the trajectories they follow alone, the loop is the Adam loop GGL and ROG ran one search at a
time, and the vmapped match is the per-view match."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_gp.attacks import ServerView, cosine_distance, parameter_gradients, squared_l2_distance, update_clip
from lightning_gp.attacks.batched import gradient_match_rows, mappable
from lightning_gp.attacks.optimization import plateaued
from lightning_gp.attacks.searches import adam_searches, cosine_to, step_decay
from lightning_gp.defenses import clip_update
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")


def _bowls(count: int, dim: int = 6, seed: int = 0) -> tuple[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]]:
    """``count`` ill-conditioned quadratics of different centres and curvatures: starts, and the
    row-wise objective ``(x [A, dim], rows [A]) -> [A]``."""
    torch.manual_seed(seed)
    centres = torch.randn(count, dim, dtype=torch.float64)
    curvature = torch.logspace(-2, 1, dim, dtype=torch.float64) * torch.rand(count, 1, dtype=torch.float64).add(0.5)

    def value_of(x: Tensor, rows: Tensor) -> Tensor:
        return (curvature[rows] * (x - centres[rows]).pow(2)).sum(-1)

    return torch.randn(count, dim, dtype=torch.float64), centres, value_of


def _reference(start: Tensor, objective: Callable[[Tensor], Tensor], iterations: int, lr: float, steps: int) -> tuple:
    """The Adam loop GGL ran per restart before: torch's Adam and MultiStepLR, the objective recorded
    before each step, the best iterate kept, a plateau or a non-finite value ending it."""
    x = start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=lr)
    milestones = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    best, best_value, trace, stopped = x.detach().clone(), math.inf, [], "iterations"
    for _ in range(iterations):
        optimizer.zero_grad()
        loss = objective(x)
        value = float(loss.detach())
        if not math.isfinite(value):
            stopped = "non-finite objective"
            break
        trace.append(value)
        if value < best_value:
            best, best_value = x.detach().clone(), value
        if plateaued(trace, steps, 1e-3):
            stopped = "plateau"
            break
        loss.backward()
        optimizer.step()
        scheduler.step()
    return best, best_value, trace, stopped


def test_problems_searched_side_by_side_follow_the_trajectories_they_follow_alone() -> None:
    """Eight bowls, two per call, a plateau rule that stops them at different steps (so the loop drops
    finished problems and their Adam moments mid-run): each result equals that problem's search
    alone, in float64 to 1e-12."""
    starts, _, value_of = _bowls(8)
    options = {"iterations": 400, "lr": 0.05, "schedule": step_decay(400), "plateau_steps": 20, "plateau_rtol": 1e-3}
    together = adam_searches(starts, value_of, rows_per_call=2, **options)
    steps = {len(r.trace) for r in together}
    assert len(steps) > 1 and min(steps) < 400, steps  # they stopped at different steps, some on a plateau
    for p, result in enumerate(together):
        alone = adam_searches(
            starts[p : p + 1], lambda x, rows, p=p: value_of(x, rows + p), rows_per_call=1, **options
        )[0]
        assert result.stopped == alone.stopped and len(result.trace) == len(alone.trace)
        assert torch.allclose(result.best, alone.best, rtol=0, atol=1e-12)
        assert result.value == pytest.approx(alone.value, rel=1e-12)


def test_the_loop_is_the_adam_loop_with_step_decay_and_a_plateau_stop_it_replaces() -> None:
    starts, _, value_of = _bowls(3, seed=1)
    together = adam_searches(
        starts, value_of, iterations=300, lr=0.1, schedule=step_decay(300), plateau_steps=30, plateau_rtol=1e-3,
        rows_per_call=3,
    )  # fmt: skip
    for p, result in enumerate(together):
        best, _, trace, stopped = _reference(
            starts[p], lambda x, p=p: value_of(x[None], torch.tensor([p]))[0], 300, 0.1, 30
        )
        assert torch.allclose(result.best, best, rtol=0, atol=1e-12)
        assert result.trace == pytest.approx(trace, rel=1e-12)
        assert result.stopped.startswith(stopped)


def test_the_cosine_schedule_and_the_projection_act_after_each_step() -> None:
    """ROG's loop: Adam at a cosine-annealed rate, iterates clamped to [0, 1] after each step (a bowl
    centred outside the box ends on its face), as CosineAnnealingLR and clamp_ did."""
    centre = torch.tensor([[1.5, 0.3, -0.4]], dtype=torch.float64)

    def value_of(x: Tensor, rows: Tensor) -> Tensor:
        return (x - centre[rows]).pow(2).sum(-1)

    start = torch.full((1, 3), 0.5, dtype=torch.float64)
    result = adam_searches(
        start, value_of, iterations=200, lr=0.05, schedule=cosine_to(0.1, 200), plateau_steps=0, plateau_rtol=0.0,
        rows_per_call=1, project=lambda x: x.clamp(0, 1),
    )[0]  # fmt: skip
    x = start[0].clone().requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=0.05)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200, eta_min=0.005)
    for _ in range(200):
        optimizer.zero_grad()
        value_of(x[None], torch.tensor([0]))[0].backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            x.clamp_(0, 1)
    assert len(result.trace) == 200 and result.stopped == "iterations"
    assert torch.allclose(result.best, torch.tensor([1.0, 0.3, 0.0], dtype=torch.float64), atol=2e-3)
    assert torch.allclose(result.best, x.detach(), atol=1e-9)


def test_a_problem_whose_objective_stops_being_finite_keeps_its_best_iterate_and_leaves_alone() -> None:
    starts, _, value_of = _bowls(3, seed=2)

    def poisoned(x: Tensor, rows: Tensor) -> Tensor:
        values = value_of(x, rows)
        return torch.where((rows == 1) & (values < 0.5 * value_of(starts[1:2], torch.tensor([1]))), math.nan, values)

    options = {"iterations": 200, "lr": 0.1, "schedule": step_decay(200), "plateau_steps": 0, "plateau_rtol": 0.0}
    results = adam_searches(starts, poisoned, rows_per_call=3, **options)
    clean = adam_searches(starts, value_of, rows_per_call=3, **options)
    assert results[1].stopped == "non-finite objective" and len(results[1].trace) < 200
    assert all(math.isfinite(v) for v in results[1].trace) and results[1].value == min(results[1].trace)
    for p in (0, 2):  # the others never notice
        assert torch.allclose(results[p].best, clean[p].best, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"iterations": 0}, "iterations"), ({"lr": 0.0}, "lr"), ({"rows_per_call": 0}, "rows_per_call"),
     ({"plateau_steps": -1}, "plateau_steps"), ({"plateau_rtol": 2.0}, "plateau_rtol")],
)  # fmt: skip
def test_bad_search_arguments_are_refused_naming_them(kwargs, name) -> None:
    starts, _, value_of = _bowls(2)
    options = {
        "iterations": 5, "lr": 0.1, "schedule": step_decay(5), "plateau_steps": 0, "plateau_rtol": 0.0, "rows_per_call": 1,
    }  # fmt: skip
    with pytest.raises(ValueError, match=name):
        adam_searches(starts, value_of, **{**options, **kwargs})
    with pytest.raises(ValueError, match="starts"):
        adam_searches(starts[:0], value_of, **options)


# ------------------------------------------------------------------------------ the row-wise match
def _views(count: int, batch: int) -> tuple[list[ServerView], list[Tensor]]:
    torch.manual_seed(3)
    model = LeNetZhu()
    views, labels = [], []
    for _ in range(count):
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
        shared = {n: g.detach() for n, g in parameter_gradients(model, nn.CrossEntropyLoss(), x, y).items()}
        views.append(
            ServerView(model=model, gradients=shared, batch_size=batch, input_shape=(1, 28, 28), num_classes=10)
        )
        labels.append(y)
    return views, labels


def test_the_vmapped_match_of_any_rows_is_each_view_s_own_match_restarts_sharing_a_target() -> None:
    """Three views, two restarts each, rows in any order: each value is the view's match computed
    alone, plain (squared L2 over every layer) and through a plan's support, per-layer weight and
    target (cosine over a subset of layers), to float32 precision."""
    views, labels = _views(3, 2)
    torch.manual_seed(4)
    images = torch.randn(4, 2, 1, 28, 28)
    rows = torch.tensor([5, 0, 3, 2])  # views 2, 0, 1, 1
    plain = gradient_match_rows(views, labels, squared_l2_distance, repeats=2)(images, rows)
    names = ["body.0.weight", "fc.weight", "fc.bias"]
    support = [{n: torch.rand_like(g) > 0.3 for n, g in v.gradients.items()} for v in views]
    scale = [
        {"body.0.weight": 0.5, "fc.weight": torch.rand_like(v.gradients["fc.weight"]), "fc.bias": 2.0} for v in views
    ]
    targets = [{n: torch.randn_like(v.gradients[n]) for n in names} for v in views]
    planned = gradient_match_rows(
        views, labels, cosine_distance, names=names, targets=targets, support=support, scale=scale, repeats=2
    )(images, rows)
    for a, row in enumerate(rows.tolist()):
        v = row // 2
        guess = parameter_gradients(views[v].model, views[v].loss_fn, images[a], labels[v])
        expected = float(squared_l2_distance(guess, views[v].gradients).detach())
        assert float(plain[a].detach()) == pytest.approx(expected, rel=1e-4)
        restricted = {n: torch.where(support[v][n], guess[n], torch.zeros_like(guess[n])) * scale[v][n] for n in names}
        expected = float(cosine_distance(restricted, targets[v], names).detach())
        assert float(planned[a].detach()) == pytest.approx(expected, rel=1e-4)


def test_the_vmapped_match_through_dp_sgd_s_per_example_clip_is_the_knowledge_s_dummy_gradient() -> None:
    """Batch 3: each example's gradient clipped to 0.05 on its own, then averaged (what the server
    knows a DP-SGD client computed), through the vmapped match as through DefenseKnowledge.dummy_gradient."""
    from lightning_gp.attacks import DefenseKnowledge

    views, labels = _views(2, 3)
    knowledge = DefenseKnowledge(defense="DPSGD", models=(), support=False, per_example_clip=0.05)
    torch.manual_seed(6)
    images = torch.randn(2, 3, 1, 28, 28)
    values = gradient_match_rows(views, labels, cosine_distance, per_example_clip=0.05)(images, torch.tensor([1, 0]))
    for a, v in enumerate([1, 0]):
        guess = knowledge.dummy_gradient(views[v], images[a], labels[v])
        expected = float(cosine_distance(guess, views[v].gradients).detach())
        assert float(values[a].detach()) == pytest.approx(expected, rel=1e-4)
    plain = gradient_match_rows(views, labels, cosine_distance)(images, torch.tensor([1, 0]))
    assert not torch.allclose(plain, values)  # the clip binds here


def test_views_whose_plans_keep_other_layers_stack_over_the_union_with_the_left_out_layers_weighing_nothing() -> None:
    """Known Gaussian noise: the Wiener gain zeroes a layer where the noise swamps it, so two views'
    plans keep different layers; stacked over the union, each row is still its own plan's match."""
    from lightning_gp.attacks import DefenseKnowledge
    from lightning_gp.attacks.adaptive import stacked_match

    views, labels = _views(2, 1)
    views[1] = ServerView(
        **{**views[1].__dict__, "gradients": {**views[1].gradients, "fc.bias": 1e-6 * views[1].gradients["fc.bias"]}}
    )
    knowledge = DefenseKnowledge(defense="GaussianNoise", models=(), support=False, noise_std=1e-3)
    plans = [knowledge.plan(view) for view in views]
    assert plans[0].names != plans[1].names  # the noise swamps view 1's bias only
    match = stacked_match(knowledge, views, labels, cosine_distance, repeats=2)
    assert match is not None
    images = torch.randn(3, 1, 1, 28, 28)
    values = match(images, torch.tensor([3, 0, 2]))
    for a, v in enumerate([1, 0, 1]):
        guess = plans[v].restrict(knowledge.dummy_gradient(views[v], images[a], labels[v]))
        expected = float(cosine_distance(guess, plans[v].target, plans[v].names).detach())
        assert float(values[a].detach()) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("clip", ["update", "per example"])
def test_the_vmapped_match_of_a_secure_aggregate_is_the_mean_of_its_clients_each_clipped_on_its_own(clip) -> None:
    """Aggregates of 3 clients of 2 images: each row's guess is the mean of its clients' chunks, each
    clipped on its own (the Gaussian mechanism's update clip, DP-SGD's per-example clip) as the
    aggregate's knowledge computes it (DefenseKnowledge.over_clients), through the plan of the
    aggregate's noise. The update clip of the whole batch at once gives other values (DP-SGD's mean of
    clipped examples is the same over the whole batch as over its equal chunks)."""
    from lightning_gp.attacks import DefenseKnowledge
    from lightning_gp.attacks.adaptive import stacked_match

    views, labels = _views(2, 6)
    clips = {"transform": update_clip(0.05)} if clip == "update" else {"per_example_clip": 0.05}
    one = DefenseKnowledge(defense="clip", models=(), support=False, noise_std=1e-3, **clips)
    knowledge = one.over_clients(3)
    match = stacked_match(knowledge, views, labels, squared_l2_distance, repeats=2)
    assert match is not None
    torch.manual_seed(7)
    images = torch.randn(3, 6, 1, 28, 28)
    rows = torch.tensor([3, 0, 2])
    values = match(images, rows)
    if clip == "update":
        whole = stacked_match(one, views, labels, squared_l2_distance, repeats=2)
        assert whole is not None and not torch.allclose(whole(images, rows), values, rtol=1e-3)
    for a, v in enumerate([1, 0, 1]):
        plan = knowledge.plan(views[v])
        guess = plan.restrict(knowledge.dummy_gradient(views[v], images[a], labels[v]))
        expected = float(squared_l2_distance(guess, plan.target, plan.names).detach())
        assert float(values[a].detach()) == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ValueError, match="clients"):
        gradient_match_rows(views, labels, squared_l2_distance, clients=4)


def test_the_match_is_differentiable_per_row_and_a_model_that_does_not_map_is_told_apart() -> None:
    views, labels = _views(2, 1)
    match = gradient_match_rows(views, labels, cosine_distance)
    images = torch.randn(2, 1, 1, 28, 28, requires_grad=True)
    (gradient,) = torch.autograd.grad(match(images, torch.tensor([0, 1])).sum(), images)
    alone = images[1].detach().requires_grad_(True)
    guess = parameter_gradients(views[1].model, views[1].loss_fn, alone, labels[1])
    (expected,) = torch.autograd.grad(cosine_distance(guess, views[1].gradients), alone)
    assert torch.allclose(gradient[1], expected, atol=1e-6)
    assert mappable(match, views[0])

    class ReadsAValue(nn.Module):  # data-dependent control flow: no batching rule
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(784, 10)

        def forward(self, x: Tensor) -> Tensor:
            out = self.fc(x.flatten(1))
            return out * 2 if float(out.sum()) > 0 else out

    model = ReadsAValue()
    x, y = torch.randn(1, 1, 28, 28), torch.tensor([3])
    shared = {n: g.detach() for n, g in parameter_gradients(model, nn.CrossEntropyLoss(), x, y).items()}
    view = ServerView(model=model, gradients=shared, batch_size=1, input_shape=(1, 28, 28), num_classes=10)
    assert not mappable(gradient_match_rows([view], [y], cosine_distance), view)


def test_row_wise_match_arguments_of_the_wrong_length_are_refused_naming_them() -> None:
    views, labels = _views(2, 1)
    with pytest.raises(ValueError, match="targets"):
        gradient_match_rows(views, labels, cosine_distance, targets=[views[0].gradients])
    with pytest.raises(ValueError, match="repeats"):
        gradient_match_rows(views, labels, cosine_distance, repeats=0)


@pytest.mark.parametrize("norm", [0.0, 0.4, 1.0, 3.0], ids=["zero", "inside", "on the sphere", "outside"])
def test_the_known_clip_is_the_defense_s_clip_in_value_and_gradient_and_maps(norm: float) -> None:
    """update_clip (what the attacks model the Gaussian mechanism's clip with) gives clip_update's values
    bit for bit and its gradient (none inside the ball, finite at zero), without a branch on the norm."""
    torch.manual_seed(5)
    raw = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    scale = norm / float(sum(t.pow(2).sum() for t in raw.values()).sqrt()) if norm else 0.0
    update = {n: (t * scale).requires_grad_(True) for n, t in raw.items()}
    known, reference = update_clip(1.0)(update), clip_update(update, 1.0)
    assert all(torch.equal(known[n], reference[n]) for n in update)
    weights = {n: torch.randn_like(t) for n, t in update.items()}
    grads = torch.autograd.grad(sum((known[n] * weights[n]).sum() for n in update), list(update.values()))
    expected = torch.autograd.grad(sum((reference[n] * weights[n]).sum() for n in update), list(update.values()))
    if norm != 1.0:  # on the sphere itself the two one-sided derivatives differ (a set of measure zero)
        assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    stacked = {n: torch.stack([t.detach(), 2 * t.detach()]) for n, t in update.items()}
    mapped = torch.func.vmap(update_clip(1.0))(stacked)
    for i in range(2):
        alone = clip_update({n: t[i] for n, t in stacked.items()}, 1.0)
        assert all(torch.allclose(mapped[n][i], alone[n]) for n in update)
