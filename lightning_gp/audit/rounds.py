"""Tapped rounds: run one federated round with a defense and keep what the attacked clients shared.

client batch -> defenses -> **shared gradient** (tapped) -> the attack engine (:mod:`.engine`)

:func:`tap_fedsgd_round` runs FedSGD (or one-step FedAvg) through
:class:`~lightning_gp.federated.FederatedSimulation` with the given defense callbacks, so the attacked
gradient is exactly what the defenses let out; the attacked clients' batches come from the
simulation's sampler or are chosen images. :func:`tap_defended_round` does the same for a catalogue
:class:`~lightning_gp.audit.catalog.DefenseSetting` (its wrapping module, architecture change or
plain-Trainer runner). An active attack (one with ``modify_model``, e.g. Robbing the Fed) plays the
malicious server through :func:`malicious_server_model`: it replaces the model sent to the clients
before the round and keeps its secrets for the attack.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

from lightning_gp.attacks import AttackNotApplicable, GradientAttack
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.quiet import internal_trainer, quiet_lightning
from lightning_gp.audit.training import simulated_cohort, trainer_runner
from lightning_gp.callbacks import GradientDefense, GradientTap
from lightning_gp.defenses.base import Gradients
from lightning_gp.federated import FederatedSimulation, ModelProvenance, ModelRejected, weighted_mean
from lightning_gp.records import TappedGradient
from lightning_gp.validation import as_int, check_int, check_positive_int


class NoPublicSplitError(ValueError):
    """The datamodule has no (or an empty) test split to serve as the server's public images."""


def public_batch(datamodule: L.LightningDataModule, size: int = 1000) -> Tensor:
    """Images a server may hold (the test split, never the clients' training data)."""
    return public_examples(datamodule, size)[0]


def public_examples(datamodule: L.LightningDataModule, size: int = 1000) -> tuple[Tensor, Tensor]:
    """The first ``size`` labelled images of the test split: what a server may hold, never a client's
    training data. ``(inputs [N, C, H, W], labels [N])``."""
    check_positive_int(size, "size")
    datamodule.setup("test")
    dataset = getattr(datamodule, "test_dataset", None)
    if dataset is None or len(dataset) == 0:
        raise NoPublicSplitError(
            f"datamodule: {type(datamodule).__name__} has {'an empty' if dataset is not None else 'no'} test split "
            "(test_dataset): the audit holds it as the server's public split, calibrates its recognisable-image "
            "tests on it and keeps it apart from the attacked training images"
        )
    pairs = [dataset[i] for i in range(min(size, len(dataset)))]
    images = torch.stack([image for image, _ in pairs])
    if not torch.isfinite(images).all():
        raise ValueError(f"datamodule: {type(datamodule).__name__}'s public (test-split) images hold NaN or inf")
    return images, torch.as_tensor([int(label) for _, label in pairs])


def training_order(datamodule: L.LightningDataModule, seed: int) -> Tensor:
    """The training split's indices in the order ``seed`` draws them: the audit's one draw of training
    images (the attacked clients', :func:`~lightning_gp.frontier.run.attacked_images`, and kappa's)."""
    datamodule.setup("fit")
    size = len(cast(Any, datamodule).train_dataset)
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed))


def training_examples(datamodule: L.LightningDataModule, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """The first ``count`` labelled training images of :func:`training_order` (fewer where the split is
    smaller), ``(inputs [N, C, H, W], labels [N])``. Raises ``ValueError`` naming ``datamodule`` where a
    label is not one class per image."""
    check_positive_int(count, "count")
    train = cast(Any, datamodule).train_dataset
    pairs = [train[int(i)] for i in training_order(datamodule, seed)[:count]]
    try:
        labels = torch.as_tensor([int(label) for _, label in pairs])
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"datamodule: {type(datamodule).__name__}'s training labels are not one class per image"
        ) from err
    return torch.stack([image for image, _ in pairs]), labels


def malicious_server_model(
    attack: GradientAttack | None,
    model: nn.Module,
    datamodule: L.LightningDataModule,
    *,
    model_checks: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """The model a server running ``attack`` sends, and the secrets it keeps for the attack.

    An active attack (one with ``modify_model``, e.g. Robbing the Fed's imprint block) replaces the
    model, knowing the data's shape and normalisation and holding public images (the test split);
    a passive one (or ``None``) sends ``model`` unchanged, with no secrets. With ``model_checks`` the
    clients accept only ``model`` itself, the public record's model
    (:class:`~lightning_gp.federated.ModelProvenance`): any other model raises
    :class:`~lightning_gp.attacks.AttackNotApplicable` saying what the check found.
    """
    modify_model = getattr(attack, "modify_model", None)
    if modify_model is None:
        return model, {}
    data = cast(Any, datamodule)
    sent, secrets = modify_model(model, data.image_shape, data.mean, data.std, public_data=public_batch(datamodule))
    if model_checks:
        try:
            ModelProvenance(model).check(sent)
        except ModelRejected as err:
            raise AttackNotApplicable(
                f"the clients refuse the model the server sends (they replay the public record: ModelProvenance): {err}"
            ) from err
    return sent, secrets


def _chosen_lists(value: Any, name: str, high: int | None) -> list[list[int]]:
    """``value`` as one non-empty list of ints per attacked client, all of one length."""
    example = f"e.g. {name}=[[12, 7], [301, 5]] for two clients with two images each"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be one list of training images per attacked client ({example}), got {value!r}")
    rows = list(value)
    if not rows:
        raise ValueError(f"{name} must hold at least one list ({example}), got an empty list")
    lists = []
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            raise ValueError(f"{name} must be one list per attacked client ({example}); {name}[{i}] is {row!r}")
        items = list(row)
        if not items:
            raise ValueError(f"{name}[{i}] is empty: each attacked client needs at least one image")
        lists.append([check_int(as_int(v), f"{name}[{i}][{j}]", low=0, high=high) for j, v in enumerate(items)])
    lengths = [len(items) for items in lists]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"every list in {name} must have the same length (all FedSGD clients share one local_batch_size), "
            f"got lengths {lengths}"
        )
    return lists


def tap_fedsgd_round(
    model: nn.Module,
    datamodule: L.LightningDataModule,
    *,
    defenses: Sequence[Callback] = (),
    attack: GradientAttack | None = None,
    round: int = 0,
    clients: Sequence[int] | None = None,
    num_clients: int = 10,
    local_batch_size: int | None = None,
    indices: Sequence[Sequence[int]] | None = None,
    positions: Sequence[Sequence[int]] | None = None,
    algorithm: Literal["fedsgd", "fedavg"] = "fedsgd",
    local_lr: float = 0.1,
    local_steps: int = 1,
    server_optimizer: Literal["sgd", "adam"] = "adam",
    server_lr: float = 1e-3,
    seed: int = 0,
    batchnorm: Literal["train", "eval"] = "train",
) -> tuple[list[TappedGradient], nn.Module, dict[str, Any]]:
    """Run FedSGD through ``round`` and return the shared gradients of ``clients`` in that round.

    With ``algorithm="fedavg"`` each client runs ``local_steps`` local SGD steps at ``local_lr`` instead
    (chosen lists then hold ``local_steps * local_batch_size`` images, the steps' batches in turn) and
    shares that update (a module that shares weights, e.g. PriPrune, needs FedAvg). Rounds before
    ``round`` apply the aggregate with ``server_optimizer`` at ``server_lr``.

    Every client takes part in every round, and each client's batch is drawn by the simulation's
    sampler, except where the attacked images are chosen:

    - ``indices``: one list of training-set indices (into ``datamodule.train_dataset``) per
      attacked client, e.g. ``[[12, 7], [301, 5]]``: in round ``round`` that client's batch is
      exactly these images, in this order;
    - ``positions``: the same, as positions within each attacked client's own partition.

    The round still goes through the simulation's FedSGD step with the ``defenses`` callbacks,
    so each tapped gradient is exactly what the defenses let out for those images. ``clients``
    defaults to ``[0]``, or ``0 .. len(indices) - 1`` with chosen images; ``local_batch_size``
    to the length of the chosen lists, else 1. Each record's ``meta["dataset_indices"]`` lists
    the training-set indices of its batch.

    Returns the records, the model the server sent (modified if ``attack`` is active) and the
    server's secrets for the attack.
    """
    check_int(round, "round", low=0)
    check_positive_int(num_clients, "num_clients")
    if indices is not None and positions is not None:
        raise ValueError("pass indices (training-set indices) or positions (within each client's partition), not both")
    L.seed_everything(seed, verbose=False)
    datamodule.setup("fit")
    chosen_name = "indices" if indices is not None else "positions" if positions is not None else None
    chosen: list[list[int]] | None = None
    if chosen_name is not None:
        chosen = _chosen_from(datamodule, indices if indices is not None else positions, chosen_name)
    clients = _attacked_clients(clients, chosen, chosen_name, num_clients)
    local_batch_size = _local_batch_size(
        local_batch_size, chosen, chosen_name, check_positive_int(local_steps, "local_steps")
    )

    model, secrets = malicious_server_model(attack, model, datamodule)
    simulation = FederatedSimulation(
        model,
        datamodule=datamodule,
        num_clients=num_clients,
        clients_per_round=num_clients,
        cohort_size=simulated_cohort(defenses, num_clients),
        local_batch_size=local_batch_size,
        server_optimizer=server_optimizer,
        server_lr=server_lr,
        algorithm=algorithm,
        local_lr=local_lr,
        local_steps=local_steps,
        batchnorm=batchnorm,
        seed=seed,
    )
    if chosen is not None:
        for client, items in zip(clients, chosen):
            simulation.choose_batch(round, client, items, by="index" if chosen_name == "indices" else "position")
    return _tap_round(simulation, round, clients, defenses), model, secrets


def _chosen_from(datamodule: L.LightningDataModule, value: Any, chosen_name: str) -> list[list[int]]:
    """The chosen images (``indices`` into the set-up ``train_dataset``, or ``positions``) as checked lists."""
    train_dataset = getattr(datamodule, "train_dataset", None)
    if train_dataset is None:
        raise ValueError(
            f"{type(datamodule).__name__} has no train_dataset after setup('fit') to take {chosen_name} from"
        )
    high = len(train_dataset) - 1 if chosen_name == "indices" else None
    return _chosen_lists(value, chosen_name, high)


def _attacked_clients(
    clients: Sequence[int] | None, chosen: list[list[int]] | None, chosen_name: str | None, num_clients: int
) -> list[int]:
    """The attacked clients' ids, checked: distinct, in range, one per chosen list (default ``[0]``,
    or ``0 .. len(chosen) - 1`` with chosen images)."""
    if clients is None:
        clients = list(range(len(chosen))) if chosen is not None else [0]
    clients = [as_int(c) for c in clients]
    if not clients or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < num_clients for c in clients):
        raise ValueError(f"clients must be ids in [0, {num_clients}), got {clients}")
    if len(set(clients)) != len(clients):
        raise ValueError(f"clients must be distinct, got {clients}")
    if chosen is not None and len(chosen) != len(clients):
        raise ValueError(
            f"{chosen_name} needs one list per attacked client: clients {clients} but {len(chosen)} list(s) in "
            f"{chosen_name}"
        )
    return clients


def _local_batch_size(
    local_batch_size: int | None, chosen: list[list[int]] | None, chosen_name: str | None, local_steps: int = 1
) -> int:
    """``local_batch_size``, checked (default: the chosen lists' length over ``local_steps``, else 1)."""
    if local_batch_size is None:
        local_batch_size = max(1, len(chosen[0]) // local_steps) if chosen is not None else 1
    check_positive_int(local_batch_size, "local_batch_size")
    if chosen is not None and len(chosen[0]) != local_batch_size * local_steps:
        raise ValueError(
            f"local_batch_size={local_batch_size} disagrees with the {len(chosen[0])} image(s) per client in "
            f"{chosen_name}: every client's round holds local_steps * local_batch_size = "
            f"{local_steps * local_batch_size} images"
        )
    return local_batch_size


def _tap_round(
    simulation: FederatedSimulation, round: int, clients: Sequence[int], defenses: Sequence[Callback]
) -> list[TappedGradient]:
    """Train ``simulation`` through ``round`` behind ``defenses`` and return what each of ``clients``
    shared in that round, with its batch's training-set indices in ``meta["dataset_indices"]``."""
    taps = [GradientTap(clients=c, rounds=[round]) for c in clients]
    with quiet_lightning():
        internal_trainer(max_steps=round + 1, callbacks=[*defenses, *taps]).fit(simulation)
    records = [tap.latest() for tap in taps]
    for record in records:
        record.meta["dataset_indices"] = simulation.local_indices(round, record.client_id)
    return records


def _strip_wrapper(record: TappedGradient, prefix: str) -> TappedGradient:
    """The record in the bare model's names: a wrapper's ``prefix`` removed, its own state dropped."""
    gradients = {n.removeprefix(prefix): g for n, g in record.gradients.items() if n.startswith(prefix)}
    if len(gradients) != len(record.gradients):
        extra = [n for n in record.gradients if not n.startswith(prefix)]
        raise ValueError(f"the wrapper shared parameters outside its wrapped model: {extra}")
    state = {n.removeprefix(prefix): t for n, t in record.model_state.items() if n.startswith(prefix)}
    return dataclasses.replace(record, gradients=gradients, model_state=state)


class _ChosenImages(L.LightningDataModule):
    """The training images of one client, in order, as one batch (for the plain-Trainer runner)."""

    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        super().__init__()
        self.subset = Subset(dataset, list(indices))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.subset, batch_size=len(self.subset), shuffle=False)


def _tap_with_trainer(
    setting: DefenseSetting, model: nn.Module, datamodule: Any, indices: Sequence[Sequence[int]], lr: float, seed: int
) -> list[TappedGradient]:
    """Each client trains one step from ``model`` in its own ``Trainer`` with the setting's callbacks
    (client ``c``'s random streams seeded by ``seed + c``)."""
    from lightning_gp.models import ImageClassifier

    records = []
    for client, chosen in enumerate(indices):
        L.seed_everything(seed + client, verbose=False)
        module = ImageClassifier(copy.deepcopy(model), lr=lr)
        tap = GradientTap(rounds=[0])
        callbacks = [copy.deepcopy(cb) for cb in setting.callbacks]
        with quiet_lightning():
            trainer = internal_trainer(max_steps=1, callbacks=[*callbacks, tap])
            trainer.fit(module, datamodule=_ChosenImages(datamodule.train_dataset, chosen))
        record = tap.latest()
        record = dataclasses.replace(record, client_id=client)
        record.meta["dataset_indices"] = list(chosen)
        records.append(_strip_wrapper(record, "model."))
    return records


def _train_on_trainer(
    setting: DefenseSetting, model: nn.Module, datamodule: Any, steps: int, batch_size: int, seed: int
) -> nn.Module:
    """``model`` after ``steps`` steps of the plain-Trainer runner through the setting's callbacks,
    ``batch_size`` images per step (the rounds :func:`~lightning_gp.audit.train_setting` trains)."""
    L.seed_everything(seed, verbose=False)
    module, data = trainer_runner(setting, model, datamodule, batch_size)
    with quiet_lightning():
        trainer = internal_trainer(max_steps=steps, callbacks=[copy.deepcopy(cb) for cb in setting.callbacks])
        trainer.fit(module, datamodule=data)
    return cast(nn.Module, module.model)


def tap_defended_round(
    setting: DefenseSetting,
    model: nn.Module,
    datamodule: L.LightningDataModule,
    *,
    indices: Sequence[Sequence[int]],
    num_clients: int = 10,
    attack: GradientAttack | None = None,
    seed: int = 0,
    round: int = 0,
) -> tuple[list[TappedGradient], nn.Module, dict[str, Any]]:
    """Round ``round`` of ``setting`` with client ``c``'s batch the training images ``indices[c]``.

    ``model`` is the server's model at initialisation (the caller seeds it); a setting that changes
    the architecture (PRECODE) changes it, and an active ``attack`` (Robbing the Fed) then replaces
    it, as a malicious server would. With ``round = r > 0`` the setting first trains ``r`` FedSGD
    rounds (every client's batch drawn by the simulation's sampler; on the plain-Trainer runner, ``r``
    steps of ``num_clients`` clients' images each, as :func:`~lightning_gp.audit.train_setting`
    trains it) through the same defense callbacks, so the tapped round sees the weights and the
    defenses' state (error-feedback residuals, Outpost's step counters, ...) as they are at round
    ``r``; the records carry round ``r``'s weights. Tapping a trained round needs a passive server (an
    active ``attack`` here would send its model from round 0 on); a server that turns malicious at
    round ``r`` is round 0 from the round-``r`` weights where :func:`active_replay_blocker` allows
    it (what :func:`~lightning_gp.audit.audit_setting` does).

    Returns the records in the parameter names of the model the server sent (a wrapping module's
    prefix removed), that model (with the round's weights in each record) and the server's secrets.
    """
    check_int(round, "round", low=0)
    if round > 0 and getattr(attack, "modify_model", None) is not None:
        raise ValueError(
            f"round={round}: an active attack ({type(attack).__name__}) here would send its model from round 0 on; "
            "to audit a server that turns malicious at a trained round, tap round 0 from that round's weights "
            "(active_replay_blocker says where that is exact)"
        )
    datamodule.setup("fit")
    model, secrets = malicious_server_model(
        attack, setting.server_model(copy.deepcopy(model)), datamodule, model_checks=setting.model_checks
    )
    if setting.runner == "trainer":
        if round > 0:
            batch_size = max(num_clients, len(indices)) * len(indices[0])
            model = _train_on_trainer(setting, model, datamodule, round, batch_size, seed)
        return _tap_with_trainer(setting, model, datamodule, indices, setting.local_lr, seed), model, secrets
    client_model = setting.wrap(model) if setting.wrap is not None else model
    batch_size, steps, rounds_items = local_schedule(setting, indices, seed)
    records, _, _ = tap_fedsgd_round(
        client_model,
        datamodule,
        defenses=[copy.deepcopy(cb) for cb in setting.callbacks],
        clients=list(range(len(indices))),
        num_clients=max(num_clients, len(indices)),
        indices=rounds_items,
        local_batch_size=batch_size,
        algorithm=setting.algorithm,
        local_lr=setting.local_lr,
        local_steps=steps,
        server_optimizer=setting.server_optimizer,
        server_lr=setting.server_lr,
        seed=seed,
        round=round,
        batchnorm=setting.batchnorm,
    )
    if setting.wrap is not None:
        records = [_strip_wrapper(r, "module.") for r in records]
    if setting.local_training:
        records = [_local_dataset_record(r, list(items), setting.local_epochs) for r, items in zip(records, indices)]
    return records, model, secrets


def local_schedule(
    setting: DefenseSetting, indices: Sequence[Sequence[int]], seed: int
) -> tuple[int, int, list[list[int]]]:
    """``(local_batch_size, local_steps, items)`` of one round of ``setting`` whose client ``c`` holds
    the training images ``indices[c]``: one step on the whole batch, or under FedAvg's local training
    (:attr:`DefenseSetting.local_training`) ``local_epochs`` epochs over the ``n`` images in batches of
    ``local_batch_size``, each epoch a fresh order drawn with ``seed`` (``items[c]``: the steps' images in
    turn)."""
    n = len(indices[0])
    if not setting.local_training:
        return n, 1, [list(items) for items in indices]
    batch = n if setting.local_batch_size is None else setting.local_batch_size
    if n % batch:
        raise ValueError(
            f"local_batch_size={batch} must divide the {n} images each audited client holds (indices): a "
            "FedAvg client's epoch is n / local_batch_size full local batches"
        )
    g = torch.Generator().manual_seed(seed)
    items = []
    for client in indices:
        orders = [torch.randperm(n, generator=g).tolist() for _ in range(setting.local_epochs)]
        items.append([int(client[k]) for order in orders for k in order])
    return batch, setting.local_epochs * n // batch, items


def _local_dataset_record(record: TappedGradient, indices: list[int], epochs: int) -> TappedGradient:
    """``record`` of a FedAvg client's local training with its batch the ``indices`` images it holds, once
    each in this order (the round's steps saw them ``epochs`` times), and the schedule in ``meta``."""
    seen = [int(i) for i in record.meta["dataset_indices"]]
    first = torch.as_tensor([seen.index(i) for i in indices])
    inputs, targets = cast(Tensor, record.inputs), cast(Tensor, record.targets)
    record.batch = (inputs[first], targets[first])
    record.meta["dataset_indices"] = list(indices)
    record.meta["local_epochs"] = epochs
    return record


def active_replay_blocker(setting: DefenseSetting, record: TappedGradient) -> str | None:
    """Why a malicious server that turns active at a trained round ``r`` cannot be replayed as round 0
    of a simulation that starts at the round-``r`` weights (``record.model_state``); ``None`` when it can.

    The server builds its modified model (Robbing the Fed's imprint block) on the weights it holds at
    round ``r`` and sends it instead; each client then defends the new model's gradient. That round
    equals round 0 from those weights when no client defense carries anything from one round to the
    next: no per-client state (error feedback, Outpost's step counter), no adapter state (a cached
    sensitivity, GradDefense's root statistics) and no coordination of a round's clients (ADGP's
    mask), and the setting neither wraps nor changes the model (Refiner, PriPrune, PRECODE); on the
    plain-Trainer runner, when its only callback is DP-SGD. The defenses' random streams start
    afresh, which changes the draw and not its law."""
    if setting.runner == "trainer":
        from lightning_gp.callbacks import DPSGD

        # DP-SGD clips each example and draws fresh noise at every step; its accountant only counts
        others = [type(cb).__name__ for cb in setting.callbacks if not isinstance(cb, DPSGD)]
        return f"{', '.join(others)} on the plain Trainer declares nothing of what it keeps" if others else None
    if setting.wrap is not None or setting.architecture is not None:
        return f"{setting.name} wraps or changes the model the clients train"
    for callback in setting.callbacks:
        name = type(callback).__name__
        if not isinstance(callback, GradientDefense):
            return f"{name} does not declare what it keeps across rounds"
        if callback.prepares_rounds:
            return f"{name} coordinates the clients of each round"
        if type(callback).adapter_state is not GradientDefense.adapter_state:
            return f"{name} keeps state across rounds"
        if callback.defense.init_client_state(dict(record.gradients)):
            return f"{name} keeps per-client state across rounds"
    return None


def aggregate_record(
    records: Sequence[TappedGradient], combine: Callable[[list[Gradients]], Gradients] | None = None
) -> TappedGradient:
    """What a server behind secure aggregation sees of one round: only the combination of the round's
    shared updates (Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
    Learning", CCS 2017), as one record of every client's images.

    ``combine`` turns the clients' shared gradients into the released update (default: their mean,
    FedAvg's uniform aggregate; DP-FedAvg's clipped, noised mean is
    ``lambda g: dp.noised_mean([dp.clip(u) for u in g], len(g), round)``). With equal batches of ``B``
    images the mean of ``N`` FedSGD gradients is the gradient of the mean loss over the ``N x B``
    images, so an attack sees one batch of ``N x B``: the record's batch is every client's images in
    client order (``meta["aggregate_of"]``: the client ids, ``meta["dataset_indices"]``: their indices).
    """
    if not records:
        raise ValueError("records is empty: a round needs at least one client to aggregate")
    first = records[0]
    sizes = {None if r.inputs is None else int(r.inputs.shape[0]) for r in records}
    if None in sizes or len(sizes) != 1:
        raise ValueError(f"records must each hold their batch, all of one size, to be scored together; sizes {sizes}")
    if any(r.round != first.round or r.model_state.keys() != first.model_state.keys() for r in records):
        raise ValueError("records must come from one round of one model")
    gradients = [dict(r.gradients) for r in records]
    combined = (combine or weighted_mean)(gradients)
    inputs = torch.cat([cast(Tensor, r.inputs) for r in records])
    targets = torch.cat([cast(Tensor, r.targets).reshape(-1) for r in records])
    meta = {
        **first.meta,
        "aggregate_of": [r.client_id for r in records],
        "dataset_indices": [i for r in records for i in r.meta.get("dataset_indices", [])],
        "local_batch_size": int(inputs.shape[0]),
    }
    return TappedGradient(
        round=first.round,
        client_id=first.client_id,
        gradients=combined,
        model_state=dict(first.model_state),
        model_class=first.model_class,
        batch=(inputs, targets),
        meta=meta,
    )
