"""The privacy-utility frontier's configuration: defense families, their strength grids (data, not
code), the axes (client batch size, model stage), and the checks that refuse a bad config before any
work starts.

A **family** (:class:`Family`, :func:`register_family`) turns a dict of keyword arguments into a
:class:`~lightning_gp.audit.catalog.DefenseSetting`: the named defense callbacks of
:mod:`lightning_gp.callbacks` each make one (``TopKPruning``, ``GaussianNoise``, ``Outpost``, ...);
DP-SGD (Opacus, the plain-Trainer runner), Refiner, PriPrune, ATS and PRECODE wrap or change the
model and have their own builders. A **grid** (:class:`Grid`) sweeps one keyword (``knob``) of one
family over ``values``, other keywords fixed in ``params``, optionally after fixed defenses
(``before``: a composition such as pruning followed by noise). The **axes** are the client batch
sizes and the model stages (rounds of training before the tapped round); the threat models come
from the audit's verdicts (passive and active).

:func:`check_frontier_config` builds every point's setting once, so a strength outside a defense's
range fails here with the defense's own message and the config field that holds it
(``grids[2].values[4]``), as do an unknown family, an empty grid and a batch size the data cannot
fill.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from torch import nn

from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.setting_audit import AttackBudget, published_attacks
from lightning_gp.validation import check_bool, check_int, check_positive_int

Builder = Callable[[dict[str, Any], int, int], DefenseSetting]


@dataclass(frozen=True)
class Family:
    """A defense family: ``build(params, seed, channels)`` gives its setting at ``params``.

    Attributes:
        name: the config's ``family`` value.
        build: the builder; ``params`` are the defense's keyword arguments.
        paper: where the defense comes from (for the report).
    """

    name: str
    build: Builder
    paper: str = ""


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family, *, replace: bool = False) -> None:
    """Make ``family`` available to frontier grids by its name (a user's own defense included)."""
    if not isinstance(family, Family):
        raise TypeError(f"family must be a Family, got {type(family).__name__}")
    if family.name in _FAMILIES and not replace:
        raise ValueError(f"a frontier family named {family.name!r} exists; pass replace=True to swap it")
    _FAMILIES[family.name] = family


def frontier_families() -> dict[str, Family]:
    """The registered families by name."""
    return dict(_FAMILIES)


def _callback_family(name: str, paper: str, **defaults: Any) -> Family:
    """A family of one named defense callback of :mod:`lightning_gp.callbacks` (``seed`` added)."""

    def build(params: dict[str, Any], seed: int, channels: int) -> DefenseSetting:
        cls = getattr(importlib.import_module("lightning_gp.callbacks"), name)
        kwargs = {**defaults, **params}
        if "seed" in inspect.signature(cls.__init__).parameters:
            kwargs.setdefault("seed", seed)
        return DefenseSetting(setting_name(name, params), [cls(**kwargs)])

    return Family(name, build, paper)


def _dpsgd(params: dict[str, Any], seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.callbacks import DPSGD

    # the catalogue's DP-SGD: one client batch is the whole sampled set (q = 1), accounted by RDP
    kwargs = {"max_grad_norm": 1.0, "poisson_sampling": False, "accountant": "rdp", **params}
    return DefenseSetting(setting_name("DPSGD", params), [DPSGD(**kwargs)], runner="trainer")


def _refiner(params: dict[str, Any], seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.refiner import RefinerModule, load_evaluator

    evaluator = load_evaluator(channels)
    RefinerModule(nn.Linear(1, 1), loss_fn=nn.CrossEntropyLoss(), evaluator=evaluator, **params)  # checks params
    return DefenseSetting(
        setting_name("Refiner", params),
        wrap=lambda model: RefinerModule(
            model, loss_fn=nn.CrossEntropyLoss(), evaluator=evaluator, seed=seed, **params
        ),
    )


def _priprune(params: dict[str, Any], seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.priprune import PriPruneModule

    kwargs = {"base_scheme": "magnitude", "base_rate": 0.3, **params}
    PriPruneModule(nn.Linear(1, 1), seed=seed, **kwargs)  # checks params
    return DefenseSetting(
        setting_name("PriPrune", params),
        wrap=lambda model: PriPruneModule(model, seed=seed, **kwargs),
        algorithm="fedavg",
        local_lr=0.25,
        server_optimizer="sgd",
        server_lr=1.0,  # FedAvg of weights, as the catalogue's PriPrune
    )


def _ats(params: dict[str, Any], seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.augmentation import ATSModule

    kwargs = {"policy": "hybrid", **params}

    def wrap(model: nn.Module) -> ATSModule:
        return ATSModule(model, loss_fn=nn.CrossEntropyLoss(), seed=seed, **kwargs)

    def trained_inputs(record: Any, datamodule: Any) -> Any:
        return wrap(nn.Identity()).transformed_inputs(record, mean=datamodule.mean, std=datamodule.std)

    wrap(nn.Linear(1, 1))  # checks params
    return DefenseSetting(setting_name("ATS", params), wrap=wrap, trained_inputs=trained_inputs)


def _precode(params: dict[str, Any], seed: int, channels: int) -> DefenseSetting:
    from lightning_gp.models import PRECODE

    known = set(inspect.signature(PRECODE.__init__).parameters) - {"self", "model", "seed"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"PRECODE has no argument(s) {unknown}; it takes {sorted(known)}")
    return DefenseSetting(
        setting_name("PRECODE", params), architecture=lambda model: PRECODE(model, seed=seed, **params)
    )


def setting_name(family: str, params: dict[str, Any]) -> str:
    """``"TopKPruning(rate=0.9)"``: the family and its keywords, in the order given."""
    return f"{family}({', '.join(f'{k}={_short(v)}' for k, v in params.items())})"


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


for _family in (
    _callback_family("TopKPruning", "DGC-style Top-k"),
    _callback_family("MagnitudePruning", "DLG Sec. 5"),
    _callback_family("RandomPruning", ""),
    _callback_family("DualGradientPruning", "DGP"),
    _callback_family("AlignedDualGradientPruning", "ADGP"),
    _callback_family("OptimalGradientPruning", "optimal defenses, Eq. 14"),
    _callback_family("OptimalGradientNoise", "optimal defenses, Eq. 8"),
    _callback_family("OptimalDPSGD", "optimal defenses, Eq. 13"),
    _callback_family("GaussianNoise", "DLG Sec. 5"),
    _callback_family("LaplaceNoise", "DLG Sec. 5"),
    _callback_family("LocalGaussianMechanism", "McMahan et al. 2018 (clip), local"),
    _callback_family("DistributedGaussianMechanism", "Kairouz et al. 2021 (distributed DP), continuous"),
    _callback_family("GradientQuantization", ""),
    _callback_family("Soteria", "Sun et al. CVPR 2021"),
    # the root set: public images of the validation split, never an attacked training image
    _callback_family("GradDefense", "Wang et al. INFOCOM 2022", root_data="val"),
    _callback_family("Outpost", "Wang et al. INFOCOM 2023"),
    Family("DPSGD", _dpsgd, "Abadi et al. 2016 (Opacus)"),
    Family("Refiner", _refiner, "Refiner"),
    Family("PriPrune", _priprune, "PriPrune"),
    Family("ATS", _ats, "Gao et al. CVPR 2021"),
    Family("PRECODE", _precode, "Scheliga et al. WACV 2022"),
):
    register_family(_family)


@dataclass(frozen=True)
class Fixed:
    """A defense at fixed keywords, applied before a grid's swept defense (a composition)."""

    family: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Grid:
    """One family swept over one strength knob.

    Attributes:
        family: a registered family (:func:`frontier_families`).
        knob: the keyword swept, e.g. ``"rate"``, ``"scale"``, ``"noise_multiplier"``, ``"bits"``.
        values: the strengths, from "no effect" to "destroys utility" (at least one).
        params: the family's other keywords, fixed (e.g. ``{"clip": 1.0}``).
        before: fixed defenses the client applies first, in order (a composition).
        label: the line's name in the report (default: the families joined by ``+``).
    """

    family: str
    knob: str
    values: list[Any]
    params: dict[str, Any] = field(default_factory=dict)
    before: list[Fixed] = field(default_factory=list)
    label: str | None = None

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return "+".join([*(f.family for f in self.before), self.family])


@dataclass(frozen=True)
class ClientTraining:
    """How each client trains on its images before it shares: the frontier's ``client_training`` axis.

    ``algorithm="fedsgd"`` (the default): one gradient of the client's whole batch. ``"fedavg"``: the
    client trains ``local_epochs`` epochs over its images in local batches of ``local_batch_size``
    (``None``: the whole batch each step) and shares ``w_global - w_local`` (McMahan et al. 2017), which
    the audit attacks with :class:`~lightning_gp.attacks.FedAvgInversion` (Dimitrov et al., TMLR 2022)
    beside the published attacks (:meth:`~lightning_gp.audit.DefenseSetting.with_client_training`). A
    FedAvg client of ``B`` images takes ``local_epochs * B / local_batch_size`` local steps a round.
    """

    algorithm: Literal["fedsgd", "fedavg"] = "fedsgd"
    local_epochs: int = 1
    local_batch_size: int | None = None

    @property
    def label(self) -> str:
        """``"FedSGD"``, or e.g. ``"FedAvg E=5, b=8"`` (as the setting's name says it)."""
        if self.algorithm == "fedsgd":
            return "FedSGD"
        return f"FedAvg E={self.local_epochs}, b={self.local_batch_size or 'all'}"

    def apply(self, setting: DefenseSetting) -> DefenseSetting:
        """``setting`` with this client training (a FedAvg setting's name gains ``[FedAvg E=.., b=..]``)."""
        if self.algorithm == "fedsgd":
            return setting
        return setting.with_client_training("fedavg", self.local_epochs, self.local_batch_size)

    def local_steps(self, batch_size: int) -> int:
        """Local steps a round of a client holding ``batch_size`` images."""
        return self.local_epochs * (batch_size // (self.local_batch_size or batch_size))


@dataclass(frozen=True)
class FrontierConfig:
    """What a frontier run sweeps and how hard it attacks.

    Attributes:
        model: the client model, ``{"class_path": ..., "init_args": {...}}`` (LightningCLI style).
        datamodule: the clients' data, the same form.
        grids: the strength grids (:class:`Grid`).
        batch_sizes: images per client batch (each a separate frontier).
        stages: the audited rounds: ``0`` is the model at initialisation, ``r`` the round after ``r``
            rounds of training under the setting (:func:`~lightning_gp.audit.audit_setting`'s ``round``).
        images: attacked images per point (``ceil(images / B)`` clients of ``B`` images each).
        train_rounds: FedSGD rounds of the training that measures PMM, time and bytes.
        num_clients: clients of the federation (every client takes part in every round).
        attacks: the published attacks (``None``: all of them); a FedAvg point (``client_training``)
            always adds ``FedAvgInversion``, the attack built for its update.
        budget: the attacks' budget (:class:`~lightning_gp.audit.AttackBudget`).
        lpips: score LPIPS (without it no verdict can be "private": the semantic test did not run).
        undefended: add the undefended reference (PMM 1) at every batch size and stage.
        seed: seeds the images drawn, the models' initialisation and every attack.
        threads: torch threads per worker.
        client_training: how the clients train before they share (:class:`ClientTraining`): each entry
            a separate frontier of every setting (default: FedSGD only). A setting that cannot train so
            (DP-SGD's plain-Trainer runner takes one step per round) is left out of that entry's
            frontier, and the report says so (:func:`not_applicable`).
        model_checks: the clients check every model they receive
            (:meth:`~lightning_gp.audit.DefenseSetting.with_model_checks`: the digest of the model in the
            secure sum, its provenance from the public record); an active attack whose model they refuse
            is an ``n/a`` cell. Every point's setting (the undefended reference's too) is named
            ``"... +model checks"``, so its jobs never mix with those of a frontier without the checks.
    """

    model: dict[str, Any]
    datamodule: dict[str, Any]
    grids: list[Grid]
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    stages: list[int] = field(default_factory=lambda: [0, 50])
    images: int = 8
    train_rounds: int = 200
    num_clients: int = 10
    attacks: list[str] | None = None
    budget: AttackBudget = field(default_factory=AttackBudget)
    lpips: bool = True
    undefended: bool = True
    seed: int = 0
    threads: int = 1
    client_training: list[ClientTraining] = field(default_factory=lambda: [ClientTraining()])
    model_checks: bool = False


@dataclass(frozen=True)
class PointSpec:
    """One defense setting of a grid, before the axes (batch size, stage) are applied."""

    grid: str
    family: str
    knob: str
    value: Any
    index: int  # position of the value in its grid (the line's order)

    def setting(self, config: FrontierConfig, channels: int) -> DefenseSetting:
        """The point's setting (the undefended reference when ``family == "undefended"``), with the
        clients' model checks where the config asks for them."""
        if self.family == "undefended":
            setting = DefenseSetting("undefended")
        else:
            grid = next(g for g in config.grids if g.name == self.grid)
            setting = compose_setting(grid, self.value, config.seed, channels)
        return setting.with_model_checks() if config.model_checks else setting

    @property
    def key(self) -> str:
        return f"{self.grid}|{self.knob}={_short(self.value)}"


def compose_setting(grid: Grid, value: Any, seed: int, channels: int) -> DefenseSetting:
    """The setting of ``grid`` at strength ``value``: its fixed defenses, then the swept one."""
    parts = [_FAMILIES[f.family].build(dict(f.params), seed, channels) for f in grid.before]
    parts.append(_FAMILIES[grid.family].build({**grid.params, grid.knob: value}, seed, channels))
    if len(parts) == 1:
        return parts[0]
    return _merge(parts)


def _merge(parts: Sequence[DefenseSetting]) -> DefenseSetting:
    """One setting applying ``parts`` in order: their callbacks concatenated; at most one of them may
    wrap the model, change its architecture or need another runner or algorithm."""
    name = " + ".join(p.name for p in parts)
    for attribute in ("wrap", "architecture", "trained_inputs"):
        if sum(getattr(p, attribute) is not None for p in parts) > 1:
            raise ValueError(f"{name}: at most one defense of a composition may set {attribute}")
    special = [p for p in parts if p.wrap is not None or p.architecture is not None or p.runner != "simulation"]
    base = special[0] if special else parts[-1]
    return DefenseSetting(
        name,
        [cb for p in parts for cb in p.callbacks],
        wrap=base.wrap,
        algorithm=base.algorithm,
        runner=base.runner,
        local_lr=base.local_lr,
        server_optimizer=base.server_optimizer,
        server_lr=base.server_lr,
        trained_inputs=base.trained_inputs,
        architecture=base.architecture,
    )


def grid_points(config: FrontierConfig) -> list[PointSpec]:
    """Every setting of the run: the undefended reference first (with ``config.undefended``), then
    each grid's values in order."""
    points = [PointSpec("undefended", "undefended", "-", "-", 0)] if config.undefended else []
    for grid in config.grids:
        points += [PointSpec(grid.name, grid.family, grid.knob, v, i) for i, v in enumerate(grid.values)]
    return points


def point_settings(config: FrontierConfig, channels: int) -> list[tuple[PointSpec, ClientTraining, DefenseSetting]]:
    """Every setting of the run on every client-training axis entry, in the order of
    :func:`grid_points` within each entry; the pairs :func:`not_applicable` names are left out."""
    return _trained_settings(config, channels)[0]


def not_applicable(config: FrontierConfig, channels: int) -> list[str]:
    """One line per (grid, client training) the frontier leaves out because the setting cannot train so,
    with the reason (a named gap in the report, never a silent skip)."""
    return _trained_settings(config, channels)[1]


def _trained_settings(
    config: FrontierConfig, channels: int
) -> tuple[list[tuple[PointSpec, ClientTraining, DefenseSetting]], list[str]]:
    """Each point's setting under each client training, and a line per (grid, training) refused (an
    error of the setting itself, a strength out of range, propagates: only the training is refused)."""
    kept, lines = [], []
    for training in config.client_training:
        refused: dict[str, str] = {}
        for point in grid_points(config):
            setting = point.setting(config, channels)
            try:
                kept.append((point, training, training.apply(setting)))
            except ValueError as err:
                refused.setdefault(point.grid, str(err))
        lines += [f"{grid} is not on the {training.label} frontier: {why}" for grid, why in refused.items()]
    return kept, lines


def build_spec(spec: Any, field_name: str) -> Any:
    """An object from ``{"class_path": "pkg.Class", "init_args": {...}}`` (LightningCLI style)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise ValueError(f"{field_name} must be {{'class_path': 'package.Class', 'init_args': {{...}}}}, got {spec!r}")
    unknown = sorted(set(spec) - {"class_path", "init_args"})
    if unknown:
        raise ValueError(f"{field_name} has unknown key(s) {unknown}; it takes class_path and init_args")
    module, _, name = spec["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{field_name}.class_path: cannot import {spec['class_path']!r} ({err})") from err
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ValueError(f"{field_name}.init_args must be a mapping, got {init_args!r}")
    return cls(**init_args)


def check_frontier_config(config: FrontierConfig) -> tuple[Any, nn.Module]:
    """Refuse a bad config before any work, naming the field; return the set-up datamodule and a model.

    Checked: every field's type and range; the published attacks' names; every grid (a registered
    family, a knob, at least one value, distinct values, no ``knob`` in ``params``) and every value
    (its setting is built, so the defense's own range check runs: ``grids[i].values[j]``); each batch
    size against the training split (``num_clients`` clients of ``B`` images per round, and the
    attacked images).
    """
    if not isinstance(config, FrontierConfig):
        raise TypeError(f"config must be a FrontierConfig, got {type(config).__name__}")
    for name in ("images", "train_rounds", "num_clients", "threads"):
        check_positive_int(getattr(config, name), name)
    check_int(config.seed, "seed", low=0)
    check_bool(config.lpips, "lpips")
    check_bool(config.undefended, "undefended")
    check_bool(config.model_checks, "model_checks")
    if not isinstance(config.budget, AttackBudget):
        raise TypeError(f"budget must be an AttackBudget, got {type(config.budget).__name__}")
    _check_int_list(config.batch_sizes, "batch_sizes", low=1)
    _check_int_list(config.stages, "stages", low=0)
    try:
        published_attacks(config.budget, config.attacks)
    except ValueError as err:
        raise ValueError(f"attacks: {err}") from err
    datamodule = build_spec(config.datamodule, "datamodule")
    model = build_spec(config.model, "model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must build an nn.Module, got {type(model).__name__}")
    datamodule.setup("fit")
    train = len(datamodule.train_dataset)
    for i, size in enumerate(config.batch_sizes):
        clients = math.ceil(config.images / size)
        if max(config.num_clients, clients) * size > train:
            raise ValueError(
                f"batch_sizes[{i}] = {size}: the training split holds {train} images, fewer than "
                f"max(num_clients={config.num_clients}, {clients} attacked clients) x {size} images per round"
            )
    _check_client_training(config.client_training, config.batch_sizes)
    if not config.grids and not config.undefended:
        raise ValueError("grids is empty: give at least one grid (or undefended=true)")
    channels = int(datamodule.image_shape[0])
    names: set[str] = set()
    for i, grid in enumerate(config.grids):
        _check_grid(grid, f"grids[{i}]", config, channels, model, datamodule)
        if grid.name in names:
            raise ValueError(f"grids[{i}]: a second grid named {grid.name!r}; give it a distinct label")
        names.add(grid.name)
    return datamodule, model


def _check_client_training(entries: Any, batch_sizes: Sequence[int]) -> None:
    """Each entry a :class:`ClientTraining` that trains as it says, on every batch size, and no two alike."""
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(f"client_training must be a non-empty list of ClientTraining, got {entries!r}")
    labels: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"client_training[{i}]"
        if not isinstance(entry, ClientTraining):
            raise TypeError(f"{where} must be a ClientTraining, got {type(entry).__name__}")
        if entry.algorithm not in ("fedsgd", "fedavg"):
            raise ValueError(f"{where}.algorithm must be 'fedsgd' or 'fedavg', got {entry.algorithm!r}")
        check_positive_int(entry.local_epochs, f"{where}.local_epochs")
        if entry.local_batch_size is not None:
            check_positive_int(entry.local_batch_size, f"{where}.local_batch_size")
        if entry.algorithm == "fedsgd" and (entry.local_epochs != 1 or entry.local_batch_size is not None):
            raise ValueError(f"{where}: local_epochs and local_batch_size need algorithm='fedavg'")
        if entry.algorithm == "fedavg" and entry.local_epochs == 1 and entry.local_batch_size is None:
            raise ValueError(
                f"{where}: FedAvg with one local step on the whole batch shares FedSGD's update; give "
                "local_epochs > 1 or a local_batch_size (or algorithm='fedsgd')"
            )
        for j, size in enumerate(batch_sizes):
            if entry.local_batch_size is not None and size % entry.local_batch_size:
                raise ValueError(
                    f"{where}.local_batch_size = {entry.local_batch_size} must divide batch_sizes[{j}] = {size}: "
                    "a FedAvg client's epoch is batch_size / local_batch_size full local batches"
                )
        if entry.label in labels:
            raise ValueError(f"{where} repeats {entry.label}")
        labels.add(entry.label)


def _check_int_list(values: Any, name: str, *, low: int) -> None:
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{name} must be a non-empty list of integers, got {values!r}")
    for i, value in enumerate(values):
        check_int(value, f"{name}[{i}]", low=low)
    if len(set(values)) != len(values):
        raise ValueError(f"{name} has repeated values: {list(values)}")


def _check_grid(grid: Any, where: str, config: FrontierConfig, channels: int, model: nn.Module, data: Any) -> None:
    if not isinstance(grid, Grid):
        raise TypeError(f"{where} must be a Grid, got {type(grid).__name__}")
    for j, fixed in enumerate(grid.before):
        if fixed.family not in _FAMILIES:
            raise ValueError(f"{where}.before[{j}].family: unknown family {fixed.family!r}; known: {sorted(_FAMILIES)}")
    if grid.family not in _FAMILIES:
        raise ValueError(f"{where}.family: unknown family {grid.family!r}; known: {sorted(_FAMILIES)}")
    if not isinstance(grid.knob, str) or not grid.knob:
        raise ValueError(f"{where}.knob must name the swept keyword of {grid.family}, got {grid.knob!r}")
    if grid.knob in grid.params:
        raise ValueError(f"{where}.params sets {grid.knob!r}, the knob the grid sweeps")
    if not isinstance(grid.values, (list, tuple)) or not grid.values:
        raise ValueError(f"{where}.values is empty: a grid needs at least one strength of {grid.knob!r}")
    if len({_short(v) for v in grid.values}) != len(grid.values):
        raise ValueError(f"{where}.values has repeated strengths: {list(grid.values)}")
    for j, value in enumerate(grid.values):
        try:
            setting = compose_setting(grid, value, config.seed, channels)
            setting.defenses(model)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}.values[{j}] = {value!r} ({grid.family}.{grid.knob}): {err}") from err


def config_fields() -> list[str]:
    """The names of :class:`FrontierConfig`'s fields (the YAML's top-level keys)."""
    return [f.name for f in fields(FrontierConfig)]
