"""The adaptive attack on PRECODE: recover the bottleneck's input from its encoder's gradient, then invert it.

PRECODE (:class:`~lightning_gp.models.PRECODE`) samples ``z = mu + sigma eps`` in a variational
bottleneck (VB) before the output layer, so every gradient depends on the client's unknown ``eps``
and the published Inverting Gradients cannot converge. But the VB's encoder is a biased linear layer
``s = W h + b`` on the features ``h`` (the output layer's input), and for any linear layer the
gradient is an outer product (Phong et al. 2017; Geiping et al. 2020). For one image,
with ``delta = dL/ds``:

    dL/dW = delta h^T,   dL/db = delta   =>   h = dL/dW[i, :] / dL/db[i]   for any i with dL/db[i] != 0,

whatever ``eps`` was: the noise only changes ``delta``. And ``delta`` itself is in the shared
gradient (``dL/db``), so the gradient reaching the features, ``dL/dh = W^T delta``, is known too,
and with it the exact, noise-free gradient of every layer before the bottleneck for a candidate image.
The attack optimises the image ``x`` (Inverting Gradients' machinery: Adam on signed gradients in the
data box, TV prior, restarts) so that

- the features ``f(x)`` reproduce the encoder's gradient: with ``Delta`` the least-squares upstream
  gradients given ``f(x)`` (closed form), ``||Delta^T f(x) / B - dL/dW||^2 / ||dL/dW||^2`` plus the same
  for the bias (which fixes the scale); for one image this is the feature match to the analytic ``h``;
- the layers before the bottleneck match their shared gradient (cosine distance) under the upstream
  gradient ``W^T Delta / B``.

Both terms are exactly zero at the client's images, for any ``eps``. For a batch of ``B > 1`` images
the encoder's gradient ``sum_b delta_b h_b^T / B`` only gives the span of the ``B`` features and the
per-image ``delta_b`` are not observed: the attack fits every image jointly with the ``delta_b`` that
best explain the gradient given the candidate features (the same objective; it reduces to the
analytic recovery when ``B = 1``), so a batch is recovered only as far as that fit identifies it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_gp.attacks.base import AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.gradient_matching import cosine_distance, total_variation
from lightning_gp.attacks.labels import classification_layer, recover_labels
from lightning_gp.attacks.optimization import best_of_restarts, random_images
from lightning_gp.attacks.registry import register_adaptive_attack
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView
from lightning_gp.models.precode import PRECODE
from lightning_gp.validation import check_nonnegative, check_positive, check_positive_int


def find_precode(model: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, module)`` of the one PRECODE module in ``model`` (``prefix`` is ``""`` when ``model``
    is the PRECODE model, else the submodule's name and a dot)."""
    from lightning_gp.models.precode import PRECODE  # the models import Lightning; the attacks stay light

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, PRECODE)]
    if len(found) != 1:
        raise AttackNotApplicable(
            f"the PRECODE-aware attack needs a model holding exactly one PRECODE module, {type(model).__name__} "
            f"holds {len(found)}"
        )
    name, module = found[0]
    return (f"{name}." if name else ""), module


def recover_features(view: ServerView) -> Tensor:
    """The bottleneck's input ``h`` ``[1, d]`` of a one-image gradient: ``dL/dW_enc[i] / dL/db_enc[i]``,
    combined over every row by least squares (``sum_i db_i dW_i / sum_i db_i^2``), exact whatever ``eps``."""
    if view.batch_size != 1:
        raise AttackNotApplicable(
            f"the encoder's gradient gives one image's features analytically; the batch has {view.batch_size} "
            "(PRECODEAwareInversion fits a batch jointly)"
        )
    prefix, _ = find_precode(view.model)
    weight = view.gradients[f"{prefix}bottleneck.encoder.weight"].double()
    bias = view.gradients[f"{prefix}bottleneck.encoder.bias"].double()
    energy = bias.pow(2).sum()
    if energy == 0:
        raise ValueError("the encoder's bias gradient is zero: the features cannot be recovered from it")
    return ((bias @ weight) / energy).to(view.gradients[f"{prefix}bottleneck.encoder.weight"].dtype)[None]


class _Features(nn.Module):
    """``PRECODE.features`` as a module's forward, so ``functional_call`` can evaluate it."""

    def __init__(self, precode: nn.Module) -> None:
        super().__init__()
        self.precode = precode

    def forward(self, x: Tensor) -> Tensor:
        return self.precode.features(x)  # type: ignore[operator]


class PRECODEAwareInversion(GradientAttack):
    """Inverting Gradients on PRECODE's noise-free part: the features from the VB encoder's gradient and
    the gradient of the layers before the bottleneck (see the module docstring).

    Minimises ``feature_weight * (encoder residual + bias residual) + gradient_weight * (1 - cos)
    + tv_weight * TV(x)`` with Adam on signed gradients in the data box, the learning rate divided by
    10 at 3/8, 5/8, 7/8 of the run; of ``restarts`` runs the lowest objective wins. Labels from
    ``view.labels`` or the output layer's bias gradient: for one image its one negative entry
    (``recover_labels(method="bias")``, whatever ``eps``), for a batch the per-class counts
    (:func:`~lightning_gp.attacks.label_counts`; labels may repeat).

    Args:
        iterations, lr, tv_weight, restarts, signed, boxed, lr_decay: as :class:`~lightning_gp.attacks.InvertingGradients`.
        feature_weight: weight of the encoder-gradient (feature) terms.
        gradient_weight: weight of the cosine match of the layers before the bottleneck (0: features only).
        ridge: relative Tikhonov term of the least-squares upstream gradients (``B > 1`` conditioning).
    """

    # class C: it knows the client's PRECODE block
    requires = requirements("basic_knowledge", "training_details")

    def __init__(
        self,
        iterations: int = 4800,
        lr: float = 0.1,
        tv_weight: float = 1e-4,
        feature_weight: float = 1.0,
        gradient_weight: float = 1.0,
        restarts: int = 1,
        signed: bool = True,
        boxed: bool = True,
        lr_decay: bool = True,
        ridge: float = 1e-6,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.iterations = check_positive_int(iterations, "iterations")
        self.lr = check_positive(lr, "lr")
        self.tv_weight = check_nonnegative(tv_weight, "tv_weight")
        self.feature_weight = check_nonnegative(feature_weight, "feature_weight")
        self.gradient_weight = check_nonnegative(gradient_weight, "gradient_weight")
        if self.feature_weight == 0 and self.gradient_weight == 0:
            raise ValueError("feature_weight and gradient_weight are both 0: nothing to match")
        self.restarts = check_positive_int(restarts, "restarts")
        self.signed, self.boxed, self.lr_decay = signed, boxed, lr_decay
        self.ridge = check_nonnegative(ridge, "ridge")

    def objective(self, view: ServerView) -> Callable[[Tensor], Tensor]:
        """The attack's objective of a candidate batch ``[B, C, H, W]`` (zero at the client's images)."""
        prefix, precode = find_precode(view.model)
        extractor = _Features(precode)
        inner = {n: p for n, p in precode.named_parameters() if p.requires_grad}
        buffers = {f"precode.{n}": b for n, b in precode.named_buffers()}
        encoder_weight = inner["bottleneck.encoder.weight"].detach()
        shared_weight = view.gradients[f"{prefix}bottleneck.encoder.weight"]
        shared_bias = view.gradients[f"{prefix}bottleneck.encoder.bias"]
        output_prefix = f"model.{precode.output_layer}."
        body = self._body_parameters(view, extractor, inner, buffers, output_prefix)
        shared_body = {n: view.gradients[f"{prefix}{n}"] for n in body}
        weight_energy = shared_weight.pow(2).sum().clamp_min(1e-30)
        bias_energy = shared_bias.pow(2).sum().clamp_min(1e-30)
        batch = view.batch_size

        def loss(images: Tensor) -> Tensor:
            params = {f"precode.{n}": p for n, p in inner.items()}
            # cloned buffers: a candidate in training mode never moves BatchNorm statistics
            state = {**params, **{n: b.clone() for n, b in buffers.items()}}
            features = functional_call(extractor, state, (images,))
            if features.shape != (batch, encoder_weight.shape[1]):
                raise ValueError(
                    f"the PRECODE-aware attack needs [batch, features] inputs to the bottleneck, got {tuple(features.shape)}"
                )
            flat = features
            gram = flat @ flat.T
            ridge = self.ridge * gram.diagonal().mean().detach() * torch.eye(batch, device=gram.device)
            # upstream gradients dL_b/ds_b (rows) that best explain dL/dW = sum_b delta_b h_b^T / B
            deltas = batch * torch.linalg.solve(gram + ridge, flat @ shared_weight.T)
            total = images.new_zeros(())
            if self.feature_weight > 0:
                weight_residual = (deltas.T @ flat / batch - shared_weight).pow(2).sum() / weight_energy
                bias_residual = (deltas.mean(0) - shared_bias).pow(2).sum() / bias_energy
                total = total + self.feature_weight * (weight_residual + bias_residual)
            if self.gradient_weight > 0:
                upstream = deltas @ encoder_weight / batch
                names = list(body)
                grads = torch.autograd.grad(
                    features, [params[f"precode.{n}"] for n in names], grad_outputs=upstream, create_graph=True
                )
                guess = dict(zip(names, grads))
                total = total + self.gradient_weight * cosine_distance(guess, shared_body, names)
            return total + self.tv_weight * total_variation(images)

        return loss

    def _body_parameters(
        self,
        view: ServerView,
        extractor: nn.Module,
        inner: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        output_prefix: str,
    ) -> list[str]:
        """The trainable parameters the features depend on (the layers before the bottleneck)."""
        if self.gradient_weight == 0:
            return []
        candidates = [n for n in inner if n.startswith("model.") and not n.startswith(output_prefix)]
        probe = torch.zeros(
            (view.batch_size, *view.input_shape), device=view.device, dtype=inner["bottleneck.encoder.weight"].dtype
        )
        with torch.enable_grad():
            state = {**{f"precode.{n}": p for n, p in inner.items()}, **{n: b.clone() for n, b in buffers.items()}}
            features = functional_call(extractor, state, (probe,))
            grads = torch.autograd.grad(
                features.sum(), [inner[n] for n in candidates], allow_unused=True, materialize_grads=False
            )
        used = [n for n, g in zip(candidates, grads) if g is not None]
        if not used:
            raise AttackNotApplicable("no trainable layer before PRECODE's bottleneck: use gradient_weight=0")
        return used

    def reconstruct(self, view: ServerView) -> Reconstruction:
        view, generator = self._prepare(view)
        objective = self.objective(view)
        images, trace, final, restart, objectives = best_of_restarts(
            objective,
            lambda: random_images(view, generator),
            restarts=self.restarts,
            iterations=self.iterations,
            lr=self.lr,
            signed=self.signed,
            bounds=view.data_bounds() if self.boxed else None,
            lr_decay=self.lr_decay,
            report=self._report,
        )
        return Reconstruction(
            images=images,
            labels=view.labels if view.labels is not None else _labels(view),
            loss_trace=trace,
            attack=type(self).__name__,
            meta={"objective": final, "best_restart": restart, "objectives": objectives},
        )


def _labels(view: ServerView) -> Tensor:
    _, bias = classification_layer(view)
    use_bias = bias is not None and view.batch_size == 1
    return recover_labels(view, method="bias" if use_bias else "auto").to(view.device)


@register_adaptive_attack(PRECODE)
def _precode(target: PRECODE, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """PRECODE's adaptive attack: the VB encoder's gradient gives the features whatever eps was;
    invert them (Adam only)."""
    kwargs.pop("lbfgs_iterations", None)
    return [PRECODEAwareInversion(**kwargs)]
