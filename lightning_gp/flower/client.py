"""A Flower ``ClientApp`` that trains a user's LightningModule for one round with a ``Trainer``.

Each train message carries the global weights; the client loads them into a fresh module, trains
one round (its local batches of that round, one optimizer step each) in a ``Trainer`` whose
callbacks may include gradient-level defenses (they defend every local step's gradient exactly
as in plain Lightning), and replies with its new weights. Update-level defenses of the FedAvg
update ``w_global - w_local`` run as :class:`~lightning_gp.flower.UpdateDefenseMod` around it.
State that must outlive the round (the callbacks' per-client defense state) is kept in the
node's ``Context.state`` (:mod:`lightning_gp.flower.state`).

:class:`FederatedData` gives every client the batches :class:`~lightning_gp.federated.FederatedSimulation`
would give it, so a Flower federation and the in-process simulation run the same algorithm.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import lightning.pytorch as pl
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, MetricRecordValues, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.federated.partition import PARTITION_SCHEMES, partition
from lightning_gp.federated.rounds import ClientRounds
from lightning_gp.flower import protocol
from lightning_gp.flower.state import client_record, load_state, partition_id, save_state
from lightning_gp.functional import trainable_parameters
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_choice, check_int, check_positive, check_positive_int

#: the node's Context.state record of the local Trainer's callbacks
STATE_RECORD = "lightning_gp.trainer_callbacks"


@runtime_checkable
class ClientData(Protocol):
    """Where a client's data of a round comes from (what :func:`lightning_client_app` trains on)."""

    def loader(self, client_id: int, round: int) -> DataLoader:
        """The batches client ``client_id`` trains on in ``round`` (0-based; one epoch is one round)."""
        ...

    def num_examples(self, client_id: int) -> int:
        """The client's weight in FedAvg (Flower's ``num-examples``: its dataset size)."""
        ...


class FederatedData:
    """Each client's data of each round, drawn exactly as :class:`~lightning_gp.federated.FederatedSimulation` draws it.

    The training set is split with the same partition and seed, and client ``c``'s data in round
    ``r`` are the same ``local_steps * local_batch_size`` samples in the same order
    (:class:`~lightning_gp.federated.ClientRounds`), so a Flower run with these loaders and the
    simulation with the same arguments train on identical batches. ``num_examples`` is the
    client's partition size (the simulation's ``weighting="num_samples"``).

    Args:
        datamodule: its ``train_dataset`` (after ``setup("fit")``, done lazily) is split.
        num_clients: as in :class:`~lightning_gp.federated.FederatedSimulation`, as are
            ``local_batch_size``, ``local_steps``, ``partition``, ``dirichlet_alpha``,
            ``shards_per_client`` and ``seed``.
    """

    def __init__(
        self,
        datamodule: pl.LightningDataModule,
        num_clients: int,
        *,
        local_batch_size: int = 8,
        local_steps: int = 1,
        partition: str = "iid",
        dirichlet_alpha: float = 0.5,
        shards_per_client: int = 2,
        seed: int = 0,
    ) -> None:
        if not isinstance(datamodule, pl.LightningDataModule):
            raise TypeError(f"datamodule must be a LightningDataModule, got {type(datamodule).__name__}")
        self.datamodule = datamodule
        self.num_clients = check_positive_int(num_clients, "num_clients")
        self.local_batch_size = check_positive_int(local_batch_size, "local_batch_size")
        self.local_steps = check_positive_int(local_steps, "local_steps")
        self.partition = check_choice(partition, "partition", PARTITION_SCHEMES)
        self.dirichlet_alpha = check_positive(dirichlet_alpha, "dirichlet_alpha")
        self.shards_per_client = check_positive_int(shards_per_client, "shards_per_client")
        self.seed = seed
        self._rounds: ClientRounds | None = None

    def __getstate__(self) -> dict[str, Any]:
        # sent to Flower's worker processes before use: each builds its own split (a fixed function of the seed)
        return {**self.__dict__, "_rounds": None}

    @property
    def rounds(self) -> ClientRounds:
        """The per-round sampler (built on first use: the partition of the training set)."""
        if self._rounds is None:
            self.datamodule.setup("fit")
            dataset: Dataset | None = getattr(self.datamodule, "train_dataset", None)
            if dataset is None:
                raise ValueError(f"{type(self.datamodule).__name__} has no train_dataset after setup('fit')")
            targets = getattr(dataset, "targets", None)
            if targets is None and self.partition != "iid":
                targets = torch.as_tensor([int(y) for _, y in dataset])  # type: ignore[attr-defined]
            indices = partition(
                self.partition,  # type: ignore[arg-type]  # checked against PARTITION_SCHEMES
                self.num_clients,
                num_samples=len(dataset),  # type: ignore[arg-type]
                targets=targets,
                dirichlet_alpha=self.dirichlet_alpha,
                shards_per_client=self.shards_per_client,
                seed=self.seed,
            )
            self._rounds = ClientRounds(
                dataset, indices, self.num_clients, self.local_batch_size, self.local_steps, seed=self.seed
            )
        return self._rounds

    def indices(self, client_id: int, round: int) -> list[int]:
        """The ``train_dataset`` indices of the client's data in ``round``, in training order."""
        check_int(client_id, "client_id", low=0, high=self.num_clients - 1)
        check_int(round, "round", low=0)
        return self.rounds.sample_local_indices(round, client_id).tolist()

    def loader(self, client_id: int, round: int) -> DataLoader:
        return DataLoader(
            Subset(self.rounds.dataset, self.indices(client_id, round)), batch_size=self.local_batch_size, shuffle=False
        )

    def batch(self, client_id: int, round: int) -> tuple[Tensor, Tensor]:
        """All of the client's samples of ``round`` as one ``(inputs, targets)`` batch (what a tap records
        for scoring reconstructions; a real server never has it)."""
        items = [self.rounds.dataset[i] for i in self.indices(client_id, round)]
        return torch.stack([torch.as_tensor(x) for x, _ in items]), torch.stack([torch.as_tensor(y) for _, y in items])

    def num_examples(self, client_id: int) -> int:
        check_int(client_id, "client_id", low=0, high=self.num_clients - 1)
        return len(self.rounds.client_indices[client_id])


def lightning_client_app(
    module: Callable[[Context], pl.LightningModule],
    data: ClientData | Callable[[Context], ClientData],
    *,
    callbacks: Callable[[Context], Sequence[Callback]] | None = None,
    mods: Sequence[Mod] = (),
    trainer_kwargs: Mapping[str, Any] | None = None,
    client_id: Callable[[Context], int] = partition_id,
) -> ClientApp:
    """A ``ClientApp`` whose train function runs one round of local training in a Lightning ``Trainer``.

    Args:
        module: builds the client's LightningModule (called every round; the global weights are
            loaded into it). Its ``configure_optimizers`` is the local optimizer.
        data: the client's batches per round (:class:`ClientData`, e.g. :class:`FederatedData`), or a
            function of the node's ``Context`` that returns it (e.g. reading a data path from
            ``context.node_config``; cache what it builds, it is called every round).
        callbacks: builds the local Trainer's callbacks every round, e.g. gradient-level defenses
            (``lambda context: [Soteria(...)]``). Their state (``Callback.state_dict``) is kept in
            the node's ``Context.state`` between rounds. A defense callback is client 0 of its local
            Trainer; on the client's first round its random stream is set to ``(seed, client_id)``,
            so clients built with the same seed still draw independent noise.
        mods: Flower mods around the train function, outermost first, e.g.
            ``[UpdateDefenseMod(DualGradientPruning(seed=0))]`` or Flower's ``fixedclipping_mod``.
        trainer_kwargs: extra ``Trainer`` arguments (e.g. ``accelerator``); the round is one epoch
            over ``data.loader(client, round)``.
        client_id: the client id of a node (default: ``node_config["partition-id"]``).

    The reply holds the client's weights (``"arrays"``), ``num-examples`` and ``train_loss`` (if
    the module logs it) in ``"metrics"``, and the :data:`~lightning_gp.flower.protocol.REPLY_RECORD`
    (client id, trainable parameter names, local steps, batch size and learning rate).
    Register an evaluate function on the returned app if the strategy samples clients to evaluate
    (or pass ``fraction_evaluate=0.0`` to the strategy).
    """
    if not isinstance(data, ClientData) and not callable(data):
        raise TypeError(
            "data must provide loader(client_id, round) and num_examples(client_id) (e.g. FederatedData), or be a "
            f"function of the Context that returns such an object; got {type(data).__name__}"
        )
    extra = _round_trainer_kwargs(trainer_kwargs)
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        client = client_id(context)
        record = client_record(context, STATE_RECORD, client)  # refuses a node that changed client id
        round_idx = _round(msg)
        arrays = _single(msg.content.array_records, "ArrayRecord")
        model = module(context)
        model.load_state_dict(arrays.to_torch_state_dict())
        local_callbacks = list(callbacks(context)) if callbacks is not None else []
        for callback in local_callbacks:
            _restore_callback(callback, record, client)
        source = data if isinstance(data, ClientData) else _client_data(data(context))
        loader = source.loader(client, round_idx)
        trainer = _train_one_epoch(model, loader, extra, local_callbacks)
        for callback in local_callbacks:
            state = callback.state_dict()
            if state:
                save_state(record, callback.state_key, state)
        return _train_reply(msg, model, arrays, trainer, loader, int(source.num_examples(client)), client)

    return app


def _round_trainer_kwargs(trainer_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The user's extra ``Trainer`` arguments, refusing those a round fixes (one epoch, our callbacks)."""
    extra = dict(trainer_kwargs or {})
    fixed = {"max_epochs", "max_steps", "callbacks"} & set(extra)
    if fixed:
        raise ValueError(f"trainer_kwargs may not set {sorted(fixed)}: a round is one epoch of data.loader(...)")
    return extra


def _train_one_epoch(
    model: pl.LightningModule, loader: DataLoader, extra: Mapping[str, Any], callbacks: list[Callback]
) -> pl.Trainer:
    """Fit ``model`` for one epoch of ``loader`` in a quiet local ``Trainer`` (``extra`` on top of its
    defaults); the fitted Trainer."""
    trainer = pl.Trainer(
        **{
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            **extra,
            "max_epochs": 1,
            "callbacks": callbacks,
        }
    )
    with warnings.catch_warnings():  # a round trains only; the module's validation_step is for evaluation
        warnings.filterwarnings("ignore", message=".*validation_step.*val_dataloader.*")
        trainer.fit(model, train_dataloaders=loader)
    return trainer


def _train_reply(
    msg: Message,
    model: pl.LightningModule,
    arrays: ArrayRecord,
    trainer: pl.Trainer,
    loader: DataLoader,
    num_examples: int,
    client: int,
) -> Message:
    """The reply to ``msg``: the weights named in the received ``arrays``, ``num-examples`` and
    ``train_loss`` (if logged), and the :data:`~lightning_gp.flower.protocol.REPLY_RECORD`."""
    weights = model.state_dict()
    metrics: dict[str, MetricRecordValues] = {"num-examples": num_examples}
    if "train_loss" in trainer.callback_metrics:
        metrics["train_loss"] = float(trainer.callback_metrics["train_loss"])
    info = ConfigRecord(
        {
            protocol.CLIENT_ID: client,
            protocol.PARAMETERS: list(trainable_parameters(model)),
            protocol.LOCAL_STEPS: int(trainer.global_step),
            protocol.LOCAL_BATCH_SIZE: int(loader.batch_size or 0),
            protocol.LOCAL_LR: _learning_rate(trainer),
        }
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord({name: weights[name] for name in arrays}),
            "metrics": MetricRecord(metrics),
            protocol.REPLY_RECORD: info,
        }
    )
    return Message(content, reply_to=msg)


def _restore_callback(callback: Callback, record: ConfigRecord, client: int) -> None:
    saved = load_state(record, callback.state_key)
    if saved is not None:
        callback.load_state_dict(saved)
    elif isinstance(callback, GradientDefense):
        # first round: the local Trainer's only client is 0; draw from the client's own stream
        defense = callback.defense
        defense.load_state_dict(
            {**defense.state_dict(), "generator_states": {0: seeded_generator(defense.seed, client).get_state()}}
        )


def _client_data(data: Any) -> ClientData:
    if not isinstance(data, ClientData):
        raise TypeError(
            f"the data function returned a {type(data).__name__}, which lacks loader(client_id, round) and "
            "num_examples(client_id)"
        )
    return data


def _round(msg: Message) -> int:
    """The 0-based round of a train message (Flower's strategies send ``server-round``, from 1)."""
    for config in msg.content.config_records.values():
        if "server-round" in config:
            return check_int(int(cast(int, config["server-round"])), "server-round", low=1) - 1
    raise ValueError("the train message has no 'server-round' in its config (Flower's strategies send it)")


def _single(records: Mapping[str, ArrayRecord], kind: str) -> ArrayRecord:
    if len(records) != 1:
        raise ValueError(f"the train message must carry exactly one {kind} (the global model), found {len(records)}")
    return next(iter(records.values()))


def _learning_rate(trainer: pl.Trainer) -> float:
    optimizers = trainer.optimizers
    lr = optimizers[0].param_groups[0].get("lr") if optimizers else None
    return float(lr) if isinstance(lr, (int, float)) else math.nan
