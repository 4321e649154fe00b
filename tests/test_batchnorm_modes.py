"""BatchNorm clients are tapped and attacked in the mode they train in: batch statistics or frozen ones."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_gp.attacks import ServerView
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.rounds import tap_fedsgd_round
from lightning_gp.callbacks import GradientTap
from lightning_gp.functional import batchnorm_mode, set_batchnorm_mode
from lightning_gp.models import ImageClassifier


class SmallBatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4 * 13 * 13, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _gradient(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    nn.functional.cross_entropy(model(inputs), targets).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _with_running_stats(model: nn.Module) -> nn.Module:
    """Running statistics away from (0, 1), so the two modes differ on any batch."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.fill_(0.3)
            m.running_var.fill_(2.0)
    return model


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_tapped_gradient_is_the_clients_in_its_mode_and_the_attackers_model_runs_in_it(data, mode) -> None:
    torch.manual_seed(0)
    model = _with_running_stats(SmallBatchNormNet())
    records, _, _ = tap_fedsgd_round(model, data, indices=[[0, 2, 4]], num_clients=2, batchnorm=mode)
    record = records[0]
    assert record.meta["batchnorm"] == mode
    view = ServerView.from_tap(record, SmallBatchNormNet(), num_classes=10)
    assert batchnorm_mode(view.model) == mode
    # the attacker's model on the true batch gives exactly what the client shared
    replay = _gradient(view.model, record.inputs, record.targets)
    for name, value in replay.items():
        torch.testing.assert_close(value, record.gradients[name], rtol=1e-5, atol=1e-7)
    other = set_batchnorm_mode(SmallBatchNormNet(), "eval" if mode == "train" else "train")
    other.load_state_dict(record.model_state)
    differs = _gradient(other, record.inputs, record.targets)
    assert not torch.allclose(differs["head.weight"], record.gradients["head.weight"], atol=1e-6)


def test_a_plain_trainer_tap_says_its_batchnorm_mode(data) -> None:
    tap = GradientTap(clients=0, rounds=[0])
    trainer = L.Trainer(
        max_steps=1, callbacks=[tap], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(ImageClassifier(SmallBatchNormNet()), data)
    assert tap.latest().meta["batchnorm"] == "train"


def test_the_settings_mode_is_named_and_checked() -> None:
    setting = DefenseSetting("undefended", []).with_client_training(batchnorm="eval")
    assert setting.batchnorm == "eval" and setting.name == "undefended [BatchNorm eval]"
    both = DefenseSetting("x", []).with_client_training("fedavg", 5, 8, "eval")
    assert both.name == "x [FedAvg E=5, b=8, BatchNorm eval]"
    with pytest.raises(ValueError, match="batchnorm='eval' needs the simulation runner"):
        DefenseSetting("dp", [], runner="trainer", batchnorm="eval")
    with pytest.raises(ValueError, match="batchnorm must be 'train' or 'eval'"):
        DefenseSetting("x", [], batchnorm="frozen")
    with pytest.raises(ValueError, match="batchnorm mode must be"):
        set_batchnorm_mode(SmallBatchNormNet(), "frozen")
