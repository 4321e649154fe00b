"""Places that used to do the wrong thing without a word, now loud or correct.

Each test names the old behaviour it guards against. The DDP cases (a NaN on one rank; error
feedback for parameters DDP leaves without a gradient) are in tests/test_ddp.py, the metric pixel
ranges in tests/test_metrics.py, the 0-image idx file in tests/test_array_data.py.
"""

from __future__ import annotations

import pickle

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer, small_cnn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp import callbacks, defenses
from lightning_gp.attacks import ServerView
from lightning_gp.attacks.gradient_matching import parameter_gradients
from lightning_gp.federated import FederatedSimulation
from lightning_gp.records import TappedGradient

CE = nn.functional.cross_entropy


class Classifier(L.LightningModule):
    """A plain module; ``loss_fn`` is the attribute the optimal defenses take the loss from."""

    def __init__(self, loss_fn=None, freeze_head_in_optimizer: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 3))
        if loss_fn is not None:
            self.loss_fn = loss_fn
        self.freeze_head_in_optimizer = freeze_head_in_optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return (getattr(self, "loss_fn", None) or CE)(self(batch[0]), batch[1])

    def configure_optimizers(self):
        params = self.net[1].parameters() if self.freeze_head_in_optimizer else self.parameters()
        return torch.optim.SGD(params, lr=0.1)


def loader(seed: int = 0, n: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 3, 4, generator=g), torch.randint(0, 3, (n,), generator=g)), 4)


# ------------------------------------------------------------------ optimal defenses never guess the loss
def test_optimal_defense_without_any_loss_is_refused_instead_of_assuming_cross_entropy():
    # Before: a module without `loss_fn` silently got cross-entropy, whatever it trained with.
    noise = callbacks.OptimalGradientNoise(scale=0.01, probes=2, seed=0)
    with pytest.raises(ValueError, match=r"needs the client's loss.*Classifier has no callable `loss_fn`"):
        quiet_trainer(max_steps=1, callbacks=[noise]).fit(Classifier(), loader())


def test_optimal_defense_estimates_with_the_modules_own_loss():
    def squared_error(logits, targets):  # not cross-entropy: the estimate must follow it
        return ((logits.softmax(-1) - nn.functional.one_hot(targets, 3).float()) ** 2).sum(-1).mean()

    L.seed_everything(0)
    model = Classifier(loss_fn=squared_error)
    x, y = next(iter(loader()))
    pruning = callbacks.OptimalGradientPruning(rate=0.5, probes=3, seed=4)
    own = callbacks.OptimalGradientPruning(rate=0.5, probes=3, seed=4, loss_fn=squared_error)
    cross_entropy = callbacks.OptimalGradientPruning(rate=0.5, probes=3, seed=4, loss_fn=CE)
    expected = own.estimate(model, x, y, seed_words=(0, 0, 0))
    wrong = cross_entropy.estimate(model, x, y, seed_words=(0, 0, 0))
    assert any(not torch.allclose(expected[n], wrong[n]) for n in expected)  # the two losses differ
    tap = callbacks.GradientTap(rounds=[0])
    quiet_trainer(max_steps=1, callbacks=[pruning, tap]).fit(model, loader())
    raw_model = Classifier(loss_fn=squared_error)
    raw_model.load_state_dict(tap.latest().model_state)
    raw = parameter_gradients(raw_model, squared_error, x, y, create_graph=False)
    shared = defenses.OptimalGradientPruning(0.5)(raw, 0, sensitivity=expected)
    for name, g in shared.items():
        torch.testing.assert_close(tap.latest().gradients[name], g)


# ------------------------------------------------------------------ resume without the defense callbacks
def test_resuming_a_simulation_without_its_defense_callbacks_is_refused(tmp_path):
    # Before: Lightning dropped the saved residuals and random streams of every client silently.
    L.seed_everything(0)

    def simulation():
        return FederatedSimulation(
            small_cnn(), datamodule=RandomImages(), num_clients=4, clients_per_round=2, local_batch_size=4, seed=1
        )

    trainer = quiet_trainer(max_steps=2, callbacks=[callbacks.TopKPruning(rate=0.8, seed=3)])
    trainer.fit(simulation())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match=r"per-client defense state .*TopKPruning.*no such defense callback"):
        quiet_trainer(max_steps=4).fit(simulation(), ckpt_path=tmp_path / "c.ckpt")
    # With the callback the run resumes.
    quiet_trainer(max_steps=3, callbacks=[callbacks.TopKPruning(rate=0.8, seed=3)]).fit(
        simulation(), ckpt_path=tmp_path / "c.ckpt"
    )


# ------------------------------------------------------------------ a transform given as a callback
def test_a_defense_transform_given_to_the_trainer_says_which_callback_to_use():
    # Before: Lightning's AttributeError "'MagnitudePruning' object has no attribute 'state_key'".
    with pytest.raises(
        TypeError, match=r"pure gradient transform.*pass lightning_gp\.callbacks\.MagnitudePruning\(\.\.\.\)"
    ):
        L.Trainer(callbacks=[defenses.MagnitudePruning(0.8)], logger=False)
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        defenses.MagnitudePruning(0.8).missing  # other attributes still fail as usual


# ------------------------------------------------------------------ an optimizer stepping part of the model
def test_an_optimizer_that_steps_some_parameters_shares_exactly_those():
    # Before: "holds state for other layers than the gradients of client 0 ... another model?".
    model = Classifier(freeze_head_in_optimizer=True)
    tap = callbacks.GradientTap(rounds=[0, 1])
    quiet_trainer(max_steps=2, callbacks=[callbacks.MagnitudePruning(rate=0.5, error_feedback=True), tap]).fit(
        model, loader()
    )
    assert [r.round for r in tap.records] == [0, 1]
    assert set(tap.latest().gradients) == {"net.1.weight", "net.1.bias"}


# ------------------------------------------------------------------ state in another dtype or device
def test_error_feedback_state_of_another_dtype_still_shares_the_gradients_dtype():
    # Before: residuals restored in float64 turned a float32 upload into float64.
    g = {"w": torch.randn(5, 4), "b": torch.randn(4)}
    first = defenses.TopKPruning(rate=0.75, seed=1)
    first(g, 0)
    state = first.state_dict()
    state["client_states"] = {c: {n: t.double() for n, t in s.items()} for c, s in state["client_states"].items()}
    restored = defenses.TopKPruning(rate=0.75, seed=1)
    restored.load_state_dict(state)
    shared = restored(g, 0)
    assert {n: t.dtype for n, t in shared.items()} == {"w": torch.float32, "b": torch.float32}
    expected = first(g, 0)  # the same step from the float32 state
    for n in g:
        torch.testing.assert_close(shared[n], expected[n])


def all_defenses() -> list[defenses.Defense]:
    return [
        defenses.MagnitudePruning(0.5, error_feedback=True),
        defenses.TopKPruning(rate=0.8),
        defenses.RandomPruning(0.5),
        defenses.DualGradientPruning(),
        defenses.AlignedDualGradientPruning(),
        defenses.GradientQuantization(4),
        defenses.GradientQuantization(4, stochastic_rounding=True),
        defenses.GaussianNoise(0.1, clip=1.0),
        defenses.LaplaceNoise(0.1),
        defenses.OptimalGradientNoise(0.1),
        defenses.OptimalGradientPruning(0.5),
        defenses.OptimalDPSGD(1.0, 0.1),
    ]


@pytest.mark.parametrize("defense", all_defenses(), ids=lambda d: repr(d))
def test_zero_element_layers_pass_through_every_defense(defense):
    # Before: quantization, Top-k, DGP and ADGP crashed in torch on an empty layer.
    g = {"w": torch.randn(4, 3), "empty": torch.zeros(0, 3), "b": torch.randn(3)}
    extra = {}
    if isinstance(defense, defenses.SensitivityDefense):
        extra = {"sensitivity": {n: torch.rand(t.shape) for n, t in g.items()}}
    defense.begin_round(0, [0], {0: g}, defenses.share_in_process)
    shared = defense(g, 0, **extra)
    assert shared["empty"].shape == (0, 3) and shared["w"].shape == (4, 3)
    assert all(torch.isfinite(t).all() for t in shared.values())


def test_dual_pruning_from_send_rate_blames_p_not_k1():
    # Before: p=inf gave "k1 must be in [0, 1], got nan".
    for p in (float("inf"), float("nan"), -0.5):
        with pytest.raises(ValueError, match=r"^p must be a finite number >= 0"):
            defenses.DualGradientPruning.from_send_rate(0.2, p=p)


# ------------------------------------------------------------------ a tap that can never record
def test_a_tap_for_a_client_the_run_does_not_have_fails_at_fit_start():
    # Before: it recorded nothing all run and failed only in latest().
    sim = FederatedSimulation(small_cnn(), datamodule=RandomImages(), num_clients=4, clients_per_round=2)
    with pytest.raises(
        ValueError,
        match=r"GradientTap\(clients=\[99\]\): client\(s\) \[99\] would never be recorded: this run has 4 client",
    ):
        quiet_trainer(max_steps=1, callbacks=[callbacks.GradientTap(clients=99)]).fit(sim)


# ------------------------------------------------------------------ the server's view owns its tensors
def view_of(model: nn.Module, input_shape=(1, 12, 12), num_classes: int = 4, **kwargs) -> ServerView:
    x, y = torch.randn(2, 1, 12, 12), torch.tensor([0, 3])
    grads = parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False)
    return ServerView(model=model, gradients=grads, batch_size=2, input_shape=input_shape, num_classes=num_classes)


def test_server_view_copies_the_gradients_and_labels_it_is_given():
    # Before: the view aliased the caller's tensors, so later in-place changes leaked into it.
    model = small_cnn()
    grads = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    labels = torch.tensor([1, 2])
    view = ServerView(model=model, gradients=grads, batch_size=2, input_shape=(1, 12, 12), num_classes=4, labels=labels)
    for g in grads.values():
        g.mul_(3)
    labels[0] = 0
    assert all(torch.equal(g, torch.ones_like(g)) for g in view.gradients.values())
    assert view.labels.tolist() == [1, 2]


def test_server_view_checks_input_shape_and_num_classes_against_the_model():
    # Before: a wrong input_shape failed deep inside an attack's first forward pass, or not at all.
    model = small_cnn()
    with pytest.raises(ValueError, match=r"input_shape \(3, 32, 32\) does not fit the model"):
        view_of(model, input_shape=(3, 32, 32))
    with pytest.raises(ValueError, match="num_classes is 10, but the model gives 4 outputs"):
        view_of(model, num_classes=10)
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(200, 4)).train()
    before = {n: b.clone() for n, b in bn.named_buffers()}
    view_of(bn)
    assert bn.training and all(torch.equal(before[n], b) for n, b in bn.named_buffers())  # the check left no trace


# ------------------------------------------------------------------ tap files load without unpickling code
class _Payload:
    def __reduce__(self):
        return (exec, ("import builtins; builtins.LIGHTNING_GP_PWNED = True",))


def test_a_tap_file_with_pickled_code_is_refused_without_running_it(tmp_path):
    # Before: TappedGradient.load used torch.load(weights_only=False) and ran whatever the file held.
    import builtins

    path = tmp_path / "evil.pt"
    with open(path, "wb") as handle:
        pickle.dump({"format": "lightning_gp.TappedGradient/1", "round": _Payload()}, handle)
    with pytest.raises(ValueError, match="not a tapped gradient this version can load safely"):
        TappedGradient.load(path)
    assert not hasattr(builtins, "LIGHTNING_GP_PWNED")


def test_a_tap_file_round_trips_exactly(tmp_path):
    record = TappedGradient(
        round=3,
        client_id=1,
        gradients={"w": torch.randn(2, 3)},
        model_state={"w": torch.randn(2, 3), "running_mean": torch.zeros(3)},
        model_class="torch.nn.Linear",
        batch=(torch.rand(2, 1, 4, 4), torch.tensor([0, 1])),
        meta={"path": "simulation", "local_lr": 0.1, "nested": {"steps": [1, 2]}},
    )
    loaded = TappedGradient.load(record.save(tmp_path / "r.pt"))
    assert (loaded.round, loaded.client_id, loaded.model_class) == (3, 1, "torch.nn.Linear")
    assert torch.equal(loaded.gradients["w"], record.gradients["w"])
    assert torch.equal(loaded.model_state["running_mean"], record.model_state["running_mean"])
    assert isinstance(loaded.batch, tuple) and all(torch.equal(a, b) for a, b in zip(loaded.batch, record.batch))
    assert loaded.meta == {"path": "simulation", "local_lr": 0.1, "nested": {"steps": [1, 2]}}
    with pytest.raises(TypeError, match="meta holds a value of type object"):
        TappedGradient(0, 0, {}, {}, "m", meta={"x": object()}).save(tmp_path / "bad.pt")


# ------------------------------------------------------------------ schedulers inside the simulation
class PlateauClassifier(L.LightningModule):
    def __init__(self, monitor: str) -> None:
        super().__init__()
        self.net, self.monitor = small_cnn(), monitor

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": self.monitor}}


def test_a_plateau_scheduler_in_the_simulation_steps_on_its_monitored_metric():
    # Before: the simulation called ReduceLROnPlateau.step() without the metric (a TypeError in torch).
    sim = FederatedSimulation(
        PlateauClassifier("train_loss"),
        datamodule=RandomImages(),
        num_clients=4,
        clients_per_round=2,
        rounds_per_epoch=2,
    )
    trainer = quiet_trainer(max_epochs=3, limit_val_batches=0)
    trainer.fit(sim)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3  # stepped once per epoch, with the metric
    missing = FederatedSimulation(
        PlateauClassifier("accuracy"), datamodule=RandomImages(), num_clients=4, clients_per_round=2, rounds_per_epoch=2
    )
    with pytest.raises(ValueError, match="ReduceLROnPlateau monitors 'accuracy', which was not logged"):
        quiet_trainer(max_epochs=1, limit_val_batches=0).fit(missing)
