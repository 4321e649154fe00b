"""DP-SGD at close to the cost of plain training (issue 48): the Conv2d ghost norm, book-keeping clipping,
and DPSGD(grad_sample_mode=...) in each of its modes.

"To float precision" below: float32 sums in another order, so entries agree to a few 1e-6 of the largest
entry of the tensor (``close``), not bitwise.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import quiet_trainer
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from scipy.stats import chi2, norm
from test_dp_sgd import RandomImagesWithTrain, RandomVectors, Tiny, Wide, fit
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader

from lightning_gp.callbacks import DPSGD, GradientTap
from lightning_gp.dp_sgd import BookKeeping, conv2d_norm_sample, conv2d_squared_norms, conv_norm, ghost_is_cheaper
from lightning_gp.models import ConvNet, ImageClassifier, LeNetZhu, ResNet18

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # Opacus' backward hooks on a first layer whose input needs no gradient (as in test_dp_sgd.py)
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]
MODES = ("hooks", "ghost", "book_keeping")
CE = nn.functional.cross_entropy


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 2e-5) -> None:
    """Equal to float precision: every entry within ``rel`` of the largest entry of ``expected``."""
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= rel * scale + 1e-12, (actual, expected)


def per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every example's gradient of its own loss, by torch.func (the reference)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return CE(functional_call(model, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


# ---------------------------------------------------------------- the Conv2d norm sampler

CONV_CONFIGS = [
    dict(kernel_size=3),
    dict(kernel_size=5, stride=2, padding=2),
    dict(kernel_size=3, dilation=2, padding=1),
    dict(kernel_size=3, padding="same", bias=False),
    dict(kernel_size=(2, 3), padding="same", dilation=(1, 2)),  # asymmetric "same" padding
    dict(kernel_size=3, groups=2, padding=1),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
    dict(kernel_size=1, stride=2, bias=False),
]


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("config", CONV_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("method", ["ghost", "instantiate"])
def test_conv2d_norms_equal_the_norms_of_instantiated_per_example_gradients(config, method):
    torch.manual_seed(0)
    layer = nn.Conv2d(4, 6, **config)
    x = torch.randn(5, 4, 9, 8)
    out = layer(x)
    backprops = torch.randn_like(out)
    reference = vmap(grad(lambda p, xi, gi: (functional_call(layer, p, (xi[None],)) * gi[None]).sum()), (None, 0, 0))(
        {n: p.detach() for n, p in layer.named_parameters()}, x, backprops
    )
    squared = conv2d_squared_norms(layer, x, backprops, method)
    assert set(squared) == set(layer.parameters())
    for name, p in layer.named_parameters():
        close(squared[p], reference[name].flatten(1).square().sum(1))


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("config", CONV_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_the_patch_gram_from_the_input_s_pixel_gram_equals_the_unfolded_one(config):
    torch.manual_seed(0)
    layer = nn.Conv2d(4, 6, **config)
    x = torch.randn(3, 4, 9, 8)
    out_hw = tuple(layer(x).shape[2:])
    close(conv_norm.patch_gram(layer, x, out_hw, "input"), conv_norm.patch_gram(layer, x, out_hw, "unfold"))


@pytest.mark.parametrize("strategy", ["loop", "grouped", "grouped_channels_last"])
def test_every_way_of_instantiating_conv2d_gradients_gives_the_same(strategy):
    torch.manual_seed(0)
    layer = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    x = torch.randn(3, 4, 8, 8)
    backprops = torch.randn_like(layer(x))
    reference = vmap(grad(lambda w, xi, gi: (nn.functional.conv2d(xi[None], w, None, 2, 1, 1, 2) * gi[None]).sum()), (None, 0, 0))(
        layer.weight.detach(), x, backprops
    )  # fmt: skip
    close(conv_norm.conv2d_per_example_weight_grads(layer, x, backprops, strategy), reference)


def test_the_mixed_rule_picks_the_cheaper_computation():
    # LeNetZhu's first conv (196 positions, 25 inputs, 12 outputs): instantiating is cheaper
    assert not ghost_is_cheaper(196, 25, 12)
    # ResNet-18's last stage at 32x32 (16 positions, 512 * 9 inputs, 512 outputs): the ghost norm is
    assert ghost_is_cheaper(16, 4608, 512)


def test_the_norm_sampler_is_registered_with_opacus_and_speaks_its_interface():
    assert GradSampleModuleFastGradientClipping.NORM_SAMPLERS[nn.Conv2d] is conv2d_norm_sample
    torch.manual_seed(0)
    layer = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 5, 5)
    backprops = torch.randn_like(layer(x))
    norms = conv2d_norm_sample(layer, [x], backprops)  # Opacus passes the forward inputs as a list
    squared = conv2d_squared_norms(layer, x, backprops)
    for p in layer.parameters():
        close(norms[p], squared[p].sqrt())
    layer.bias.requires_grad_(False)  # Opacus reads the norms of the trainable parameters only
    assert list(conv2d_norm_sample(layer, [x], backprops)) == [layer.weight]


# ---------------------------------------------------------------- book-keeping against Opacus


class Sequence(nn.Module):
    """A Linear over 5 positions per example (the ghost norm's other home), averaged."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(6, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x.reshape(len(x), 5, 6))).mean(1))


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).mean(1))


def layer_models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """One small model per layer type, with a batch of inputs; the targets have 3 classes."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    conv = nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2, bias=False), nn.Flatten(), nn.Linear(64, 3),
    )  # fmt: skip
    return {
        "Linear": (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(6, 6, generator=g)),
        "Linear over positions": (Sequence(), torch.randn(6, 30, generator=g)),
        "Conv2d": (conv, torch.randn(6, 2, 8, 8, generator=g)),
        "GroupNorm": (
            nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(144, 3)),
            torch.randn(6, 2, 8, 8, generator=g),
        ),
        "LayerNorm": (
            nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)),
            torch.randn(6, 6, generator=g),
        ),
        "Embedding": (Tokens(), torch.randint(0, 20, (6, 4), generator=g)),
    }


def opacus_hooks_gradient(model: nn.Module, x, y, clip: float, batch: int) -> dict[str, torch.Tensor]:
    """What Opacus' per-example path (GradSampleModule + DPOptimizer, no noise) puts into ``.grad``."""
    model = copy.deepcopy(model)
    gsm = GradSampleModule(model, loss_reduction="mean")
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=batch
    )
    optimizer.zero_grad()
    CE(gsm(x), y).backward()
    optimizer.pre_step()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def opacus_ghost_gradient(model: nn.Module, x, y, clip: float, batch: int) -> dict[str, torch.Tensor]:
    """Opacus' ghost clipping (two backward passes), with this package's Conv2d norm sampler."""
    model = copy.deepcopy(model)
    gsm = GradSampleModuleFastGradientClipping(model, loss_reduction="mean", max_grad_norm=clip)
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=batch
    )
    criterion = DPLossFastGradientClipping(gsm, optimizer, nn.CrossEntropyLoss())
    optimizer.zero_grad()
    criterion(gsm(x), y).backward()
    optimizer.pre_step()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def book_keeping_gradient(model: nn.Module, x, y, clip: float, batch: int, method: str = "mixed"):
    model = copy.deepcopy(model)
    engine = BookKeeping(model, max_grad_norm=clip, norm_method=method)
    engine.backward(CE(model(x), y))
    engine.detach()
    return {n: p.grad / batch for n, p in model.named_parameters()}


def median_norm(model: nn.Module, x, y) -> float:
    """A clip that clips about half the examples."""
    grads = per_example_grads(model, x, y)
    return torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1).median().item()


@pytest.mark.parametrize("kind", list(layer_models()))
def test_book_keeping_equals_opacus_per_example_clipping_for_each_layer_type(kind):
    model, x = layer_models()[kind]
    y = torch.arange(len(x)) % 3
    for clip in (median_norm(model, x, y), 1e6):  # half the examples clipped; none
        expected = opacus_hooks_gradient(model, x, y, clip, batch=8)
        for method in ("mixed", "ghost", "instantiate"):
            ours = book_keeping_gradient(model, x, y, clip, batch=8, method=method)
            for name, g in expected.items():
                close(ours[name], g)
        ghost = opacus_ghost_gradient(model, x, y, clip, batch=8)
        for name, g in expected.items():
            close(ghost[name], g)


def whole_models() -> list[tuple[str, nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("LeNetZhu", LeNetZhu(), torch.randn(5, 1, 28, 28)),
        ("ConvNet", ConvNet(), torch.randn(4, 1, 28, 28)),
        ("ResNet18 group", ResNet18(norm="group", width=8, image_size=16), torch.randn(3, 3, 16, 16)),
    ]


@pytest.mark.parametrize("index", range(3), ids=["LeNetZhu", "ConvNet", "ResNet18-group"])
def test_book_keeping_and_ghost_equal_opacus_per_example_clipping_on_whole_models(index):
    _, model, x = whole_models()[index]
    y = torch.arange(len(x)) % 10
    clip = median_norm(model, x, y)
    expected = opacus_hooks_gradient(model, x, y, clip, batch=4)
    for name, g in book_keeping_gradient(model, x, y, clip, batch=4).items():
        close(g, expected[name], rel=5e-5)
    for name, g in opacus_ghost_gradient(model, x, y, clip, batch=4).items():
        close(g, expected[name], rel=5e-5)


def test_book_keeping_reports_each_example_s_norm_and_cleans_up():
    model, x = layer_models()["Conv2d"]
    y = torch.arange(len(x)) % 3
    engine = BookKeeping(model, max_grad_norm=1.0)
    engine.backward(CE(model(x), y))
    grads = per_example_grads(model, x, y)
    close(engine.per_sample_norms, torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1))
    engine.detach()
    assert not any(m._forward_hooks for m in model.modules())
    assert engine.per_sample_norms is None


def test_an_empty_batch_gives_zero_gradients_and_unused_layers_zero_too():
    model, x = layer_models()["Linear"]
    engine = BookKeeping(model, max_grad_norm=1.0)
    engine.backward(CE(model(x[:0]), torch.zeros(0, dtype=torch.long)))
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


class Scaled(nn.Module):
    """A layer no per-example gradient rule knows: a raw parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_layers_book_keeping_cannot_handle_are_named():
    model = nn.Sequential(nn.Linear(12, 10), Scaled(), nn.Linear(10, 3))
    with pytest.raises(ValueError, match=r"1 \(Scaled\).*grad_sample_mode='hooks'"):
        BookKeeping(model, max_grad_norm=1.0)
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"shared by two layers \(0 and 1\)"):
        BookKeeping(tied, max_grad_norm=1.0)


# ---------------------------------------------------------------- DPSGD(grad_sample_mode=...)


def image_classifier() -> ImageClassifier:
    torch.manual_seed(0)
    return ImageClassifier(LeNetZhu(num_classes=4, image_size=12), lr=0.1)


def test_every_mode_shares_the_same_clipped_gradient_and_the_default_is_book_keeping():
    """The same Poisson batch, no noise, a clip below most examples' norms: the gradient tapped after
    DP-SGD is the same in every mode (to float precision)."""
    tapped = {}
    for mode in (*MODES, "auto"):
        tap = GradientTap(rounds=[0])
        dp = DPSGD(noise_multiplier=0.0, max_grad_norm=0.05, grad_sample_mode=mode)
        fit(dp, model=image_classifier(), data=RandomImagesWithTrain(), extra=[tap], max_steps=1)
        assert dp.grad_sample_mode_used == ("book_keeping" if mode == "auto" else mode)
        tapped[mode] = tap.latest()
        described = tapped[mode].meta["defenses"][0]["config"]
        assert (described["grad_sample_mode"], described["grad_sample_mode_used"]) == (mode, dp.grad_sample_mode_used)
    reference = tapped["hooks"]
    for mode in ("ghost", "book_keeping", "auto"):
        assert torch.equal(tapped[mode].inputs, reference.inputs)
        for name, g in reference.gradients.items():
            close(tapped[mode].gradients[name], g, rel=5e-5)


def _epsilon_after(steps: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
    from opacus.accountants import create_accountant

    reference = create_accountant(mechanism="rdp")
    reference.history = [(noise_multiplier, sample_rate, steps)]
    return reference.get_epsilon(delta=delta)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_trains_accounts_and_stops_at_the_budget_alike_and_leaves_the_module_clean(mode):
    # 64 examples, batch 8: q = 1/8; a budget between the 5th and the 6th step
    budget = (_epsilon_after(5, 0.8, 1 / 8, 1e-3) + _epsilon_after(6, 0.8, 1 / 8, 1e-3)) / 2
    dp = DPSGD(noise_multiplier=0.8, delta=1e-3, accountant="rdp", stop_at_epsilon=budget, grad_sample_mode=mode)
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, model = fit(dp, model=model, max_epochs=3)
    assert dp.steps_within_budget == dp.steps == trainer.global_step == 5
    assert dp.epsilon == pytest.approx(_epsilon_after(5, 0.8, 1 / 8, 1e-3), rel=1e-9)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    attrs = ("grad_sample", "summed_grad", "_forward_counter", "_norm_sample", "_current_grad_sample")
    assert not any(hasattr(p, a) for p in model.parameters() for a in attrs)
    for m in model.modules():
        assert not m._forward_hooks and not m._backward_hooks and not hasattr(m, "activations")
    assert "backward" not in vars(model) and not hasattr(model, "autograd_grad_sample_hooks")
    assert type(trainer.optimizers[0]) is torch.optim.SGD


class OneAtATime(RandomVectors):
    """Batch size 1 over 16 examples: q = 1/16, so Poisson sampling draws empty batches."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_dataset, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_poisson_batch_steps_with_noise_only(mode):
    class Recording(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def training_step(self, batch, batch_idx):
            self.sizes.append(len(batch[0]))
            return super().training_step(batch, batch_idx)

    model = Recording()
    tap = GradientTap(rounds=None)
    dp = DPSGD(noise_multiplier=0.0, grad_sample_mode=mode)
    trainer, _ = fit(dp, model=model, data=OneAtATime(n=16), extra=[tap], max_steps=8)
    assert dp.steps == trainer.global_step == 8
    empty = model.sizes.index(0)  # the seeded sampler draws one within 8 steps
    record = next(r for r in tap.records if r.round == empty)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in record.gradients.values())  # no noise: no step


@pytest.mark.parametrize("mode", ["ghost", "book_keeping"])
def test_the_noise_has_std_sigma_clip_over_the_expected_batch_size(mode):
    sigma, clip = 0.5, 100.0  # clip far above the per-example norms: only the noise differs
    taps = {}
    for s in (0.0, sigma):
        taps[s] = GradientTap(rounds=[0])
        fit(
            DPSGD(noise_multiplier=s, max_grad_norm=clip, grad_sample_mode=mode),
            model=Wide(),
            extra=[taps[s]],
            max_steps=1,
        )
    clean, noised = taps[0.0].latest(), taps[sigma].latest()
    assert torch.equal(clean.inputs, noised.inputs) and len(clean.inputs) != 8
    noise = torch.cat([(noised.gradients[n] - clean.gradients[n]).flatten() for n in clean.gradients]).double()
    n = noise.numel()
    # N(0, (sigma C)^2) added to the clipped sum, divided by the expected batch size 8: (n - 1) s^2 / std^2
    # is chi-square with n - 1 degrees of freedom and the mean N(0, std^2 / n); each bound fails a correct
    # implementation with probability 1e-6 (two-sided); at n = 4099 the std band is about +-5.5%, so it
    # catches a division by the actual batch size (not 8), sigma^2 for sigma or a missing noise.
    std = sigma * clip / 8
    low, high = (math.sqrt(chi2.ppf(q, n - 1) / (n - 1)) for q in (5e-7, 1 - 5e-7))
    assert low * std <= noise.std().item() <= high * std, (noise.std().item() / std, low, high)
    assert abs(noise.mean().item()) <= norm.isf(5e-7) * std / math.sqrt(n)


def test_the_default_falls_back_to_hooks_where_book_keeping_cannot_clip():
    class WithScale(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(12, 10), Scaled(), nn.Tanh(), nn.Linear(10, 3))

    dp = DPSGD(noise_multiplier=1.0)
    fit(dp, model=WithScale(), max_steps=2)
    assert dp.grad_sample_mode_used == "hooks" and dp.steps == 2
    with pytest.raises(ValueError, match=r"book_keeping.*net\.1 \(Scaled\)"):
        fit(DPSGD(noise_multiplier=1.0, grad_sample_mode="book_keeping"), model=WithScale(), max_steps=1)


def test_ghost_needs_the_loss_from_one_call_of_the_module():
    class CallsItsNet(Tiny):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return CE(self.net(x), y)

    with pytest.raises(ValueError, match="one call of the module"):
        fit(DPSGD(noise_multiplier=1.0, grad_sample_mode="ghost"), model=CallsItsNet(), max_steps=1)
    dp = DPSGD(noise_multiplier=1.0, grad_sample_mode="book_keeping")  # book-keeping does not care
    fit(dp, model=CallsItsNet(), max_steps=1)
    assert dp.steps == 1


def test_a_run_resumes_in_another_mode_and_keeps_accounting(tmp_path):
    config = dict(noise_multiplier=0.8, delta=1e-3, accountant="rdp")
    trainer, _ = fit(DPSGD(**config, grad_sample_mode="book_keeping"), max_epochs=1)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    resumed = DPSGD(**config, grad_sample_mode="hooks")
    quiet_trainer(max_epochs=2, callbacks=[resumed]).fit(
        Tiny(), datamodule=RandomVectors(), ckpt_path=tmp_path / "one.ckpt"
    )
    assert resumed.steps == 16
    assert resumed.epsilon == pytest.approx(_epsilon_after(16, 0.8, 1 / 8, 1e-3), rel=1e-9)


def test_a_bad_grad_sample_mode_is_named():
    with pytest.raises(ValueError, match=r"grad_sample_mode must be one of .*'functorch'"):
        DPSGD(noise_multiplier=1.0, grad_sample_mode="functorch")
    assert repr(DPSGD(noise_multiplier=1.0)) == repr(DPSGD(noise_multiplier=1.0, grad_sample_mode="auto"))
    assert "grad_sample_mode='ghost'" in repr(DPSGD(noise_multiplier=1.0, grad_sample_mode="ghost"))
    assert DPSGD(noise_multiplier=1.0).state_key == DPSGD(noise_multiplier=1.0, grad_sample_mode="hooks").state_key
