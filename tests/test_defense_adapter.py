"""The one defense adapter: ``GradientDefense`` around any pure defense, the named callbacks as
one-line subclasses, the frozen per-call contexts, and the pipeline the fit's runner holds."""

from __future__ import annotations

import dataclasses
import inspect

import lightning as L
import pytest
import torch
from helpers import quiet_trainer
from jsonargparse import ArgumentParser
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp import callbacks, defenses
from lightning_gp.callbacks import GradientDefense, MagnitudePruning
from lightning_gp.defenses.base import DefenseCall
from lightning_gp.pipeline import LocalClientStep, SharedGradientPipeline, StageCall

NAMED = sorted(
    name
    for name, value in vars(callbacks).items()
    if inspect.isclass(value) and issubclass(value, GradientDefense) and value.defense_class is not None
)


def test_every_named_defense_callback_is_declared_on_its_defense():
    assert (
        sorted(
            [
                "AlignedDualGradientPruning",
                "DistributedGaussianMechanism",
                "DualGradientPruning",
                "GaussianNoise",
                "GradDefense",
                "GradientQuantization",
                "LaplaceNoise",
                "LocalGaussianMechanism",
                "MagnitudePruning",
                "OptimalDPSGD",
                "OptimalGradientNoise",
                "OptimalGradientPruning",
                "Outpost",
                "RandomPruning",
                "Soteria",
                "TopKPruning",
            ]
        )
        == NAMED
    )


@pytest.mark.parametrize("name", NAMED)
def test_a_named_callback_takes_its_defense_s_arguments_and_defaults_by_keyword_then_the_adapter_s(name):
    callback = getattr(callbacks, name)
    parameters = list(inspect.signature(callback).parameters.values())
    defense = list(inspect.signature(callback.defense_class.__init__).parameters.values())[1:]
    adapter = list(inspect.signature(callback.adapt).parameters.values())[1:]
    assert [p.name for p in parameters] == [p.name for p in defense + adapter]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)
    assert [p.default for p in parameters[: len(defense)]] == [p.default for p in defense]


def test_a_named_callback_builds_its_defense_and_refuses_positional_or_unknown_arguments():
    callback = MagnitudePruning(rate=0.5, seed=3)
    assert type(callback.defense) is defenses.MagnitudePruning
    assert callback.defense.config() == {"rate": 0.5, "error_feedback": False} and callback.defense.seed == 3
    with pytest.raises(TypeError, match="positional"):
        MagnitudePruning(0.5)  # type: ignore[misc]
    with pytest.raises(
        TypeError, match=r"unexpected arguments \['rat'\]; it takes rate, error_feedback, seed, nonfinite"
    ):
        MagnitudePruning(rat=0.5)
    with pytest.raises(TypeError, match=r"unexpected arguments \['probe'\].*probes, refresh_every"):
        callbacks.Soteria(probes=2, probe=3)  # the adapter's settings are listed too
    with pytest.raises(TypeError, match="positional"):
        MagnitudePruning(defenses.MagnitudePruning(0.5))  # type: ignore[misc]


def test_the_generic_adapter_takes_any_defense_and_only_a_defense():
    callback = GradientDefense(defenses.RandomPruning(0.3, seed=1))
    assert repr(callback) == "RandomPruning(rate=0.3, error_feedback=True)"
    with pytest.raises(TypeError, match=r"must be a lightning_gp\.defenses\.Defense"):
        GradientDefense(nn.Linear(1, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected arguments"):
        GradientDefense(defenses.RandomPruning(0.3), refresh_every=2)


def test_the_adapter_s_own_settings_are_part_of_the_state_key():
    a = callbacks.OptimalGradientNoise(scale=0.01, probes=4, loss_fn=nn.CrossEntropyLoss())
    b = callbacks.OptimalGradientNoise(scale=0.01, probes=8, loss_fn=nn.CrossEntropyLoss())
    c = callbacks.OptimalGradientNoise(scale=0.01, probes=4, chunk_size=2)  # memory only, and the loss: not
    assert a.state_key != b.state_key and a.state_key == c.state_key


def test_lightning_cli_reads_a_named_callback_from_its_signature_and_refuses_a_typo():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callback", type=L.Callback)
    config = parser.parse_args(
        ['--callback={"class_path": "lightning_gp.callbacks.TopKPruning", "init_args": {"rate": 0.7}}']
    )
    built = parser.instantiate_classes(config).callback
    assert isinstance(built, callbacks.TopKPruning) and built.defense.rate == 0.7 and built.defense.error_feedback
    with pytest.raises(Exception, match="rat"):
        parser.parse_args(
            ['--callback={"class_path": "lightning_gp.callbacks.TopKPruning", "init_args": {"rat": 0.7}}']
        )


def test_the_call_contexts_are_frozen():
    call = StageCall(0, 1, nn.Linear(1, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.round = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        DefenseCall(0, torch.Generator()).statistic = 1  # type: ignore[misc]


def test_a_defense_that_needs_only_the_gradient_refuses_other_inputs_and_a_data_dependent_one_needs_them():
    g = {"w": torch.randn(4)}
    with pytest.raises(TypeError, match="defends from the gradient alone; it takes no sensitivity"):
        defenses.GaussianNoise(0.1)(g, 0, sensitivity=g)
    with pytest.raises(TypeError, match="pass sensitivity="):
        defenses.OptimalGradientNoise(0.1)(g, 0)
    with pytest.raises(TypeError, match="pass weights="):
        defenses.Outpost()(g, 0)


class PipelineSeen(callbacks.SharedGradientObserver):
    """Records the pipeline the fit's runner holds at each observation."""

    def __init__(self) -> None:
        self.pipelines: list[SharedGradientPipeline] = []
        self.fit_runner: object = None

    def observe(self, gradients, call) -> None:
        return

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        first = next(cb for cb in trainer.callbacks if isinstance(cb, callbacks.SharedGradientCallback))
        assert isinstance(first.runner, LocalClientStep)
        self.fit_runner = first.runner
        self.pipelines.append(first.runner.pipeline)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.rand(12, 1, 28, 28, generator=g), torch.randint(0, 3, (12,), generator=g)), batch_size=4
    )


def test_the_fit_s_runner_holds_one_pipeline_for_the_fit_and_lets_it_go_at_teardown():
    L.seed_everything(0)
    pruning, seen = MagnitudePruning(rate=0.5), PipelineSeen()
    quiet_trainer(max_steps=3, callbacks=[pruning, seen]).fit(Tiny(), loader())
    first = seen.pipelines[0]
    assert len(seen.pipelines) == 3 and all(p is first for p in seen.pipelines)
    assert first.defenses == [pruning] and first.observers == [seen]
    assert seen.fit_runner.pipeline is None  # type: ignore[attr-defined]
