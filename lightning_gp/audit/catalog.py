"""The defense catalogue: every packaged defense at its default setting.

The matrix benchmark (``benchmarks/matrix.py``), the demo and the baselines benchmark take their
rows from here, so a defense added with :func:`register_defense` (a baseline, a user's own) shows
up in all of them. Each entry builds a :class:`DefenseSetting`: the callbacks a client runs, or the
module that wraps the model (Refiner, PriPrune), the federated algorithm, and who runs the client
step (the in-process simulation, or a plain ``Trainer`` for DP-SGD through Opacus, which runs its
own client step). The setting knows the defense object whose adaptive attacks
(:mod:`lightning_gp.attacks.registry`) the audit adds to the published ones.

:func:`~lightning_gp.audit.rounds.tap_defended_round` runs one round of a setting on chosen
training images; :func:`~lightning_gp.audit.training.train_setting` trains it to measure its cost.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_gp.attacks import GradientAttack, adaptive_attacks_of
from lightning_gp.callbacks import (
    DPSGD,
    AlignedDualGradientPruning,
    DualGradientPruning,
    GaussianNoise,
    GradDefense,
    GradientQuantization,
    LaplaceNoise,
    LocalGaussianMechanism,
    MagnitudePruning,
    OptimalDPSGD,
    OptimalGradientNoise,
    OptimalGradientPruning,
    Outpost,
    RandomPruning,
    Soteria,
    TopKPruning,
)
from lightning_gp.records import TappedGradient
from lightning_gp.validation import check_positive_int

Algorithm = Literal["fedsgd", "fedavg"]
Runner = Literal["simulation", "trainer"]


@dataclass
class DefenseSetting:
    """One defense at one setting, ready to run.

    Attributes:
        name: the row label, e.g. ``"TopKPruning(rate=0.8)"``.
        callbacks: the defense callbacks of every client (fresh objects: they hold client state).
        wrap: wraps the user's model in the module that defends it (Refiner, PriPrune).
        algorithm: ``"fedsgd"`` (clients share one gradient) or ``"fedavg"`` (local SGD at ``local_lr``,
            the client shares ``w_global - w_local``; PriPrune shares weights).
        local_epochs, local_batch_size: under FedAvg, each audited client trains ``local_epochs``
            epochs over the images it holds (``indices[c]``, ``n`` of them) in local batches of
            ``local_batch_size`` (``None``: all ``n`` in one batch), each epoch in a fresh seeded order:
            ``local_epochs * n / local_batch_size`` local steps (McMahan et al.'s FedAvg; the setting of
            Dimitrov et al., TMLR 2022). The defaults are one step on the whole batch.
        batchnorm: the mode of the model's BatchNorm layers in the clients' passes, ``"train"`` (batch
            statistics, as a client trains by default) or ``"eval"`` (frozen running statistics); the
            attackers' model runs in the same mode (Valadi et al. 2025: the mode changes what leaks).
        runner: ``"simulation"`` (:class:`~lightning_gp.federated.FederatedSimulation`) or
            ``"trainer"`` (a plain ``Trainer`` per client, for a callback that runs its own client
            step, i.e. DP-SGD).
        local_lr: the clients' local learning rate under FedAvg (and of the plain Trainer's tapped step).
        server_optimizer, server_lr: how the server applies the aggregate in training runs.
        declared: the object whose adaptive attacks apply, instead of every defense of the setting
            (see :meth:`defenses`); ``None``: all of them, composed in the order the client applies them.
        trained_inputs: for a defense that transforms the client's batch before training (ATS),
            ``trained_inputs(record, datamodule)`` rebuilds the (normalised) images the client really
            trained on; the audit then also scores every reconstruction against them (ATS-T next to
            the raw image's ATS-R, which stays the privacy verdict).
        architecture: changes the model itself (PRECODE's bottleneck): the server sends, the
            clients train and the attacks see the changed model, its own parameters included.
        model_checks: the clients replay the public record and refuse any other model
            (:class:`~lightning_gp.federated.ModelProvenance`): an active attack whose model is not the
            honest one (Robbing the Fed's and LOKI's imprints) is refused, an ``n/a`` cell that names the
            check, and the active views then rest on the passive attacks and the active ones that pass it.
    """

    name: str
    callbacks: list[Callback] = field(default_factory=list)
    wrap: Callable[[nn.Module], nn.Module] | None = None
    algorithm: Algorithm = "fedsgd"
    runner: Runner = "simulation"
    local_lr: float = 0.1
    local_epochs: int = 1
    local_batch_size: int | None = None
    batchnorm: Literal["train", "eval"] = "train"
    server_optimizer: Literal["sgd", "adam"] = "adam"
    server_lr: float = 1e-3
    declared: Any = None
    trained_inputs: Callable[[TappedGradient, Any], Tensor] | None = None
    architecture: Callable[[nn.Module], nn.Module] | None = None
    model_checks: bool = False

    def __post_init__(self) -> None:
        if self.runner not in ("simulation", "trainer"):
            raise ValueError(f"{self.name}: runner must be 'simulation' or 'trainer', got {self.runner!r}")
        if self.algorithm not in ("fedsgd", "fedavg"):
            raise ValueError(f"{self.name}: algorithm must be 'fedsgd' or 'fedavg', got {self.algorithm!r}")
        if self.server_optimizer not in ("sgd", "adam"):
            raise ValueError(f"{self.name}: server_optimizer must be 'sgd' or 'adam', got {self.server_optimizer!r}")
        # the plain-Trainer runner trains the bare model one FedSGD step per batch: it can neither wrap
        # the model nor run FedAvg, so such a setting is refused here, once, for tapping and training alike
        if self.runner == "trainer" and self.wrap is not None:
            raise ValueError(f"{self.name}: a wrapping defense runs in the simulation, not in a plain Trainer (runner)")
        if self.runner == "trainer" and self.algorithm != "fedsgd":
            raise ValueError(f"{self.name}: the plain-Trainer runner shares one gradient per step (algorithm='fedsgd')")
        check_positive_int(self.local_epochs, "local_epochs")
        if self.local_batch_size is not None:
            check_positive_int(self.local_batch_size, "local_batch_size")
        if self.batchnorm not in ("train", "eval"):
            raise ValueError(f"{self.name}: batchnorm must be 'train' or 'eval', got {self.batchnorm!r}")
        if self.runner == "trainer" and self.batchnorm != "train":
            raise ValueError(
                f"{self.name}: batchnorm='eval' needs the simulation runner (a plain Trainer trains in train mode)"
            )
        if self.algorithm == "fedsgd" and (self.local_epochs != 1 or self.local_batch_size is not None):
            raise ValueError(
                f"{self.name}: local_epochs and local_batch_size describe FedAvg's local training; they need "
                "algorithm='fedavg' (a FedSGD client shares one gradient of its batch)"
            )

    def with_client_training(
        self,
        algorithm: Algorithm | None = None,
        local_epochs: int | None = None,
        local_batch_size: int | None = None,
        batchnorm: Literal["train", "eval"] | None = None,
    ) -> DefenseSetting:
        """This setting with the clients' algorithm, local training and BatchNorm mode replaced where
        given, its name saying how it departs from one FedSGD step in train mode (a setting of the
        plain-Trainer runner, DP-SGD's, refuses FedAvg and eval mode with an error naming it)."""
        given = {"algorithm": algorithm, "local_epochs": local_epochs, "local_batch_size": local_batch_size}
        changes: dict[str, Any] = {k: v for k, v in {**given, "batchnorm": batchnorm}.items() if v is not None}
        if not changes:
            return self
        changed = dataclasses.replace(self, **changes)
        notes = []
        if changed.local_training:
            notes.append(f"FedAvg E={changed.local_epochs}, b={changed.local_batch_size or 'all'}")
        if changed.batchnorm == "eval":
            notes.append("BatchNorm eval")
        return dataclasses.replace(changed, name=f"{self.name} [{', '.join(notes)}]") if notes else changed

    def with_model_checks(self) -> DefenseSetting:
        """This setting with clients that refuse any model the public record does not explain
        (:attr:`model_checks`), its name saying so."""
        if self.model_checks:
            return self
        return dataclasses.replace(self, model_checks=True, name=f"{self.name} +model checks")

    @property
    def local_training(self) -> bool:
        """Whether a client trains several local steps (FedAvg with epochs or local batches)."""
        return self.algorithm == "fedavg" and (self.local_epochs > 1 or self.local_batch_size is not None)

    @property
    def undefended(self) -> bool:
        return not self.callbacks and self.wrap is None and self.architecture is None

    def server_model(self, model: nn.Module) -> nn.Module:
        """The model the server sends: ``model`` itself, or a changed copy (``architecture``)."""
        return model if self.architecture is None else self.architecture(copy.deepcopy(model))

    def defenses(self, model: nn.Module | None = None, datamodule: Any = None) -> list[Any]:
        """The defense objects of a client, in the order it applies them: the changed architecture
        (PRECODE), the wrapping module (Refiner, PriPrune), then each callback; or ``[declared]``.

        A wrapping or architecture-changing defense is built around a copy of ``model`` to ask it. A
        defense that takes public data from the datamodule (GradDefense's root set) takes it from
        ``datamodule``: the server holds the same public data.
        """
        if self.declared is not None:
            found = [self.declared]
        else:
            found = []
            if self.architecture is not None:
                if model is None:
                    raise ValueError(f"{self.name} changes the model: pass the model to find its adaptive attacks")
                found.append(self.server_model(model))
            if self.wrap is not None:
                if model is None:
                    raise ValueError(f"{self.name} wraps the model: pass the model to find its adaptive attacks")
                found.append(self.wrap(copy.deepcopy(model)))
            found += self.callbacks
        for defense in found:
            resolve = getattr(defense, "resolve_root_set", None)
            if datamodule is not None and callable(resolve):
                resolve(datamodule)
        return found

    def adaptive_attacks(
        self, model: nn.Module | None = None, datamodule: Any = None, **budget: Any
    ) -> list[GradientAttack]:
        """The adaptive attacks of the setting (none when undefended): one attacker that models every
        defense of :meth:`defenses` together (:func:`~lightning_gp.attacks.adaptive_attacks_of`), so a
        composition is attacked as a whole, not as its first member."""
        found = self.defenses(model, datamodule)
        return adaptive_attacks_of(found, **budget) if found else []


@dataclass(frozen=True)
class CatalogEntry:
    """A defense of the catalogue: ``build(seed, in_channels)`` gives its default setting."""

    name: str
    family: str
    paper: str
    build: Callable[[int, int], DefenseSetting]


_CATALOG: dict[str, CatalogEntry] = {}


def register_defense(entry: CatalogEntry, *, replace: bool = False) -> None:
    """Add ``entry`` to the catalogue (the matrix, the demo and the baselines pick it up)."""
    if not isinstance(entry, CatalogEntry):
        raise TypeError(f"entry must be a CatalogEntry, got {type(entry).__name__}")
    if entry.name in _CATALOG and not replace:
        raise ValueError(f"the catalogue already has a defense named {entry.name!r}; pass replace=True to swap it")
    _CATALOG[entry.name] = entry


def defense_catalog(names: Sequence[str] | None = None) -> list[CatalogEntry]:
    """The catalogue's entries in registration order, or the ones named (unknown names are an error)."""
    if names is None:
        return list(_CATALOG.values())
    unknown = [n for n in names if n not in _CATALOG]
    if unknown:
        raise ValueError(f"unknown defense(s) {unknown}; the catalogue has {list(_CATALOG)}")
    return [_CATALOG[n] for n in names]


# ------------------------------------------------------------------------------------- defaults
def _callbacks(
    name: str, build: Callable[[int], list[Callback]], **kwargs: Any
) -> Callable[[int, int], DefenseSetting]:
    return lambda seed, channels: DefenseSetting(name, build(seed), **kwargs)


def _refiner(seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.refiner import RefinerModule, load_evaluator

    evaluator = load_evaluator(channels)
    return DefenseSetting(
        "Refiner(alpha=0.5, eps=0.1)",
        wrap=lambda model: RefinerModule(model, loss_fn=nn.CrossEntropyLoss(), evaluator=evaluator, seed=seed),
    )


def _ats(seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.augmentation import ATSModule

    def wrap(model: nn.Module) -> ATSModule:
        return ATSModule(model, policy="hybrid", loss_fn=nn.CrossEntropyLoss(), seed=seed)

    def trained_inputs(record: TappedGradient, datamodule: Any) -> Tensor:
        # the same policy and seed as the clients: the draw depends only on (seed, client, round)
        return wrap(nn.Identity()).transformed_inputs(record, mean=datamodule.mean, std=datamodule.std)

    # "3-1-7", the paper's lead policy, shifts every image by 13 of 28 columns: on LeNetZhu (a linear
    # head on the spatial map) accuracy collapses to 0.13 after 300 rounds (0.75 undefended), so the
    # row uses the hybrid of the two published policies (0.60)
    return DefenseSetting("ATS(hybrid)", wrap=wrap, trained_inputs=trained_inputs)


def _precode(seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.models import PRECODE

    return DefenseSetting("PRECODE(K=256, beta=1e-3)", architecture=lambda model: PRECODE(model, seed=seed))


def _priprune(seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.priprune import PriPruneModule

    return DefenseSetting(
        "PriPrune(magnitude 0.3)",
        wrap=lambda model: PriPruneModule(model, base_scheme="magnitude", base_rate=0.3, seed=seed),
        algorithm="fedavg",
        local_lr=0.25,
        server_optimizer="sgd",
        server_lr=1.0,  # FedAvg of weights: the aggregate update applied as is
    )


for _entry in (
    CatalogEntry("undefended", "none", "", lambda seed, channels: DefenseSetting("undefended")),
    CatalogEntry(
        "TopKPruning",
        "pruning",
        "DGC-style Top-k",
        _callbacks("TopKPruning(rate=0.8)", lambda s: [TopKPruning(rate=0.8, seed=s)]),
    ),
    CatalogEntry(
        "MagnitudePruning",
        "pruning",
        "DLG Sec. 5",
        _callbacks("MagnitudePruning(rate=0.8)", lambda s: [MagnitudePruning(rate=0.8, seed=s)]),
    ),
    CatalogEntry(
        "RandomPruning",
        "pruning",
        "",
        _callbacks("RandomPruning(rate=0.8)", lambda s: [RandomPruning(rate=0.8, seed=s)]),
    ),
    CatalogEntry(
        "DualGradientPruning",
        "pruning",
        "DGP",
        _callbacks("DualGradientPruning(default)", lambda s: [DualGradientPruning(seed=s)]),
    ),
    CatalogEntry(
        "AlignedDualGradientPruning",
        "pruning",
        "ADGP",
        _callbacks("AlignedDualGradientPruning(default)", lambda s: [AlignedDualGradientPruning(seed=s)]),
    ),
    CatalogEntry(
        "OptimalGradientPruning",
        "optimal",
        "optimal defenses, Eq. 14",
        _callbacks("OptimalGradientPruning(default)", lambda s: [OptimalGradientPruning(seed=s)]),
    ),
    CatalogEntry(
        "OptimalGradientNoise",
        "optimal",
        "optimal defenses, Eq. 8",
        _callbacks("OptimalGradientNoise(default)", lambda s: [OptimalGradientNoise(seed=s)]),
    ),
    CatalogEntry(
        "OptimalDPSGD",
        "optimal",
        "optimal defenses, Eq. 13",
        _callbacks("OptimalDPSGD(default)", lambda s: [OptimalDPSGD(seed=s)]),
    ),
    CatalogEntry(
        "GaussianNoise",
        "noise",
        "DLG Sec. 5",
        _callbacks("GaussianNoise(scale=0.01)", lambda s: [GaussianNoise(seed=s)]),
    ),
    CatalogEntry(
        "LaplaceNoise", "noise", "DLG Sec. 5", _callbacks("LaplaceNoise(scale=0.01)", lambda s: [LaplaceNoise(seed=s)])
    ),
    CatalogEntry(
        "LocalGaussianMechanism",
        "dp",
        "McMahan et al. 2018 (clip), local",
        _callbacks(
            "LocalGaussianMechanism(z=0.5, C=1)",
            lambda s: [LocalGaussianMechanism(noise_multiplier=0.5, max_update_norm=1.0, seed=s)],
        ),
    ),
    CatalogEntry(
        "GradientQuantization",
        "compression",
        "",
        _callbacks("GradientQuantization(bits=8)", lambda s: [GradientQuantization(seed=s)]),
    ),
    CatalogEntry(
        "DPSGD",
        "dp",
        "Abadi et al. 2016 (Opacus)",
        _callbacks(
            "DPSGD(sigma=1, C=1)",
            # RDP: one client batch is the whole sampled set (q = 1), where the PRV accountant fails
            lambda s: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, accountant="rdp")],
            runner="trainer",
        ),
    ),
    CatalogEntry(
        "Soteria",
        "baseline",
        "Sun et al. CVPR 2021",
        _callbacks("Soteria(rate=0.8)", lambda s: [Soteria(rate=0.8, seed=s)]),
    ),
    CatalogEntry(
        "GradDefense",
        "baseline",
        "Wang et al. INFOCOM 2022",
        # the root set: 5 public images per class of the validation split, never an attacked training image
        _callbacks("GradDefense(S=10, p=5, sigma=0.01, Q=6)", lambda s: [GradDefense(root_data="val", seed=s)]),
    ),
    CatalogEntry(
        "Outpost",
        "baseline",
        "Wang et al. INFOCOM 2023",
        _callbacks("Outpost(beta=0.1, phi=40, rho=80, lambda=0.8)", lambda s: [Outpost(seed=s)]),
    ),
    CatalogEntry("PRECODE", "baseline", "Scheliga et al. WACV 2022", _precode),
    CatalogEntry("ATS", "baseline", "Gao et al. CVPR 2021", _ats),
    CatalogEntry("Refiner", "robust data", "Refiner", _refiner),
    CatalogEntry("PriPrune", "pruning", "PriPrune", _priprune),
):
    register_defense(_entry)
