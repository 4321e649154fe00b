"""The server simulates a setting's clients to train the learned inverter
(:class:`~lightning_gp.attacks.learned.LearnedInversion`, Wu et al., UAI 2023).

:func:`setting_simulator` runs a :class:`~lightning_gp.audit.catalog.DefenseSetting`'s defense
exactly as its clients run it: fresh copies of the setting's own callbacks, in a
:class:`~lightning_gp.pipeline.SharedGradientPipeline` that is given every client's batch
(as :class:`~lightning_gp.federated.FederatedSimulation` gives it), fed the clients' FedSGD
gradients (:func:`~lightning_gp.federated.client_updates.client_gradients`, the simulation's own
client step) or, under FedAvg, their local updates ``w_global - w_local`` after the setting's local
epochs over the batch in its local batches
(:func:`~lightning_gp.federated.client_updates.client_local_updates`), one round of ``num_clients``
fresh clients at a time (a defense that prepares its rounds from every client, ADGP, sees a round of
the size the clients run). Every round's copies
are reseeded from the attack's seed, so the simulated randomness is a stream of the server's own.

Settings whose transform the server cannot run this way (:func:`simulation_refusal` says why):

- a wrapping module (Refiner, ATS, PriPrune): the client's step is the module's own training step
  (Refiner optimises robust data per batch, which costs the defense's own optimisation per training
  pair; PriPrune shares FedAvg weights; ATS's augmented step runs in the module), not a gradient
  pipeline the server can replay from the callbacks;
- the plain-Trainer runner with anything but one :class:`~lightning_gp.callbacks.DPSGD` callback, or a
  DP-SGD that picks its noise multiplier at fit start from a target epsilon (the server does not know
  the run's length).

DP-SGD (the plain-Trainer runner, its clip and noise inside Opacus's optimizer step) is replayed in
tensor form: each client's per-example gradients, clipped, summed, noised and divided by the batch
size as Opacus's ``DPOptimizer`` does (:func:`~lightning_gp.defenses.dp_sgd_gradient`). An audited
client's round is its one batch (under Poisson sampling the audit's loader holds just that batch, so
every example joins), which is what the replay gives.

A changed architecture (PRECODE) is simulated: the server sends that model, so the clients'
gradient is the plain gradient of the model in the view, its sampling included.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.attacks import GradientAttack, InvertingGradients
from lightning_gp.attacks.learned import (
    REFINED_DECOYS,
    DefenseSimulator,
    InverterCache,
    InverterConfig,
    LearnedInversion,
    RefinedLearnedInversion,
)
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.rounds import public_examples
from lightning_gp.defenses.base import share_in_process
from lightning_gp.defenses.clipping import dp_sgd_gradient
from lightning_gp.federated.client_updates import client_gradients, client_local_updates
from lightning_gp.functional import trainable_parameters, updates_running_stats
from lightning_gp.pipeline import ClientSetup, ClientStepRunner, DefenseStage, SharedGradientPipeline, StageCall
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_int, check_nonnegative, check_positive_int


class _ServerSimulatedClients(ClientStepRunner):
    """The runner the server plays when it replays a setting's clients: it hands every client's
    batch to the stages (like the federated simulation) and adds no defense of its own."""

    execution_path = "server-simulation"
    passes_client_batches = True

    def client_setup(self, trainer: Any, pl_module: Any) -> ClientSetup:
        raise RuntimeError("the server's simulation binds its pipeline itself")


def simulation_refusal(setting: DefenseSetting) -> str | None:
    """Why the server cannot replay ``setting``'s clients (``None``: it can)."""
    if setting.wrap is not None:
        return f"{setting.name} wraps the model: the client's step is the wrapping module's own training step"
    if setting.runner == "trainer":
        return _dp_sgd_refusal(setting)
    if setting.runner != "simulation":
        return f"{setting.name} runs its own client step ({setting.runner} runner: the defense acts inside it)"
    stages = [cb for cb in setting.callbacks if not isinstance(cb, DefenseStage)]
    if stages:
        return f"{setting.name} has callbacks that are not pipeline stages: {[type(s).__name__ for s in stages]}"
    return None


def _dp_sgd_refusal(setting: DefenseSetting) -> str | None:
    """Why the server cannot replay a plain-Trainer ``setting`` (``None``: it is one DP-SGD callback
    with a fixed noise multiplier, which :func:`_dp_sgd_simulator` replays)."""
    from lightning_gp.callbacks import DPSGD

    callbacks = list(setting.callbacks)
    if len(callbacks) != 1 or not isinstance(callbacks[0], DPSGD):
        names = [type(cb).__name__ for cb in callbacks]
        return f"{setting.name} runs its own client step (trainer runner with {names}: only DP-SGD alone is replayed)"
    if callbacks[0].noise_multiplier is None:
        return f"{setting.name} picks its noise multiplier at fit start from a target epsilon and the run's length"
    return None


def _dp_sgd_simulator(setting: DefenseSetting, num_clients: int, loss: nn.Module) -> DefenseSimulator:
    """DP-SGD's clients replayed in tensor form (:func:`~lightning_gp.defenses.dp_sgd_gradient`):
    per-example gradients of each client's batch, clipped, summed, noised and averaged."""
    dp_sgd: Any = setting.callbacks[0]  # a DPSGD with a noise multiplier (_dp_sgd_refusal)
    clip, sigma = float(dp_sgd.max_grad_norm), float(dp_sgd.noise_multiplier)

    def simulate(model: nn.Module, images: Tensor, labels: Tensor, seed: int) -> dict[str, Tensor]:
        _check_client_batches(images, labels)
        model.train()
        vectorize = not updates_running_stats(model)
        generator = seeded_generator(seed)
        out: dict[str, list[Tensor]] = {}
        for start in range(0, images.shape[0], num_clients):
            xs, ys = images[start : start + num_clients], labels[start : start + num_clients]
            # every example its own "client" of one image: its gradient is the one Opacus clips
            flat_x = xs.reshape(-1, 1, *xs.shape[2:])
            grads, _ = client_gradients(model, loss, flat_x, ys.reshape(-1, 1), vectorize=vectorize)
            for c in range(xs.shape[0]):
                rows = slice(c * xs.shape[1], (c + 1) * xs.shape[1])
                shared = dp_sgd_gradient({n: g[rows] for n, g in grads.items()}, clip, sigma, generator=generator)
                for name, tensor in shared.items():
                    out.setdefault(name, []).append(tensor.detach())
        return {n: torch.stack(parts) for n, parts in out.items()}

    return simulate


def _check_client_batches(images: Tensor, labels: Tensor) -> None:
    if images.ndim < 3 or labels.shape != images.shape[:2]:
        raise ValueError(
            f"images must be [N, B, ...] and labels [N, B]; got {tuple(images.shape)}, {tuple(labels.shape)}"
        )


def _reseeded(callbacks: list[Any], seed: int, loss_fn: nn.Module) -> list[Any]:
    """Fresh copies of ``callbacks`` whose defenses draw from streams seeded by ``seed``; a callback
    that takes the client's loss at fit start (GradDefense's root-set sensitivity) gets ``loss_fn``,
    the loss the simulation's clients train with."""
    copies = [copy.deepcopy(cb) for cb in callbacks]
    for index, stage in enumerate(copies):
        if hasattr(stage, "loss_fn") and stage.loss_fn is None:
            stage.loss_fn = loss_fn
        defense = getattr(stage, "defense", None)
        if defense is not None and hasattr(defense, "reset"):
            defense.reset()
            defense.seed = int(seeded_generator(seed, index).initial_seed() % (2**62))
        reset_adapter = getattr(stage, "reset_adapter_state", None)
        if callable(reset_adapter):
            reset_adapter()
    return copies


#: Adam steps of the refined learned inverter's gradient matching (Wu et al.'s "LTI + optimisation").
REFINE_ITERATIONS = 200


def setting_simulator(
    setting: DefenseSetting, *, num_clients: int = 10, round: int = 0, loss_fn: nn.Module | None = None
) -> DefenseSimulator:
    """``simulate(model, images [N, B, ...], labels [N, B], seed)``: what ``N`` fresh clients of
    ``setting`` holding those batches share in round ``round`` (groups of ``num_clients`` clients
    per simulated round; every stage is told ``round``): the defended gradient, or under FedAvg the
    defended local update (:func:`_client_updates`). Fresh: no state carried from earlier
    rounds (an error-feedback residual, Outpost's step counter start empty; the server holds no
    client's). DP-SGD's replay keeps nothing across rounds, so its round changes nothing. Raises
    ``ValueError`` when the server cannot replay the setting (:func:`simulation_refusal`)."""
    refusal = simulation_refusal(setting)
    if refusal is not None:
        raise ValueError(f"setting: {refusal}")
    check_positive_int(num_clients, "num_clients")
    check_int(round, "round", low=0)
    loss = nn.CrossEntropyLoss() if loss_fn is None else loss_fn
    if setting.runner == "trainer":
        return _dp_sgd_simulator(setting, num_clients, loss)
    runner = _ServerSimulatedClients()

    def simulate(model: nn.Module, images: Tensor, labels: Tensor, seed: int) -> dict[str, Tensor]:
        _check_client_batches(images, labels)
        model.train()
        shapes = {n: p.shape for n, p in trainable_parameters(model).items()}
        vectorize = not updates_running_stats(model)
        out: dict[str, list[Tensor]] = {n: [] for n in shapes}
        for group, start in enumerate(range(0, images.shape[0], num_clients)):
            xs, ys = images[start : start + num_clients], labels[start : start + num_clients]
            clients = list(range(xs.shape[0]))
            pipeline = SharedGradientPipeline(_reseeded(setting.callbacks, seed + group, loss), [])
            pipeline.bind(ClientSetup(len(clients), model, shapes), runner)
            grads, meta = _client_updates(setting, model, loss, xs, ys, seeded_generator(seed, group), vectorize)
            local = {c: {n: g[c] for n, g in grads.items()} for c in clients}
            batches = {c: (xs[c], ys[c]) for c in clients}
            meta["path"] = runner.execution_path
            pipeline.begin_round(round, clients, local, share_in_process, model=model, batches=batches, meta=meta)
            for c in clients:
                shared = pipeline.process(local[c], StageCall(c, round, model, batches[c], meta))
                for n in shapes:
                    out[n].append(shared[n].detach())
            pipeline.finish_round({}, round=round, clients=len(clients))
        return {n: torch.stack(parts) for n, parts in out.items()}

    return simulate


def _client_updates(
    setting: DefenseSetting,
    model: nn.Module,
    loss: nn.Module,
    xs: Tensor,
    ys: Tensor,
    generator: torch.Generator,
    vectorize: bool,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """What clients holding the batches ``xs`` ``[C, B, ...]`` compute before their defense, and the meta
    the stages are told: FedSGD's gradient, or FedAvg's update ``w_global - w_local`` after
    ``local_epochs`` epochs over the ``B`` images in batches of ``local_batch_size`` (each epoch a fresh
    order drawn from ``generator``, as :func:`~lightning_gp.audit.rounds.local_schedule` orders an
    audited client's) at ``local_lr``."""
    if setting.algorithm == "fedsgd":
        grads, _ = client_gradients(model, loss, xs, ys, vectorize=vectorize)
        return grads, {"algorithm": "fedsgd", "local_batch_size": int(xs.shape[1])}
    images = int(xs.shape[1])
    batch = images if setting.local_batch_size is None else setting.local_batch_size
    if images % batch:
        raise ValueError(
            f"local_batch_size={batch} must divide the {images} images each simulated client holds: a FedAvg "
            "client's epoch is n / local_batch_size full local batches"
        )
    epochs = setting.local_epochs if setting.local_training else 1
    orders = torch.stack(
        [torch.cat([torch.randperm(images, generator=generator) for _ in range(epochs)]) for _ in range(xs.shape[0])]
    )  # [C, epochs * B]
    steps = epochs * images // batch
    picked = torch.arange(xs.shape[0])[:, None]
    step_x = xs[picked, orders].reshape(xs.shape[0], steps, batch, *xs.shape[2:])
    step_y = ys[picked, orders].reshape(xs.shape[0], steps, batch, *ys.shape[2:])
    updates, _, _ = client_local_updates(model, loss, step_x, step_y, lr=setting.local_lr, vectorize=vectorize)
    meta = {"algorithm": "fedavg", "local_batch_size": batch, "local_steps": steps, "local_lr": setting.local_lr}
    return updates, meta


def aggregate_simulator(simulate: DefenseSimulator, clients: int, absent_noise_std: float = 0.0) -> DefenseSimulator:
    """What a server behind secure aggregation sees of ``clients`` simulated clients: ``simulate`` on each
    client's share of a batch of ``clients x B`` images (client ``k`` the ``k``-th ``B``, the order of
    :func:`~lightning_gp.audit.rounds.aggregate_record`), their shared updates averaged as the audit's
    round combines them (the uniform mean of equal batches); ``absent_noise_std``: the std of the noise
    shares of a cohort's other clients in the sum (fresh per draw, over ``clients`` on the mean;
    :func:`~lightning_gp.audit.setting_audit.with_absent_shares`)."""
    check_positive_int(clients, "clients")
    check_nonnegative(absent_noise_std, "absent_noise_std")

    def simulated(model: nn.Module, images: Tensor, labels: Tensor, seed: int) -> dict[str, Tensor]:
        _check_client_batches(images, labels)
        count, total = labels.shape[0], labels.shape[1]
        if total % clients:
            raise ValueError(f"images: a batch of {total} images does not split among {clients} clients")
        per = total // clients
        shared = simulate(
            model, images.reshape(count * clients, per, *images.shape[2:]), labels.reshape(count * clients, per), seed
        )
        generator = torch.Generator().manual_seed(seed)
        out = {}
        for n, g in shared.items():
            mean = g.reshape(count, clients, *g.shape[1:]).mean(1)
            if absent_noise_std > 0:
                noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype).to(mean.device)
                mean = mean + noise * (absent_noise_std / clients)
            out[n] = mean
        return out

    return simulated


def _inverter_key(
    setting: DefenseSetting, round: int, num_clients: int, aggregate_of: int | None, absent_noise_std: float
) -> str:
    """The defense part of an inverter's cache key: the setting, its round and clients, the aggregate and,
    under FedAvg, the local training it replays."""
    return (
        f"{setting.name}|{[repr(cb) for cb in setting.callbacks]}|architecture={setting.architecture is not None}"
        f"|round={round}|num_clients={num_clients}"
        + ("" if aggregate_of is None else f"|aggregate_of={aggregate_of}|absent_noise={absent_noise_std:g}")
        + (
            ""
            if setting.algorithm == "fedsgd"
            else f"|fedavg E={setting.local_epochs} b={setting.local_batch_size} lr={setting.local_lr:g}"
        )
    )


def learned_inversion_attacks(
    setting: DefenseSetting,
    datamodule: Any,
    *,
    adaptive: list[GradientAttack] | None = None,
    public_size: int = 10_000,
    num_clients: int = 10,
    config: InverterConfig | None = None,
    refine_iterations: int = REFINE_ITERATIONS,
    refined_decoys: int = REFINED_DECOYS,
    cache: InverterCache | None = None,
    seed: int = 0,
    round: int = 0,
    aggregate_of: int | None = None,
    absent_noise_std: float = 0.0,
) -> list[GradientAttack]:
    """The learned inverter of ``setting`` and its refined variant, trained on the public split
    (:func:`~lightning_gp.audit.rounds.public_examples`: the test split, at most ``public_size``
    images), never on a training image. The refinement matches with the first Inverting-Gradients
    attack of ``adaptive`` (the setting's defense-aware one), else the published one;
    ``refined_decoys`` sets the refined variant's prior-only control (:class:`RefinedLearnedInversion`).
    ``[]`` when the server cannot replay the setting (:func:`simulation_refusal`).

    ``round``: the round attacked. The server simulates that round (:func:`setting_simulator` with
    ``round``: the round index every stage is told, e.g. what seeds a data-dependent defense's
    statistic or which client provides ADGP's mask) at the weights of the attacked view (the
    inverter's cache key holds them, :meth:`~lightning_gp.attacks.learned.LearnedInversion.key`, and
    the round and ``num_clients`` are part of its defense key, so an inverter of round 0 is never
    reused for another round). Its clients are fresh, as the server can simulate them: a defense that
    carries per-client state from round to round (error feedback of Top-k and DGP, Outpost's step
    counter; :func:`~lightning_gp.audit.rounds.active_replay_blocker` lists them) starts from an empty
    state in the simulation, while the attacked client at a trained round carries ``round`` rounds of
    it. The inverter then learns the defense as a fresh client applies it, which is not what that
    client shares: an attack that still runs (its leaks are real leaks), but weaker there than one
    trained on the client's own state, which the server does not hold.

    ``aggregate_of=K``: the inverters attack the secure aggregate of ``K`` clients (one simulated round of
    ``K``): trained on the mean of ``K`` simulated clients' shared updates (:func:`aggregate_simulator`),
    they output all ``K x B`` images of the aggregate (``adaptive``: the setting's adaptive attacks lifted
    to the aggregate, one of which the refinement matches with; ``absent_noise_std``: the noise shares
    of a distributed mechanism's other cohort members in the sum)."""
    if simulation_refusal(setting) is not None:
        return []
    check_positive_int(public_size, "public_size")
    check_int(round, "round", low=0)
    for callback in setting.callbacks:  # a defense built on public data (GradDefense's root set) takes it here
        resolve = getattr(callback, "resolve_root_set", None)
        if callable(resolve):
            resolve(datamodule)
    images, labels = public_examples(datamodule, public_size)
    if aggregate_of is None:
        simulate = setting_simulator(setting, num_clients=num_clients, round=round)
    else:
        num_clients = check_positive_int(aggregate_of, "aggregate_of")
        simulate = aggregate_simulator(
            setting_simulator(setting, num_clients=num_clients, round=round), num_clients, absent_noise_std
        )
    key = _inverter_key(setting, round, num_clients, aggregate_of, absent_noise_std)
    matching = next((a for a in adaptive or [] if isinstance(a, InvertingGradients)), None)
    common: dict[str, Any] = {"defense_key": key, "config": config, "cache": cache, "seed": seed}
    return [
        LearnedInversion(simulate, images, labels, **common),
        RefinedLearnedInversion(
            simulate,
            images,
            labels,
            matching=matching,
            refine_iterations=refine_iterations,
            refined_decoys=refined_decoys,
            **common,
        ),
    ]
