"""PrivacyAudit: attacks the shared gradient during training, logs through a real CSVLogger, changes nothing.

Tiny real runs (a 12x12 CNN, 1-3 steps, attack budgets of a few iterations) on the local path and
in a FederatedSimulation; each audited run is compared bit for bit with the same run without it.
"""

from __future__ import annotations

import csv
import math
import struct
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer, small_cnn
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.attacks import (
    IDLG,
    AttackNotApplicable,
    GradientAttack,
    InvertingGradients,
    UnmodelledDefenseWarning,
)
from lightning_gp.audit import PrivacyAudit, defense_mechanism
from lightning_gp.callbacks import GaussianNoise, MagnitudePruning, TopKPruning
from lightning_gp.federated import FederatedSimulation
from lightning_gp.pipeline import StageCall

pytestmark = pytest.mark.usefixtures("one_thread")

KNOWN = dict(num_classes=4, mean=(0.5,), std=(0.25,))  # what the server knows of the tiny task


class TinyModule(L.LightningModule):
    """A CNN with dropout: training draws from the global RNG every step, so an audit that moved the
    generator (e.g. by building the noise-ratio network) would change the weights after it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = small_cnn()
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.dropout(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(batch_size: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(8, 1, 12, 12, generator=g) - 0.5) / 0.25  # pixels in [0, 1], normalised
    return DataLoader(TensorDataset(images, torch.randint(0, 4, (8,), generator=g)), batch_size=batch_size)


def tiny_attacks() -> list:
    return [IDLG(iterations=2, max_iter=3), InvertingGradients(iterations=4)]


def fit_local(callbacks: list, logger=False, steps: int = 3) -> TinyModule:
    L.seed_everything(0)
    module = TinyModule()
    quiet_trainer(max_steps=steps, logger=logger, log_every_n_steps=1, callbacks=callbacks).fit(module, loader())
    return module


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_local_path_logs_to_a_csv_logger_and_leaves_the_weights_bit_identical(tmp_path) -> None:
    baseline = fit_local([MagnitudePruning(rate=0.5)])
    tiny_adaptive = {"iterations": 3, "lbfgs_iterations": 2}
    audit = PrivacyAudit(rounds=[0, 2], attacks=tiny_attacks(), adaptive_budget=tiny_adaptive, **KNOWN)
    logger = CSVLogger(tmp_path, name="run")
    audited = fit_local([MagnitudePruning(rate=0.5), audit], logger=logger)
    assert_same_weights(baseline, audited)

    assert [(r.round, r.client_id) for r in audit.results] == [(0, 0), (2, 0)]
    rows = read_csv(Path(logger.log_dir) / "metrics.csv")
    columns = set(rows[0])
    attacks = ("IDLG", "InvertingGradients", "DefenseAwareInversion", "DefenseAwareIDLG")  # + the pruning's adaptive
    for name in (*attacks, "passive"):
        for metric in ("psnr", "ssim", "lpips", "noise_ratio", "leak_fraction"):
            assert f"privacy_audit/client0/{name}/{metric}" in columns, (name, metric)
    assert "privacy_audit/client0/passive/private" in columns and "privacy_audit/client0/baseline_blank/psnr" in columns
    assert "privacy_audit/client0/passive/inconclusive" in columns
    assert {"privacy_audit/client0/active/private", "privacy_audit/client0/active/inconclusive"} <= columns
    assert "privacy_audit/client0/baseline_dataset_mean/psnr" in columns  # a constant image of the known mean
    logged = {int(r["step"]): r for r in rows if r.get("privacy_audit/client0/passive/psnr")}
    assert sorted(logged) == [0, 2]
    for result in audit.results:
        row = logged[result.round]
        worst = result.worst
        assert float(row["privacy_audit/client0/passive/psnr"]) == pytest.approx(worst.means["psnr"], rel=1e-6)
        per_attack = [float(row[f"privacy_audit/client0/{n}/psnr"]) for n in attacks]
        assert float(row["privacy_audit/client0/passive/psnr"]) == pytest.approx(
            max(per_attack), rel=1e-6
        )  # batch of 1
        assert float(row["privacy_audit/client0/passive/leak_fraction"]) == worst.leak_fraction
        # 12x12 images are outside the semantic classifier: the passive verdict cannot be "private"
        assert worst.verdict in ("leaks", "inconclusive") and worst.threat_model == "passive"
        assert (
            float(row["privacy_audit/client0/active/inconclusive"]) == 1.0 and result.active_verdict == "inconclusive"
        )
        assert "modified model" in result.active_reason
        # what was attacked is what left the client: the pruned gradient at that step's weights
        shared = result.attacks[0].record.gradients
        assert math.isclose(float((shared["net.3.weight"] == 0).float().mean()), 0.5, abs_tol=0.02)
        assert result.image_path is not None and result.image_path.is_file()
        assert result.image_path.parent == Path(logger.log_dir) / "privacy_audit"


def test_simulation_path_audits_chosen_clients_without_changing_the_run(tmp_path) -> None:
    def simulation() -> FederatedSimulation:
        torch.manual_seed(0)
        return FederatedSimulation(
            small_cnn(),
            datamodule=RandomImages(),
            num_clients=4,
            clients_per_round=4,
            local_batch_size=2,
            server_optimizer="sgd",
            server_lr=0.5,
            seed=3,
        )

    def fit(callbacks: list, logger=False) -> FederatedSimulation:
        L.seed_everything(0)
        sim = simulation()
        quiet_trainer(max_steps=2, logger=logger, log_every_n_steps=1, callbacks=callbacks).fit(sim)
        return sim

    baseline = fit([])
    audit = PrivacyAudit(
        rounds=1, clients=[0, 2], attacks=[InvertingGradients(iterations=3)], lpips=False, noise_ratio=False, **KNOWN
    )
    logger = CSVLogger(tmp_path, name="sim")
    audited = fit([audit], logger=logger)
    assert_same_weights(baseline.module, audited.module)

    assert sorted((r.round, r.client_id) for r in audit.results) == [(1, 0), (1, 2)]
    for result in audit.results:
        record = result.attacks[0].record
        assert record.inputs.shape == (2, 1, 12, 12) and record.meta["path"] == "simulation"
        assert result.worst.batch_size == 2 and 0.0 <= result.worst.leak_fraction <= 1.0
    columns = set(read_csv(Path(logger.log_dir) / "metrics.csv")[0])
    for client in (0, 2):
        assert f"privacy_audit/client{client}/InvertingGradients/psnr" in columns
        assert f"privacy_audit/client{client}/passive/leak_fraction" in columns
    assert "privacy_audit/client0/passive/noise_ratio" not in columns  # noise_ratio=False: not scored, not logged


def test_bad_inputs_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="attacks must hold at least one"):
        PrivacyAudit(attacks=[])
    with pytest.raises(TypeError, match=r"attacks\[0\] must be a GradientAttack"):
        PrivacyAudit(attacks=[IDLG])  # the class, not an instance
    with pytest.raises(ValueError, match="rounds"):
        PrivacyAudit(rounds=[])
    with pytest.raises(ValueError, match="clients"):
        PrivacyAudit(clients=-1)
    with pytest.raises(ValueError, match="leak_thresholds: unknown metric"):
        PrivacyAudit(leak_thresholds={"accuracy": 0.9})
    with pytest.raises(ValueError, match="adaptive_budget takes"):
        PrivacyAudit(adaptive_budget={"epochs": 3})
    with pytest.raises(ValueError, match="adaptive_budget"):
        PrivacyAudit(adaptive_budget={"iterations": 0})
    with pytest.raises(ValueError, match=r"client\(s\) \[3\] never share"):
        fit_local([PrivacyAudit(clients=[0, 3], attacks=tiny_attacks(), **KNOWN)], steps=1)
    with pytest.raises(ValueError, match=r"round\(s\) \[5\] are outside this run.*max_steps=2"):
        fit_local([PrivacyAudit(rounds=[1, 5], attacks=tiny_attacks(), **KNOWN)], steps=2)
    with pytest.raises(ValueError, match="needs num_classes"):
        fit_local([PrivacyAudit(attacks=tiny_attacks(), mean=(0.5,), std=(0.25,))], steps=1)
    L.seed_everything(0)
    late = PrivacyAudit(rounds=[0, 20], attacks=tiny_attacks(), lpips=False, noise_ratio=False, **KNOWN)
    with pytest.warns(UserWarning, match=r"round\(s\) \[20\] are past the estimated end of this run \(8"):
        quiet_trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[late]).fit(TinyModule(), loader())
    assert [r.round for r in late.results] == [0]
    assert (tmp_path / "privacy_audit" / "step0_client0.png").is_file()  # no logger: grids under default_root_dir
    audit = PrivacyAudit(attacks=tiny_attacks(), **KNOWN)
    with pytest.raises(ValueError, match="record_data=True"):
        audit.observe({}, StageCall(0, 0, small_cnn(), None, {"path": "local"}))


class _Raises(GradientAttack):
    def __init__(self, error: Exception) -> None:
        super().__init__(seed=0)
        self.error = error

    def reconstruct(self, view):
        raise self.error


def test_failed_or_inapplicable_attacks_make_the_verdict_inconclusive_without_stopping_the_run() -> None:
    broken = PrivacyAudit(
        rounds=[0],
        attacks=[InvertingGradients(iterations=2), _Raises(RuntimeError("diverged. Step 3."))],
        adaptive=False,
        thresholds={"psnr": 15.0, "ssim": 0.5},  # LPIPS of 12x12 images upsampled for AlexNet says little
        save_images=False,
        **KNOWN,
    )
    with pytest.warns(UserWarning, match="diverged. Step 3."):
        fit_local([broken], steps=1)
    (result,) = broken.results
    assert result.skipped == {"_Raises": "error: RuntimeError: diverged. Step 3."}
    assert result.worst.verdict == "inconclusive", result.worst.verdict_reasons
    assert any("diverged. Step 3." in reason for reason in result.worst.verdict_reasons), result.worst.verdict_reasons

    nothing = PrivacyAudit(
        rounds=[0],
        attacks=[_Raises(AttackNotApplicable("needs BatchNorm"))],
        adaptive=False,
        save_images=False,
        **KNOWN,
    )
    with pytest.warns(UserWarning, match="no attack could run"):
        fit_local([nothing], steps=1)
    (result,) = nothing.results
    assert result.worst.verdict == "inconclusive" and result.worst.batch_size == 1
    assert any("no attack could run" in reason for reason in result.worst.verdict_reasons)


def test_the_attacker_uses_the_given_loss_and_the_composed_adaptive_attack() -> None:
    def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)

    audit = PrivacyAudit(
        rounds=[0],
        attacks=[InvertingGradients(iterations=2)],
        adaptive_budget={"iterations": 2, "lbfgs_iterations": 2},
        loss_fn=smoothed,
        save_images=False,
        **KNOWN,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmodelledDefenseWarning)
        fit_local([GaussianNoise(scale=1e-3, seed=0), TopKPruning(rate=0.5, seed=0), audit], steps=1)
    (result,) = audit.results
    assert all(r.view.loss_fn is smoothed for r in result.attacks)
    adaptive = [r for r in result.attacks if r.reconstruction.meta.get("defense")]
    assert adaptive and all(not r.reconstruction.meta.get("fallback") for r in adaptive)
    assert {r.reconstruction.meta["defense"] for r in adaptive} == {"GaussianNoise+TopKPruning"}
    assert not any("fell back" in reason for reason in result.worst.verdict_reasons)


def test_a_batch_with_more_images_than_classes_is_audited_with_the_true_labels_granted_and_said() -> None:
    # Before: label recovery assumes distinct labels, so at a batch of 8 images of 4 classes every
    # attack was n/a and the audit said nothing useful (the README's example at batch 64 failed)
    L.seed_everything(0)
    quiet = dict(adaptive=False, lpips=False, noise_ratio=False, save_images=False)
    audit = PrivacyAudit(rounds=0, attacks=tiny_attacks(), **quiet, **KNOWN)
    with pytest.warns(UserWarning, match=r"given the true labels: a batch of 8 images of 4 classes"):
        quiet_trainer(max_steps=1, callbacks=[audit]).fit(TinyModule(), loader(batch_size=8))
    (result,) = audit.results
    assert len(result.attacks) == 2 and not result.skipped  # iDLG and IG both ran
    assert result.labels_granted is not None and "stronger attacker" in result.labels_granted
    small = PrivacyAudit(rounds=0, attacks=tiny_attacks(), **quiet, **KNOWN)
    quiet_trainer(max_steps=1, callbacks=[small]).fit(TinyModule(), loader(batch_size=2))
    assert small.results[0].labels_granted is None  # distinct labels are possible: recovered, not granted


def test_a_trained_step_of_a_batch_is_audited_with_the_true_labels_unless_the_server_holds_public_data() -> None:
    # Label counts from random inputs get labels wrong on a trained model (benchmarks/results/
    # label_counts_trained.md): without public data the audit grants the labels, with it it recovers them
    quiet = dict(adaptive=False, lpips=False, noise_ratio=False, save_images=False)
    L.seed_everything(0)
    audit = PrivacyAudit(rounds=1, attacks=tiny_attacks(), **quiet, **KNOWN)
    with pytest.warns(UserWarning, match=r"at step 1 \(a trained model\) the label counts of a batch of 2"):
        quiet_trainer(max_steps=2, callbacks=[audit]).fit(TinyModule(), loader(batch_size=2))
    assert audit.results[0].labels_granted is not None
    assert all(r.view.labels is not None for r in audit.results[0].attacks)
    g = torch.Generator().manual_seed(1)
    public = ((torch.rand(8, 1, 12, 12, generator=g) - 0.5) / 0.25, torch.arange(4).repeat(2))
    L.seed_everything(0)
    held = PrivacyAudit(rounds=1, attacks=tiny_attacks(), public_data=public, **quiet, **KNOWN)
    quiet_trainer(max_steps=2, callbacks=[held]).fit(TinyModule(), loader(batch_size=2))
    assert held.results[0].labels_granted is None
    assert all(r.view.labels is None and r.view.public_data is not None for r in held.results[0].attacks)


@pytest.mark.parametrize("disagree", [True, False])
def test_where_the_label_estimates_differ_each_attack_also_runs_on_the_dummy_input_labels(
    monkeypatch: pytest.MonkeyPatch, disagree: bool
) -> None:
    """As in audit_setting: two label estimates that differ are two attacks, and the worst case takes
    both, so each label-recovering attack runs a second time on Geng et al.'s dummy-input counts; its
    view keeps the public images (an attack's prior trains on them). Whether they differ is
    label_estimates_differ's, tested on real views in test_attacks."""
    import lightning_gp.audit.callback as callback

    monkeypatch.setattr(callback, "label_estimates_differ", lambda view: disagree)
    g = torch.Generator().manual_seed(1)
    public = ((torch.rand(8, 1, 12, 12, generator=g) - 0.5) / 0.25, torch.arange(4).repeat(2))
    quiet = dict(adaptive=False, lpips=False, noise_ratio=False, save_images=False)
    L.seed_everything(0)
    audit = PrivacyAudit(rounds=1, attacks=tiny_attacks(), public_data=public, **quiet, **KNOWN)
    quiet_trainer(max_steps=2, callbacks=[audit]).fit(TinyModule(), loader(batch_size=2))
    attacks = audit.results[0].attacks
    sources = [r.view.label_softmax for r in attacks]
    assert sources == (["auto", "dummy"] * len(tiny_attacks()) if disagree else ["auto"] * len(tiny_attacks()))
    assert all(r.view.public_data is not None for r in attacks)


@pytest.mark.parametrize(
    "public_data, message",
    [
        (torch.zeros(2, 1, 12, 12), "a pair"),
        ((torch.zeros(2, 1, 12, 12), torch.tensor([0.0, 1.0])), "integer labels"),
        ((torch.zeros(2, 1, 12, 12), torch.tensor([0, 4])), r"labels must lie in \[0, 4\)"),
    ],
)
def test_privacy_audit_rejects_bad_public_data_at_construction(public_data, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        PrivacyAudit(public_data=public_data, **KNOWN)


def test_a_batch_of_16_gives_a_bounded_figure_and_a_one_screen_summary_beside_it(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(16, 1, 12, 12, generator=g) - 0.5) / 0.25
    data = DataLoader(TensorDataset(images, torch.randint(0, 4, (16,), generator=g)), batch_size=16)
    attacks = [InvertingGradients(iterations=2), InvertingGradients(iterations=3), InvertingGradients(iterations=4)]
    audit = PrivacyAudit(attacks=attacks, adaptive=False, lpips=False, noise_ratio=False, **KNOWN)
    L.seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 16 images of 4 classes: the labels are granted, said in a warning
        quiet_trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[MagnitudePruning(rate=0.5), audit]).fit(
            TinyModule(), data
        )
    (result,) = audit.results
    # one column per image and a row per attack made this 2100 px wide (64 images: 7867 px)
    assert result.image_path == tmp_path / "privacy_audit" / "step0_client0.png"
    width, height = struct.unpack(">II", result.image_path.read_bytes()[16:24])
    assert width <= 1400 and height <= 1100

    assert audit.summary_path == tmp_path / "privacy_audit" / "summary.md"
    summary = audit.summary_path.read_text()
    assert len(summary.splitlines()) <= 40
    assert summary.startswith("# PrivacyAudit: is this run's setting private?")
    # adaptive=False: the defended run is at best inconclusive, never picked as private
    assert result.worst.verdict in ("leaks", "inconclusive")
    assert f"**Not private: {result.worst.verdict}.** MagnitudePruning" in summary  # one run: judged, not picked
    assert f"| step 0, client 0 | {result.worst.verdict} |" in summary
    assert summary.count(audit.rule.describe()) == 1


def test_the_audit_logs_the_rero_bound_of_a_clipped_gaussian_mechanism_and_none_for_pruning() -> None:
    audit = PrivacyAudit(
        rounds=[0], attacks=[InvertingGradients(iterations=2)], adaptive=False, save_images=False, **KNOWN
    )
    fit_local([GaussianNoise(scale=1.0, clip=1e-4, seed=0), audit], steps=1)
    (result,) = audit.results
    eta, kappa = result.metrics["privacy_audit/client0/rero_eta"], result.metrics["privacy_audit/client0/rero_kappa"]
    assert 0.0 < kappa <= eta <= 1.0
    pruned = PrivacyAudit(
        rounds=[0], attacks=[InvertingGradients(iterations=2)], adaptive=False, save_images=False, **KNOWN
    )
    fit_local([TopKPruning(rate=0.5, seed=0), pruned], steps=1)
    assert not any("rero" in key for key in pruned.results[0].metrics)


def test_the_rero_bound_at_step_s_composes_the_releases_of_steps_0_to_s() -> None:
    # pixel lines only: on one 12x12 image the semantic test's class share alone would put kappa at 1
    audit = PrivacyAudit(
        rounds=[2],
        attacks=[InvertingGradients(iterations=2)],
        adaptive=False,
        save_images=False,
        leak_thresholds={"psnr": 20.0, "ssim": 0.5},
        **KNOWN,
    )
    defense = GaussianNoise(scale=1.0, clip=1e-3, seed=0)
    fit_local([defense, audit], steps=3)
    (result,) = audit.results
    eta, kappa = result.metrics["privacy_audit/client0/rero_eta"], result.metrics["privacy_audit/client0/rero_kappa"]
    size = sum(p.numel() for p in TinyModule().parameters())
    three = defense_mechanism(defense.defense, size, releases=3)
    assert kappa < 1 and three.steps == 3 and eta == pytest.approx(three.eta(kappa))
    assert eta > defense_mechanism(defense.defense, size).eta(kappa)  # one release: the old, smaller bound


def test_privacy_audit_without_the_noise_ratio_is_inconclusive_unless_its_rule_drops_the_paired_test() -> None:
    """The noise ratio is part of the default leak rule (paired with "closer than every trivial guess"):
    ``noise_ratio=False`` used to drop it from the rule silently. Under heavy noise no attack leaks, and
    the verdict names the noise ratio as a gap; stated without the paired test, it does not."""
    pixel_rule = {"psnr": 20.0, "ssim": 0.5}  # 12x12 images: no semantic test
    verdicts = {}
    for line in (0.4, None):
        audit = PrivacyAudit(
            rounds=[0],
            attacks=tiny_attacks(),
            adaptive=False,
            lpips=False,
            noise_ratio=False,
            save_images=False,
            leak_thresholds=pixel_rule,
            noise_ratio_line=line,
            thresholds={"psnr": 15.0},
            **KNOWN,
        )
        fit_local([GaussianNoise(scale=100.0, seed=0), audit], steps=1)
        (result,) = audit.results
        verdicts[line] = (result.worst.verdict, result.worst.verdict_reasons)
    # adaptive=False is a gap of its own in both; the noise ratio is one only where the rule has it
    verdict, reasons = verdicts[0.4]
    assert verdict == "inconclusive" and any("noise ratio" in r for r in reasons), reasons
    verdict, reasons = verdicts[None]
    assert verdict == "inconclusive" and reasons == ["the adaptive attacks were not run (adaptive=False)"], reasons


class _SigtermAfterTheStep(L.Callback):
    """What Lightning's SIGTERM handler does (``received_sigterm``) while the step's audit is pending."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer._signal_connector.received_sigterm = True


def test_a_sigterm_ends_the_audit_at_its_attacks_next_iteration_and_the_fit_with_lightnings_exception() -> None:
    # Before: SIGTERM was caught ("Received SIGTERM") and the audit ran on until kill -9
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    audit = PrivacyAudit(rounds=[0], attacks=[IDLG(iterations=10_000)], save_images=False, **KNOWN)
    with pytest.raises(SIGTERMException, match="SIGTERM received; the audit of step 0, client 0 was stopped"):
        fit_local([_SigtermAfterTheStep(), audit], steps=1)
    assert audit.results == []  # no verdict from an audit cut short


def test_a_running_attack_prints_progress_and_progress_seconds_is_checked(capsys) -> None:
    audit = PrivacyAudit(rounds=[0], attacks=tiny_attacks(), save_images=False, progress_seconds=1e-9, **KNOWN)
    fit_local([audit], steps=1)
    printed = capsys.readouterr().out
    assert "[IDLG] iteration 1/2, objective" in printed and "[InvertingGradients] iteration 4/4" in printed
    with pytest.raises(ValueError, match="progress_seconds"):
        PrivacyAudit(progress_seconds=0)


@pytest.mark.parametrize("normalize", [False, True])
def test_a_datamodule_serving_raw_pixels_is_refused_unless_the_audit_is_told_the_identity(normalize, tmp_path) -> None:
    from lightning_gp.data import ArrayDataModule
    from lightning_gp.models import ImageClassifier

    images = torch.Generator().manual_seed(0)
    x = (torch.rand(40, 1, 12, 12, generator=images) * 255).to(torch.uint8).numpy()
    data = ArrayDataModule(x=x, y=(torch.arange(40) % 4).numpy(), batch_size=1, normalize=normalize)
    module = ImageClassifier(small_cnn())

    def fit(audit: PrivacyAudit) -> PrivacyAudit:
        quiet_trainer(max_steps=1, callbacks=[audit]).fit(module, datamodule=data)
        return audit

    if normalize is False:
        with pytest.raises(ValueError, match=r"ArrayDataModule\(normalize=False\) serves raw pixels"):
            fit(PrivacyAudit(rounds=[0], attacks=tiny_attacks(), dirpath=tmp_path))
    # told the normalisation (the identity for raw pixels, or read off a standardising datamodule), it runs
    known = dict(mean=(0.0,), std=(1.0,)) if normalize is False else {}
    audited = fit(PrivacyAudit(rounds=[0], attacks=tiny_attacks(), dirpath=tmp_path, **known))
    assert [r.round for r in audited.results] == [0]
