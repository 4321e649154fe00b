"""In-process federated learning: many simulated clients, one LightningModule.

One training step is one communication round:
sample clients -> each computes its gradient (FedSGD) or local update (FedAvg) on its own data
-> the trainer's defense callbacks rewrite it with that client's own state -> **shared update**
(observers such as GradientTap see it here) -> the server averages and its optimizer steps.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence, Sized
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_gp.defenses.base import share_in_process
from lightning_gp.federated.aggregation import weighted_mean
from lightning_gp.federated.client_dp import ClientLevelDP
from lightning_gp.federated.client_updates import (
    ClientGradientProvider,
    ClientUpdateProvider,
    client_gradients,
    client_local_updates,
    trainable_parameters,
    updates_running_stats,
)
from lightning_gp.federated.partition import PARTITION_SCHEMES, partition
from lightning_gp.federated.rounds import ClientRounds, RoundLoader, RoundSampler
from lightning_gp.functional import set_batchnorm_mode
from lightning_gp.pipeline.pipeline import ClientStepRunner, trainer_callbacks
from lightning_gp.pipeline.stages import ClientSetup, DefenseStage, StageCall
from lightning_gp.validation import (
    as_int,
    check_choice,
    check_int,
    check_model_fits_data,
    check_number,
    check_positive,
    check_positive_int,
)

Algorithm = Literal["fedsgd", "fedavg"]


def _defense_states(checkpoint: dict[str, Any]) -> set[str]:
    """State keys of the saved callbacks that hold per-client defense state."""
    return {
        key
        for key, state in checkpoint.get("callbacks", {}).items()
        if isinstance(state, dict) and isinstance(state.get("defense"), dict) and "client_states" in state["defense"]
    }


def _check_module_runs(module: nn.Module, algorithm: str, vectorize: bool | None) -> None:
    """Refuse a module whose own client step (or BatchNorm statistics, under ``vectorize``) the
    algorithm cannot run."""
    if isinstance(module, ClientGradientProvider) and algorithm != "fedsgd":
        raise ValueError(
            f"{type(module).__name__} computes each client's FedSGD gradient itself (one batch, one upload); "
            "use algorithm='fedsgd'"
        )
    if isinstance(module, ClientUpdateProvider) and algorithm != "fedavg":
        raise ValueError(
            f"{type(module).__name__} runs each client's FedAvg local training itself and shares weights; "
            "use algorithm='fedavg'"
        )
    if vectorize and updates_running_stats(module):
        raise ValueError(
            "vectorize=True cannot update BatchNorm running statistics under vmap; pass vectorize=None/False "
            "or use a model with GroupNorm"
        )


def _check_client_dp(client_dp: ClientLevelDP | None, weighting: str, module: nn.Module) -> None:
    """Refuse a ``client_dp`` that is not one, or that the weighting or the module would void."""
    if client_dp is not None and not isinstance(client_dp, ClientLevelDP):
        raise TypeError(f"client_dp must be a ClientLevelDP, got {type(client_dp).__name__}")
    if client_dp is not None and weighting != "uniform":
        raise ValueError(
            "client_dp needs weighting='uniform': weighting clients by their data size changes how far one "
            "client moves the aggregate, which the DP-FedAvg accounting assumes is max_update_norm / clients_per_round"
        )
    if client_dp is not None and isinstance(module, ClientUpdateProvider):
        raise ValueError(
            f"client_dp: {type(module).__name__} aggregates its clients' updates itself, which DP-FedAvg's noised "
            "sum would replace; use client_dp with a plain module"
        )


class FederatedSimulation(pl.LightningModule, ClientStepRunner):
    """Simulate FedSGD or FedAvg with ``num_clients`` clients around a user's model.

    Each training step is one round: ``clients_per_round`` clients are drawn (a fixed function of
    the seed and the round, so resumed runs see the same clients and data), every client works
    on its own partition of the training set, the trainer's ``GradientDefense`` callbacks
    transform what each client shares with that client's own state, and the server averages the
    shared updates and steps its optimizer. Rounds are ``Trainer(max_steps=...)``.

    Args:
        module: the client model, an ``nn.Module`` or a ``LightningModule``; its ``forward(x)``
            gives the outputs, and a LightningModule's ``configure_optimizers`` (if it defines
            one) builds the server optimizer. A ``ClientGradientProvider`` (FedSGD, e.g. RefinerModule)
            or ``ClientUpdateProvider`` (FedAvg, e.g. PriPruneModule) runs its own client step.
        datamodule: where the data comes from: its ``train_dataset`` is split among the clients
            and its val/test loaders evaluate the global model. Pass it here, not to ``fit``.
        loss_fn: the client loss (mean over the batch); default: ``module.loss_fn`` if present,
            else cross-entropy.
        algorithm: ``"fedsgd"`` (clients share one gradient of their local batch) or
            ``"fedavg"`` (clients run ``local_steps`` SGD steps at ``local_lr`` and share
            ``w_global - w_local``; the server's SGD at lr 1.0 is McMahan et al.'s FedAvg).
        num_clients: total clients; ``clients_per_round``: clients sampled each round.
        cohort_size: the uploads one round's secure aggregate sums in the deployment the simulation
            stands for (default ``clients_per_round``; at least it): a simulation of a few clients of a
            larger round, as the audit's taps are, sets it. A defense sized for a cohort
            (:class:`~lightning_gp.callbacks.DistributedGaussianMechanism`) is refused where it is
            larger, since the sum would carry less noise than its guarantee states.
        local_batch_size: samples in one local batch; ``local_steps``: local batches per round
            (FedAvg only; FedSGD uses one).
        partition: ``"iid"``, ``"dirichlet"`` (label skew with ``dirichlet_alpha``) or
            ``"shards"`` (``shards_per_client`` label shards each).
        rounds_per_epoch: rounds between validations; default one pass over the data.
        server_optimizer, server_lr, server_momentum: the server optimizer when ``module`` does
            not configure one.
        vectorize: batch clients with ``torch.func.vmap`` (``None``: whenever the model does not
            update BatchNorm running statistics, falling back to the loop if vmap fails). Both
            paths give the same updates; which is faster depends on the model and device (on
            CPU, vmap wins for LeNetZhu and loses for ConvNet's max-pooling: see
            ``benchmarks/simulation_throughput.py``).
        client_chunk_size: clients per vmap chunk, to bound memory on large models.
        batchnorm: the mode of the model's BatchNorm layers in the clients' passes: ``"train"`` (batch
            statistics, and running statistics updated: how a client trains by default) or ``"eval"``
            (the running statistics, frozen; e.g. a client that fine-tunes with frozen normalisation).
            The tapped records say which (``meta["batchnorm"]``) and the attackers' model runs in it.
        weighting: ``"uniform"`` mean of shared updates, or ``"num_samples"`` weighted by each
            client's partition size (McMahan et al. 2017).
        seed: seeds the partition and the per-round sampling.
        client_dp: client-level DP (DP-FedAvg, :class:`~lightning_gp.federated.ClientLevelDP`): each
            client's shared update (after the defense callbacks) is clipped to its
            ``max_update_norm`` before it leaves the client, so the taps see the clipped update; the
            server adds the Gaussian noise to the sum and divides by ``clients_per_round``. Logs
            ``dp_epsilon`` (and ``dp_rero_eta`` with a ``kappa``) every round and ends the fit cleanly
            before the round that would pass its ``stop_at_epsilon``. Needs ``weighting="uniform"``.
            The guarantee is about what the released model (the noised mean) reveals; a server that
            sees each client's clipped update is not bound by it (secure aggregation closes that gap:
            the audit's aggregate view).
    """

    # The simulation runs the client step itself: every client's gradient goes through the
    # trainer's defense callbacks with that client's state, batch in hand (ClientStepRunner).
    execution_path = "simulation"
    passes_client_batches = True

    def __init__(
        self,
        module: nn.Module,
        datamodule: pl.LightningDataModule | None = None,
        loss_fn: nn.Module | None = None,
        algorithm: Algorithm = "fedsgd",
        num_clients: int = 10,
        clients_per_round: int = 10,
        local_batch_size: int = 8,
        local_steps: int = 1,
        local_lr: float = 0.1,
        partition: Literal["iid", "dirichlet", "shards"] = "iid",
        dirichlet_alpha: float = 0.5,
        shards_per_client: int = 2,
        rounds_per_epoch: int | None = None,
        server_optimizer: Literal["sgd", "adam"] = "sgd",
        server_lr: float = 0.1,
        server_momentum: float = 0.0,
        vectorize: bool | None = None,
        client_chunk_size: int | None = None,
        batchnorm: Literal["train", "eval"] = "train",
        weighting: Literal["uniform", "num_samples"] = "uniform",
        num_workers: int = 0,
        seed: int = 0,
        client_dp: ClientLevelDP | None = None,
        cohort_size: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if datamodule is not None and not isinstance(datamodule, pl.LightningDataModule):
            raise TypeError(f"datamodule must be a LightningDataModule, got {type(datamodule).__name__}")
        self._set_rounds(
            algorithm,
            num_clients,
            clients_per_round,
            local_batch_size,
            local_steps,
            local_lr,
            partition,
            dirichlet_alpha,
            shards_per_client,
            rounds_per_epoch,
        )
        self.server_optimizer = check_choice(server_optimizer, "server_optimizer", ("sgd", "adam"))
        self.server_lr = check_positive(server_lr, "server_lr")
        self.server_momentum = check_number(server_momentum, "server_momentum", low=0.0, high=1.0, high_open=True)
        _check_module_runs(module, algorithm, vectorize)
        self.vectorize = vectorize
        self.client_chunk_size = (
            None if client_chunk_size is None else check_positive_int(client_chunk_size, "client_chunk_size")
        )
        self.weighting = check_choice(weighting, "weighting", ("uniform", "num_samples"))
        self.batchnorm = check_choice(batchnorm, "batchnorm", ("train", "eval"))
        self.num_workers = check_int(num_workers, "num_workers", low=0)
        _check_client_dp(client_dp, weighting, module)
        self.cohort_size = clients_per_round if cohort_size is None else check_positive_int(cohort_size, "cohort_size")
        if self.cohort_size < clients_per_round:
            raise ValueError(f"cohort_size ({cohort_size}) cannot be below clients_per_round ({clients_per_round})")
        self.client_dp = client_dp
        self.seed = seed
        self.module = module
        self.source_datamodule = datamodule
        self.loss_fn = loss_fn if loss_fn is not None else getattr(module, "loss_fn", None) or nn.CrossEntropyLoss()
        self.automatic_optimization = False
        self.client_indices: list[Tensor] | None = None
        self._rounds: ClientRounds | None = None
        self._restored_defense_states: set[str] = set()
        self._monitors: dict[int, str] = {}  # scheduler id -> the metric a ReduceLROnPlateau monitors
        self._choices: dict[tuple[int, int], tuple[list[int], str]] = {}  # (round, client) -> chosen data
        self.save_hyperparameters(ignore=["module", "datamodule", "loss_fn", "client_dp"])

    def _set_rounds(
        self,
        algorithm: Algorithm,
        num_clients: int,
        clients_per_round: int,
        local_batch_size: int,
        local_steps: int,
        local_lr: float,
        partition: str,
        dirichlet_alpha: float,
        shards_per_client: int,
        rounds_per_epoch: int | None,
    ) -> None:
        """Check and keep what one round is: the algorithm, the clients, their local work and data split."""
        self.algorithm = check_choice(algorithm, "algorithm", ("fedsgd", "fedavg"))
        self.num_clients = check_positive_int(num_clients, "num_clients")
        self.clients_per_round = check_positive_int(clients_per_round, "clients_per_round")
        if clients_per_round > num_clients:
            raise ValueError(f"clients_per_round ({clients_per_round}) cannot exceed num_clients ({num_clients})")
        self.local_batch_size = check_positive_int(local_batch_size, "local_batch_size")
        self.local_steps = check_positive_int(local_steps, "local_steps")
        if algorithm == "fedsgd" and local_steps != 1:
            raise ValueError("local_steps > 1 needs algorithm='fedavg' (a FedSGD client shares one gradient)")
        self.local_lr = check_positive(local_lr, "local_lr")
        self.partition = check_choice(partition, "partition", PARTITION_SCHEMES)
        self.dirichlet_alpha = check_positive(dirichlet_alpha, "dirichlet_alpha")
        self.shards_per_client = check_positive_int(shards_per_client, "shards_per_client")
        self.rounds_per_epoch = (
            None if rounds_per_epoch is None else check_positive_int(rounds_per_epoch, "rounds_per_epoch")
        )

    # ------------------------------------------------------------------ the client step
    def client_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ClientSetup:
        shapes = {n: p.shape for n, p in trainable_parameters(self.module).items()}
        return ClientSetup(self.num_clients, self.module, shapes, cohort_size=self.cohort_size)

    @property
    def client_module(self) -> nn.Module:
        """The model every client trains (its gradient is what clients share)."""
        return self.module

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._restored_defense_states = _defense_states(checkpoint)

    def on_fit_start(self) -> None:
        check_model_fits_data(self.module, self.source_datamodule)
        # Lightning restores callback state only into callbacks present now and drops the rest
        # without a word; for a defense that would reset every client's error-feedback residuals
        # and random streams. The guard lives here, not in the defense callbacks, because it must
        # fire when the callbacks are missing (callbacks that are present but configured
        # differently have already refused the checkpoint themselves).
        saved, self._restored_defense_states = self._restored_defense_states, set()
        present = {
            cb.state_key
            for cb in trainer_callbacks(self.trainer)
            if isinstance(cb, DefenseStage) and isinstance(cb, Callback)
        }
        missing = sorted(saved - present)
        if missing:
            raise ValueError(
                f"the checkpoint holds per-client defense state (error-feedback residuals, random streams) for "
                f"{', '.join(missing)}, but this Trainer has no such defense callback, so resuming would drop every "
                "client's state silently. Resume with the defense callbacks (and settings) the run was started "
                "with, or start a new run without ckpt_path"
            )

    # ------------------------------------------------------------------ model

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x)

    def configure_optimizers(self) -> Any:
        if isinstance(self.module, pl.LightningModule) and is_overridden(
            "configure_optimizers", self.module, pl.LightningModule
        ):
            config = self.module.configure_optimizers()
            # Under manual optimization Lightning drops a scheduler's "monitor"; the simulation steps
            # the schedulers itself, so it keeps the monitors.
            schedulers = config.get("lr_scheduler") if isinstance(config, dict) else None
            if isinstance(schedulers, dict) and "monitor" in schedulers:
                self._monitors[id(schedulers["scheduler"])] = schedulers["monitor"]
            return config
        params = list(trainable_parameters(self.module).values())
        if self.server_optimizer == "adam":
            return torch.optim.Adam(params, lr=self.server_lr)
        return torch.optim.SGD(params, lr=self.server_lr, momentum=self.server_momentum)

    # ------------------------------------------------------------------ data
    def prepare_data(self) -> None:
        self._require_datamodule().prepare_data()

    def setup(self, stage: str) -> None:
        if self._trainer is not None and getattr(self.trainer, "datamodule", None) is not None:
            raise ValueError(
                "FederatedSimulation splits its own data among clients: pass the datamodule as "
                "FederatedSimulation(datamodule=...), not to Trainer.fit/validate/test"
            )
        if self.trainer is not None and self.trainer.world_size > 1:
            raise NotImplementedError(
                "FederatedSimulation runs every client in one process; for one client per rank, train your "
                "LightningModule under DDP directly (the defense callbacks then run in the DDP comm hook)"
            )
        datamodule = self._require_datamodule()
        datamodule.setup(stage)
        if isinstance(self.module, ClientGradientProvider):
            self.module.prepare_clients(datamodule)
        if isinstance(self.module, ClientUpdateProvider):
            self.module.prepare_clients(datamodule, num_clients=self.num_clients)
        if stage == "fit":
            self._build_clients(datamodule)

    def _require_datamodule(self) -> pl.LightningDataModule:
        if self.source_datamodule is None:
            raise ValueError("FederatedSimulation needs data: pass datamodule=YourDataModule(...)")
        return self.source_datamodule

    def _build_clients(self, datamodule: pl.LightningDataModule) -> None:
        dataset = getattr(datamodule, "train_dataset", None)
        if dataset is None:
            raise ValueError(
                f"{type(datamodule).__name__} has no train_dataset after setup('fit'); the simulation splits it among clients"
            )
        targets = getattr(dataset, "targets", None)
        if targets is None and self.partition != "iid":
            targets = torch.as_tensor([int(y) for _, y in dataset])
        self.client_indices = partition(
            self.partition,  # type: ignore[arg-type]  # checked against PARTITION_SCHEMES in __init__
            self.num_clients,
            num_samples=len(dataset),
            targets=targets,
            dirichlet_alpha=self.dirichlet_alpha,
            shards_per_client=self.shards_per_client,
            seed=self.seed,
        )
        self._rounds = ClientRounds(
            dataset,
            self.client_indices,
            self.clients_per_round,
            self.local_batch_size,
            self.local_steps,
            seed=self.seed,
        )
        self._apply_choices()
        small = [c for c, idx in enumerate(self.client_indices) if len(idx) < self.local_batch_size * self.local_steps]
        if small:
            warnings.warn(
                f"clients {small[:10]}{'...' if len(small) > 10 else ''} hold fewer than local_batch_size * local_steps "
                "samples and draw their local batches with replacement",
                stacklevel=2,
            )

    def _apply_choices(self) -> None:
        """Give the rounds the data :meth:`choose_batch` fixed (positions resolved in the partitions)."""
        assert self._rounds is not None and self.client_indices is not None
        for (round_idx, client), (items, by) in self._choices.items():
            if by == "position":
                owned = self.client_indices[client]
                outside = [p for p in items if not 0 <= p < len(owned)]
                if outside:
                    raise ValueError(
                        f"positions {outside} are outside client {client}'s partition, which holds {len(owned)} "
                        f"samples (positions 0..{len(owned) - 1})"
                    )
                items = owned[torch.as_tensor(items, dtype=torch.long)].tolist()
            self._rounds.choose(round_idx, client, items)

    def choose_batch(self, round: int, client: int, items: Sequence[int], *, by: str = "index") -> None:
        """Fix client ``client``'s local data in round ``round`` (to audit chosen images).

        ``items`` are ``local_steps * local_batch_size`` indices into the datamodule's
        ``train_dataset`` (``by="index"``) or positions in that client's own partition
        (``by="position"``); every other round and client keeps its seeded sample. The round still
        runs the ordinary client step, defenses included. Call before ``Trainer.fit``.
        """
        check_int(round, "round", low=0)
        check_int(client, "client", low=0, high=self.num_clients - 1)
        check_choice(by, "by", ("index", "position"))
        values = [check_int(as_int(v), "items", low=0) for v in items]
        if len(values) != self.local_steps * self.local_batch_size:
            raise ValueError(
                f"items must hold local_steps * local_batch_size = {self.local_steps * self.local_batch_size} "
                f"samples, got {len(values)}"
            )
        self._choices[(round, client)] = (values, by)
        if self._rounds is not None:  # already set up: apply now
            self._apply_choices()

    def local_indices(self, round: int, client: int) -> list[int]:
        """The ``train_dataset`` indices of client ``client``'s local data in round ``round``."""
        if self._rounds is None:
            raise RuntimeError("local_indices() is only available after setup('fit')")
        return self._rounds.sample_local_indices(round, client).tolist()

    def train_dataloader(self) -> RoundLoader:
        if self._rounds is None:
            raise RuntimeError("train_dataloader() is only available after setup('fit')")
        per_round = self.clients_per_round * self.local_batch_size * self.local_steps
        rounds = self.rounds_per_epoch or max(1, math.ceil(len(cast(Sized, self._rounds.dataset)) / per_round))
        # The sampler starts each epoch at the current step, so round r always gets data r.
        sampler = RoundSampler(lambda: self.global_step, rounds)
        return RoundLoader(self._rounds, batch_size=None, sampler=sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> Any:
        return self._require_datamodule().val_dataloader()

    def test_dataloader(self) -> Any:
        return self._require_datamodule().test_dataloader()

    # ------------------------------------------------------------------ one round
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        round_idx = int(batch["round"])
        client_ids: list[int] = batch["client_ids"].tolist()
        inputs, targets = batch["inputs"], batch["targets"]
        self.module.train()
        if self.batchnorm == "eval":
            set_batchnorm_mode(self.module, "eval")
        provider = self.module if isinstance(self.module, ClientUpdateProvider) else None
        if isinstance(self.module, ClientGradientProvider):
            updates, losses, buffers = self._provided_gradients(batch, client_ids, round_idx)
        elif provider is not None:
            updates, losses, buffers = self._provided_updates(provider, batch, client_ids, round_idx)
        else:
            updates, losses, buffers = self._client_updates(inputs, targets)

        pipeline = self.fit_pipeline()
        local = {client: {name: update[i] for name, update in updates.items()} for i, client in enumerate(client_ids)}
        client_batches = {
            client: (inputs[i].flatten(0, 1), targets[i].flatten(0, 1)) for i, client in enumerate(client_ids)
        }
        meta = {
            "path": self.execution_path,
            "algorithm": self.algorithm,
            "local_batch_size": self.local_batch_size,
            "local_steps": self.local_steps,
            "local_lr": self.local_lr,
            "batchnorm": self.batchnorm,
        }
        if provider is not None:
            meta["upload"] = "weights"  # the client sends w_shared = w_global - update (CommunicationMeter)
        # every client's update is known now: a stage that prepares the round (ADGP's mask) is
        # prepared from the updates as the stages before it defend them, each client's once
        pipeline.begin_round(
            round_idx, client_ids, local, share_in_process, model=self.module, batches=client_batches, meta=meta
        )
        if self.client_dp is not None:
            meta["client_dp"] = self.client_dp.config()
        shared = [
            self._share(
                pipeline, local[client], StageCall(client, round_idx, self.module, client_batches[client], meta)
            )
            for client in client_ids
        ]
        if self.client_dp is not None:
            aggregate = self.client_dp.noised_mean(shared, self.clients_per_round, round_idx)
        else:
            weights = None
            if self.weighting == "num_samples" and self.client_indices is not None:
                weights = [len(self.client_indices[c]) for c in client_ids]
            aggregate = (
                weighted_mean(shared, weights) if provider is None else provider.aggregate_updates(shared, weights)
            )
        pipeline.finish_round(aggregate, round=round_idx, clients=len(client_ids))
        self._server_step(aggregate, buffers)

        loss = losses.mean()
        self.log("train_loss", loss, prog_bar=True, batch_size=len(client_ids))
        if self.client_dp is not None:
            self._account(round_idx + 1, len(client_ids))
        return loss

    def _share(self, pipeline: Any, update: dict[str, Tensor], call: StageCall) -> dict[str, Tensor]:
        """What one client sends: its update through the defenses, clipped to DP-FedAvg's norm when
        :attr:`client_dp` is set (the last step on the client), then shown to the observers."""
        if self.client_dp is None:
            return pipeline.process(update, call)
        shared = self.client_dp.clip(pipeline.defend(update, call))
        pipeline.observe(shared, call)
        return shared

    # ------------------------------------------------------------------ client-level DP
    @property
    def dp_sample_rate(self) -> float:
        """The rate DP-FedAvg's accounting charges per round (:meth:`ClientLevelDP.sample_rate`)."""
        if self.client_dp is None:
            raise RuntimeError("dp_sample_rate needs client_dp")
        return self.client_dp.sample_rate(self.clients_per_round, self.num_clients)

    def dp_epsilon(self, rounds: int | None = None) -> float:
        """The client-level epsilon after ``rounds`` rounds (default: the rounds trained so far)."""
        if self.client_dp is None:
            raise RuntimeError("dp_epsilon needs client_dp: FederatedSimulation(client_dp=ClientLevelDP(...))")
        return self.client_dp.epsilon(self.global_step if rounds is None else rounds, self.dp_sample_rate)

    def _account(self, rounds: int, clients: int) -> None:
        """Log the epsilon (and eta) after ``rounds`` rounds; stop before a round past the budget."""
        dp = self.client_dp
        assert dp is not None
        self.log("dp_epsilon", self.dp_epsilon(rounds), prog_bar=True, batch_size=clients)
        if dp.kappa is not None:
            self.log("dp_rero_eta", dp.eta(rounds, self.dp_sample_rate, dp.kappa), batch_size=clients)
        self._stop_at_budget(rounds)

    def _stop_at_budget(self, rounds: int) -> None:
        dp = self.client_dp
        if dp is None or dp.stop_at_epsilon is None or self._trainer is None or self.trainer.should_stop:
            return
        if not dp.allows(rounds + 1, self.dp_sample_rate):
            self.trainer.should_stop = True
            rank_zero_info(
                f"FederatedSimulation: stopping after {rounds} round(s), epsilon {self.dp_epsilon(rounds):.4g} at delta "
                f"{dp.delta:.3g}: one more round would spend more than stop_at_epsilon={dp.stop_at_epsilon:g}"
            )

    def on_train_start(self) -> None:
        self._stop_at_budget(self.global_step)

    def _provided_gradients(
        self, batch: dict[str, Any], client_ids: list[int], round_idx: int
    ) -> tuple[dict[str, Tensor], Tensor, None]:
        """Each client's gradient from a :class:`ClientGradientProvider` module (one client at a time)."""
        provider = cast(ClientGradientProvider, self.module)
        per_client, losses = [], []
        for i, client in enumerate(client_ids):
            grads, loss = provider.client_gradient(
                batch["inputs"][i, 0],
                batch["targets"][i, 0],
                client_id=client,
                round=round_idx,
                sample_ids=batch["indices"][i, 0] if "indices" in batch else None,
            )
            per_client.append(grads)
            losses.append(loss.detach())
        return self._stack_provided(per_client, f"{type(provider).__name__}.client_gradient"), torch.stack(losses), None

    def _provided_updates(
        self, provider: ClientUpdateProvider, batch: dict[str, Any], client_ids: list[int], round_idx: int
    ) -> tuple[dict[str, Tensor], Tensor, None]:
        """Each client's pseudo-gradient from a :class:`ClientUpdateProvider` module (one client at a time)."""
        provider.begin_round(round_idx)
        per_client, losses = [], []
        for i, client in enumerate(client_ids):
            update, loss = provider.client_update(
                batch["inputs"][i],
                batch["targets"][i],
                client_id=client,
                round=round_idx,
                lr=self.local_lr,
                sample_ids=batch["indices"][i] if "indices" in batch else None,
            )
            per_client.append(update)
            losses.append(loss.detach())
        return self._stack_provided(per_client, f"{type(provider).__name__}.client_update"), torch.stack(losses), None

    def _stack_provided(self, per_client: list[dict[str, Tensor]], source: str) -> dict[str, Tensor]:
        names = list(trainable_parameters(self.module))
        missing = sorted(set(names) - set(per_client[0]))
        if missing:
            raise ValueError(f"{source} returned nothing for {missing}")
        return {n: torch.stack([client[n] for client in per_client]) for n in names}

    def _client_updates(
        self, inputs: Tensor, targets: Tensor
    ) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor] | None]:
        vectorize = self.vectorize if self.vectorize is not None else not updates_running_stats(self.module)
        try:
            return self._compute_updates(inputs, targets, vectorize)
        except RuntimeError as err:
            if not vectorize or self.vectorize is not None:
                raise
            warnings.warn(f"vmap over clients failed ({err}); falling back to one pass per client", stacklevel=2)
            self.vectorize = False
            return self._compute_updates(inputs, targets, False)

    def _compute_updates(
        self, inputs: Tensor, targets: Tensor, vectorize: bool
    ) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor] | None]:
        if self.algorithm == "fedsgd":
            grads, losses = client_gradients(
                self.module,
                self.loss_fn,
                inputs[:, 0],
                targets[:, 0],
                vectorize=vectorize,
                chunk_size=self.client_chunk_size,
            )
            return grads, losses, None
        return client_local_updates(
            self.module,
            self.loss_fn,
            inputs,
            targets,
            lr=self.local_lr,
            vectorize=vectorize,
            chunk_size=self.client_chunk_size,
        )

    @torch.no_grad()
    def _server_step(self, update: dict[str, Tensor], buffers: dict[str, Tensor] | None) -> None:
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)  # configure_optimizers returns one optimizer
        optimizer.zero_grad(set_to_none=True)
        for name, param in trainable_parameters(self.module).items():
            param.grad = update[name].to(param.dtype)
        optimizer.step()
        if buffers is not None:
            for name, buffer in self.module.named_buffers():
                buffer.copy_(buffers[name])
        self._step_schedulers("step")

    def on_train_epoch_end(self) -> None:
        self._step_schedulers("epoch")

    def _step_schedulers(self, interval: str) -> None:
        for config in self.trainer.lr_scheduler_configs:
            if config.interval == interval:
                count = self.trainer.global_step if interval == "step" else self.trainer.current_epoch + 1
                if count % config.frequency != 0:
                    continue
                if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    monitor = config.monitor or self._monitors.get(id(config.scheduler))
                    metrics = self.trainer.callback_metrics
                    if monitor not in metrics:
                        raise ValueError(
                            f"ReduceLROnPlateau monitors {monitor!r}, which was not logged; logged: {sorted(metrics)} "
                            "(the simulation logs train_loss, val_loss and val_acc; return "
                            '{"lr_scheduler": {"scheduler": ..., "monitor": "train_loss"}} from configure_optimizers)'
                        )
                    config.scheduler.step(metrics[monitor])
                else:
                    config.scheduler.step()

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch[0], batch[1]
        logits = self.module(x)
        self.log(f"{stage}_loss", self.loss_fn(logits, y), prog_bar=False, batch_size=len(y))
        if logits.ndim == 2 and y.ndim == 1:
            self.log(f"{stage}_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True, batch_size=len(y))
