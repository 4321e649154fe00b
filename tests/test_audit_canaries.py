"""Canaries for the audit itself: a known leak planted through every path the audit has must read
"leaks", and an attack or metric that was asked for and is missing must read "inconclusive", never
"private".

DP auditing plants canaries in the data; these plant them in the attacks' output. The planted leak is
an exact copy, or a blurred copy (Gaussian, sigma 0.7: SSIM above 0.65 on every image of the sample), of
one original, at every position of the attack's output, with the other outputs junk (zeros, grey, noise,
public images, NaN). The verdict path is exercised directly (every batch size, position and junk) and end
to end through :func:`~lightning_gp.audit.audit_setting` for each attack kind: published, adaptive
(declared by the defense), prior-carrying (judged with its prior-only control) and active, for each client
and threat model.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_gp.attacks import (
    AttackNotApplicable,
    DefenseKnowledge,
    GradientAttack,
    Reconstruction,
    ServerView,
    parameter_gradients,
)
from lightning_gp.attacks.registry import _DECLARATIONS, register_adaptive_attack
from lightning_gp.audit import AttackBudget, AttackSpec, DefenseSetting, audit_setting
from lightning_gp.audit.prior_control import prior_only_control
from lightning_gp.audit.rounds import public_batch
from lightning_gp.audit.verdict import worst_case_report
from lightning_gp.callbacks import GradientDefense
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import Defense
from lightning_gp.metrics import concatenate_reports, reconstruction_report
from lightning_gp.models import LeNetZhu
from lightning_gp.normalization import denormalize, normalize

pytestmark = pytest.mark.usefixtures("one_thread")

JUNK = ("zeros", "grey", "noise", "public", "nan")
BLUR_SIGMA = 0.7


@pytest.fixture(scope="module")
def sample():
    data = FashionMNISTSampleDataModule(batch_size=500)
    data.setup("fit")
    data.setup("test")
    return data


def _train(data, picks: list[int]) -> tuple[Tensor, Tensor]:
    images = torch.stack([data.train_dataset[i][0] for i in picks])
    return images, torch.as_tensor([int(data.train_dataset[i][1]) for i in picks])


def _blur(pixels: Tensor, sigma: float = BLUR_SIGMA) -> Tensor:
    taps = torch.arange(-3, 4, dtype=pixels.dtype)
    kernel = torch.exp(-(taps**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    rows = nn.functional.conv2d(pixels, kernel.view(1, 1, 1, 7), padding=(0, 3))
    return nn.functional.conv2d(rows, kernel.view(1, 1, 7, 1), padding=(3, 0)).clamp(0, 1)


def _planted(original: Tensor, plant: str, data) -> Tensor:
    """One original (normalised ``[C, H, W]``) as the planted leak: itself or its blurred copy."""
    if plant == "copy":
        return original.clone()
    return normalize(_blur(denormalize(original[None], data.mean, data.std)), data.mean, data.std)[0]


def _junk(kind: str, count: int, data, public: Tensor, seed: int) -> Tensor:
    """``count`` normalised outputs that carry nothing of the batch (``nan``: public images, one of them NaN)."""
    g = torch.Generator().manual_seed(seed)
    shape = (count, 1, 28, 28)
    if kind == "zeros":
        pixels = torch.zeros(shape)
    elif kind == "grey":
        pixels = torch.full(shape, 0.5)
    elif kind == "noise":
        pixels = torch.rand(shape, generator=g)
    else:
        picks = torch.randperm(public.shape[0], generator=g)[:count]
        return public[picks].clone()
    return normalize(pixels, data.mean, data.std)


def _output(originals: Tensor, target: int, position: int, plant: str, junk: str, data, public: Tensor) -> Tensor:
    out = _junk(junk, originals.shape[0], data, public, seed=target * 31 + position)
    out[position] = _planted(originals[target], plant, data)
    if junk == "nan" and originals.shape[0] > 1:
        out[(position + 1) % originals.shape[0]] = math.nan
    return out


def _view(originals: Tensor, labels: Tensor, data) -> ServerView:
    model = LeNetZhu()
    gradients = parameter_gradients(model, nn.CrossEntropyLoss(), originals, labels, create_graph=False)
    return ServerView(model, gradients, originals.shape[0], (1, 28, 28), 10, mean=tuple(data.mean), std=tuple(data.std))


@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("plant", ["copy", "blur"])
def test_a_planted_leak_at_any_output_position_leaks_whatever_the_other_outputs(sample, batch, plant) -> None:
    """The copy of original ``t`` sits at output ``p``; ``t`` runs over the batch as ``p`` does, so the
    planted image is often not where a one-to-one matching would put it (an exact copy handed to the
    wrong original read "private" before the rule judged every output)."""
    originals, labels = _train(sample, [37 * k + batch for k in range(batch)])
    public = public_batch(sample, 200)
    view = _view(originals, labels, sample)
    reference = denormalize(public, sample.mean, sample.std)
    for junk in JUNK:
        for position in range(batch):
            target = (3 * position + 1) % batch
            output = _output(originals, target, position, plant, junk, sample, public)
            report = reconstruction_report(
                Reconstruction(output, None), originals, view, true_labels=labels, lpips=False
            )
            worst = worst_case_report([report], reference_images=reference)
            assert worst.rows[target].leaks, (junk, position, target, report.permutation)
            assert worst.verdict == "leaks"


@pytest.mark.parametrize("plant", ["copy", "blur"])
def test_a_planted_leak_passes_the_prior_only_control_of_a_prior_carrying_attack(sample, plant) -> None:
    """A prior-carrying attack is judged against its own uninformed outputs (here: public batches); the
    planted image is credited at the first and last position of a batch of 8, among public-image junk, on
    each client of a two-client report (more positions: test_prior_control.py)."""
    public = public_batch(sample, 8 * 13)
    decoys = public[8:].reshape(12, 8, 1, 28, 28)
    reference = denormalize(public, sample.mean, sample.std)
    clients = [_train(sample, [37 * k + c for k in range(8)]) for c in range(2)]

    def controlled(c: int, output: Tensor):
        originals, labels = clients[c]
        view = _view(originals, labels, sample)
        report = reconstruction_report(
            Reconstruction(output, None, attack="prior"), originals, view, true_labels=labels, lpips=False
        )
        control = prior_only_control(report, decoys, originals, view, labels, reference=reference)
        return dataclasses.replace(report, prior_only=control.bars, prior_only_false_alarm=control.false_alarm)

    junk = [controlled(c, _junk("public", 8, sample, public[:8], seed=c)) for c in range(2)]
    for position in (0, 7):
        for leaking in range(2):
            output = _junk("public", 8, sample, public[:8], seed=leaking)
            output[position] = _planted(clients[leaking][0][(position + 3) % 8], plant, sample)
            reports = [controlled(c, output) if c == leaking else junk[c] for c in range(2)]
            worst = worst_case_report([concatenate_reports(reports)], reference_images=reference)
            target = 8 * leaking + (position + 3) % 8
            assert worst.rows[target].leaks, (plant, position, leaking)
            assert worst.verdict == "leaks" and worst.control_false_alarm is not None


def test_one_client_without_a_metric_blanks_it_for_that_client_only_and_the_verdict_is_inconclusive(sample) -> None:
    """``concatenate_reports`` used to merge ``unavailable`` across clients: one client whose semantic
    test could not run blanked it for all. Now the other clients keep their scores, and the missing ones
    are a gap."""
    public = public_batch(sample, 16)
    reference = denormalize(public, sample.mean, sample.std)
    reports = []
    for c in range(2):
        originals, labels = _train(sample, [37 * k + c for k in range(4)])
        view = _view(originals, labels, sample)
        report = reconstruction_report(
            Reconstruction(_junk("grey", 4, sample, public, 0), None, attack="grey"),
            originals,
            view,
            true_labels=labels if c == 0 else None,  # client 1: no labels, no semantic test
            lpips=False,
        )
        reports.append(report)
    merged = concatenate_reports(reports)
    assert "semantic" not in merged.unavailable
    assert all(row.semantic is not None for row in merged.rows[:4]) and all(
        row.semantic is None for row in merged.rows[4:]
    )
    worst = worst_case_report([merged], reference_images=reference)
    assert worst.verdict == "inconclusive" and any("semantic" in r for r in worst.verdict_reasons)


def test_a_rule_metric_that_was_not_computed_is_a_gap_never_private(sample, sample_tests) -> None:
    """The noise ratio is part of the default rule (its paired clean-image test): a report scored with
    ``noise_ratio=False`` cannot say "private"; the same grey guess with it scored can."""
    originals, labels = _train(sample, [37 * k for k in range(4)])
    view = _view(originals, labels, sample)
    public = public_batch(sample, 16)
    reference = denormalize(public, sample.mean, sample.std)
    grey = Reconstruction(_junk("grey", 4, sample, public, 0), None, attack="grey")
    scored = reconstruction_report(grey, originals, view, true_labels=labels, lpips=False, tests=sample_tests)
    assert worst_case_report([scored], reference_images=reference).verdict == "private"
    unscored = reconstruction_report(
        grey, originals, view, true_labels=labels, lpips=False, noise_ratio=False, tests=sample_tests
    )
    worst = worst_case_report([unscored], reference_images=reference)
    assert worst.verdict == "inconclusive" and any("noise ratio" in r for r in worst.verdict_reasons)
    # a rule stated without the paired test needs no noise ratio
    stated = worst_case_report([unscored], reference_images=reference, noise_ratio_line=None)
    assert stated.verdict == "private"


# ------------------------------------------------------------------------------ end to end, audit_setting
class PlantedLeak(GradientAttack):
    """A canary attack: it knows every client's batch (``clients``), finds which one sent the gradient
    it is given (the nearest gradient on the model it sees), and returns public-image junk with a
    copy of that client's image ``target`` at output ``position``; other clients get junk only. It
    returns the true labels, as a label-recovering attack would."""

    def __init__(self, clients: list[tuple[Tensor, Tensor]], leaking: int, target: int, position: int, public: Tensor):
        super().__init__(seed=0)
        self.clients, self.leaking, self.target, self.position, self.public = clients, leaking, target, position, public

    def reconstruct(self, view: ServerView) -> Reconstruction:
        client = self._sender(view)
        images, labels = self.clients[client]
        output = self.public[torch.arange(images.shape[0]) + 8 * client].clone()
        if client == self.leaking:
            output[self.position] = images[self.target]
        return Reconstruction(output, labels.clone(), attack=type(self).__name__)

    def _sender(self, view: ServerView) -> int:
        flat = torch.cat([g.flatten() for g in view.gradients.values()])
        distances = []
        for images, labels in self.clients:
            gradients = parameter_gradients(view.model, view.loss_fn, images, labels, create_graph=False)
            own = torch.cat([gradients[n].flatten() for n in view.gradients])
            distances.append(float((own - flat).norm()))
        return min(range(len(distances)), key=distances.__getitem__)


class PlantedLeakOnDummyLabels(PlantedLeak):
    """The canary on the second label estimate: it leaks only when the server counts the batch's labels
    from dummy inputs (``view.label_softmax == "dummy"``), the run the audit adds where the estimates differ."""

    def reconstruct(self, view: ServerView) -> Reconstruction:
        if view.label_softmax != "dummy":  # nothing: flat images at the data's mean
            images, labels = self.clients[self._sender(view)]
            return Reconstruction(torch.zeros_like(images), labels.clone(), attack=type(self).__name__)
        return super().reconstruct(view)


class PlantedLeakWithPrior(PlantedLeak):
    """The canary as a prior-carrying attack: its prior-only guesses are public batches."""

    def prior_only_guesses(self, view: ServerView, count: int) -> Tensor:
        return self.public[16 : 16 + 8 * 12].reshape(12, 8, 1, 28, 28)[:count, : view.batch_size]


class PlantedLeakActive(PlantedLeak):
    """The canary as an active attack: the server sends the model unchanged (its threat model is active)."""

    def modify_model(self, model: nn.Module, input_shape, mean=(0.0,), std=(1.0,), *, public_data=None):
        return model, {}


class PassThrough(Defense):
    """A defense whose declared adaptive attack is the canary (the adaptive path of the audit)."""

    def transform(self, gradients, state, call):
        return dict(gradients), state


def _campaign(
    sample,
    batch: int,
    leaking: int,
    position: int,
    kind: str,
    first: int = 0,
    model_checks: bool = False,
    aggregate: bool = False,
):
    """The audit of two clients with the canary of ``kind`` (with ``aggregate``: the canary that plants
    its leak in the secure aggregate's reconstruction, and the audit's secure-aggregation views)."""
    indices = [[37 * k + c for k in range(batch)] for c in range(first, first + 2)]
    clients = [_train(sample, picks) for picks in indices]
    public = public_batch(sample, 16 + 8 * 12)
    target = (position + 1) % batch
    per_client = {
        "published": PlantedLeak,
        "prior": PlantedLeakWithPrior,
        "active": PlantedLeakActive,
        "dummy labels": PlantedLeakOnDummyLabels,
    }
    on_aggregate = {"published": PlantedLeakOnAggregate, "active": PlantedLeakIsolating, "adaptive": PlantedLeakLifted}

    def build(seed: int, model: nn.Module) -> GradientAttack:
        cls = (on_aggregate if aggregate else per_client).get(kind, PlantedLeak)
        return cls(clients, leaking, target, position, public)

    published = [] if kind == "adaptive" else [AttackSpec(f"canary-{kind}", "published", build)]
    setting = DefenseSetting("pass-through", [GradientDefense(PassThrough(seed=0))], model_checks=model_checks)
    if kind == "adaptive":
        register_adaptive_attack(PassThrough, lambda defense, kwargs: [build(0, None)])  # type: ignore[arg-type]
    L.seed_everything(0, verbose=False)
    try:
        audit = audit_setting(
            setting,
            LeNetZhu(),
            sample,
            indices=indices,
            published=published,
            budget=AttackBudget(ig_iterations=2, lbfgs_iterations=2),
            adaptive=kind == "adaptive",
            num_clients=2,
            aggregate=aggregate,
            log=lambda line: None,
        )
    finally:
        _DECLARATIONS.pop(PassThrough, None)
    return audit, batch * leaking + target


@pytest.mark.parametrize(
    "kind, batch, leaking, position, first",
    [
        ("published", 1, 0, 0, 0),
        ("published", 4, 1, 2, 0),
        ("adaptive", 4, 0, 3, 0),
        ("prior", 8, 1, 5, 0),
        ("active", 4, 1, 0, 0),
        # clients 9 and 10 of the sample at batch 8: their public-image and dummy-input label counts differ
        ("dummy labels", 8, 1, 6, 9),
    ],
)
def test_a_planted_leak_reads_leaks_end_to_end_for_every_attack_kind(
    sample, kind, batch, leaking, position, first
) -> None:
    audit, image = _campaign(sample, batch, leaking, position, kind, first)
    if kind == "dummy labels":  # the premise: the audit ran the second label estimate, and only it leaks
        assert [c.attack for c in audit.cells] == ["canary-dummy labels", "canary-dummy labels (dummy-input labels)"]
        assert audit.passive is not None and audit.passive.rows[image].leaked_by == [audit.passive.attacks[1]]
    threats = ("active",) if kind == "active" else ("passive", "active")
    for threat in threats:
        worst = getattr(audit, threat)
        assert worst is not None and worst.rows[image].leaks, (threat, [c.note for c in audit.cells])
        assert worst.verdict == "leaks"
    if kind == "active":  # the passive server never saw the active attack: it has no cell there
        assert audit.passive is None or not audit.passive.rows[image].leaks


# ------------------------------------------------------------- end to end, the secure-aggregation views
class PlantedLeakOnAggregate(PlantedLeak):
    """The canary on the secure aggregate: on a view of every client's images (the aggregate's batch, in
    client order) it returns flat images at the data's mean with a copy of client ``leaking``'s image
    ``target`` at output ``position``; on one client's view, flat images only. (Public images as the
    junk would not do here: the semantic line credits a public image of an original's class.)"""

    def reconstruct(self, view: ServerView) -> Reconstruction:
        images, labels = (torch.cat(parts) for parts in zip(*self.clients))
        if view.batch_size != images.shape[0]:
            own_images, own_labels = self.clients[self._sender(view)]
            return Reconstruction(torch.zeros_like(own_images), own_labels.clone(), attack=type(self).__name__)
        output = torch.zeros_like(images)
        output[self.position] = images[self.leaking * self.clients[0][0].shape[0] + self.target]
        return Reconstruction(output, labels.clone(), attack=type(self).__name__)


class PlantedLeakIsolating(PlantedLeakOnAggregate):
    """The canary as a model-inconsistency attack (LOKI's path): each client is sent its own model (here
    the model unchanged), the attack reads the aggregate of their updates; one model for every client is
    refused, as LOKI refuses it."""

    def modify_model(self, model: nn.Module, input_shape, mean=(0.0,), std=(1.0,), *, public_data=None):
        raise AttackNotApplicable("the canary sends each client its own model")

    def client_models(self, model, clients, input_shape, mean=(0.0,), std=(1.0,), **kwargs):
        return [(copy.deepcopy(model), {}) for _ in range(clients)]


class PlantedLeakLifted(PlantedLeakOnAggregate):
    """The canary as an adaptive attack whose defense knowledge carries over to the mean of the clients
    (the audit lifts it with :meth:`~lightning_gp.attacks.DefenseKnowledge.over_clients`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.knowledge = DefenseKnowledge(defense="pass-through", support=False)


@pytest.mark.parametrize("kind", ["published", "active", "adaptive"])
def test_a_planted_leak_on_the_secure_aggregate_reads_leaks_in_its_threat_model(sample, kind) -> None:
    """Behind secure aggregation the leak planted in the aggregate's reconstruction reads "leaks" in the
    view of its threat model: a passive published attack in both (the malicious server can do what the
    honest one does), the model-inconsistency attack only for the malicious server, and the lifted
    adaptive attack in both; no per-client view is credited with it."""
    audit, image = _campaign(sample, 4, 1, 2, kind, aggregate=True)
    views = {"active": ("aggregate_active",)}
    for view in views.get(kind, ("aggregate", "aggregate_active")):
        worst = getattr(audit, view)
        assert worst is not None and worst.rows[image].leaks, (view, [c.note for c in audit.aggregate_cells])
        assert worst.verdict == "leaks"
    if kind == "active":  # the honest server never sent the models: the leak is not in its view
        assert audit.aggregate is None or not audit.aggregate.rows[image].leaks
    for threat in ("passive", "active"):
        worst = getattr(audit, threat)
        assert worst is None or not any(row.leaks for row in worst.rows), threat


def test_an_active_leak_through_the_honest_model_survives_the_clients_model_checks(sample) -> None:
    """The clients' model checks refuse a model the public record does not explain; the active canary
    sends the honest model, so its planted leak is still found in the active view (the checks never
    hide a leak that an accepted model carries)."""
    audit, image = _campaign(sample, 4, 1, 0, "active", model_checks=True)
    assert audit.active is not None and audit.active.rows[image].leaks and audit.active.verdict == "leaks"
    assert all(c.status == "ok" for c in audit.cells), [(c.attack, c.note) for c in audit.cells]


class FailingAttack(PlantedLeak):
    def reconstruct(self, view: ServerView) -> Reconstruction:
        raise RuntimeError("the canary attack broke")


class NonFiniteAttack(PlantedLeak):
    def reconstruct(self, view: ServerView) -> Reconstruction:
        images, _ = self.clients[self._sender(view)]
        return Reconstruction(torch.full_like(images, math.nan), None, attack="NonFinite")


@pytest.mark.parametrize("broken", [FailingAttack, NonFiniteAttack])
def test_an_attack_that_errs_or_returns_nan_leaves_the_audit_inconclusive(sample, broken) -> None:
    indices = [[37 * k + c for k in range(4)] for c in range(2)]
    clients = [_train(sample, picks) for picks in indices]
    public = public_batch(sample, 16)
    L.seed_everything(0, verbose=False)
    audit = audit_setting(
        DefenseSetting("pass-through", [GradientDefense(PassThrough(seed=0))]),
        LeNetZhu(),
        sample,
        indices=indices,
        published=[AttackSpec("broken", "published", lambda seed, model: broken(clients, 0, 0, 0, public))],
        budget=AttackBudget(ig_iterations=2, lbfgs_iterations=2),
        adaptive=False,
        num_clients=2,
        log=lambda line: None,
    )
    for threat in ("passive", "active"):
        assert audit.verdict(threat) == "inconclusive", (threat, [c.note for c in audit.cells])


def test_an_exact_copy_beside_a_blank_output_leaks_on_every_pair_the_matching_swaps(sample) -> None:
    """The issue's case: the output [copy of A, all-zero image] on the batch {A, B}. The matching minimises
    the total MSE and hands the copy to B whenever mse(0, B) - mse(0, A) > mse(A, B); A then scored 12 dB
    and the verdict read "private". Every such pair of 120 drawn from the sample must leak A."""
    g = torch.Generator().manual_seed(0)
    public = public_batch(sample, 16)
    reference = denormalize(public, sample.mean, sample.std)
    zero = normalize(torch.zeros(1, 1, 28, 28), sample.mean, sample.std)[0]
    swapped = 0
    for _ in range(120):
        picks = torch.randperm(len(sample.train_dataset), generator=g)[:2].tolist()
        originals, labels = _train(sample, picks)
        view = _view(originals, labels, sample)
        output = torch.stack([originals[0].clone(), zero])
        report = reconstruction_report(Reconstruction(output, None), originals, view, true_labels=labels, lpips=False)
        swapped += report.permutation != [0, 1]
        worst = worst_case_report([report], reference_images=reference)
        assert worst.rows[0].leaks and worst.verdict == "leaks", (picks, report.permutation)
    assert swapped > 0  # the premise: the matching does swap some pairs


def test_a_verdict_resting_on_a_mean_line_alone_says_which_mean_crossed_which_line(sample) -> None:
    """Before: "LEAKS: 0 of 4 images leak" when a worst-case mean crossed a mean line and no image met
    the per-image rule. The headline names the mean, its value and the line instead."""
    originals, labels = _train(sample, [3, 41, 77, 105])
    view = _view(originals, labels, sample)
    pixels = denormalize(originals, sample.mean, sample.std)
    faint = normalize(0.8 * torch.full((4, 1, 28, 28), 0.5) + 0.2 * pixels, sample.mean, sample.std)  # beats grey
    report = reconstruction_report(Reconstruction(faint, None), originals, view, true_labels=labels, lpips=False)
    # a mean line any output crosses, and a per-image rule nothing here meets
    worst = worst_case_report([report], thresholds={"psnr": 1.0}, leak_thresholds={"psnr": 40.0}, noise_ratio_line=None)
    assert worst.leaked == 0 and worst.verdict == "leaks" and worst.mean_lines_at_guess == []
    mean = worst.means["psnr"]
    assert worst.headline() == (
        f"LEAKS by the worst-case mean over 4 images: PSNR {mean:.3g} dB crossed its line (PSNR > 1 dB); "
        "no single image met the per-image rule"
    )
    judged = worst_case_report([report], leak_thresholds={"psnr": 40.0}, noise_ratio_line=None)  # no line crossed
    assert judged.headline() == f"{judged.verdict.upper()}: 0 of 4 images leak"


def test_a_mean_line_a_trivial_guess_crosses_as_far_is_no_leak(sample, sample_tests) -> None:
    """A worst-case mean over a verdict line counts only where it beats every trivial guess's mean: a
    reconstruction that is the blank guess itself crosses a 1 dB PSNR line as far as the blank guess
    does, which says something of the images, nothing of the defense. The report names the line."""
    originals, labels = _train(sample, [3, 41, 77, 105])
    view = _view(originals, labels, sample)
    grey = normalize(torch.full((4, 1, 28, 28), 0.5), sample.mean, sample.std)  # the blank guess itself
    report = reconstruction_report(
        Reconstruction(grey, None), originals, view, true_labels=labels, lpips=False, tests=sample_tests
    )
    worst = worst_case_report([report], thresholds={"psnr": 1.0})
    assert worst.baseline("blank").kind == "grey 0.5" and worst.private["psnr"] is False
    assert worst.leaked == 0 and worst.verdict == "private" and worst.mean_lines_at_guess == ["psnr"]
    assert worst.headline() == "PRIVATE: 0 of 4 images leak"
    assert "a trivial guess's mean does so as far" in worst.to_markdown()
    assert worst.to_dict()["mean_lines_at_guess"] == ["psnr"]
    # without the originals' pixels no guess is scored: every crossed line counts
    blind = dataclasses.replace(report, original_pixels=None)
    assert worst_case_report([blind], thresholds={"psnr": 1.0}).verdict == "leaks"
