"""A learned inverter: the server trains a network that maps defended gradients to images.

Wu, Chen, Guo, Weinberger, "Learning to Invert: Simple Adaptive Attacks for Gradient Inversion in
Federated Learning" (UAI 2023): the server holds public data of the task, runs the client's
defense on it exactly as the client would (its randomness included) and fits a network
``f(feature(defended gradient)) ~ images`` by least squares on those pairs (their Eq. 2); the
attack is one forward pass. Because the training pairs come out of the defense itself, the
network learns to undo what the defense does to the gradient's distribution (noise, pruning,
compression) without a model of it. Optionally the network's output starts a gradient-matching
run (their Sec. 4.3, "LTI + optimisation"): :class:`RefinedLearnedInversion`.

Design choices, stated:

- **Input feature** (:class:`GradientSketch`): the defended gradient, each layer divided by its
  root-mean-square over a first draw of training pairs (so a layer with small gradients is not drowned),
  flattened and compressed by a fixed, seeded count sketch to ``feature_dim`` numbers when the
  model has more parameters (Wu et al. compress large models' gradients the same way; a count
  sketch preserves inner products in expectation and costs one pass over the gradient). LeNetZhu
  has 13,426 parameters: 4,096 sketched features keep the input layer small enough to train in
  minutes on two cores.
- **Network**: an MLP (Wu et al.'s choice for small models) with ``hidden`` units, two hidden
  layers, a sigmoid output in pixel space ([0, 1]); MSE on pixels (their Eq. 2).
- **Batches**: the network outputs all ``B`` images of a client's batch; the training targets
  are sorted by label (ties in draw order), so slot ``k`` holds the ``k``-th smallest label; the
  scoring matches reconstructions to originals one-to-one anyway.
- **Data**: only the ``public_images`` given (the audit gives the public split, never a training
  image). A held-out part of them (``val_fraction``) decides when training stops: the validation
  loss has not improved for ``patience`` epochs, or ``max_epochs`` are spent.

The server's simulation of the client (``simulate``) lives above the attacks (it runs the
client's pipeline: :func:`lightning_gp.audit.learned.setting_simulator`); here it is any callable
``simulate(model, images [N, B, C, H, W], labels [N, B], seed) -> {name: [N, *shape]}``.

A trained inverter is cached (:class:`InverterCache`) per (model weights, defense, data, batch
size, seed, configuration), so attacking many images of one setting trains it once; its cost
(seconds, samples, epochs) is in every reconstruction's ``meta["training"]``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, overload

import torch
from torch import Tensor, nn

from lightning_gp.attacks.base import GradientAttack, Reconstruction
from lightning_gp.attacks.optimization import (
    InvertingGradients,
    known_or_recovered_labels,
    optimize_image_batch,
    optimize_images,
)
from lightning_gp.attacks.searches import BATCHED_IMAGES, decoys_per_search
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.trained_cache import DigestedKey, TrainedCache, tensor_state
from lightning_gp.attacks.view import ServerView
from lightning_gp.normalization import normalize
from lightning_gp.optim import fused_adam
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_positive, check_positive_int

#: ``simulate(model, images, labels, seed) -> defended gradients``: ``images`` ``[N, B, C, H, W]``
#: (normalised), ``labels`` ``[N, B]``; returns ``{name: [N, *param.shape]}``, what ``N`` fresh
#: clients holding those batches would share after the defense (fresh randomness per ``seed``).
DefenseSimulator = Callable[[nn.Module, Tensor, Tensor, int], dict[str, Tensor]]


def model_fingerprint(model: nn.Module) -> str:
    """A digest of ``model``'s parameters and buffers (names, shapes and values)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def tensor_fingerprint(tensor: Tensor) -> str:
    """A digest of one tensor's shape and values (the public data's identity)."""
    digest = hashlib.sha256(str(tuple(tensor.shape)).encode())
    digest.update(tensor.detach().cpu().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------ the feature
class GradientSketch(nn.Module):
    """The inverter's input: each layer of a gradient divided by its scale, flattened, then count
    sketched (Charikar et al. 2002) to ``dim`` numbers, or kept whole when the model has at most
    ``dim`` parameters. Bucket and sign of every coordinate are drawn once from ``seed``.

    Args:
        shapes: the shared layers' names and shapes, in the gradient's order.
        dim: the sketch's size.
        seed: seeds the buckets and signs.
    """

    buckets: Tensor
    signs: Tensor
    layer_scales: Tensor

    def __init__(self, shapes: Mapping[str, torch.Size], dim: int, seed: int) -> None:
        super().__init__()
        self.names = list(shapes)
        self.shapes = {n: tuple(int(d) for d in shapes[n]) for n in self.names}
        self.sizes = [math.prod(shapes[n]) for n in self.names]
        self.seed = int(seed)
        total = sum(self.sizes)
        self.dim = min(check_positive_int(dim, "dim"), total)
        generator = seeded_generator(seed, 0x5CE7C4)
        sketched = total > self.dim
        buckets = torch.randint(0, self.dim, (total,), generator=generator) if sketched else torch.arange(total)
        signs = torch.randint(0, 2, (total,), generator=generator).float() * 2 - 1 if sketched else torch.ones(total)
        self.register_buffer("buckets", buckets)
        self.register_buffer("signs", signs)
        self.register_buffer("layer_scales", torch.ones(len(self.names)))

    def flat(self, gradients: Mapping[str, Tensor]) -> Tensor:
        """``[N, P]``: the layers of ``N`` stacked gradients, each divided by its scale."""
        parts = [gradients[n].reshape(gradients[n].shape[0], -1).float() for n in self.names]
        return torch.cat([p / s for p, s in zip(parts, self.layer_scales.tolist())], dim=1)

    @torch.no_grad()
    def fit_scales(self, gradients: Mapping[str, Tensor]) -> None:
        """Set each layer's scale to its root-mean-square over ``gradients`` (stacked, ``[N, ...]``)."""
        scales = [gradients[n].float().pow(2).mean().sqrt().item() for n in self.names]
        self.layer_scales.copy_(torch.tensor([s if math.isfinite(s) and s > 0 else 1.0 for s in scales]))

    @torch.no_grad()
    def forward(self, gradients: Mapping[str, Tensor]) -> Tensor:
        flat = self.flat(gradients)
        out = torch.zeros(flat.shape[0], self.dim, device=flat.device)
        return out.index_add_(1, self.buckets.to(flat.device), flat * self.signs.to(flat.device))


class InverterNetwork(nn.Module):
    """Standardised sketch -> MLP (two hidden ReLU layers) -> sigmoid pixels ``[N, B, C, H, W]``."""

    feature_mean: Tensor
    feature_std: Tensor

    def __init__(self, dim: int, hidden: int, batch_size: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.dim, self.hidden = int(dim), int(hidden)
        self.out_shape = (batch_size, *input_shape)
        self.register_buffer("feature_mean", torch.zeros(dim))
        self.register_buffer("feature_std", torch.ones(dim))
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, math.prod(self.out_shape)),
        )

    def forward(self, features: Tensor) -> Tensor:
        z = (features - self.feature_mean) / self.feature_std
        return torch.sigmoid(self.mlp(z)).reshape(-1, *self.out_shape)


@dataclass
class TrainingCost:
    """What training an inverter cost: wall seconds (simulating the defense, then fitting) and the
    process's CPU seconds (all its threads; the honest figure on a shared machine), the training and
    validation pairs, the epochs run, the best validation MSE (pixels) and why it stopped."""

    seconds: float
    cpu_seconds: float
    simulation_seconds: float
    samples: int
    validation_samples: int
    epochs: int
    validation_mse: float
    stopped: str


@dataclass
class TrainedInverter:
    """A trained inverter: its feature, its network and what training it cost."""

    sketch: GradientSketch
    network: InverterNetwork
    cost: TrainingCost

    @torch.no_grad()
    def pixels(self, gradients: Mapping[str, Tensor]) -> Tensor:
        """``[N, B, C, H, W]`` pixels in [0, 1] from ``N`` stacked gradients."""
        self.network.eval()
        return self.network(self.sketch(gradients))


# ------------------------------------------------------------------------------------------ cache
@dataclass(frozen=True)
class InverterKey(DigestedKey):
    """What a trained inverter depends on: the model's weights, the defense (as the caller
    describes it), the public data, the batch size, the seed and the training configuration."""

    model: str
    defense: str
    data: str
    batch_size: int
    seed: int
    config: str


#: The layout of an inverter file of :class:`InverterCache`; a file of another layout is retrained.
CACHE_FORMAT = "lightning-gp inverter cache 1"


class InverterCache(TrainedCache[InverterKey, TrainedInverter]):
    """Trained inverters by :class:`InverterKey`, in memory and, with ``directory``, on disk
    (``<directory>/<key digest>.pt``; a later process with the same key loads it instead of
    training). ``trainings`` counts the inverters this cache trained.

    A file holds the sketch's and the network's state dicts, their constructor arguments, the
    training cost as a dict and the key's ``repr``, read back as
    :class:`~lightning_gp.attacks.trained_cache.TrainedCache` reads every file (``weights_only``; a file
    that does not match is ignored with a warning and overwritten)."""

    kind = "inverter"

    def _payload(self, key: InverterKey, value: TrainedInverter) -> dict[str, Any]:
        return _inverter_payload(key, value)

    def _from_payload(self, payload: Any, key: InverterKey) -> TrainedInverter:
        return _inverter_from_payload(payload, key)


def _inverter_payload(key: InverterKey, inverter: TrainedInverter) -> dict[str, Any]:
    """What :class:`InverterCache` writes of ``inverter``: tensors, numbers, strings and containers."""
    sketch, network = inverter.sketch, inverter.network
    return {
        "format": CACHE_FORMAT,
        "key": repr(key),
        "sketch": {
            "shapes": [[name, list(sketch.shapes[name])] for name in sketch.names],
            "dim": int(sketch.dim),
            "seed": int(sketch.seed),
            "state": {n: t.detach().cpu() for n, t in sketch.state_dict().items()},
        },
        "network": {
            "dim": int(network.dim),
            "hidden": int(network.hidden),
            "batch_size": int(network.out_shape[0]),
            "input_shape": [int(d) for d in network.out_shape[1:]],
            "state": {n: t.detach().cpu() for n, t in network.state_dict().items()},
        },
        "cost": asdict(inverter.cost),
    }


def _inverter_from_payload(payload: Any, key: InverterKey) -> TrainedInverter:
    """The inverter :func:`_inverter_payload` wrote for ``key``, rebuilt (``ValueError`` on any mismatch)."""
    if not isinstance(payload, dict) or payload.get("format") != CACHE_FORMAT:
        raise ValueError(f"not an inverter file of this version (no {CACHE_FORMAT!r} header)")
    if payload.get("key") != repr(key):
        raise ValueError("the file was written for another inverter key")
    sketch_fields, network_fields = payload["sketch"], payload["network"]
    shapes = {str(name): torch.Size(int(d) for d in shape) for name, shape in sketch_fields["shapes"]}
    sketch = GradientSketch(shapes, int(sketch_fields["dim"]), int(sketch_fields["seed"]))
    sketch.load_state_dict(tensor_state(sketch_fields["state"]))
    input_shape = tuple(int(d) for d in network_fields["input_shape"])
    network = InverterNetwork(
        int(network_fields["dim"]), int(network_fields["hidden"]), int(network_fields["batch_size"]), input_shape
    )
    network.load_state_dict(tensor_state(network_fields["state"]))
    network.eval()
    cost = payload["cost"]
    if not isinstance(cost, dict) or set(cost) != {f.name for f in dataclasses.fields(TrainingCost)}:
        raise ValueError(f"the training cost's fields are {sorted(cost) if isinstance(cost, dict) else cost!r}")
    return TrainedInverter(sketch, network, TrainingCost(**cost))


#: training pairs drawn (a stream of their own) to set the sketch's per-layer scales
SCALE_PAIRS = 256

#: the cache every :class:`LearnedInversion` uses unless given its own
DEFAULT_CACHE = InverterCache()

#: public batches :class:`RefinedLearnedInversion` attacks end to end for its prior-only control
#: (a 1-in-32 test per metric; refining each is costly)
REFINED_DECOYS = 31


# ----------------------------------------------------------------------------------------- attack
@dataclass(frozen=True)
class InverterConfig:
    """How an inverter is built and trained (part of its cache key).

    Attributes:
        feature_dim: size of the gradient sketch (:class:`GradientSketch`).
        hidden: units of each hidden layer.
        max_epochs: cap on the epochs; training stops earlier on convergence.
        patience: epochs without a better validation loss before training stops.
        val_fraction: the share of the public images held out to decide when to stop.
        passes: how many times each training image is drawn (each time with fresh defense randomness).
        lr, batch: Adam's learning rate and minibatch size.
        simulate_chunk: clients simulated per call of ``simulate``.
    """

    feature_dim: int = 4096
    hidden: int = 1000
    max_epochs: int = 60
    patience: int = 4
    val_fraction: float = 0.1
    passes: int = 1
    lr: float = 1e-3
    batch: int = 64
    simulate_chunk: int = 10

    def __post_init__(self) -> None:
        for name in ("feature_dim", "hidden", "max_epochs", "patience", "passes", "batch", "simulate_chunk"):
            check_positive_int(getattr(self, name), name)
        if not isinstance(self.val_fraction, float) or not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        check_positive(self.lr, "lr")


class LearnedInversion(GradientAttack):
    """Learning to Invert (Wu et al., UAI 2023, Eq. 2): a network trained on the server's public
    data, defended as the client defends, maps the shared gradient to the images in one pass.

    Args:
        simulate: the server's simulation of the client's defense (:data:`DefenseSimulator`).
        public_images: ``[M, C, H, W]`` normalised images the server holds (never a client's).
        public_labels: ``[M]`` their labels.
        defense_key: what identifies the defense in the cache key (e.g. the setting's name and
            configuration); two different defenses must not share one.
        config: the network and training settings (:class:`InverterConfig`).
        cache: where trained inverters are kept (default: :data:`DEFAULT_CACHE`).
        seed: seeds the sketch, the draws of training batches, the defense's randomness in the
            simulation (a stream of its own, never a client's) and the network's initialisation.
    """

    # class D: trained on public data, defended as the client defends
    requires = requirements("basic_knowledge", "training_details", "surrogate_data")

    def __init__(
        self,
        simulate: DefenseSimulator,
        public_images: Tensor,
        public_labels: Tensor,
        *,
        defense_key: str,
        config: InverterConfig | None = None,
        cache: InverterCache | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(simulate):
            raise TypeError(f"simulate must be callable (model, images, labels, seed), got {type(simulate).__name__}")
        if not isinstance(public_images, Tensor) or public_images.ndim < 2:
            raise ValueError("public_images must be a tensor [M, C, H, W] of normalised images")
        if not isinstance(public_labels, Tensor) or public_labels.shape != public_images.shape[:1]:
            raise ValueError(
                f"public_labels must be a tensor of one label per public image, shape ({public_images.shape[0]},), "
                f"got {getattr(public_labels, 'shape', type(public_labels).__name__)}"
            )
        if not isinstance(defense_key, str) or not defense_key:
            raise ValueError(f"defense_key must be a non-empty str naming the defense, got {defense_key!r}")
        config = InverterConfig() if config is None else config
        if not isinstance(config, InverterConfig):
            raise TypeError(f"config must be an InverterConfig, got {type(config).__name__}")
        self.simulate = simulate
        self.public_images = public_images.detach()
        self.public_labels = public_labels.detach().long()
        self.defense_key = defense_key
        self.config = config
        self.cache = DEFAULT_CACHE if cache is None else cache
        self._prior_only: dict[tuple[str, int, bool], Tensor] = {}
        self._data_key = f"{tensor_fingerprint(self.public_images)}:{tensor_fingerprint(self.public_labels.float())}"

    def key(self, view: ServerView) -> InverterKey:
        """The cache key of the inverter that attacks ``view``."""
        return InverterKey(
            model_fingerprint(view.model),
            self.defense_key,
            self._data_key,
            view.batch_size,
            self.seed,
            repr(self.config),
        )

    def inverter(self, view: ServerView) -> TrainedInverter:
        """The inverter for ``view``'s model and batch size: cached, or trained now."""
        return self.cache.get(self.key(view), lambda: self.train(view))

    def _inverter_on(self, view: ServerView) -> TrainedInverter:
        """:meth:`inverter`, its network and sketch moved to the view's device."""
        inverter = self.inverter(view)
        inverter.network.to(view.device)
        inverter.sketch.to(view.device)
        return inverter

    def reconstruct(self, view: ServerView) -> Reconstruction:
        view, _ = self._prepare(view)
        inverter = self._inverter_on(view)
        stacked = {n: g.unsqueeze(0) for n, g in view.gradients.items()}
        pixels = inverter.pixels(stacked)[0]
        images = _normalize(pixels, view)
        labels = known_or_recovered_labels(view) if view.batch_size == 1 else None
        return Reconstruction(
            images=images,
            labels=labels,
            attack=type(self).__name__,
            meta={"training": asdict(inverter.cost), "inverter_key": self.key(view).digest()},
        )

    # ------------------------------------------------------------------------------ training
    def train(self, view: ServerView) -> TrainedInverter:
        """Simulate the defense on the public images at ``view``'s model and fit the network."""
        start, cpu_start = time.perf_counter(), time.process_time()
        cfg = self.config
        batch_size = view.batch_size
        images = self.public_images.to(view.device)
        labels = self.public_labels.to(view.device)
        if tuple(images.shape[1:]) != tuple(view.input_shape):
            raise ValueError(
                f"public_images hold inputs of shape {tuple(images.shape[1:])}, the view's are {view.input_shape}"
            )
        generator, val_idx, train_idx = self._split(batch_size, view.device)
        model = copy.deepcopy(view.model)
        train_batches = self._batches(train_idx, batch_size, cfg.passes, generator)
        val_batches = self._batches(val_idx, batch_size, 1, generator)
        sim_start = time.perf_counter()
        # the layer scales from a first draw of training batches (a stream of their own), then every
        # pair is sketched as soon as it is simulated: memory grows with the sketch, not the model
        scale_grads = self._simulate(model, images, labels, train_batches[:SCALE_PAIRS], stream=0)
        sketch = GradientSketch({n: g.shape[1:] for n, g in scale_grads.items()}, cfg.feature_dim, self.seed)
        sketch.fit_scales(scale_grads)
        del scale_grads
        train_x = self._simulate(model, images, labels, train_batches, stream=1, sketch=sketch)
        val_x = self._simulate(model, images, labels, val_batches, stream=2, sketch=sketch)
        simulation_seconds = time.perf_counter() - sim_start
        train_y = _sorted_targets(images, labels, train_batches)
        val_y = _sorted_targets(images, labels, val_batches)
        train_y, val_y = _pixels(train_y, view), _pixels(val_y, view)

        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
        network = InverterNetwork(sketch.dim, cfg.hidden, batch_size, tuple(view.input_shape)).to(view.device)
        network.feature_mean.copy_(train_x.mean(0))
        network.feature_std.copy_(train_x.std(0).clamp_min(1e-6))
        optimizer = fused_adam(network.parameters(), lr=cfg.lr)
        best, best_state, since, epochs, stopped = math.inf, copy.deepcopy(network.state_dict()), 0, 0, "max_epochs"
        for epoch in range(cfg.max_epochs):
            network.train()
            perm = torch.randperm(train_x.shape[0], generator=generator).to(view.device)
            for i in range(0, len(perm), cfg.batch):
                rows = perm[i : i + cfg.batch]
                optimizer.zero_grad()
                loss = (network(train_x[rows]) - train_y[rows]).pow(2).mean()
                loss.backward()
                optimizer.step()
            epochs = epoch + 1
            network.eval()
            with torch.no_grad():
                val = float((network(val_x) - val_y).pow(2).mean())
            self._report(epoch, cfg.max_epochs, val)
            if not math.isfinite(val):
                stopped = "non-finite validation loss"
                break
            if val < best - 1e-6:
                best, best_state, since = val, copy.deepcopy(network.state_dict()), 0
            else:
                since += 1
                if since >= cfg.patience:
                    stopped = f"converged (no better validation loss for {cfg.patience} epochs)"
                    break
        network.load_state_dict(best_state)
        network.eval()
        cost = TrainingCost(
            seconds=time.perf_counter() - start,
            cpu_seconds=time.process_time() - cpu_start,
            simulation_seconds=simulation_seconds,
            samples=int(train_x.shape[0]),
            validation_samples=int(val_x.shape[0]),
            epochs=epochs,
            validation_mse=best,
            stopped=stopped,
        )
        return TrainedInverter(sketch.cpu(), network.cpu(), cost)

    def _split(self, batch_size: int, device: torch.device) -> tuple[torch.Generator, Tensor, Tensor]:
        """The seeded generator of training and the public images' indices held out to validate
        (never fitted) and to train on."""
        count = self.public_images.shape[0]
        generator = seeded_generator(self.seed, 0x1EA2)
        order = torch.randperm(count, generator=generator).to(device)
        held_out = max(batch_size, round(self.config.val_fraction * count))
        if count - held_out < 2 * batch_size:
            raise ValueError(
                f"public_images: {count} images are too few to train and validate an inverter for batches of {batch_size}"
            )
        return generator, order[:held_out], order[held_out:]

    # -------------------------------------------------------------------- prior-only guesses
    def prior_only_guesses(self, view: ServerView, count: int) -> Tensor:
        """``[K, B, C, H, W]`` normalised images (``K = count``; fewer for the refined variant): what this attack returns from the
        defended gradients of ``count`` public batches of ``view``'s size, drawn from the images the
        inverter held out from fitting, with defense randomness of their own. They carry no
        information about the attacked batch: matched to its originals they are the attack's
        prior-only guesses, the control the audit scores its reconstructions against
        (:mod:`lightning_gp.audit.prior_control`). Computed once per model, batch size and count."""
        check_positive_int(count, "count")
        # a guess refined on its batch's recovered labels recovers them as the attack does: from the
        # public images where the view holds them, else from dummy inputs (two label estimates)
        key = (self.key(view).digest(), count, view.public_data is None)
        if key not in self._prior_only:
            self._prior_only[key] = self._prior_only_guesses(view, count)
        return self._prior_only[key]

    def _prior_only_guesses(self, view: ServerView, count: int) -> Tensor:
        view, _ = self._prepare(view)
        inverter = self._inverter_on(view)
        model, images, labels, batches = self._decoy_batches(view, count)
        features = self._simulate(model, images, labels, batches, stream=3, sketch=inverter.sketch)
        with torch.no_grad():
            inverter.network.eval()
            return _normalize(inverter.network(features), view)

    def _decoy_batches(self, view: ServerView, count: int) -> tuple[nn.Module, Tensor, Tensor, Tensor]:
        """A copy of the view's model, the public images and labels on its device, and ``[count, B]``
        indices of held-out images (as many shuffles of them as ``count`` batches need)."""
        images = self.public_images.to(view.device)
        labels = self.public_labels.to(view.device)
        _, held_out, _ = self._split(view.batch_size, view.device)
        passes = math.ceil(count / (held_out.numel() // view.batch_size))
        batches = self._batches(held_out, view.batch_size, passes, seeded_generator(self.seed, 0xDEC0))[:count]
        return copy.deepcopy(view.model), images, labels, batches

    @staticmethod
    def _batches(indices: Tensor, batch_size: int, passes: int, generator: torch.Generator) -> Tensor:
        """``[N, B]`` rows of public-image indices: ``passes`` shuffles of ``indices`` cut into batches."""
        rows = []
        for _ in range(passes):
            shuffled = indices[torch.randperm(len(indices), generator=generator).to(indices.device)]
            usable = len(shuffled) // batch_size * batch_size
            rows.append(shuffled[:usable].reshape(-1, batch_size))
        return torch.cat(rows)

    @overload
    def _simulate(
        self, model: nn.Module, images: Tensor, labels: Tensor, batches: Tensor, *, stream: int, sketch: None = None
    ) -> dict[str, Tensor]: ...
    @overload
    def _simulate(
        self, model: nn.Module, images: Tensor, labels: Tensor, batches: Tensor, *, stream: int, sketch: GradientSketch
    ) -> Tensor: ...
    def _simulate(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        batches: Tensor,
        *,
        stream: int,
        sketch: GradientSketch | None = None,
    ) -> dict[str, Tensor] | Tensor:
        """The defended gradients of the clients holding ``batches`` (stacked), or with ``sketch``
        their sketches ``[N, dim]``; ``simulate_chunk`` clients at a time, each chunk with its own
        seed drawn from the attack's seed and ``stream`` (never a client's stream)."""
        chunk = self.config.simulate_chunk
        parts: list[dict[str, Tensor]] = []
        features: list[Tensor] = []
        for start in range(0, batches.shape[0], chunk):
            rows = batches[start : start + chunk]
            seed = int(seeded_generator(self.seed, 0x51A, stream, start).initial_seed() % (2**62))
            out = {n: g.detach() for n, g in self.simulate(model, images[rows], labels[rows], seed).items()}
            if sketch is None:
                parts.append(out)
            else:
                features.append(sketch(out))
        if sketch is not None:
            return torch.cat(features)
        return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


class RefinedLearnedInversion(LearnedInversion):
    """:class:`LearnedInversion`, then gradient matching started at its output (Wu et al., UAI
    2023, Sec. 4.3): ``refine_iterations`` Adam steps on ``matching``'s objective (the published
    Inverting Gradients, or a defense-aware one that models the defense), keeping the refined
    images only when they match the shared gradient better than the inverter's own output.

    Args:
        matching: the attack whose :meth:`~InvertingGradients.objective` is minimised (its
            learning rate, signed steps and box are used; its iterations are not).
        refine_iterations: Adam steps of the refinement.
        lr: the refinement's learning rate (small: it starts near an answer).
        refined_decoys: held-out public batches attacked end to end for the audit's prior-only
            control (:meth:`prior_only_guesses`; 31: a chance level of 1/32 per metric).
    """

    def __init__(
        self,
        *args: Any,
        matching: InvertingGradients | None = None,
        refine_iterations: int = 200,
        lr: float = 0.01,
        refined_decoys: int = REFINED_DECOYS,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.refined_decoys = check_positive_int(refined_decoys, "refined_decoys")
        if matching is not None and not isinstance(matching, InvertingGradients):
            raise TypeError(f"matching must be an InvertingGradients attack or None, got {type(matching).__name__}")
        self.matching = InvertingGradients() if matching is None else matching
        self.refine_iterations = check_positive_int(refine_iterations, "refine_iterations")
        self.refine_lr = check_positive(lr, "lr")

    def _prior_only_guesses(self, view: ServerView, count: int) -> Tensor:
        """``refined_decoys`` (at most ``count``) held-out public batches attacked end to end, the
        refinement included: only guesses made the same way are exchangeable with the attack's
        output when the gradient says nothing (the inverter's own outputs score higher there, so
        mixing them in would hide a refinement that reads the gradient). Refining is costly, so
        these are fewer than the inverter's: the control's chance level is ``1 / (K + 1)``."""
        prepared, _ = self._prepare(view)
        model, images, labels, batches = self._decoy_batches(prepared, min(count, self.refined_decoys))
        shared = self._simulate(model, images, labels, batches, stream=4)
        decoys = [
            dataclasses.replace(
                prepared,
                gradients={n: g[k] for n, g in shared.items()},
                labels=None if prepared.labels is None else labels[batches[k]],
            )
            for k in range(batches.shape[0])
        ]
        group = min(decoys_per_search(prepared, len(decoys)), max(1, BATCHED_IMAGES // prepared.batch_size))
        guesses = []
        for first in range(0, len(decoys), group):
            part = decoys[first : first + group]
            side_by_side = self._refined_side_by_side(part)
            if side_by_side is None:
                side_by_side = torch.stack([self.reconstruct(decoy).images.detach() for decoy in part])
            guesses.append(side_by_side)
        return torch.cat(guesses)

    def _refined_side_by_side(self, decoys: list[ServerView]) -> Tensor | None:
        """:meth:`reconstruct`'s images of every decoy, the refinements in one vmapped optimisation
        (:func:`~lightning_gp.attacks.optimization.optimize_image_batch`: each follows the trajectory it
        follows alone, to float rounding); ``None`` where the matching's objective does not stack
        (:meth:`~lightning_gp.attacks.InvertingGradients.stacked_objective`)."""
        labels = [known_or_recovered_labels(decoy) for decoy in decoys]
        objective = self.matching.stacked_objective(decoys, labels)
        if objective is None:
            return None
        learned = torch.stack([LearnedInversion.reconstruct(self, decoy).images for decoy in decoys])
        with torch.enable_grad():
            start = objective(learned).detach()
        bounds = decoys[0].data_bounds() if self.matching.boxed else None
        images, _ = optimize_image_batch(
            objective, learned, iterations=self.refine_iterations, lr=self.refine_lr, signed=self.matching.signed,
            bounds=bounds, lr_decay=self.matching.lr_decay, report=self._report,
        )  # fmt: skip
        with torch.enable_grad():
            final = objective(images).detach()
        kept = torch.isfinite(final) & (final <= start)
        return torch.where(kept.reshape(-1, *[1] * (images.ndim - 1)), images, learned).detach()

    def reconstruct(self, view: ServerView) -> Reconstruction:
        learned = super().reconstruct(view)
        view, _ = self._prepare(view)
        labels = known_or_recovered_labels(view)
        objective = self.matching.objective(view, labels)
        with torch.enable_grad():
            start_objective = float(objective(learned.images).detach())
        images, trace = optimize_images(
            objective,
            learned.images,
            iterations=self.refine_iterations,
            lr=self.refine_lr,
            signed=self.matching.signed,
            bounds=view.data_bounds() if self.matching.boxed else None,
            lr_decay=self.matching.lr_decay,
            report=self._report,
        )
        with torch.enable_grad():
            final = float(objective(images).detach())
        refined = math.isfinite(final) and final <= start_objective
        meta = {**learned.meta, "objective": final if refined else start_objective, "refined": refined}
        return Reconstruction(
            images=images if refined else learned.images,
            labels=labels,
            loss_trace=trace,
            attack=type(self).__name__,
            meta=meta,
        )


# ---------------------------------------------------------------------------------------- helpers
def _sorted_targets(images: Tensor, labels: Tensor, batches: Tensor) -> Tensor:
    """``[N, B, C, H, W]``: each batch's images sorted by label (stable), the inverter's slot order."""
    order = torch.sort(labels[batches], dim=1, stable=True).indices
    return images[torch.gather(batches, 1, order)]


def _pixels(images: Tensor, view: ServerView) -> Tensor:
    return view.denormalize(images)


def _normalize(pixels: Tensor, view: ServerView) -> Tensor:
    return normalize(pixels, view.mean, view.std, sample_ndim=len(view.input_shape))


__all__ = [
    "DEFAULT_CACHE",
    "REFINED_DECOYS",
    "DefenseSimulator",
    "GradientSketch",
    "InverterCache",
    "InverterConfig",
    "InverterKey",
    "InverterNetwork",
    "LearnedInversion",
    "RefinedLearnedInversion",
    "TrainedInverter",
    "TrainingCost",
    "model_fingerprint",
    "tensor_fingerprint",
]
