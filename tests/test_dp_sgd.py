"""DPSGD: Opacus DP-SGD as a callback; the shared gradient is the clipped and noised one."""

import math

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer
from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.data_loader import DPDataLoader
from scipy.stats import chi2, norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import DPSGD, GradientTap, MagnitudePruning
from lightning_gp.defenses import MagnitudePruning as MagnitudePruningTransform
from lightning_gp.models import ImageClassifier, LeNetZhu
from lightning_gp.pipeline import ClientStepRunner

pytestmark = pytest.mark.usefixtures("one_thread")


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.5, batch_norm: bool = False, scheduler: bool = False) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(10) if batch_norm else nn.Identity()
        self.net = nn.Sequential(nn.Linear(12, 10), norm, nn.Tanh(), nn.Linear(10, 3))
        self.lr, self.scheduler = lr, scheduler

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.scheduler:
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]
        return optimizer


class RandomVectors(L.LightningDataModule):
    """64 seeded examples; the loader's own generator makes the Poisson batches reproducible."""

    def __init__(self, n: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.train_dataset = TensorDataset(
            torch.randn(self.n, 12, generator=g), torch.randint(0, 3, (self.n,), generator=g)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_dataset, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1)
        )


class RandomImagesWithTrain(RandomImages):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_dataset, batch_size=24, shuffle=True)


def fit(dp: DPSGD, *, model=None, data=None, extra=(), **trainer_kwargs) -> tuple[L.Trainer, L.LightningModule]:
    L.seed_everything(0, verbose=False)
    model = model if model is not None else Tiny()
    trainer_kwargs.setdefault("max_epochs", 1)
    trainer = quiet_trainer(callbacks=[dp, *extra], **trainer_kwargs)
    trainer.fit(model, datamodule=data if data is not None else RandomVectors())
    return trainer, model


def sum_gradient_over(record, expected_batch_size: int) -> dict[str, torch.Tensor]:
    """The gradient Opacus forms without clipping or noise: per-example sum over the expected batch size."""
    model = Tiny()
    model.load_state_dict(record.model_state)
    loss = nn.functional.cross_entropy(model(record.inputs), record.targets, reduction="sum") / expected_batch_size
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


def test_trains_an_image_classifier_with_poisson_batches_and_logs_epsilon():
    model = ImageClassifier(LeNetZhu(num_classes=4, image_size=12), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer, model = fit(dp, model=model, data=RandomImagesWithTrain(), max_epochs=2)
    assert math.isfinite(trainer.callback_metrics["train_loss"].item())
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert dp.sample_rate == pytest.approx(1 / 10) and dp.expected_batch_size == 24  # 240 examples, batch 24
    assert dp.steps == trainer.global_step == 20
    assert dp.target_delta == pytest.approx(1 / 240**1.1)
    assert 0 < dp.epsilon < math.inf
    assert trainer.callback_metrics["dp_epsilon"].item() == pytest.approx(dp.epsilon, rel=1e-6)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_epsilon_equals_a_fresh_opacus_accountant_stepped_as_often(accountant):
    dp = DPSGD(noise_multiplier=0.9, max_grad_norm=1.0, delta=1e-3, accountant=accountant)
    trainer, _ = fit(dp, max_epochs=2)
    assert dp.sample_rate == 1 / 8  # 64 examples, batch 8: q = 1 / len(loader)
    reference = create_accountant(mechanism=accountant)
    for _ in range(trainer.global_step):
        reference.step(noise_multiplier=0.9, sample_rate=1 / 8)
    assert trainer.global_step == 16
    assert dp.epsilon == pytest.approx(reference.get_epsilon(delta=1e-3), rel=1e-9)


def test_target_epsilon_picks_the_noise_multiplier_get_noise_multiplier_gives_for_the_run():
    dp = DPSGD(target_epsilon=2.0, delta=1e-3, accountant="rdp")
    fit(dp, max_epochs=3)
    expected = get_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-3, sample_rate=1 / 8, steps=24, accountant="rdp"
    )
    assert dp.noise_multiplier_used == expected
    assert 2.0 - 0.02 <= dp.epsilon <= 2.0  # the budget is spent, not exceeded, by the end of the run


def test_target_epsilon_needs_a_bounded_run():
    with pytest.raises(ValueError, match="max_epochs"):
        fit(DPSGD(target_epsilon=2.0), max_epochs=-1)


def test_tapped_gradient_is_the_sampled_batch_sum_over_the_expected_batch_size_without_noise():
    tap = GradientTap(rounds=[0])
    dp = DPSGD(noise_multiplier=0.0, max_grad_norm=1e6)
    fit(dp, extra=[tap], max_steps=1)
    record = tap.latest()
    clean = sum_gradient_over(record, dp.expected_batch_size)
    for name, g in clean.items():
        torch.testing.assert_close(record.gradients[name], g)


class Wide(Tiny):
    """Tiny with 256 hidden units: 4099 gradient entries, enough noise samples for a tight std estimate."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # both runs of a comparison start from the same weights
        self.net = nn.Sequential(nn.Linear(12, 256), nn.Tanh(), nn.Linear(256, 3))


def test_tapped_gradient_carries_the_dp_noise():
    sigma, clip = 0.5, 100.0  # clip far above the per-example norms: only the noise differs
    taps = {}
    for s in (0.0, sigma):
        taps[s] = GradientTap(rounds=[0])
        fit(DPSGD(noise_multiplier=s, max_grad_norm=clip), model=Wide(), extra=[taps[s]], max_steps=1)
    clean, noised = taps[0.0].latest(), taps[sigma].latest()
    assert torch.equal(clean.inputs, noised.inputs)  # the same Poisson batch
    assert len(clean.inputs) != 8  # so dividing by the actual batch size instead would show (below)
    noise = torch.cat([(noised.gradients[n] - clean.gradients[n]).flatten() for n in clean.gradients]).double()
    n = noise.numel()
    assert n == 12 * 256 + 256 + 256 * 3 + 3
    # Opacus adds N(0, (sigma * clip)^2) to the summed gradient and divides by the expected batch size 8.
    # For n Gaussian samples (n - 1) s^2 / std^2 is chi-square with n - 1 degrees of freedom, and the sample
    # mean is N(0, std^2 / n): each check below fails a correct implementation with probability 1e-6
    # (two-sided). The noise comes from the seeded global generator, so this run's outcome is fixed; the
    # bounds say how unlucky a seed would have to be. At n = 4099 the std interval is about +-5.5%: it
    # catches noise divided by the actual batch size (here not 8), sigma^2 for sigma, a missing clip
    # factor or a missing noise; the mean bound (0.08 std) catches biased noise.
    std = sigma * clip / 8
    low, high = (math.sqrt(chi2.ppf(q, n - 1) / (n - 1)) for q in (5e-7, 1 - 5e-7))
    assert low * std <= noise.std().item() <= high * std, (noise.std().item() / std, low, high)
    assert abs(noise.mean().item()) <= norm.isf(5e-7) * std / math.sqrt(n)


def test_pruning_after_dp_shares_a_sparse_noised_gradient_and_the_step_uses_it():
    tap = GradientTap(rounds=[0])
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1e3)
    model = Tiny(lr=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, model = fit(dp, model=model, extra=[MagnitudePruning(rate=0.8), tap], max_steps=1)
    record = tap.latest()
    # Before: meta["defenses"] named the pruning only, although DP-SGD clipped and noised first
    assert [d["name"] for d in record.meta["defenses"]] == ["DPSGD", "MagnitudePruning"]
    assert record.meta["defenses"][0]["config"]["max_grad_norm"] == 1e3
    shared = record.gradients
    for name in ("net.0.weight", "net.3.weight"):
        assert (shared[name] != 0).float().mean().item() == pytest.approx(0.2, abs=0.02)
    pruned_clean = MagnitudePruningTransform(0.8)(sum_gradient_over(record, dp.expected_batch_size))
    assert not torch.allclose(shared["net.0.weight"], pruned_clean["net.0.weight"], atol=1e-3)
    for name, p in model.named_parameters():  # SGD stepped with exactly the shared gradient
        torch.testing.assert_close(before[name] - p.detach(), 0.5 * shared[name])
    assert dp.steps == trainer.global_step == 1


def test_lr_schedulers_keep_stepping_the_wrapped_optimizer():
    trainer, _ = fit(DPSGD(noise_multiplier=1.0), model=Tiny(lr=0.4, scheduler=True), max_epochs=2)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1)


def test_module_is_clean_after_fit():
    data = RandomVectors()
    trainer, model = fit(DPSGD(noise_multiplier=1.0), data=data, max_steps=2)
    assert not any(
        hasattr(p, a) for p in model.parameters() for a in ("grad_sample", "summed_grad", "_forward_counter")
    )
    for m in model.modules():
        assert not m._forward_hooks and not m._backward_hooks and not hasattr(m, "activations")
    assert not hasattr(model, "autograd_grad_sample_hooks")
    assert "train_dataloader" not in vars(data)  # the datamodule's own method again
    assert not isinstance(data.train_dataloader(), DPDataLoader)
    assert type(trainer.optimizers[0]) is torch.optim.SGD


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({}, "noise_multiplier and target_epsilon"),
        ({"noise_multiplier": 1.0, "target_epsilon": 1.0}, "noise_multiplier and target_epsilon"),
        ({"noise_multiplier": -0.1}, "noise_multiplier"),
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 0.0}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "delta": 1.0}, "delta"),
        ({"noise_multiplier": 1.0, "delta": 0.0}, "delta"),
        ({"noise_multiplier": 1.0, "accountant": "moments"}, "accountant"),
        ({"noise_multiplier": 1.0, "stop_at_epsilon": -1.0}, "stop_at_epsilon"),
        ({"noise_multiplier": 1.0, "stop_at_epsilon": 0.0}, "stop_at_epsilon"),
    ],
)
def test_bad_arguments_are_reported_by_name(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        DPSGD(**kwargs)


def test_batch_norm_model_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"net\.1 \(BatchNorm1d\).*GroupNorm.*ModuleValidator\.fix"):
        fit(DPSGD(noise_multiplier=1.0), model=Tiny(batch_norm=True))


class ManualTiny(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class SimulationLike(Tiny, ClientStepRunner):
    """A module that runs its own clients' steps (as FederatedSimulation does)."""

    execution_path = "simulation-like"

    def client_setup(self, trainer, pl_module):
        raise AssertionError("DPSGD must refuse the module before asking it for clients")


@pytest.mark.parametrize(
    "model, trainer_kwargs, message",
    [
        (Tiny, {"accumulate_grad_batches": 2}, "accumulate_grad_batches"),
        (Tiny, {"gradient_clip_val": 1.0}, "gradient_clip_val"),
        (ManualTiny, {}, "automatic optimization"),
        (SimulationLike, {}, "runs its own clients"),
    ],
)
def test_unsupported_training_setups_are_rejected(model, trainer_kwargs, message):
    with pytest.raises(ValueError, match=message):
        fit(DPSGD(noise_multiplier=1.0), model=model(), **trainer_kwargs)


def test_a_loader_given_to_fit_needs_poisson_wrapping_or_poisson_sampling_off():
    data = RandomVectors()
    data.setup("fit")
    L.seed_everything(0, verbose=False)
    with pytest.raises(ValueError, match=r"DPDataLoader\.from_data_loader"):
        quiet_trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0)]).fit(Tiny(), data.train_dataloader())

    dp = DPSGD(noise_multiplier=1.0, poisson_sampling=False)
    trainer = quiet_trainer(max_epochs=1, callbacks=[dp])
    trainer.fit(Tiny(), data.train_dataloader())
    assert dp.sample_rate == 1 / 8 and dp.steps == trainer.global_step == 8

    dp = DPSGD(noise_multiplier=1.0)  # wrapped by the user: accepted as it is
    trainer = quiet_trainer(max_epochs=1, callbacks=[dp])
    trainer.fit(Tiny(), DPDataLoader.from_data_loader(data.train_dataloader()))
    assert dp.sample_rate == 1 / 8 and dp.steps == 8


def test_resume_continues_the_privacy_accounting(tmp_path):
    config = dict(noise_multiplier=0.8, delta=1e-3, accountant="rdp")
    trainer, _ = fit(DPSGD(**config), max_epochs=2)
    trainer.save_checkpoint(tmp_path / "two.ckpt")

    resumed_dp = DPSGD(**config)
    resumed = quiet_trainer(max_epochs=3, callbacks=[resumed_dp])
    resumed.fit(Tiny(), datamodule=RandomVectors(), ckpt_path=tmp_path / "two.ckpt")
    straight_dp = DPSGD(**config)
    straight, _ = fit(straight_dp, max_epochs=3)
    assert resumed.global_step == straight.global_step == 24 and resumed_dp.steps == 24
    assert resumed_dp.epsilon == straight_dp.epsilon

    with pytest.raises(ValueError, match="DPSGD settings the run was started with"):
        quiet_trainer(max_epochs=3, callbacks=[DPSGD(**{**config, "noise_multiplier": 2.0})]).fit(
            Tiny(), datamodule=RandomVectors(), ckpt_path=tmp_path / "two.ckpt"
        )
    plain = quiet_trainer(max_steps=2)
    plain.fit(Tiny(), datamodule=RandomVectors())
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="without DPSGD"):
        quiet_trainer(max_steps=4, callbacks=[DPSGD(**config)]).fit(
            Tiny(), datamodule=RandomVectors(), ckpt_path=tmp_path / "plain.ckpt"
        )


def _epsilon_after(steps: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
    reference = create_accountant(mechanism="rdp")
    reference.history = [(noise_multiplier, sample_rate, steps)]
    return reference.get_epsilon(delta=delta)


def test_stop_at_epsilon_ends_the_fit_before_the_step_that_would_pass_the_budget(tmp_path):
    # 64 examples, batch 8: q = 1/8, 8 steps an epoch; a budget between the 11th and the 12th step
    budget = (_epsilon_after(11, 0.8, 1 / 8, 1e-3) + _epsilon_after(12, 0.8, 1 / 8, 1e-3)) / 2
    dp = DPSGD(noise_multiplier=0.8, delta=1e-3, accountant="rdp", stop_at_epsilon=budget)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path)
    trainer, _ = fit(dp, max_epochs=5, extra=[checkpoint], enable_checkpointing=True)
    assert dp.steps_within_budget == dp.steps == trainer.global_step == 11
    assert dp.epsilon <= budget < _epsilon_after(12, 0.8, 1 / 8, 1e-3)
    assert trainer.current_epoch == 2  # stopped in the second epoch, which still ended
    assert trainer.callback_metrics["dp_epsilon"].item() == pytest.approx(dp.epsilon, rel=1e-6)
    saved = torch.load(checkpoint.best_model_path or checkpoint.last_model_path, weights_only=False)
    assert saved["global_step"] == 11


def test_a_budget_below_one_step_takes_no_step():
    dp = DPSGD(noise_multiplier=0.8, delta=1e-3, accountant="rdp", stop_at_epsilon=1e-3)
    trainer, _ = fit(dp, max_epochs=2)
    assert dp.steps == trainer.global_step == 0 and dp.steps_within_budget == 0


def test_stop_at_epsilon_refuses_min_epochs_that_would_train_past_it():
    with pytest.raises(ValueError, match="min_steps/min_epochs"):
        fit(DPSGD(noise_multiplier=1.0, stop_at_epsilon=1.0), max_epochs=2, min_epochs=2)


def test_secure_mode_trains_and_accounts():
    dp = DPSGD(noise_multiplier=1.0, secure_mode=True)
    trainer, _ = fit(dp, max_steps=3)
    assert dp.steps == trainer.global_step == 3 and 0 < dp.epsilon < math.inf
