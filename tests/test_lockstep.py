"""L-BFGS runs side by side (lightning_gp.attacks.lockstep) and the iDLG restarts that use them: each
problem gets the run it gets alone, every evaluation holds the problems still running in their order,
an error or a cancellation ends only what it must, and an attack keeps the restart it keeps one by one.

The attack-level comparisons run in float64, where the vmapped match's rounding (~1e-17) does not part
L-BFGS trajectories within a short run (in float32 the strong-Wolfe line search amplifies it).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import Tensor, nn

from lightning_gp.attacks import (
    IDLG,
    DefenseAwareIDLG,
    DefenseKnowledge,
    NoiseAwareMAP,
    ServerView,
    defense_knowledge,
    parameter_gradients,
    update_clip,
)
from lightning_gp.attacks.lockstep import Cancelled, lockstep
from lightning_gp.defenses import GaussianNoise
from lightning_gp.models import LeNetZhu

SHAPE = (1, 12, 12)
CLASSES = 4


@pytest.fixture
def float64(one_thread):
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _bowls(count: int, dim: int = 5):
    """``count`` ill-conditioned quadratics: starts and the row-wise objective ``(x [A, dim], rows [A]) -> [A]``."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(count, dim, generator=generator, dtype=torch.float64)
    curvature = torch.logspace(-2, 1, dim, dtype=torch.float64) * (1 + torch.rand(count, 1, generator=generator))

    def value_of(x: Tensor, rows: Tensor) -> Tensor:
        return (curvature[rows] * (x - centres[rows]).pow(2)).sum(-1) + (x - centres[rows]).pow(4).sum(-1)

    return torch.randn(count, dim, generator=generator, dtype=torch.float64), value_of


def _lbfgs(start: Tensor, evaluate, steps: int) -> tuple[Tensor, list[float]]:
    """torch's L-BFGS (strong Wolfe) on one problem whose objective and gradient ``evaluate`` gives."""
    x = start.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([x], max_iter=4, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        value, x.grad = evaluate(x)
        return value

    trace = [float(optimizer.step(closure)) for _ in range(steps)]
    return x.detach(), trace


def _alone(value_of, p: int):
    def evaluate(x: Tensor) -> tuple[Tensor, Tensor]:
        x = x.detach().clone().requires_grad_(True)
        value = value_of(x[None], torch.tensor([p]))[0]
        (gradient,) = torch.autograd.grad(value, x)
        return value.detach(), gradient

    return evaluate


def test_runs_side_by_side_follow_the_runs_they_make_alone() -> None:
    """Six problems, two per call of the objective, each with its own number of steps (so problems
    leave mid-run): each ends where torch's L-BFGS alone takes it, with the same trace."""
    starts, value_of = _bowls(6)
    together = lockstep(6, value_of, lambda p, evaluate: _lbfgs(starts[p], evaluate, 2 + p), rows_per_call=2)
    for p, (images, trace) in enumerate(together):
        alone_images, alone_trace = _lbfgs(starts[p], _alone(value_of, p), 2 + p)
        assert len(trace) == 2 + p
        torch.testing.assert_close(images, alone_images, rtol=0, atol=1e-12)
        assert trace == pytest.approx(alone_trace, rel=1e-12)


def test_every_evaluation_holds_the_problems_still_running_in_order() -> None:
    """Problem ``p`` asks ``p + 1`` times: the calls hold problems 0..3, then 1..3, 2..3, 3, whatever
    order the threads ask in."""
    seen: list[list[int]] = []
    starts, bowls = _bowls(4)

    def value_of(x: Tensor, rows: Tensor) -> Tensor:
        seen.append(rows.tolist())
        return bowls(x, rows)

    def run(p: int, evaluate) -> int:
        for _ in range(p + 1):
            evaluate(starts[p])
        return p

    assert lockstep(4, value_of, run, rows_per_call=8) == [0, 1, 2, 3]
    assert seen == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [3]]


def test_an_error_ends_its_own_run_and_is_raised_after_the_others_end() -> None:
    """A run that raises leaves the others running to their end (no thread waits for it); the first
    problem's error is raised. An error inside the shared objective reaches every run that asked."""
    starts, value_of = _bowls(3)
    finished: list[int] = []

    def run(p: int, evaluate) -> int:
        for step in range(4):
            if p == 1 and step == 2:
                raise ArithmeticError("problem 1 failed")
            evaluate(starts[p])
        finished.append(p)
        return p

    with pytest.raises(ArithmeticError, match="problem 1 failed"):
        lockstep(3, value_of, run, rows_per_call=3)
    assert sorted(finished) == [0, 2]

    def broken(x: Tensor, rows: Tensor) -> Tensor:
        raise FloatingPointError("objective failed")

    with pytest.raises(FloatingPointError, match="objective failed"):
        lockstep(3, broken, lambda p, evaluate: evaluate(starts[p]), rows_per_call=3)
    assert threading.active_count() < 4  # no run is left waiting


def test_a_result_that_cancels_later_problems_ends_only_those_after_it() -> None:
    """Problem 1 ends after one evaluation with a result that makes later problems moot: problems 2
    and 3 are cancelled (``None``), problem 0 runs to its end, and no run sees :class:`Cancelled`."""
    starts, value_of = _bowls(4)

    def run(p: int, evaluate) -> str:
        for _ in range(1 if p == 1 else 6):
            evaluate(starts[p])
        return "matched" if p == 1 else "ran"

    results = lockstep(4, value_of, run, rows_per_call=4, cancels_later=lambda result: result == "matched")
    assert results == ["ran", "matched", None, None]
    assert issubclass(Cancelled, Exception)


@pytest.mark.parametrize(("argument", "value"), [("count", 0), ("rows_per_call", 0)])
def test_bad_counts_are_refused(argument: str, value: int) -> None:
    _, value_of = _bowls(2)
    kwargs = {"count": 2, "rows_per_call": 2, argument: value}
    with pytest.raises(ValueError, match=argument):
        lockstep(kwargs["count"], value_of, lambda p, evaluate: p, rows_per_call=kwargs["rows_per_call"])


# ------------------------------------------------------------------------------ the attacks' restarts
def _view(batch: int = 2, noise: float = 0.05) -> ServerView:
    torch.manual_seed(0)
    model = LeNetZhu(num_classes=CLASSES, image_size=12)
    x = torch.rand(batch, *SHAPE) * 2 - 1
    y = torch.arange(batch) % CLASSES
    grads = parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False)
    noisy = {n: g + noise * torch.randn_like(g) for n, g in grads.items()}
    return ServerView(model=model, gradients=noisy, batch_size=batch, input_shape=SHAPE, num_classes=CLASSES, labels=y)


def _one_by_one(attack):
    """The same attack with its restarts run one after another (the stacked objective withheld)."""
    attack._stacked_objective = lambda views, labels, count, peers=None: None
    return attack


@pytest.mark.parametrize(
    "build",
    [
        lambda: IDLG(iterations=6, restarts=3, seed=2, max_iter=5),
        lambda: DefenseAwareIDLG(
            defense_knowledge(GaussianNoise(scale=0.05)), iterations=6, restarts=3, seed=2, max_iter=5
        ),
        # its restarts are the likelihood stage's; the MAP stage after them is one run, whose stiff TV
        # prior turns the 1e-12 difference of its start into 1e-6 in six steps
        lambda: NoiseAwareMAP(
            defense_knowledge(GaussianNoise(scale=0.05)), iterations=6, restarts=3, seed=2, max_iter=5, prior_weight=0
        ),
    ],
    ids=["iDLG", "DefenseAwareIDLG", "NoiseAwareMAP"],
)
def test_restarts_side_by_side_give_the_reconstruction_of_restarts_one_by_one(float64, build) -> None:
    """On a noisy gradient no restart matches, so the second and third run side by side: the kept
    restart, its images and its trace are those of the restarts run one by one."""
    view = _view()
    together, alone = build().reconstruct(view), _one_by_one(build()).reconstruct(view)
    assert together.meta["restarts_side_by_side"] == 2 and "restarts_side_by_side" not in alone.meta
    torch.testing.assert_close(together.images, alone.images, rtol=0, atol=1e-9)
    assert together.meta["objective"] == pytest.approx(alone.meta["objective"], rel=1e-9)
    assert together.loss_trace == pytest.approx(alone.loss_trace, rel=1e-9)


def test_a_first_restart_that_matches_ends_the_attack_as_one_by_one(float64) -> None:
    """A noiseless gradient of one image: the first restart matches to tolerance and no other runs."""
    view = _view(batch=1, noise=0.0)
    attack = IDLG(iterations=200, restarts=3, seed=2, tolerance=1e-8)
    result = attack.reconstruct(view)
    assert result.meta["objective"] <= 1e-8 * sum(float(g.pow(2).sum()) for g in view.gradients.values())
    assert "restarts_side_by_side" not in result.meta


def test_an_attack_whose_objective_is_its_own_runs_its_restarts_one_by_one(float64) -> None:
    """A subclass with its own gradient distance (a hinge) inherits no stacked objective: its restarts
    run one by one, on its own objective; so does a subclass of NoiseAwareMAP with its own likelihood."""

    class Hinge(IDLG):
        def gradient_distance(self, guess, shared):
            return sum((guess[n] - shared[n]).abs().sum() for n in shared)

    view = _view()
    assert "restarts_side_by_side" not in Hinge(iterations=3, restarts=3, seed=2, max_iter=3).reconstruct(view).meta

    class HeavierTails(NoiseAwareMAP):
        def gradient_distance(self, guess, shared):
            return super().gradient_distance(guess, shared).log1p()

    knowledge = defense_knowledge(GaussianNoise(scale=0.05))
    heavier = HeavierTails(knowledge, iterations=3, restarts=3, seed=2, max_iter=3, prior_weight=0)
    assert "restarts_side_by_side" not in heavier.reconstruct(view).meta
    plain = NoiseAwareMAP(knowledge, iterations=3, restarts=3, seed=2, max_iter=3, prior_weight=0)
    assert plain.reconstruct(view).meta["restarts_side_by_side"] == 2
    # the class-level guard on its own (the value check at the first start would catch these two too)
    assert not Hinge()._objective_is_the_stacked_ones() and not heavier._objective_is_the_stacked_ones()
    assert IDLG()._objective_is_the_stacked_ones() and plain._objective_is_the_stacked_ones()
    assert DefenseAwareIDLG(knowledge)._objective_is_the_stacked_ones()


# ------------------------------------------------------------------------------ the clients of a cell
def _clients(noises: list[float], batch: int = 2) -> list[ServerView]:
    """One round's model, a client per noise level, each with its own images."""
    torch.manual_seed(0)
    model = LeNetZhu(num_classes=CLASSES, image_size=12)
    views = []
    for client, noise in enumerate(noises):
        generator = torch.Generator().manual_seed(100 + client)
        x = torch.rand(batch, *SHAPE, generator=generator) * 2 - 1
        y = (torch.arange(batch) + client) % CLASSES
        grads = parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False)
        noisy = {n: g + noise * torch.randn(g.shape, generator=generator) for n, g in grads.items()}
        views.append(
            ServerView(model=model, gradients=noisy, batch_size=batch, input_shape=SHAPE, num_classes=CLASSES, labels=y)
        )
    return views


def _assert_each_is_its_own(together, alone) -> None:
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a.images, b.images, rtol=0, atol=1e-9)
        assert a.meta["objective"] == pytest.approx(b.meta["objective"], rel=1e-9)
        assert a.loss_trace == pytest.approx(b.loss_trace, rel=1e-9)
        assert torch.equal(a.labels, b.labels)


@pytest.mark.parametrize(
    "build",
    [
        lambda seed: IDLG(iterations=6, restarts=3, seed=seed, max_iter=5),
        lambda seed: DefenseAwareIDLG(
            defense_knowledge(GaussianNoise(scale=0.05)), iterations=6, restarts=3, seed=seed, max_iter=5
        ),
    ],
    ids=["iDLG", "DefenseAwareIDLG"],
)
def test_clients_side_by_side_each_get_the_reconstruction_of_their_own_attack(float64, build) -> None:
    """Three clients, each attacked by its own object (its own seed): first every first restart, then
    every later one, side by side; each client's result is its own attack's reconstruction."""
    views = _clients([0.05, 0.05, 0.05], batch=1)
    attacks = [build(seed) for seed in (2, 3, 4)]
    together = attacks[0].reconstruct_side_by_side(attacks, views)
    assert together is not None
    _assert_each_is_its_own(together, [attack.reconstruct(view) for attack, view in zip(attacks, views)])
    assert [r.meta["clients_side_by_side"] for r in together] == [3, 3, 3]
    assert [r.meta["restarts_side_by_side"] for r in together] == [2, 2, 2]
    if isinstance(attacks[0], DefenseAwareIDLG):
        alone = attacks[1].reconstruct(views[1])
        for mark in ("fallback", "defense", "support_fraction", "matched_layers"):
            assert together[1].meta[mark] == alone.meta[mark]


def test_a_client_whose_first_restart_matches_runs_no_other(float64) -> None:
    """A noiseless one-image client matches on its first restart and keeps it; the noisy clients beside
    it run their later restarts, each cancelling only its own."""
    views = _clients([0.0, 0.05, 0.05], batch=1)
    # a loose tolerance, so that it matches in 5 steps: over long runs the rounding of the vmapped match
    # parts L-BFGS trajectories even in float64 (8 steps here, as the restart tests run 6)
    attacks = [IDLG(iterations=8, restarts=3, seed=seed, tolerance=1e-3, max_iter=5) for seed in (2, 3, 4)]
    together = attacks[0].reconstruct_side_by_side(attacks, views)
    assert together is not None
    _assert_each_is_its_own(together, [attack.reconstruct(view) for attack, view in zip(attacks, views)])
    assert "restarts_side_by_side" not in together[0].meta
    assert together[1].meta["restarts_side_by_side"] == together[2].meta["restarts_side_by_side"] == 2


def test_clients_side_by_side_is_left_to_the_attacks_that_model_it(float64) -> None:
    from lightning_gp.attacks import DLG

    views = _clients([0.05, 0.05], batch=1)
    knowledge = defense_knowledge(GaussianNoise(scale=0.05))
    map_attacks = [NoiseAwareMAP(knowledge, iterations=2, restarts=2, seed=s) for s in (0, 1)]
    assert map_attacks[0].reconstruct_side_by_side(map_attacks, views) is None  # its own two stages
    soft = [DLG(iterations=2, seed=s) for s in (0, 1)]
    assert soft[0].reconstruct_side_by_side(soft, views) is None  # DLG optimises its labels
    observed = IDLG(iterations=2, observer=lambda i, x: None)
    assert observed.reconstruct_side_by_side([observed, observed], views) is None
    mixed = [IDLG(iterations=2), IDLG(iterations=3)]
    assert mixed[0].reconstruct_side_by_side(mixed, views) is None
    alike = [IDLG(iterations=2, seed=s) for s in (0, 1)]
    assert alike[0].reconstruct_side_by_side(alike, views) is not None
    assert alike[0].reconstruct_side_by_side(alike, _clients([0.05, 0.05], batch=2)) is None  # 2 images a client
    # knowledge that describes alike but clips otherwise: the stacked objective (the first attack's clip)
    # is not the second client's own at its start
    clipped = [
        DefenseAwareIDLG(DefenseKnowledge(support=False, transform=update_clip(c)), iterations=2) for c in (1.0, 0.01)
    ]
    assert clipped[0].reconstruct_side_by_side(clipped, views) is None
    same_clip = [DefenseAwareIDLG(DefenseKnowledge(support=False, transform=update_clip(0.01)), iterations=2)] * 2
    assert same_clip[0].reconstruct_side_by_side(same_clip, views) is not None
