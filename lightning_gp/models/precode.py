"""PRECODE: a variational bottleneck before a model's output layer (Scheliga, Mäder & Seeland, WACV 2022).

PRECODE ("PRivacy EnhanCing mODulE") extends any classifier with a variational bottleneck (VB) in
front of its output layer: the features ``h`` (the output layer's input, ``d`` values) are encoded
to ``2K`` statistics, ``mu`` and ``sigma = softplus(s - shift)``, a latent code
``z = mu + sigma * eps`` (``eps ~ N(0, I)``, the reparameterisation trick) is sampled and decoded
back to ``d`` features, which the output layer consumes. Training minimises
``CE + beta * KL(N(mu, sigma^2) || N(0, I))`` (K = 256, beta = 1e-3). The sampled ``eps`` makes the
shared gradient stochastic, which is what stops iterative gradient-matching attacks.

Choices, with the official code (github.com/dAI-SY-Group/PRECODE, ``src/VariationalBottleneck.py``):

- The KL term is the official one: summed over the ``K`` latent dimensions, averaged over the
  batch, and divided by ``ln 2`` (bits), so ``beta`` means what it means there.
- ``eps`` is sampled in evaluation mode too, as in the official code (it has no train/eval switch):
  predictions are stochastic. ``sample_in_eval=False`` decodes ``z = mu`` in evaluation mode.
- ``sigma = softplus(s - sigma_shift)`` with ``sigma_shift = 5`` by default, the VIB parameterisation
  (Alemi et al. 2017; 1Konny/VIB-pytorch); the official PRECODE module
  uses ``softplus(s)`` (``sigma_shift=0``). The shift sets the initial noise (``softplus(-5) ~ 0.007``
  vs ``softplus(0) ~ 0.69``).
- The official code builds the VB into each architecture by hand; here :class:`PRECODE` wraps any
  model: a forward pre-hook on its output ``nn.Linear`` sends the layer's input through the VB.

How the KL term reaches the loss: :meth:`PRECODE.forward` attaches ``beta * KL`` of that very call to
the output tensor it returns, and :class:`PRECODELoss` (``PRECODE.loss_fn``) adds it to the
cross-entropy of that tensor. The term travels with the output, never with the module, so it is
right under ``torch.func`` (``functional_call``, ``grad``, ``vmap``: each transform level's output
carries its own term), for a deep copy of the model, and for any number of models; it can never be
stale (a new forward returns a new tensor). Given any other tensor (a slice, a ``.float()`` copy,
a detached one) the loss raises instead of silently dropping the KL. ``ImageClassifier``,
``FederatedSimulation`` (both use ``model.loss_fn`` when the model has one), Opacus DP-SGD
(per-example gradients of ``CE + beta KL``: both are means of per-example terms) and the attacks'
``ServerView.loss_fn`` all use it.

Noise: with ``seed=None`` (default) ``eps`` comes from PyTorch's global generator, so
``lightning.seed_everything`` (or ``torch.manual_seed``) fixes it, and ``vmap(randomness="different")``
gives every vmapped client its own draw. With ``seed=n`` the module draws from its own CPU generator
(then moves ``eps`` to the model's device): the same noise on every device, independent of anything
else drawn from the global generator; ``seed_everything`` does not touch it, and its state is not
checkpointed (a rebuilt module starts again from ``seed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gp.validation import check_bool, check_nonnegative, check_number, check_positive_int

#: The attribute of PRECODE's output tensor holding ``beta * KL`` of the forward call that made it.
KL_PENALTY_ATTR = "_precode_kl_penalty"


def kl_to_standard_normal(mu: Tensor, sigma: Tensor) -> Tensor:
    """``KL(N(mu, sigma^2) || N(0, I))`` in bits, summed over the last dimension and averaged over
    the others: ``mean(sum_k -(1 + 2 ln sigma - mu^2 - sigma^2) / 2) / ln 2`` (the official loss)."""
    per_example = -0.5 * (1 + 2 * sigma.log() - mu.pow(2) - sigma.pow(2)).sum(-1)
    return per_example.mean() / math.log(2)


def bottleneck_parameter_count(features: int, latent_dim: int) -> int:
    """Parameters a VB adds in front of a layer with ``features`` inputs: encoder
    ``Linear(d, 2K)`` plus decoder ``Linear(K, d)``, i.e. ``3 K d + 2 K + d``."""
    return features * 2 * latent_dim + 2 * latent_dim + latent_dim * features + features


class VariationalBottleneck(nn.Module):
    """The VB of PRECODE: ``Linear(d, 2K) -> (mu, sigma) -> z = mu + sigma eps -> Linear(K, d)``.

    Args:
        features: ``d``, the size of the features it encodes (the output layer's ``in_features``).
        latent_dim: ``K``, the latent code's size (the paper's 256).
        beta: weight of the KL term in the loss (the paper's 1e-3); kept here for :class:`PRECODE`.
        sigma_shift: ``sigma = softplus(s - sigma_shift)`` (see the module docstring).
        sample_in_eval: sample ``eps`` in evaluation mode too (the official behaviour); else ``z = mu``.
        seed: ``None``: draw ``eps`` from the global generator; an int: from the module's own.

    ``forward(h)`` returns ``(decoded features, KL in bits)``.
    """

    def __init__(
        self,
        features: int,
        latent_dim: int = 256,
        beta: float = 1e-3,
        sigma_shift: float = 5.0,
        sample_in_eval: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.features = check_positive_int(features, "features")
        self.latent_dim = check_positive_int(latent_dim, "latent_dim")
        self.beta = check_nonnegative(beta, "beta")
        self.sigma_shift = check_number(sigma_shift, "sigma_shift")
        self.sample_in_eval = check_bool(sample_in_eval, "sample_in_eval")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be None or an int, got {type(seed).__name__} {seed!r}")
        self.seed = seed
        self._generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.encoder = nn.Linear(features, 2 * latent_dim)
        self.decoder = nn.Linear(latent_dim, features)

    def extra_repr(self) -> str:
        return f"K={self.latent_dim}, beta={self.beta:g}, sigma_shift={self.sigma_shift:g}, seed={self.seed}"

    def statistics(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """``(mu, sigma)`` of the latent code for ``features`` ``[..., d]``."""
        stats = self.encoder(features)
        mu, s = stats[..., : self.latent_dim], stats[..., self.latent_dim :]
        return mu, F.softplus(s - self.sigma_shift)

    def noise(self, like: Tensor) -> Tensor:
        """``eps ~ N(0, I)`` shaped like ``like`` (from the module's generator when it has one)."""
        if self._generator is None:
            return torch.randn_like(like)
        return torch.randn(like.shape, generator=self._generator, dtype=like.dtype).to(like.device)

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        mu, sigma = self.statistics(features)
        z = mu + sigma * self.noise(mu) if self.training or self.sample_in_eval else mu
        return self.decoder(z), kl_to_standard_normal(mu, sigma)


class PRECODELoss(nn.Module):
    """``CE(outputs, targets) + beta * KL`` with the ``beta * KL`` that :class:`PRECODE` attached to
    ``outputs`` (the tensor its forward returned). Targets may be class indices or probabilities."""

    def forward(self, outputs: Tensor, targets: Tensor) -> Tensor:
        penalty = getattr(outputs, KL_PENALTY_ATTR, None)
        if penalty is None:
            raise RuntimeError(
                "PRECODE's loss got outputs without a KL term: give it the very tensor PRECODE.forward returned "
                "(not a slice, copy or detached view of it), from a forward pass of a PRECODE model"
            )
        return F.cross_entropy(outputs, targets) + penalty


class _StopForward(Exception):
    """Raised by :meth:`PRECODE.features` once the bottleneck's input is known."""

    def __init__(self, features: Tensor) -> None:
        super().__init__("features captured")
        self.features = features


class PRECODE(nn.Module):
    """Any classifier with PRECODE's variational bottleneck before its output ``nn.Linear``.

    Scheliga et al., "PRECODE - A Generic Model Extension to Prevent Deep Gradient Leakage",
    WACV 2022: the VB with the loss ``CE + beta KL`` and the defaults of the official code (K = 256,
    beta = 1e-3).

    The wrapped ``model`` is used in place (a forward pre-hook on its output layer); parameters are
    named ``bottleneck.*`` (the VB, registered first) and ``model.*`` (the user's model, names
    unchanged). Use ``loss_fn`` (``CE + beta KL``) as the training loss: ``ImageClassifier`` and
    ``FederatedSimulation`` pick it up.

    Args:
        model: the classifier; its output layer must be an ``nn.Linear``.
        latent_dim: ``K``; ``beta``: the KL weight (>= 0).
        output_layer: the module name of the output ``nn.Linear`` (as in ``model.named_modules()``).
            Default: the last ``nn.Linear`` of the model, which the first forward pass checks is the
            last ``nn.Linear`` called and gives an output of the model's output shape (else a
            ``ValueError`` asking for ``output_layer``).
        sigma_shift, sample_in_eval, seed: see :class:`VariationalBottleneck`.
    """

    def __init__(
        self,
        model: nn.Module,
        latent_dim: int = 256,
        beta: float = 1e-3,
        output_layer: str | None = None,
        sigma_shift: float = 5.0,
        sample_in_eval: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if any(isinstance(m, (PRECODE, VariationalBottleneck)) for m in model.modules()):
            raise ValueError(f"model already holds a PRECODE bottleneck ({type(model).__name__}): wrap the bare model")
        name, layer = _output_layer(model, output_layer)
        self.bottleneck = VariationalBottleneck(
            layer.in_features, latent_dim, beta, sigma_shift=sigma_shift, sample_in_eval=sample_in_eval, seed=seed
        )
        self.model = model
        self.output_layer = name
        self.loss_fn = PRECODELoss()
        self._checked = False  # the first forward pass checks the output layer (_checked_forward)
        self._auto_layer = output_layer is None
        self._pending_kl: Tensor | None = None
        layer.register_forward_pre_hook(self._through_bottleneck)

    @property
    def beta(self) -> float:
        return self.bottleneck.beta

    @property
    def latent_dim(self) -> int:
        return self.bottleneck.latent_dim

    @property
    def added_parameters(self) -> int:
        """Parameters PRECODE adds to the model (``3 K d + 2 K + d``, :func:`bottleneck_parameter_count`)."""
        return sum(p.numel() for p in self.bottleneck.parameters())

    @property
    def added_bytes(self) -> int:
        """Bytes those parameters take (and add to every shared gradient), at their dtype."""
        return sum(p.numel() * p.element_size() for p in self.bottleneck.parameters())

    def _through_bottleneck(self, layer: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        decoded, kl = self.bottleneck(args[0])
        if self._pending_kl is not None:
            raise RuntimeError(
                f"the output layer {self.output_layer!r} ran twice in one forward pass: PRECODE needs a model that "
                "calls its output layer once (pass output_layer=... naming the layer that makes the output)"
            )
        self._pending_kl = kl
        return (decoded, *args[1:])

    def forward(self, x: Tensor) -> Tensor:
        self._pending_kl = None
        try:
            outputs = self._checked_forward(x) if not self._checked else self.model(x)
            kl = self._pending_kl
        finally:
            self._pending_kl = None
        if kl is None:
            raise RuntimeError(
                f"the output layer {self.output_layer!r} was not called in {type(self.model).__name__}'s forward pass"
            )
        setattr(outputs, KL_PENALTY_ATTR, self.bottleneck.beta * kl)
        return outputs

    def features(self, x: Tensor) -> Tensor:
        """The bottleneck's input for ``x``: the output layer's input in the bare model (the forward
        stops there, so no noise is drawn)."""

        def stop(layer: nn.Module, args: tuple[Tensor, ...]) -> None:
            raise _StopForward(args[0])

        handle = self.bottleneck.register_forward_pre_hook(stop)
        try:
            self.model(x)
        except _StopForward as captured:
            return captured.features
        finally:
            handle.remove()
        raise RuntimeError(f"the output layer {self.output_layer!r} was not called in the forward pass")

    def _checked_forward(self, x: Tensor) -> Tensor:
        """The first forward pass, watching which ``nn.Linear`` layers run: the output layer must run
        once and, when found by default, be the last one called, with the model's output shape."""
        calls: list[tuple[str, Tensor]] = []
        with _watch_linears(self.model, calls):
            outputs = self.model(x)
        layer_outputs = [out for name, out in calls if name == self.output_layer]
        if len(layer_outputs) != 1:
            raise ValueError(
                f"output_layer {self.output_layer!r} ran {len(layer_outputs)} times in one forward pass; PRECODE "
                "needs the output nn.Linear called exactly once"
            )
        # shapes, not identity: Opacus' backward hooks hand on a copy of a layer's output
        if self._auto_layer and (calls[-1][0] != self.output_layer or layer_outputs[0].shape != outputs.shape):
            raise ValueError(
                f"model: the last nn.Linear of {type(self.model).__name__} ({self.output_layer!r}) is not its final "
                f"layer (the last nn.Linear called is {calls[-1][0]!r}; the model's output has shape "
                f"{tuple(outputs.shape)}, that layer's {tuple(layer_outputs[0].shape)}); PRECODE goes before a "
                "model's final nn.Linear: pass output_layer=... to name it"
            )
        self._checked = True
        return outputs


def _output_layer(model: nn.Module, output_layer: str | None) -> tuple[str, nn.Linear]:
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if output_layer is None:
        if not linears:
            raise ValueError(
                f"model: PRECODE puts its bottleneck before the model's final nn.Linear, and {type(model).__name__} "
                "has no nn.Linear layer (pass a model that ends in one, or name it with output_layer=...)"
            )
        return linears[-1]
    if not isinstance(output_layer, str):
        raise TypeError(f"output_layer must be a module name (str) or None, got {type(output_layer).__name__}")
    modules = dict(model.named_modules())
    if output_layer not in modules:
        raise ValueError(
            f"output_layer {output_layer!r} is not a module of {type(model).__name__}; its nn.Linear layers are "
            f"{[n for n, _ in linears]}"
        )
    layer = modules[output_layer]
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"output_layer {output_layer!r} must name an nn.Linear, got {type(layer).__name__}")
    return output_layer, layer


@contextmanager
def _watch_linears(model: nn.Module, calls: list[tuple[str, Tensor]]) -> Iterator[None]:
    """Record ``(name, output)`` of every ``nn.Linear`` of ``model`` in call order."""

    def recorder(name: str) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
        def hook(layer: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            calls.append((name, output))

        return hook

    handles = [m.register_forward_hook(recorder(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
