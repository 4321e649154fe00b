"""A verdict that cannot be wrong in the defense's favour (issue 22, section 1) and verdicts per threat model.

Each test here failed on the audit before this change: a NaN hid every client's result, any
ValueError made a cell "n/a", an incomplete audit could read "private", blank guesses were called
leaks by the noise ratio while a recognisable low-PSNR image was called private, the attacker's
loss fell back to cross-entropy for a plain-function loss, a composition was attacked as its
first member, and the tapped rounds ignored the setting's server optimizer.
"""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_gp.attacks import (
    AttackNotApplicable,
    GradientAttack,
    InvertingGradients,
    Reconstruction,
    RobbingTheFed,
    ServerView,
)
from lightning_gp.audit import (
    AttackBudget,
    AttackSpec,
    DefenseSetting,
    LeakRule,
    attack_record,
    audit_setting,
    tap_fedsgd_round,
    train_setting,
    worst_case_report,
)
from lightning_gp.callbacks import GaussianNoise, TopKPruning
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.metrics import reconstruction_report
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = AttackBudget(ig_iterations=3, lbfgs_iterations=2, rtf_bins=8)
IDENTITY = ((0.0,), (1.0,))  # mean/std under which "normalised" images are pixels


@pytest.fixture(scope="module")
def datamodule() -> FashionMNISTSampleDataModule:
    data = FashionMNISTSampleDataModule()
    data.setup("fit")
    return data


def seeded_model() -> LeNetZhu:
    L.seed_everything(0, verbose=False)
    return LeNetZhu()


def sample_pixels(datamodule, count: int) -> torch.Tensor:
    """Real Fashion-MNIST training images of the built-in sample, as pixels in [0, 1]."""
    mean, std = datamodule.mean[0], datamodule.std[0]
    images = torch.stack([torch.as_tensor(datamodule.train_dataset[i][0]) for i in range(count)])
    return (images * std + mean).clamp(0, 1)


def sample_labels(datamodule, count: int) -> torch.Tensor:
    return torch.tensor([int(datamodule.train_dataset[i][1]) for i in range(count)])


def spec(name: str, build) -> AttackSpec:
    return AttackSpec(name, "published", lambda seed, model: build())


def audit_undefended(datamodule, clients: int, *specs: AttackSpec, log=lambda line: None):
    """Every given attack on ``clients`` undefended one-image clients, tiny budgets, no LPIPS."""
    return audit_setting(
        DefenseSetting("undefended"),
        seeded_model(),
        datamodule,
        indices=[[i] for i in range(clients)],
        published=list(specs),
        budget=TINY,
        lpips_fn=None,
        log=log,
    )


# ----------------------------------------------------------------------------------- item 1: NaN
def test_a_non_finite_reconstruction_scores_that_image_only_as_not_reconstructed() -> None:
    originals = torch.rand(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    images = originals.clone()
    images[1, 0, 3, 3] = float("nan")  # one pixel of one reconstruction
    images[2] = float("inf")
    report = reconstruction_report(Reconstruction(images, None, attack="A"), originals, IDENTITY, lpips=False)
    assert report.not_reconstructed == [1, 2]
    assert report.rows[0].reconstructed and report.rows[0].psnr == float("inf")  # the exact copy still counts
    assert all(torch.isnan(torch.tensor(report.rows[i].psnr)) for i in (1, 2))
    worst = worst_case_report([report])
    assert worst.leaked == 1 and worst.rows[0].leaks and worst.verdict == "leaks"


def test_an_attack_that_fails_on_one_client_keeps_the_other_clients_leaks(datamodule) -> None:
    """Robbing the Fed recovers every image exactly; its output for the second client is made NaN."""

    class PoisonSecondClient(RobbingTheFed):
        calls = 0

        def reconstruct(self, view: ServerView) -> Reconstruction:
            result = super().reconstruct(view)
            PoisonSecondClient.calls += 1
            if PoisonSecondClient.calls == 2:
                result.images = torch.full_like(result.images, float("nan"))
            return result

    audit = audit_undefended(datamodule, 3, spec("RtF", lambda: PoisonSecondClient(num_bins=8, seed=0)))
    cell = audit.cell("RtF")
    assert cell.status == "ok" and cell.threat == "active"
    assert audit.active is not None and audit.active.verdict == "leaks"
    assert [r.leaks for r in audit.active.rows] == [True, False, True]
    assert [r.report.not_reconstructed for r in audit.results["RtF"]] == [[], [0], []]


def failing_on_the_second_client(error: Exception) -> type[RobbingTheFed]:
    """RtF that raises ``error`` on the second client it attacks (and attacks the others)."""

    class FailsOnSecondClient(RobbingTheFed):
        calls = 0

        def reconstruct(self, view: ServerView) -> Reconstruction:
            FailsOnSecondClient.calls += 1
            if FailsOnSecondClient.calls == 2:
                raise error
            return super().reconstruct(view)

    return FailsOnSecondClient


def test_an_attack_that_raises_on_one_client_keeps_the_others_and_marks_the_cell_error(datamodule) -> None:
    attack = failing_on_the_second_client(RuntimeError("lost the imprint. Second client."))
    audit = audit_undefended(datamodule, 3, spec("RtF", lambda: attack(num_bins=8, seed=0)))
    cell = audit.cell("RtF")
    assert cell.status == "error" and "lost the imprint. Second client." in cell.note
    assert audit.active is not None and audit.active.verdict == "leaks"  # the leaks found stand
    assert [r.leaks for r in audit.active.rows] == [True, False, True]
    assert [r.report.not_reconstructed for r in audit.results["RtF"]] == [[], [0], []]


def test_an_attack_that_does_not_apply_to_one_client_keeps_the_others_leaks(datamodule) -> None:
    attack = failing_on_the_second_client(AttackNotApplicable("not for this client"))
    audit = audit_undefended(datamodule, 3, spec("RtF", lambda: attack(num_bins=8, seed=0)))
    cell = audit.cell("RtF")
    assert cell.status == "error" and "client 1: n/a: not for this client" in cell.note
    assert audit.active is not None and audit.active.verdict == "leaks"
    assert [r.leaks for r in audit.active.rows] == [True, False, True]


# ----------------------------------------------------------------------- item 2: n/a vs error
class Raises(GradientAttack):
    def __init__(self, error: Exception) -> None:
        super().__init__(seed=0)
        self.error = error

    def reconstruct(self, view: ServerView) -> Reconstruction:
        raise self.error


def test_only_attack_not_applicable_makes_a_cell_n_a_any_other_error_is_printed_whole(datamodule) -> None:
    message = "the solver diverged. It took 3 steps. Try a smaller learning rate."
    printed: list[str] = []
    audit = audit_undefended(
        datamodule,
        2,
        spec("IG", lambda: InvertingGradients(iterations=2, seed=0)),
        spec("Broken", lambda: Raises(ValueError(message))),
        spec("Cannot", lambda: Raises(AttackNotApplicable("needs BatchNorm. Pass bn_weight=0."))),
        log=printed.append,
    )
    broken, cannot = audit.cell("Broken"), audit.cell("Cannot")
    assert broken.status == "error" and message in broken.note
    assert any(message in line for line in printed)
    assert cannot.status == "n/a" and cannot.note == "needs BatchNorm. Pass bn_weight=0."
    assert message in broken.summary()
    # the failed attack's images score "not reconstructed"; the verdict cannot be private
    assert [r.report.not_reconstructed for r in audit.results["Broken"]] == [[0], [0]]
    assert audit.passive is not None and audit.passive.verdict == "inconclusive"
    assert any(r.startswith("Broken failed") and message in r for r in audit.passive.verdict_reasons)
    assert "Cannot" not in audit.passive.attacks


# ---------------------------------------------------------------- item 3: incomplete != private
def blank_report(originals: torch.Tensor, *, lpips_fn=None) -> object:
    return reconstruction_report(
        Reconstruction(torch.zeros_like(originals), None, attack="blank"),
        originals,
        IDENTITY,
        lpips=lpips_fn is not None,
        lpips_fn=lpips_fn,
        noise_ratio=False,
    )


def test_an_incomplete_audit_is_inconclusive_never_private() -> None:
    originals = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.5
    report = blank_report(originals)
    lenient = LeakRule({"psnr": 20.0, "ssim": 0.5}, noise_ratio_line=None)  # pixel rule only: no semantic test needed
    complete = worst_case_report(
        [report], leak_thresholds=lenient.thresholds, noise_ratio_line=None, thresholds={"psnr": 15.0}
    )
    assert complete.verdict == "private"
    gap = worst_case_report(
        [report],
        leak_thresholds=lenient.thresholds,
        noise_ratio_line=None,
        thresholds={"psnr": 15.0},
        incomplete=["adaptive:X fell back to the published attack"],
    )
    assert gap.verdict == "inconclusive" and gap.verdict_reasons == ["adaptive:X fell back to the published attack"]
    # without the originals' labels the semantic test cannot run: the default rule cannot say private
    no_semantic = worst_case_report([report])
    assert no_semantic.verdict == "inconclusive" and any("semantic" in r for r in no_semantic.verdict_reasons)


def test_a_fallback_adaptive_attack_makes_the_audit_inconclusive(datamodule) -> None:
    from lightning_gp.attacks import UnmodelledDefenseWarning
    from lightning_gp.callbacks import GradientDefense
    from lightning_gp.defenses import Defense

    class Unmodelled(Defense):
        def transform(self, gradients, state, call):
            return {n: 0.5 * g for n, g in gradients.items()}, state

    setting = DefenseSetting("HalfScale", [GradientDefense(Unmodelled(seed=0))])
    with pytest.warns(UnmodelledDefenseWarning):
        audit = audit_setting(
            setting,
            seeded_model(),
            datamodule,
            indices=[[0], [1]],
            published=[spec("IG", lambda: InvertingGradients(iterations=2, seed=0))],
            budget=TINY,
            lpips_fn=None,
            log=lambda line: None,
        )
    fallbacks = [c for c in audit.cells if c.status == "fallback"]
    assert fallbacks, [c.status for c in audit.cells]
    assert len(audit.passive.attacks) == 1 + len(fallbacks)  # fallback cells are in the worst case
    assert audit.passive.verdict == "inconclusive"
    assert any("fell back" in r for r in audit.passive.verdict_reasons)


# ------------------------------------------------------------- item 4: blank is not a leak, shapes are
@pytest.fixture(scope="module")
def lpips_fn():
    from lightning_gp.metrics import LPIPS, LPIPSWeightsNotFoundError

    try:
        return LPIPS()
    except LPIPSWeightsNotFoundError as err:  # pragma: no cover - the weights ship with make install
        pytest.skip(f"LPIPS weights missing: {err}")


def test_blank_and_dataset_mean_guesses_are_judged_private(datamodule, lpips_fn, sample_tests) -> None:
    originals = sample_pixels(datamodule, 8)
    mean_image = sample_pixels(datamodule, 200).mean(0, keepdim=True).expand_as(originals)
    for guess in (torch.zeros_like(originals), torch.full_like(originals, 0.5), mean_image):
        report = reconstruction_report(
            Reconstruction(guess.clone(), None, attack="guess"),
            originals,
            IDENTITY,
            true_labels=sample_labels(datamodule, 8),
            lpips_fn=lpips_fn,
            tests=sample_tests,
        )
        assert report.means["noise_ratio"] is not None and report.means["noise_ratio"] < 0.4  # clean-looking
        worst = worst_case_report([report], reference_images=sample_pixels(datamodule, 200))
        assert worst.leaked == 0, [r.leaked_by for r in worst.rows]
        assert worst.verdict == "private", worst.verdict_reasons


def test_a_recognisable_reconstruction_at_low_psnr_leaks(datamodule, lpips_fn) -> None:
    """The original under heavy noise (PSNR near 11 dB, SSIM well below 0.5): pixel scores call it
    private, a person sees the garment; the semantic test calls it a leak."""
    originals = sample_pixels(datamodule, 8)
    noisy = (originals + 0.35 * torch.randn(originals.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    report = reconstruction_report(
        Reconstruction(noisy, None, attack="noisy"),
        originals,
        IDENTITY,
        true_labels=sample_labels(datamodule, 8),
        lpips_fn=lpips_fn,
    )
    assert report.means["psnr"] < 15.0 and report.means["ssim"] < 0.5
    pixel_only = worst_case_report(
        [report], leak_thresholds={"psnr": 20.0, "ssim": 0.5}, noise_ratio_line=None, thresholds={"psnr": 15.0}
    )
    missed = [r.index for r in pixel_only.rows if not r.leaks]  # what the old rule's leak lines let pass
    worst = worst_case_report([report])
    caught = [i for i in missed if worst.rows[i].leaks]
    assert caught and worst.verdict == "leaks"
    for i in caught:  # each caught at low PSNR and SSIM
        assert worst.rows[i].values["psnr"] < 15.0 and worst.rows[i].values["ssim"] < 0.5
    by_semantic = [
        i for i in caught if any(c.startswith("semantic") for c in LeakRule().criteria(worst.rows[i].values))
    ]
    assert by_semantic, [worst.rows[i].values for i in caught]


def test_the_noise_ratio_alone_is_refused_as_a_leak_line() -> None:
    with pytest.raises(ValueError, match="noise ratio alone"):
        LeakRule({"noise_ratio": 0.4})
    with pytest.raises(ValueError, match="noise ratio"):
        worst_case_report([blank_report(torch.rand(1, 1, 16, 16))], thresholds={"noise_ratio": 0.4})


# ------------------------------------------------------------------------ item 6: attacker's loss
def test_the_attacker_matches_with_a_plain_function_loss(datamodule) -> None:
    def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)

    model = seeded_model()
    model.loss_fn = smoothed  # type: ignore[assignment]
    records, _, _ = tap_fedsgd_round(model, datamodule, indices=[[0]], num_clients=2)
    result = attack_record(
        records[0],
        model,
        InvertingGradients(iterations=1, seed=0),
        num_classes=10,
        mean=datamodule.mean,
        std=datamodule.std,
        lpips=False,
        noise_ratio=False,
    )
    assert result.view.loss_fn is smoothed
    explicit = attack_record(
        records[0],
        seeded_model(),
        InvertingGradients(iterations=1, seed=0),
        num_classes=10,
        mean=datamodule.mean,
        std=datamodule.std,
        lpips=False,
        noise_ratio=False,
        loss_fn=smoothed,
    )
    assert explicit.view.loss_fn is smoothed


# ------------------------------------------------------------------------ item 7: compositions
def test_a_composed_setting_is_attacked_as_a_whole_not_as_its_first_member(datamodule) -> None:
    from lightning_gp.attacks import UnmodelledDefenseWarning

    setting = DefenseSetting("noise+topk", [GaussianNoise(scale=1e-3, seed=0), TopKPruning(rate=0.8, seed=0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmodelledDefenseWarning)
        attacks = setting.adaptive_attacks(seeded_model(), datamodule, iterations=2, lbfgs_iterations=2)
        assert attacks
        records, model, _ = setting_records(setting, datamodule)
        for attack in attacks:
            view = ServerView.from_tap(
                records[0], copy.deepcopy(model), num_classes=10, mean=datamodule.mean, std=datamodule.std
            )
            result = attack.reconstruct(view)
            assert not result.meta.get("fallback"), result.meta.get("fallback_reason")


def setting_records(setting: DefenseSetting, datamodule):
    from lightning_gp.audit import tap_defended_round

    return tap_defended_round(setting, seeded_model(), datamodule, indices=[[0]], num_clients=2)


# ------------------------------------------------------------------------ item 9: runners
def test_settings_the_plain_trainer_runner_cannot_run_are_refused_for_tapping_and_training() -> None:
    with pytest.raises(ValueError, match="wrapping defense runs in the simulation"):
        DefenseSetting("wrapped", wrap=lambda model: model, runner="trainer")
    with pytest.raises(ValueError, match="algorithm='fedsgd'"):
        DefenseSetting("fedavg", runner="trainer", algorithm="fedavg")
    with pytest.raises(ValueError, match="server_optimizer"):
        DefenseSetting("bad", server_optimizer="rmsprop")  # type: ignore[arg-type]


def test_tapped_rounds_apply_the_setting_s_server_optimizer(datamodule) -> None:
    """Server SGD at lr 1 moves round 1's weights by the mean of round 0's shared gradients exactly."""
    kwargs = dict(indices=None, clients=[0, 1], num_clients=2, local_batch_size=2, seed=0)
    first, _, _ = tap_fedsgd_round(seeded_model(), datamodule, round=0, **kwargs)
    second, _, _ = tap_fedsgd_round(
        seeded_model(), datamodule, round=1, server_optimizer="sgd", server_lr=1.0, **kwargs
    )
    for name in first[0].gradients:
        mean_gradient = (first[0].gradients[name] + first[1].gradients[name]) / 2
        expected = first[0].model_state[name] - mean_gradient
        torch.testing.assert_close(second[0].model_state[name], expected, rtol=1e-5, atol=1e-6)

    setting = DefenseSetting("sgd server", server_optimizer="sgd", server_lr=1.0)
    result = train_setting(setting, seeded_model(), datamodule, rounds=1, num_clients=2, local_batch_size=2)
    assert 0.0 <= result.test_acc <= 1.0


# ------------------------------------------------------------------------ section 2: threat models
def test_passive_and_active_verdicts_are_judged_separately(datamodule) -> None:
    audit = audit_undefended(
        datamodule,
        2,
        spec("IG", lambda: InvertingGradients(iterations=2, seed=0)),
        spec("RtF", lambda: RobbingTheFed(num_bins=8, seed=0)),
    )
    assert audit.cell("IG").threat == "passive" and audit.cell("RtF").threat == "active"
    assert audit.passive is not None and audit.active is not None
    assert audit.passive.attacks == ["InvertingGradients"]
    assert set(audit.active.attacks) == {"InvertingGradients", "RobbingTheFed"}
    assert audit.passive.threat_model == "passive" and audit.active.threat_model == "active"
    assert audit.active.verdict == "leaks" and audit.active.leaked == 2  # RtF's exact copies
    assert audit.passive.leaked == 0  # two IG steps recover nothing
    assert audit.worst is audit.active
    lines = audit.summary_lines()
    assert any(line.startswith("passive server:") for line in lines)
    assert any(line.startswith("active server:") for line in lines)
