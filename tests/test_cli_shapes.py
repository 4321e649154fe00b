"""A config names the data once: the model's in_channels / image_size / num_classes come from the
datamodule unless the config sets them, and a model that still does not fit is refused naming both."""

import numpy as np
import pytest
import torch
import yaml
from jsonargparse import Namespace
from test_cli import cli  # noqa: F401  (the fixture: run a command in process, in tmp_path)

from lightning_gp.cli import main as cli_main
from lightning_gp.cli.attack import main as attack_main
from lightning_gp.cli.shapes import data_shape_arguments, fill_shape_arguments
from lightning_gp.data import ArrayDataModule, FashionMNISTSampleDataModule


@pytest.fixture
def rgb_npz(tmp_path):
    """40 seeded 3x32x32 images of 4 classes: none of LeNetZhu's defaults (1 channel, 28 px, 10 classes)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "rgb.npz"
    np.savez(path, x=rng.integers(0, 256, (40, 3, 32, 32), dtype=np.uint8), y=np.arange(40) % 4)
    return str(path)


FAST = ["--trainer.fast_dev_run=true", "--trainer.accelerator=cpu", "--data.batch_size=4"]


class RecordModel:
    """Keeps the model the CLI built (LightningCLI's ``run=True`` returns nothing)."""

    built = None


@pytest.fixture
def built_model(monkeypatch):
    from lightning_gp.cli import LightningGPCLI

    original = LightningGPCLI.instantiate_classes

    def record(self):
        original(self)
        RecordModel.built = self.model

    monkeypatch.setattr(LightningGPCLI, "instantiate_classes", record)
    yield RecordModel
    RecordModel.built = None


def test_an_image_classifier_on_array_data_takes_channels_size_and_classes_from_the_data(
    cli,  # noqa: F811
    rgb_npz,
    built_model,
):
    """Before: LeNetZhu was built for 1x28x28 and 10 classes and the fit failed on the first conv."""
    args = ["fit", "--model=lightning_gp.models.ImageClassifier", "--model.model=lightning_gp.models.LeNetZhu"]
    out = cli(cli_main, [*args, "--data=lightning_gp.data.ArrayDataModule", f"--data.path={rgb_npz}", *FAST])
    network = built_model.built.model
    assert network.body[0].in_channels == 3
    assert network(torch.zeros(2, 3, 32, 32)).shape == (2, 4)
    assert "in_channels=3, image_size=32, num_classes=4" in out.stderr  # said once, with where it went


def test_a_group_norm_resnet_on_one_channel_data_gets_one_input_channel(cli, built_model):  # noqa: F811
    args = ["fit", "--model=lightning_gp.models.ImageClassifier", "--model.model=lightning_gp.models.ResNet18"]
    args += ["--model.model.norm=group", "--model.model.width=4"]
    cli(cli_main, [*args, "--data=lightning_gp.data.FashionMNISTSampleDataModule", *FAST])
    assert built_model.built.model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_a_shape_the_config_sets_is_kept_and_a_mismatch_is_refused_naming_both_sides(cli, rgb_npz):  # noqa: F811
    args = ["fit", "--model=lightning_gp.models.ImageClassifier", "--model.model=lightning_gp.models.LeNetZhu"]
    args += ["--model.model.num_classes=7", "--data=lightning_gp.data.ArrayDataModule", f"--data.path={rgb_npz}"]
    out = cli(cli_main, [*args, *FAST], fails=True)
    assert "LeNetZhu predicts (7,) outputs per image, but ArrayDataModule has 4 classes" in out.stderr


def test_the_saved_config_records_the_shapes_that_ran_and_the_data_spec(cli, rgb_npz, tmp_path):  # noqa: F811
    args = ["fit", "--model=lightning_gp.models.ImageClassifier", "--model.model=lightning_gp.models.LeNetZhu"]
    args += ["--data=lightning_gp.data.ArrayDataModule", f"--data.path={rgb_npz}", "--trainer.max_steps=1"]
    args += ["--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--data.batch_size=4"]
    cli(cli_main, [*args, f"--trainer.default_root_dir={tmp_path}"])
    (saved,) = tmp_path.rglob("config.yaml")
    config = yaml.safe_load(saved.read_text())
    assert config["model"]["init_args"]["model"]["init_args"]["in_channels"] == 3
    assert config["data"]["init_args"]["path"] == rgb_npz  # the spec, not the built module


def test_a_simulation_takes_the_shapes_from_its_own_datamodule(cli, rgb_npz):  # noqa: F811
    args = ["fit", "--model=lightning_gp.federated.FederatedSimulation", "--model.module=lightning_gp.models.LeNetZhu"]
    args += ["--model.datamodule=lightning_gp.data.ArrayDataModule", f"--model.datamodule.path={rgb_npz}"]
    args += ["--model.num_clients=2", "--model.clients_per_round=2", "--model.local_batch_size=2"]
    out = cli(cli_main, [*args, "--trainer.fast_dev_run=true", "--trainer.accelerator=cpu"])
    assert "model.init_args.module: in_channels=3, image_size=32, num_classes=4" in out.stderr


def test_the_attack_command_takes_the_shapes_from_its_data(cli, rgb_npz, tmp_path):  # noqa: F811
    args = ["--model=lightning_gp.models.LeNetZhu", "--data=lightning_gp.data.ArrayDataModule"]
    args += [f"--data.path={rgb_npz}", "--attack=lightning_gp.attacks.IDLG", "--attack.iterations=2"]
    out = cli(attack_main, [*args, "--lpips=false", "--num_clients=2", f"--output_dir={tmp_path / 'out'}"])
    assert "in_channels=3, image_size=32, num_classes=4" in out.stdout


def test_non_square_images_give_a_height_width_pair():
    data = ArrayDataModule(x=np.zeros((8, 1, 20, 24), dtype=np.uint8), y=np.arange(8) % 2)
    assert data_shape_arguments(data) == {"in_channels": 1, "image_size": (20, 24), "num_classes": 2}


def test_only_defaults_of_classes_that_take_the_argument_change_and_a_nested_datamodule_is_left_alone():
    values = data_shape_arguments(FashionMNISTSampleDataModule()) | {"in_channels": 3}
    lenet = Namespace(class_path="lightning_gp.models.LeNetZhu", init_args=Namespace(in_channels=1, num_classes=12))
    data = Namespace(class_path="lightning_gp.data.ArrayDataModule", init_args=Namespace(num_classes=None))
    loss = Namespace(class_path="torch.nn.CrossEntropyLoss", init_args=Namespace(reduction="mean"))
    spec = Namespace(
        class_path="lightning_gp.federated.FederatedSimulation",
        init_args=Namespace(module=lenet, datamodule=data, loss_fn=loss),
    )
    changed = fill_shape_arguments(spec, values)
    assert changed == [("model.init_args.module", "in_channels", 3)]  # num_classes=12 was set: kept
    assert lenet.init_args.num_classes == 12 and data.init_args.num_classes is None
    assert vars(loss.init_args) == {"reduction": "mean"}
