"""One process = one client: defenses rewrite .grad once per optimizer step."""

import lightning as L
import pytest
import torch
from helpers import AddConstant, CountingDefense, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import GradientDefense, GradientTap, MagnitudePruning
from lightning_gp.callbacks.base import SharedGradientObserver
from lightning_gp.defenses import MagnitudePruning as MagnitudePruningTransform
from lightning_gp.pipeline import SharedGradientPipeline, StageCall


class TinyClassifier(L.LightningModule):
    def __init__(self, lr: float = 0.5, two_optimizers: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3))
        self.lr, self.two_optimizers = lr, two_optimizers
        if two_optimizers:
            self.automatic_optimization = False

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.two_optimizers:
            return [
                torch.optim.SGD(self.net[1].parameters(), lr=self.lr),
                torch.optim.SGD(self.net[3].parameters(), lr=self.lr),
            ]
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(n: int = 32, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, 3, 4, generator=g), torch.randint(0, 3, (n,), generator=g)), batch_size=batch_size
    )


def raw_gradient(model: TinyClassifier, batch) -> dict[str, torch.Tensor]:
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


def test_optimizer_steps_with_the_defended_gradient():
    L.seed_everything(0)
    model = TinyClassifier()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = MagnitudePruningTransform(0.6)(raw_gradient(model, next(iter(loader()))))
    tap = GradientTap(rounds=[0])
    quiet_trainer(max_steps=1, callbacks=[MagnitudePruning(rate=0.6), tap]).fit(model, loader())
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), 0.5 * expected[name])
        torch.testing.assert_close(tap.latest().gradients[name], expected[name])
    assert (expected["net.1.weight"] == 0).float().mean().item() == pytest.approx(0.6)


def test_defense_applies_once_per_optimizer_step_on_the_accumulated_gradient():
    L.seed_everything(0)
    counting = GradientDefense(CountingDefense())
    tap = GradientTap(rounds=[0])
    model = TinyClassifier()
    data = loader(n=32, batch_size=8)
    batches = list(data)[:2]
    raw = [raw_gradient(model, b) for b in batches]
    quiet_trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[counting, tap]).fit(model, data)
    assert counting.defense.calls == 2  # 4 batches, 2 optimizer steps
    record = tap.latest()
    assert record.inputs.shape[0] == 16  # both micro-batches of the step were captured
    for name in raw[0]:  # Lightning scales each micro-batch loss by 1/2
        torch.testing.assert_close(record.gradients[name], (raw[0][name] + raw[1][name]) / 2)


def test_defenses_compose_in_the_given_order_and_taps_see_the_final_gradient():
    L.seed_everything(0)
    model = TinyClassifier()
    raw = raw_gradient(model, next(iter(loader())))
    prune, shift = MagnitudePruningTransform(0.5), AddConstant(1.0)
    expected = prune(shift(raw))  # shift first, then prune
    tap = GradientTap(rounds=[0])  # listed first, still sees the final gradient
    callbacks = [tap, GradientDefense(AddConstant(1.0)), MagnitudePruning(rate=0.5)]
    quiet_trainer(max_steps=1, callbacks=callbacks).fit(model, loader())
    other_order = shift(prune(raw))
    for name in raw:
        torch.testing.assert_close(tap.latest().gradients[name], expected[name])
    assert any(not torch.allclose(expected[n], other_order[n]) for n in raw)


class GradStorage(L.Callback):
    """Records where each parameter's .grad lives when its on_before_optimizer_step runs."""

    def __init__(self) -> None:
        self.pointers: list[dict[str, int]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.pointers.append({n: p.grad.data_ptr() for n, p in pl_module.named_parameters()})


class SharedStorage(SharedGradientObserver):
    """Records where the shared gradients the observers see live."""

    def __init__(self) -> None:
        self.pointers: list[dict[str, int]] = []

    def observe(self, gradients, call) -> None:
        self.pointers.append({n: g.data_ptr() for n, g in gradients.items()})


@pytest.mark.parametrize("second", [None, "shift"], ids=["one-defense", "shift-then-prune"])
def test_the_local_path_defends_grad_in_place(second):
    L.seed_everything(0)
    model = TinyClassifier()
    raw = raw_gradient(model, next(iter(loader())))
    before, after, tap, seen = GradStorage(), GradStorage(), GradientTap(rounds=[0]), SharedStorage()
    defenses = [MagnitudePruning(rate=0.5, error_feedback=True)]
    expected = MagnitudePruningTransform(0.5, error_feedback=True)(AddConstant(1.0)(raw) if second else raw)
    if second:
        defenses.insert(0, GradientDefense(AddConstant(1.0)))
    quiet_trainer(max_steps=1, callbacks=[before, *defenses, after, tap, seen]).fit(model, loader())
    # the last defense wrote the shared gradient into the .grad tensors autograd made: what the
    # observers see is .grad itself, not a fresh tensor copied into it afterwards
    assert before.pointers == after.pointers == seen.pointers
    for name in raw:
        torch.testing.assert_close(tap.latest().gradients[name], expected[name])


def test_more_than_one_optimizer_is_refused():
    model = TinyClassifier(two_optimizers=True)
    with pytest.raises(ValueError, match="exactly one optimizer"):
        quiet_trainer(max_steps=1, callbacks=[MagnitudePruning(rate=0.5)]).fit(model, loader())


def test_nan_gradient_stops_training_with_a_clear_error():
    class NaNLoss(TinyClassifier):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * torch.tensor(float("nan"))

    from lightning_gp.defenses import NonFiniteGradientError

    with pytest.raises(NonFiniteGradientError, match="NaN or inf"):
        quiet_trainer(max_steps=1, callbacks=[MagnitudePruning(rate=0.5)]).fit(NaNLoss(), loader())


def test_tap_rejects_bad_arguments_and_reports_empty_recordings():
    with pytest.raises(ValueError, match="clients"):
        GradientTap(clients=-1)
    with pytest.raises(ValueError, match="clients must name at least one"):
        GradientTap(clients=[])
    with pytest.raises(ValueError, match="rounds"):
        GradientTap(rounds=[-2])
    with pytest.raises(LookupError, match="recorded nothing"):
        GradientTap().latest()


def test_tapped_gradient_round_trips_through_a_file(tmp_path):
    L.seed_everything(0)
    tap = GradientTap(rounds=[0], dirpath=str(tmp_path))
    quiet_trainer(max_steps=1, callbacks=[MagnitudePruning(rate=0.5), tap]).fit(TinyClassifier(), loader())
    from lightning_gp.records import TappedGradient

    loaded = TappedGradient.load(tmp_path / "round0_client0.pt")
    assert loaded.model_class.endswith("TinyClassifier")
    for name, grad in tap.latest().gradients.items():
        assert torch.equal(loaded.gradients[name], grad)
    assert torch.equal(loaded.inputs, tap.latest().inputs)
    with pytest.raises(FileNotFoundError, match="no tapped gradient"):
        TappedGradient.load(tmp_path / "missing.pt")


@pytest.mark.parametrize("stages", [[], [GradientDefense(AddConstant(1.0))]], ids=["no-defense", "one-defense"])
def test_the_pipeline_writes_what_it_shares_into_out(stages):
    g = {"w": torch.ones(3)}
    out = {"w": torch.zeros(3)}
    shared = SharedGradientPipeline(stages, []).defend(g, StageCall(0, 0, nn.Linear(1, 1)), out=out)
    assert shared["w"] is out["w"]
    assert torch.equal(out["w"], torch.full((3,), 2.0 if stages else 1.0))
