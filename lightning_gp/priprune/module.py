"""Pruned FedAvg and PriPrune as client models of :class:`~lightning_gp.federated.FederatedSimulation`.

``FederatedSimulation(module=PriPruneModule(model, ...), algorithm="fedavg")`` runs, each round:

server: base pruning mask (initial, or re-ranked on the scheme's schedule) applied to the global
weights -> every sampled client: start from the global weights (and, with PriPrune, its withheld
weights), local SGD on the pruned model, defense mask -> **shared weights** (as the pseudo-gradient
``w_global - w_shared``, through the trainer's defense and observer callbacks) -> aggregation
(plain weighted FedAvg, or mask-aware) -> server step (SGD at lr 1 = FedAvg).

Both modules implement :class:`~lightning_gp.federated.client_updates.ClientUpdateProvider`. The
server state (base masks, the pruned weights' last values) and, for PriPrune, the mask logits and
withheld weights of every client that has trained are the module's extra state: saved in
checkpoints (compactly: the pruned weights' values, and per client its logits and the values of
the weights it withholds, nothing that is zero by construction), restored bit-exactly on resume,
and never part of what a ``GradientTap`` records (the tap keeps tensors only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_gp.attacks.registry import register_adaptive_attack
from lightning_gp.attacks.sgi import sgi_adaptive_attacks
from lightning_gp.federated.aggregation import weighted_mean
from lightning_gp.functional import LossFn, trainable_parameters
from lightning_gp.named_tensors import flatten_named, unflatten_named
from lightning_gp.priprune.mask import (
    final_share_mask,
    gumbel_share_sample,
    layer_shares,
    local_loss_logit_gradient,
    logit,
)
from lightning_gp.priprune.schemes import (
    BasePruningScheme,
    PruningContext,
    SNIPScheme,
    make_scheme,
    prunable_weights,
)
from lightning_gp.records import TappedGradient
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import (
    check_choice,
    check_int,
    check_nonnegative,
    check_number,
    check_positive,
    check_positive_int,
)

if TYPE_CHECKING:  # the attacks import this module (SGI is registered on PrunedFedAvgModule)
    from lightning_gp.attacks.view import ServerView

PREFIX = "module."  # the client model's parameters are named module.<name> in these wrappers
_FORMAT = "lightning_gp.PrunedFedAvg/2"  # 2: frozen weights and PriPrune client state stored compactly
_FORMATS = ("lightning_gp.PrunedFedAvg/1", _FORMAT)  # 1: dense frozen weights and client state, still read
AGGREGATIONS = ("weighted", "mask_aware")


class PrunedFedAvgModule(pl.LightningModule):
    """FedAvg on a pruned model (PriPrune Alg. 1 without the defense line; Eq. 1).

    The server prunes the prunable weights (``nn.Conv*``/``nn.Linear`` weights) of the global
    model with the base scheme and sends the pruned model; each client trains the pruned model
    (``w <- w - lr dL(w * m)/dw``, so pruned weights stay zero) and returns its pruned weights.
    The server keeps the values of the weights it pruned, so a weight that a re-ranking (magnitude,
    every ``update_every`` rounds) brings back resumes from its last value.

    Args:
        module: the client model (e.g. :class:`~lightning_gp.models.Conv2`); it needs at least
            one prunable layer.
        base_scheme: ``"random"``, ``"magnitude"`` (PruneFL-style periodic re-ranking),
            ``"snip"``, ``"synflow"`` (:mod:`lightning_gp.priprune.schemes`), or a
            :class:`~lightning_gp.priprune.BasePruningScheme` instance.
        base_rate: the base pruning rate (default 0.3, the paper's), for a scheme given by name.
        mask_update_every: re-rank every this many rounds, for a scheme given by name (default:
            the scheme's: 50 for magnitude, never for the others; 0: never).
        aggregation: ``"weighted"``: the paper's weighted average of the received weights (a
            withheld weight counts as 0; the weights are the simulation's ``weighting``);
            ``"mask_aware"``: each weight averaged over the clients that sent it (a weight nobody
            sent keeps its global value).
        loss_fn: the training loss (default: ``module.loss_fn``, else cross-entropy).
        calibration_size: images of the training set the server scores SNIP on (its stand-in
            for public data), drawn with ``seed``.
        seed: seeds the random scheme and the calibration sample (PriPrune: the Gumbel noise).
    """

    kind: ClassVar[str] = "pruned_fedavg"

    def __init__(
        self,
        module: nn.Module,
        base_scheme: str | BasePruningScheme = "magnitude",
        base_rate: float | None = None,
        mask_update_every: int | None = None,
        aggregation: Literal["weighted", "mask_aware"] = "weighted",
        loss_fn: nn.Module | None = None,
        calibration_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if mask_update_every is not None:
            check_int(mask_update_every, "mask_update_every", low=0)
        self.scheme = make_scheme(base_scheme, base_rate, mask_update_every)
        if not prunable_weights(module):
            raise ValueError(
                f"module ({type(module).__name__}) has no prunable layer: base pruning prunes the trainable weights "
                "of nn.Conv1d/2d/3d and nn.Linear layers, and this model has none"
            )
        self.aggregation = check_choice(aggregation, "aggregation", AGGREGATIONS)
        self.calibration_size = check_positive_int(calibration_size, "calibration_size")
        self.seed = check_int(seed, "seed", low=0)
        self.module = module
        self.loss_fn: LossFn = (
            loss_fn if loss_fn is not None else getattr(module, "loss_fn", None) or nn.CrossEntropyLoss()
        )
        self.prunable = list(prunable_weights(module))
        self.masks: dict[str, Tensor] | None = None  # base keep-masks (True = kept), by the client model's names
        self.frozen: dict[str, Tensor] = {}  # the last value of every pruned weight (0 where kept)
        self.mask_round = -1  # the round the masks were last computed at
        self.num_clients: int | None = None
        self._saved_num_clients: int | None = None
        self._calibration: tuple[Tensor, Tensor] | None = None
        self._input_shape: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ the global (pruned) model
    def global_weights(self) -> dict[str, Tensor]:
        """The server's current weights (trainable parameters, detached), by the client model's names."""
        return {n: p.detach() for n, p in trainable_parameters(self.module).items()}

    def pruned(self, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``weights`` with the base mask applied to the prunable ones (``w * m_base``)."""
        if self.masks is None:
            return dict(weights)
        masks = self.masks
        return {n: torch.where(masks[n], w, torch.zeros_like(w)) if n in masks else w for n, w in weights.items()}

    def forward(self, x: Tensor) -> Tensor:
        """The pruned global model (the dense one before the first round's mask)."""
        if self.masks is None:
            return self.module(x)
        return functional_call(self.module, self.pruned(trainable_parameters(self.module)), (x,))

    # ------------------------------------------------------------------ ClientUpdateProvider
    def prepare_clients(self, datamodule: Any, *, num_clients: int) -> None:
        """Called by ``FederatedSimulation`` at setup: the client count and the server's calibration data."""
        check_positive_int(num_clients, "num_clients")
        saved = self._saved_num_clients
        if saved is not None and saved != num_clients:
            raise ValueError(_client_count_error(saved, num_clients))
        self.num_clients = num_clients
        dataset = getattr(datamodule, "train_dataset", None)
        if dataset is None or len(dataset) == 0:
            return
        self._input_shape = tuple(torch.as_tensor(dataset[0][0]).shape)
        if isinstance(self.scheme, SNIPScheme):
            generator = seeded_generator(self.seed, 0xCA11)
            picks = torch.randperm(len(dataset), generator=generator)[: self.calibration_size].tolist()
            items = [dataset[i] for i in picks]
            self._calibration = (
                torch.stack([torch.as_tensor(x) for x, _ in items]),
                torch.stack([torch.as_tensor(y) for _, y in items]),
            )

    @torch.no_grad()
    def begin_round(self, round: int) -> None:
        """Server side, before the clients: the first mask, or a re-ranking on the scheme's schedule;
        the global weights are pruned with the current mask."""
        if self.masks is None or (self.scheme.updates_at(round) and self.mask_round < round):
            self._prune(round)
        params = trainable_parameters(self.module)
        for name, weight in self.pruned(self.global_weights()).items():
            params[name].copy_(weight)

    def _prune(self, round: int) -> None:
        params = trainable_parameters(self.module)
        dense = {
            n: params[n].detach() + self.frozen[n] if n in self.frozen else params[n].detach() for n in self.prunable
        }
        device = next(iter(dense.values())).device
        calibration = None if self._calibration is None else tuple(t.to(device) for t in self._calibration)
        context = PruningContext(
            seed=self.seed,
            round=round,
            calibration=calibration,  # type: ignore[arg-type]  # a pair, as drawn in prepare_clients
            input_shape=self._input_shape,
            loss_fn=self.loss_fn,
        )
        masks = self.scheme.masks(self.module, dense, context)
        self.masks = {n: m.to(device) for n, m in masks.items()}
        self.frozen = {n: torch.where(self.masks[n], torch.zeros_like(w), w) for n, w in dense.items()}
        for n, w in dense.items():  # a weight the new mask keeps resumes from its last value
            params[n].copy_(torch.where(self.masks[n], w, torch.zeros_like(w)))
        self.mask_round = round

    def client_update(
        self,
        inputs: Tensor,
        targets: Tensor,
        *,
        client_id: int,
        round: int,
        lr: float,
        sample_ids: Tensor | None = None,
    ) -> tuple[dict[str, Tensor], Tensor]:
        """One client's round: local training on ``inputs [S, B, ...]`` from the pruned global model;
        returns ``w_global - w_shared`` (named ``module.<name>``) and the mean local loss."""
        if self.masks is None:
            raise RuntimeError("begin_round(round) must run before client_update: the server has not pruned yet")
        high = None if self.num_clients is None else self.num_clients - 1
        check_int(client_id, "client_id", low=0, high=high)
        check_positive(lr, "lr")
        if inputs.ndim < 2 or targets.shape[:1] != inputs.shape[:1]:
            raise ValueError(
                f"inputs must be [S, B, ...] and targets [S, B] (S local steps), got {tuple(inputs.shape)} and "
                f"{tuple(targets.shape)}"
            )
        start = self.global_weights()
        shared, loss = self._train_client(client_id, round, start, inputs, targets, lr)
        return {PREFIX + n: start[n] - shared[n] for n in start}, loss

    def _train_client(
        self, client_id: int, round: int, global_weights: dict[str, Tensor], inputs: Tensor, targets: Tensor, lr: float
    ) -> tuple[dict[str, Tensor], Tensor]:
        """Eq. 1: SGD on the pruned model; returns the pruned local weights and the mean loss."""
        weights = {n: w.clone() for n, w in global_weights.items()}
        losses = []
        for x, y in zip(inputs, targets):
            live = {n: w.requires_grad_(True) for n, w in weights.items()}
            with torch.enable_grad():
                loss = self.loss_fn(functional_call(self.module, self.pruned(live), (x,)), y)
                grads = torch.autograd.grad(loss, list(live.values()), allow_unused=True)
            weights = {n: (w - lr * g if g is not None else w).detach() for (n, w), g in zip(live.items(), grads)}
            losses.append(loss.detach())
        return self.pruned(weights), torch.stack(losses).mean()

    def aggregate_updates(
        self, updates: Sequence[Mapping[str, Tensor]], weights: Sequence[float] | None
    ) -> dict[str, Tensor]:
        """The server's aggregate of the shared pseudo-gradients (what its SGD at lr 1 applies).

        ``"weighted"``: :func:`~lightning_gp.federated.weighted_mean` (Alg. 1 line 11).
        ``"mask_aware"``: from the received weights ``w_i = w_global - update_i``, each entry is
        ``sum_i c_i w_i / sum_i c_i [w_i != 0]`` over the clients that sent it (nonzero), the
        global value where no client did.
        """
        if self.aggregation == "weighted":
            return weighted_mean([dict(u) for u in updates], weights)
        current = {PREFIX + n: w for n, w in self.global_weights().items()}
        received = [{n: current[n] - u[n] for n in u} for u in updates]
        mean = weighted_mean(received, weights)
        coverage = weighted_mean([{n: (w != 0).to(w.dtype) for n, w in r.items()} for r in received], weights)
        return {
            n: current[n] - torch.where(coverage[n] > 0, mean[n] / coverage[n].clamp_min(1e-30), current[n])
            for n in mean
        }

    # ------------------------------------------------------------------ checkpoint state
    def get_extra_state(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "kind": self.kind,
            "base_scheme": self.scheme.name,
            "base_rate": self.scheme.rate,
            "num_clients": -1 if self.num_clients is None else self.num_clients,
            # references, as state_dict gives (the module replaces these tensors, never writes into them)
            "masks": {} if self.masks is None else dict(self.masks),
            # only the pruned positions: frozen is 0 wherever the base mask keeps the weight
            "frozen": {n: f[~self.masks[n]] for n, f in self.frozen.items()} if self.masks else {},
            "mask_round": self.mask_round,
            "clients": self._client_states(),
        }

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, Mapping) or state.get("format") not in _FORMATS:
            raise ValueError(f"the checkpoint's pruned-FedAvg state is not a {_FORMAT} record")
        if state["kind"] != self.kind:
            raise ValueError(
                f"the checkpoint holds {state['kind']} state and this is {type(self).__name__} ({self.kind}): resume "
                "with the module class the run was started with"
            )
        if state["base_scheme"] != self.scheme.name:
            raise ValueError(
                f"base_scheme: the checkpoint was written with base_scheme={state['base_scheme']!r}, this module has "
                f"{self.scheme.name!r}; resume with the base scheme the run was started with"
            )
        if float(state["base_rate"]) != self.scheme.rate:
            raise ValueError(
                f"base_rate: the checkpoint was written with base_rate={state['base_rate']!r}, this module has "
                f"{self.scheme.rate!r}; resume with the base rate the run was started with"
            )
        saved = int(state["num_clients"])
        if saved >= 0:
            if self.num_clients is not None and saved != self.num_clients:
                raise ValueError(_client_count_error(saved, self.num_clients))
            self._saved_num_clients = saved
        masks = dict(state["masks"])
        if masks and set(masks) != set(self.prunable):
            raise ValueError(
                f"the checkpoint's base masks cover layers {sorted(masks)}, this model's prunable layers are "
                f"{sorted(self.prunable)}: a checkpoint of another model"
            )
        self.masks = {n: m.clone() for n, m in masks.items()} if masks else None
        self.frozen = _load_frozen(state["frozen"], masks, compact=state["format"] == _FORMAT)
        self.mask_round = int(state["mask_round"])
        self._load_client_states(state["clients"])

    def _client_states(self) -> dict[int, Any]:
        """Per-client state to checkpoint (none in plain pruned FedAvg)."""
        return {}

    def _load_client_states(self, clients: Mapping[int, Any]) -> None:
        if clients:
            raise ValueError("the checkpoint holds per-client state, which plain pruned FedAvg does not keep")


def _load_frozen(saved: Mapping[str, Tensor], masks: Mapping[str, Tensor], compact: bool) -> dict[str, Tensor]:
    """The server's frozen weights from a checkpoint: dense (format 1), or the values at the pruned
    positions ``~mask`` in order (format 2), zero elsewhere."""
    if not compact:
        return {n: f.clone() for n, f in saved.items()}
    frozen = {}
    for name, values in saved.items():
        pruned = ~masks[name] if name in masks else None
        if pruned is None or values.shape != (int(pruned.sum()),):
            raise ValueError(
                f"the checkpoint's frozen weights of {name} do not match its base mask: a corrupted checkpoint"
            )
        frozen[name] = torch.zeros(pruned.shape, dtype=values.dtype, device=values.device).masked_scatter_(
            pruned, values
        )
    return frozen


def _client_count_error(saved: int, now: int) -> str:
    return (
        f"num_clients: the checkpoint was written for {saved} clients and this simulation has {now}; per-client "
        "state belongs to a client id, so resume with the client count the run was started with"
    )


class PriPruneModule(PrunedFedAvgModule):
    """PriPrune (Chu et al., Sec. 5.2, Alg. 3): pruned FedAvg plus a learned per-client defense mask.

    Every client owns one logit per weight (all trainable parameters); ``alpha = sigmoid(logit)``
    is the probability of NOT sharing the weight. A round of client ``i``:

    1. start: the global weight where the client shared last round, its withheld weight where it
       did not (pseudo-pruning, Sec. 5.2 ``w_init``); the base mask applied;
    2. each local step ``s``: sample the mask ``m`` by hard Gumbel-softmax (Eq. 18,
       straight-through); the model is evaluated at ``v = m * w + (1 - m) * w_start`` (Alg. 3
       line 6 within the round: a weight sampled as withheld keeps its start value) with the base
       mask; local loss (Eq. 16) ``lambda_acc L_acc + lambda_pri L_pri + lambda_sha sum(alpha)``
       with ``L_pri = sum_l (N_l/N) sum_j |g_lj| (1 - alpha_lj)``, ``g = dL_acc/dv`` taken as a
       constant; the logits step on ``dL_local/dlogit`` at ``mask_lr`` (``L_acc`` reaches them
       through ``v``: ``dL_acc/dm = g (w - w_start)``) and every weight on ``g`` at the simulation's
       ``local_lr`` (pseudo-pruning trains withheld weights too; ``lambda_acc`` weighs the accuracy
       term in the mask's update only, so ``local_lr`` means what it means in plain pruned FedAvg);
    3. final mask ``m = [alpha < 0.5]``: the client sends ``w * m_base * m`` and keeps
       ``w * m_base * (1 - m)`` (Alg. 3 lines 12-14).

    The sample is drawn as a comparison and a sigmoid (:func:`~lightning_gp.priprune.mask.gumbel_share_sample`,
    the two-way softmax's sample exactly) and the logits' step is Eq. 16's gradient in closed form
    (:func:`~lightning_gp.priprune.mask.local_loss_logit_gradient`), on the whole model as one vector.

    State: a client that has trained keeps two flat tensors in the order of the model's trainable
    parameters (:meth:`client_logits` and :meth:`client_withheld` give them by name): its logits,
    one float per weight, and the values of the weights it withholds (where ``alpha >= 0.5``), in
    order; where it shares, its start is the global weight, so nothing is kept there. A client never
    sampled keeps nothing. The logits are stored dense: every local step moves every logit (the
    ``lambda_sha`` term acts on all of them; after one round of LeNetZhu none is at its initial
    value), so a checkpoint holds ``4 (N + withheld)`` bytes per client that has trained, ``N`` the
    model's trainable weights (LeNetZhu: 54 KB; Conv2: 26 MB).

    Args (besides :class:`PrunedFedAvgModule`'s):
        lambda_acc, lambda_pri, lambda_sha: weights of Eq. 16 (default 5, 15, 2e-5: the paper's
            PruneFL/FEMNIST values; SNIP/SynFlow used 10, 1, 2e-6).
        temperature: the Gumbel-softmax temperature (default 1, PyTorch's ``gumbel_softmax``
            default; the paper gives none). Lower: soft samples closer to the hard ones.
        mask_lr: the logits' SGD learning rate (default 1; the paper gives none). A logit moves by
            ``mask_lr * (lambda_pri (N_l/N) |g| - lambda_sha) * alpha (1 - alpha)`` per step; with the
            paper's lambdas ``lambda_sha`` is negligible, so alpha only rises, fastest where
            ``(N_l/N) |g|`` is large, and the defense rate grows with a client's participations.
            ``(N_l/N) |g|`` is about 1e-2 for LeNetZhu's large layers and 4e-4 for Conv2's: at the
            default rate a LeNetZhu client withholds about 1% of its weights after 20 participations
            of 3 steps (benchmarks/results/priprune_tradeoff.md); scale it with the model.
        alpha_init: every client's initial alpha (default 0.1; the paper gives none): below 0.5, so
            a client shares everything at first, and small, so the sampled masks seldom replace a
            weight by its start value while the mask is young.
    """

    kind: ClassVar[str] = "priprune"

    def __init__(
        self,
        module: nn.Module,
        base_scheme: str | BasePruningScheme = "magnitude",
        base_rate: float | None = None,
        mask_update_every: int | None = None,
        aggregation: Literal["weighted", "mask_aware"] = "weighted",
        lambda_acc: float = 5.0,
        lambda_pri: float = 15.0,
        lambda_sha: float = 2e-5,
        temperature: float = 1.0,
        mask_lr: float = 1.0,
        alpha_init: float = 0.1,
        loss_fn: nn.Module | None = None,
        calibration_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__(
            module,
            base_scheme=base_scheme,
            base_rate=base_rate,
            mask_update_every=mask_update_every,
            aggregation=aggregation,
            loss_fn=loss_fn,
            calibration_size=calibration_size,
            seed=seed,
        )
        self.lambda_acc = check_nonnegative(lambda_acc, "lambda_acc")
        self.lambda_pri = check_nonnegative(lambda_pri, "lambda_pri")
        self.lambda_sha = check_nonnegative(lambda_sha, "lambda_sha")
        self.temperature = check_positive(temperature, "temperature")
        self.mask_lr = check_positive(mask_lr, "mask_lr")
        self.alpha_init = check_number(alpha_init, "alpha_init", low=0.0, high=1.0, low_open=True, high_open=True)
        self.clients: dict[int, dict[str, Tensor]] = {}  # client -> {"logits", "withheld"} -> flat tensor
        self.defense_rates: dict[int, float] = {}  # client -> fraction of its base-kept weights withheld last round

    # ------------------------------------------------------------------ per-client state
    # self.clients[c] = {"logits": [N], "withheld": the values at ~final_share_mask(logits), in order}
    # (flat, in flatten_named order of the trainable parameters; see the class docstring)

    def _flat_base_keep(self, like: Mapping[str, Tensor]) -> Tensor:
        """The base keep-mask over all trainable weights as one boolean vector (True where not pruned)."""
        masks = self.masks or {}
        ones = {
            n: masks[n] if n in masks else torch.ones(w.shape, dtype=torch.bool, device=w.device)
            for n, w in like.items()
        }
        return flatten_named(ones).bool()

    def _flat_start(self, client_id: int, like: Mapping[str, Tensor], base: Tensor) -> Tensor:
        flat = flatten_named(like)  # a new tensor (torch.cat)
        state = self.clients.get(client_id)
        if state is not None:
            flat.masked_scatter_(~final_share_mask(state["logits"]), state["withheld"])
        return flat.masked_fill_(~base, 0.0)

    def client_start(self, client_id: int) -> dict[str, Tensor]:
        """Where client ``client_id`` starts its next round (pseudo-pruning merge, Sec. 5.2 ``w_init``):
        the global weight where it shared last round, its withheld weight where it did not."""
        like = self.global_weights()
        return unflatten_named(self._flat_start(client_id, like, self._flat_base_keep(like)), like)

    def initial_logits(self) -> dict[str, Tensor]:
        value = logit(self.alpha_init)
        return {n: torch.full_like(w, value) for n, w in self.global_weights().items()}

    def client_logits(self, client_id: int) -> dict[str, Tensor]:
        """Client ``client_id``'s mask logits by parameter name (views of its state)."""
        return unflatten_named(self._state(client_id)["logits"], self.global_weights())

    def client_withheld(self, client_id: int) -> dict[str, Tensor]:
        """The weights client ``client_id`` kept back last round by parameter name, 0 where it shared."""
        state = self._state(client_id)
        withheld = torch.zeros_like(state["logits"]).masked_scatter_(
            ~final_share_mask(state["logits"]), state["withheld"]
        )
        return unflatten_named(withheld, self.global_weights())

    def _state(self, client_id: int) -> dict[str, Tensor]:
        state = self.clients.get(client_id)
        if state is None:
            raise KeyError(f"client {client_id} has not trained yet: it has no defense mask")
        return state

    def _train_client(
        self, client_id: int, round: int, global_weights: dict[str, Tensor], inputs: Tensor, targets: Tensor, lr: float
    ) -> tuple[dict[str, Tensor], Tensor]:
        like = global_weights
        state = self.clients.get(client_id)
        # the whole model as one vector: a few large tensor operations per step instead of many per layer
        base = self._flat_base_keep(like)
        start = self._flat_start(client_id, like, base)
        logits = state["logits"] if state else flatten_named(self.initial_logits())
        weights = start
        shares = layer_shares(like)
        losses = []
        for step, (x, y) in enumerate(zip(inputs, targets)):
            hard, z = gumbel_share_sample(logits, self.temperature, seeded_generator(self.seed, client_id, round, step))
            # v = m w + (1 - m) w_start with m exactly 0 or 1 (a weight sampled as withheld keeps its start value)
            mixed = torch.where(hard, weights, start)
            # one leaf per layer (views of v): a gradient through slices of one leaf would be a full-size
            # zero tensor per layer
            live = {n: t.detach().requires_grad_(True) for n, t in unflatten_named(mixed, like).items()}
            with torch.enable_grad():
                loss = self.loss_fn(functional_call(self.module, live, (x,)), y)
                grads = torch.autograd.grad(loss, list(live.values()), allow_unused=True)
            # g = dL_acc/dv; the model sees w * m_base, so no gradient reaches a pruned weight
            g = torch.cat([(torch.zeros_like(t) if d is None else d).reshape(-1) for t, d in zip(live.values(), grads)])
            g.masked_fill_(~base, 0.0)
            # Eq. 16's gradient in the logits (dL_acc/dm = g (w - w_start) through v, the chain rule)
            logit_grad = local_loss_logit_gradient(
                logits,
                z,
                g,
                weights - start,
                shares,
                lambda_acc=self.lambda_acc,
                lambda_pri=self.lambda_pri,
                lambda_sha=self.lambda_sha,
                temperature=self.temperature,
            )
            # every weight steps on g: a weight sampled as withheld is still trained locally
            weights = weights - lr * g
            logits = logits - self.mask_lr * logit_grad
            losses.append(loss.detach())
        keep = final_share_mask(logits)
        self.clients[client_id] = {"logits": logits, "withheld": weights[~keep]}
        kept = int(base.sum())
        self.defense_rates[client_id] = int((base & ~keep).sum()) / kept if kept else 0.0
        return unflatten_named(torch.where(keep, weights, 0.0), like), torch.stack(losses).mean()

    def share_masks(self, client_id: int) -> dict[str, Tensor]:
        """Client ``client_id``'s current final mask ``[alpha < 0.5]`` times the base mask (True = sent)."""
        state = self._state(client_id)
        like = self.global_weights()
        sent = final_share_mask(state["logits"]) & self._flat_base_keep(like)
        return unflatten_named(sent, like, dtype=torch.bool)

    def _client_states(self) -> dict[int, Any]:
        # references, as state_dict gives (training replaces a client's tensors, never writes into them)
        return {client: dict(state) for client, state in self.clients.items()}

    def _load_client_states(self, clients: Mapping[int, Any]) -> None:
        like = self.global_weights()
        size = sum(w.numel() for w in like.values())
        loaded = {}
        for client, state in clients.items():
            if set(state) != {"logits", "withheld"}:
                raise ValueError(
                    f"client {client}'s saved PriPrune state has parts {sorted(state)}, not logits and withheld"
                )
            logits, withheld = state["logits"], state["withheld"]
            if isinstance(logits, Mapping):  # format 1: dense tensors by parameter name
                if set(logits) != set(like) or set(withheld) != set(like):
                    raise ValueError(
                        f"client {client}'s saved PriPrune state does not match this model (layers "
                        f"{sorted(logits)} vs {sorted(like)})"
                    )
                logits = flatten_named({n: logits[n] for n in like})
                withheld = flatten_named({n: withheld[n] for n in like})[~final_share_mask(logits)]
            withholds = int((~final_share_mask(logits)).sum()) if logits.numel() == size else -1
            if logits.ndim != 1 or logits.numel() != size or withheld.shape != (withholds,):
                raise ValueError(
                    f"client {client}'s saved PriPrune state does not match this model: {logits.numel()} logits and "
                    f"{withheld.numel()} withheld weights, for a model of {size} trainable weights"
                )
            loaded[int(client)] = {"logits": logits.clone(), "withheld": withheld.clone()}
        self.clients = loaded
        self.defense_rates = {}


def server_view(record: TappedGradient, model: nn.Module, **kwargs: Any) -> ServerView:
    """The server's view of one pruned-FedAvg/PriPrune client round on the bare client ``model``.

    A :class:`~lightning_gp.callbacks.GradientTap` on a simulation of these modules records names
    ``module.<name>``; this strips the prefix, loads the sent (pruned) weights into ``model`` and
    builds :meth:`ServerView.from_tap` (``kwargs``: ``num_classes``, ``mean``, ``std``, ...). The
    view's ``gradients`` are the update ``w_global - w_shared`` and its ``meta`` says FedAvg, so
    :class:`~lightning_gp.attacks.SGI` reads the received weights from it.
    """
    from lightning_gp.attacks.view import ServerView

    strip = {n: n.removeprefix(PREFIX) for n in [*record.gradients, *record.model_state]}
    bare = dataclasses.replace(
        record,
        gradients={strip[n]: g for n, g in record.gradients.items()},
        model_state={strip[n]: t for n, t in record.model_state.items()},
    )
    return ServerView.from_tap(bare, model, **kwargs)


# The adaptive attack of pruned FedAvg and PriPrune (declared here, beside the class it attacks).
register_adaptive_attack(PrunedFedAvgModule, sgi_adaptive_attacks)
