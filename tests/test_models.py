"""Tests for lightning_gp.models: shapes, parameter counts, argument checks, and a short fit."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.models import CNN6, VGG11, Conv2, ConvNet, ImageClassifier, LeNetZhu, ResNet18

ALL_MODELS = [LeNetZhu, CNN6, ConvNet, ResNet18, VGG11, Conv2]

# (class, default (C, H, W, classes), a non-default (num_classes, in_channels, image_size))
SHAPE_CASES = [
    (LeNetZhu, (1, 28, 28, 10), (100, 3, 32)),
    (CNN6, (3, 32, 32, 10), (7, 1, (28, 36))),
    (ConvNet, (1, 28, 28, 10), (5, 3, 32)),
    (ResNet18, (3, 32, 32, 10), (4, 1, 28)),
    (VGG11, (3, 32, 32, 10), (3, 1, (64, 32))),
    (Conv2, (1, 28, 28, 62), (10, 3, (32, 20))),
]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize(("cls", "default", "custom"), SHAPE_CASES, ids=[c[0].__name__ for c in SHAPE_CASES])
def test_output_shape(cls, default, custom) -> None:
    c, h, w, k = default
    assert cls()(torch.randn(2, c, h, w)).shape == (2, k)
    num_classes, in_channels, image_size = custom
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    model = cls(num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    assert model(torch.randn(2, in_channels, h, w)).shape == (2, num_classes)


@pytest.mark.parametrize(
    ("cls", "kwargs", "expected"),
    [
        (ResNet18, {}, 11_173_962),  # the usual "11.17M" CIFAR ResNet-18
        (ResNet18, {"norm": "group"}, 11_173_962),  # GroupNorm has BatchNorm's affine params
        (ConvNet, {}, 119_530),  # optimal-defenses paper, Table 1 ("120k")
        (VGG11, {}, 9_231_114),
        (Conv2, {}, 6_603_710),  # LEAF FEMNIST CNN (~6.6M)
        (CNN6, {}, 154_256),  # bias-free convs + bias-free 3200->10 head
    ],
    ids=["resnet18", "resnet18-group", "convnet", "vgg11", "conv2", "cnn6"],
)
def test_parameter_counts(cls, kwargs, expected: int) -> None:
    assert n_params(cls(**kwargs)) == expected


def test_resnet18_param_count_range() -> None:
    assert 11_160_000 < n_params(ResNet18()) < 11_180_000


def test_resnet18_group_norm_has_no_batchnorm_and_passes_opacus() -> None:
    from opacus.validators import ModuleValidator

    model = ResNet18(norm="group")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    group_norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert group_norms and all(m.num_channels % m.num_groups == 0 for m in group_norms)
    assert ModuleValidator.validate(model, strict=False) == []
    assert ModuleValidator.validate(ResNet18(), strict=False) != []  # BatchNorm is rejected


def test_resnet18_group_norm_odd_width() -> None:
    model = ResNet18(norm="group", width=12)  # widths 12, 24, 48, 96 -> 12, 24, 24, 32 groups
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    assert {m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)} == {12, 24, 32}


def test_vgg11_batch_norm_flag() -> None:
    assert any(isinstance(m, nn.BatchNorm2d) for m in VGG11().modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in VGG11(batch_norm=False).modules())


def test_cnn6_matches_rgap() -> None:
    model = CNN6()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [12, 36, 36, 36, 64, 128]
    assert [c.stride[0] for c in convs] == [2, 2, 1, 1, 2, 1]
    assert all(m.bias is None for m in convs) and model.classifier.bias is None
    assert model.classifier.in_features == 3200
    acts = [m for m in model.modules() if isinstance(m, nn.LeakyReLU)]
    assert len(acts) == 6 and all(a.negative_slope == 0.2 for a in acts)
    assert not any(isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)) for m in model.modules())
    assert CNN6(bias=True).classifier.bias is not None


def test_lenet_zhu_sigmoid_and_dlg_uniform_init() -> None:
    model = LeNetZhu()
    assert sum(isinstance(m, nn.Sigmoid) for m in model.modules()) == 3
    assert not any(isinstance(m, (nn.ReLU, nn.LeakyReLU)) for m in model.modules())
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert params.min() >= -0.5 and params.max() <= 0.5
    # U[-0.5, 0.5] fills the range; PyTorch's default init is bounded by 1/sqrt(fan_in) <= 0.2 here
    assert params.min() < -0.49 and params.max() > 0.49
    assert abs(params.std().item() - (1 / 12) ** 0.5) < 0.01
    default = torch.cat([p.detach().flatten() for p in LeNetZhu(init="default").parameters()])
    assert default.abs().max() < 0.3


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (LeNetZhu, {"num_classes": 1}, "num_classes"),
        (CNN6, {"in_channels": 0}, "in_channels"),
        (ConvNet, {"image_size": 3}, "image_size"),  # two max-pools need >= 4 pixels
        (Conv2, {"image_size": (28, 2)}, "image_size"),
        (VGG11, {"image_size": 16}, "image_size"),  # five max-pools need >= 32 pixels
        (ResNet18, {"image_size": 0}, "image_size"),
        (ResNet18, {"image_size": (32, 32, 3)}, "image_size"),
        (ResNet18, {"norm": "layer"}, "norm"),
        (ResNet18, {"width": 0}, "width"),
        (LeNetZhu, {"init": "xavier"}, "init"),
        (VGG11, {"num_classes": 2.5}, "num_classes"),
    ],
)
def test_bad_arguments_raise(cls, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("cls", ALL_MODELS)
def test_smallest_valid_image_size(cls) -> None:
    # the constructor accepts the smallest size its stride chain allows, and forward then works
    size = {VGG11: 32, ConvNet: 4, Conv2: 4}.get(cls, 1)
    model = cls(in_channels=2, image_size=size)
    # batch of 2: BatchNorm cannot train on a single 1x1 map
    assert model(torch.randn(2, 2, size, size)).shape == (2, 10 if cls is not Conv2 else 62)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, "lr"),
        ({"optimizer": "rmsprop"}, "optimizer"),
        ({"momentum": -0.1}, "momentum"),
        ({"optimizer": "adam", "momentum": 0.9}, "momentum"),
        ({"weight_decay": -1.0}, "weight_decay"),
    ],
)
def test_classifier_bad_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ImageClassifier(ConvNet(), **kwargs)


def test_classifier_optimizers_and_hparams() -> None:
    sgd = ImageClassifier(ConvNet(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    opt = sgd.configure_optimizers()
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["lr"] == 0.05 and opt.defaults["momentum"] == 0.9
    assert "model" not in sgd.hparams and sgd.hparams.weight_decay == 1e-4
    assert isinstance(ImageClassifier(ConvNet(), optimizer="adam").configure_optimizers(), torch.optim.Adam)
    assert isinstance(sgd.loss_fn, nn.CrossEntropyLoss)
    with pytest.raises(TypeError, match="model"):
        ImageClassifier("resnet18")  # type: ignore[arg-type]


def _loader(n: int = 32, num_classes: int = 4) -> DataLoader:
    # each class has its own template under the noise, so the loss can actually go down
    targets = torch.arange(n) % num_classes
    images = torch.randn(num_classes, 1, 28, 28)[targets] + 0.5 * torch.randn(n, 1, 28, 28)
    return DataLoader(TensorDataset(images, targets), batch_size=n)


def _mean_loss(module: ImageClassifier, loader: DataLoader) -> float:
    module.eval()
    with torch.no_grad():
        loss = sum(module.loss_fn(module(x), y).item() for x, y in loader) / len(loader)
    module.train()
    return loss


def test_classifier_fit_reduces_loss_and_logs() -> None:
    loader = _loader()
    module = ImageClassifier(ConvNet(num_classes=4), lr=1e-3, optimizer="adam")
    before = _mean_loss(module, loader)
    trainer = L.Trainer(
        max_steps=5,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    assert trainer.global_step == 5
    metrics = trainer.callback_metrics
    for key in ("train_loss", "val_loss", "val_acc"):
        assert key in metrics and torch.isfinite(metrics[key])
    assert 0.0 <= metrics["val_acc"].item() <= 1.0
    assert "val_acc" in trainer.progress_bar_metrics
    after = _mean_loss(module, loader)
    assert after < 0.8 * before  # ~1.39 -> ~0.5 over seeds 0-7
    assert abs(metrics["val_loss"].item() - after) < 1e-4  # val_loss is the loss of the final weights
    (result,) = trainer.test(module, dataloaders=loader, verbose=False)
    assert set(result) == {"test_loss", "test_acc"}


# Lightning's own LightningCLI code calls jsonargparse APIs that jsonargparse has deprecated
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_classifier_builds_from_lightning_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["lightning-gp"])  # pytest's own argv must not reach the CLI
    cli = LightningCLI(
        ImageClassifier,
        run=False,
        seed_everything_default=False,
        args={
            "model": {
                "model": {
                    "class_path": "lightning_gp.models.LeNetZhu",
                    "init_args": {"num_classes": 5, "init": "default"},
                },
                "lr": 0.01,
                "optimizer": "adam",
            },
            "trainer": {"logger": False, "enable_checkpointing": False, "accelerator": "cpu"},
        },
    )
    assert isinstance(cli.model.model, LeNetZhu)
    assert cli.model.hparams.optimizer == "adam" and cli.model.hparams.lr == 0.01
    assert cli.model(torch.randn(2, 1, 28, 28)).shape == (2, 5)
