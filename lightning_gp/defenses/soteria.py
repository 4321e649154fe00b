"""Soteria (Sun et al., CVPR 2021): prune the defended layer's gradient along the features that reveal the input.

For the representation ``r`` feeding one fully-connected layer (default: the first ``nn.Linear``
after the feature extractor, see :func:`defended_layer`), each feature ``f`` is scored over the client's batch by

    score_f = sum_b ||d r_{b,f} / d x_b|| / (r_{b,f} + 0.1)

(the official code's per-feature ratio), and the columns of that layer's
WEIGHT gradient belonging to the ``rate`` fraction of features with the SMALLEST scores are zeroed.
Only that layer is defended; every other layer is shared as is.

The official code runs one backward pass per feature (:func:`representation_scores` with
``method="loop"``, kept as the reference). ``method="jacobian"`` (default) gets every ``d r_f / d x``
at once with ``torch.func``: a forward-mode Jacobian of each example's representation, vmapped over
the batch (examples are independent; with BatchNorm in training mode they are not, and the loop
runs instead). ``method="probes"`` estimates the squared norms from a few forward-mode random
probes instead (unbiased; cheaper when the input is large, at the price of an estimate).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import jacfwd, jvp, vmap

from lightning_gp.defenses.base import Defense, DefenseCall, Gradients
from lightning_gp.defenses.selection import count_for_rate
from lightning_gp.defenses.validation import check_rate
from lightning_gp.validation import check_choice, check_positive_int

ScoreMethod = Literal["jacobian", "loop", "probes"]
METHODS = ("jacobian", "loop", "probes")
#: the official code's offset in the denominator (keeps features near 0 from dominating)
FEATURE_OFFSET = 0.1


def defended_layer(model: nn.Module, layer: str | None, example: Tensor | None = None) -> tuple[str, nn.Linear]:
    """``(name, module)`` of the fully-connected layer Soteria defends.

    ``layer`` names it in ``model.named_modules()`` (a wrapper's prefix may be left out). With
    ``layer=None`` it is the first ``nn.Linear`` called after the feature extractor, i.e. after the
    last convolution of a forward pass on ``example`` (one batch of inputs); without convolutions,
    the first ``nn.Linear`` called. Tracing the call order matters: a module registered first is not
    necessarily run first, and a malicious server may put a linear layer in front of the
    convolutions (Robbing the Fed's imprint block), which is not the layer the defense is meant for.
    Without ``example`` the first registered ``nn.Linear`` is taken. An error names the argument otherwise.
    """
    modules = dict(model.named_modules())
    if layer is None:
        linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
        if not linear:
            raise ValueError(f"Soteria defends a fully-connected layer, and {type(model).__name__} has no nn.Linear")
        name = linear[0] if example is None else _first_linear_after_features(model, example)
        chosen = modules[name]
        assert isinstance(chosen, nn.Linear)
        return name, chosen
    if layer not in modules:
        # a wrapper (e.g. ImageClassifier's ``model.``) prefixes the user's names: accept a unique suffix
        wrapped = [n for n in modules if n.endswith("." + layer)]
        if len(wrapped) != 1:
            linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise ValueError(
                f"layer {layer!r} is not a module of {type(model).__name__}; its nn.Linear layers: {linear}"
            )
        layer = wrapped[0]
    module = modules[layer]
    if not isinstance(module, nn.Linear):
        raise ValueError(f"layer {layer!r} is a {type(module).__name__}; Soteria defends an nn.Linear layer")
    return layer, module


def _first_linear_after_features(model: nn.Module, example: Tensor) -> str:
    """The first ``nn.Linear`` called after the last convolution in a forward pass on ``example``."""
    calls: list[tuple[str, bool]] = []  # (name, is_linear) in call order
    handles = [
        module.register_forward_pre_hook(lambda m, i, name=name: calls.append((name, isinstance(m, nn.Linear))))
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd))
    ]
    was_training = model.training
    try:
        model.eval()  # no BatchNorm statistics update for a trace
        with torch.no_grad():
            model(example[:1].detach())
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    last_conv = max((i for i, (_, is_linear) in enumerate(calls) if not is_linear), default=-1)
    after = [name for name, is_linear in calls[last_conv + 1 :] if is_linear]
    if not after:
        raise ValueError(
            f"{type(model).__name__} calls no nn.Linear after its last convolution: name the defended layer "
            "with layer=..."
        )
    return after[0]


def _representation_fn(model: nn.Module, layer: nn.Linear) -> Any:
    """``x -> r``: the input of ``layer`` when ``model`` runs on the batch ``x`` (the rest of the
    forward pass is not needed, so it is cut short)."""

    class _Stop(Exception):
        pass

    def representation(x: Tensor) -> Tensor:
        captured: list[Tensor] = []

        def hook(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            captured.append(inputs[0])
            raise _Stop

        handle = layer.register_forward_pre_hook(hook)
        try:
            model(x)
        except _Stop:
            pass
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError("the defended layer was not called in the model's forward pass")
        return captured[0].flatten(1)

    return representation


def representation_scores(
    model: nn.Module,
    inputs: Tensor,
    layer: str | None = None,
    *,
    method: ScoreMethod = "jacobian",
    probes: int = 10,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Soteria's feature scores ``[d]`` for the batch ``inputs`` (see the module docstring).

    ``method="probes"`` estimates each ``||d r_{b,f} / d x_b||^2`` from ``probes`` forward-mode
    probes: for ``v ~ N(0, I)`` over the input, ``E[(J_b v)_f^2] = ||d r_{b,f} / d x_b||^2``, so the
    mean over the probes is unbiased (relative standard deviation ``sqrt(2 / probes)`` per entry for
    Gaussian probes); the score uses its square root. ``generator`` draws the probes.
    """
    check_choice(method, "method", METHODS)
    check_positive_int(probes, "probes")
    _, module = defended_layer(model, layer, inputs)
    if method != "loop" and any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()):
        method = "loop"  # BatchNorm in training mode couples the examples: one example at a time is wrong
    representation = _representation_fn(model, module)
    inputs = inputs.detach()
    if method == "loop":
        x = inputs.clone().requires_grad_(True)
        r = representation(x)
        norms = torch.empty_like(r)
        for f in range(r.shape[1]):  # the official code: one backward pass per feature
            (grad,) = torch.autograd.grad(r[:, f].sum(), x, retain_graph=f < r.shape[1] - 1)
            norms[:, f] = grad.flatten(1).norm(dim=1)
        r = r.detach()
    elif method == "jacobian":
        with torch.no_grad():
            r = representation(inputs)

        def one_example(x: Tensor) -> Tensor:
            return representation(x.unsqueeze(0)).squeeze(0)

        # a model that samples on the way (PRECODE's bottleneck before the layer): the Jacobian of
        # one draw per example, the same draw for every direction
        jacobian = vmap(jacfwd(one_example, randomness="same"), randomness="different")(inputs)  # [B, d, *input]
        norms = jacobian.flatten(2).norm(dim=2)
    else:
        directions = torch.randn((probes, *inputs.shape), generator=generator, device=inputs.device, dtype=inputs.dtype)
        with torch.no_grad():
            r = representation(inputs)
            # examples are independent, so one batched jvp probes every example at once: [probes, B, d]
            tangents = vmap(lambda v: jvp(representation, (inputs,), (v,))[1], randomness="same")(directions)
        norms = tangents.square().mean(dim=0).sqrt()
    return (norms / (r + FEATURE_OFFSET)).sum(dim=0).detach()  # a statistic of the batch, not a graph


class Soteria(Defense):
    """Zero the defended layer's weight-gradient columns of the ``rate`` fraction of lowest-scoring
    features (Sun et al. 2021; scores from :func:`representation_scores`).

    Call it as ``defense(gradients, client_id, scores=s, layer="fc")`` with the scores of the
    client's batch (the callback :class:`~lightning_gp.callbacks.Soteria` computes them); ``layer``
    is the defended layer's module name in the gradient's naming (its weight is ``layer.weight``).
    Exactly ``round(rate * d)`` columns are zeroed; ties are broken by feature index.

    Args:
        rate: fraction of the layer's input features whose columns are zeroed, in [0, 1] (the paper's 80%).
    """

    def __init__(self, rate: float = 0.8, *, seed: int | None = None, nonfinite: str = "error") -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.rate = check_rate(rate, "rate")

    def config(self) -> dict[str, Any]:
        return {"rate": self.rate}

    def prepare(  # type: ignore[override]
        self, gradients: Mapping[str, Tensor], *, scores: Tensor | None = None, layer: str | None = None
    ) -> tuple[Tensor, str]:
        """``(scores, "<layer>.weight")``: the feature scores and the defended weight's name."""
        if scores is None or layer is None:
            raise TypeError(
                "Soteria is data-dependent: pass scores=representation_scores(model, inputs, layer) and layer=<the "
                "defended nn.Linear's name> (the Soteria callback does this for you)"
            )
        weight = f"{layer}.weight"
        if weight not in gradients:
            raise ValueError(f"the gradient has no {weight!r}: layer must name the defended nn.Linear in its naming")
        columns = gradients[weight].shape[1]
        if not isinstance(scores, Tensor) or scores.shape != (columns,):
            raise ValueError(f"scores must be a [{columns}] tensor (one per input feature of {layer!r})")
        if not bool(torch.isfinite(scores).all()):
            raise ValueError("scores must be finite")
        return scores.detach(), weight

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        scores, weight = call.statistic
        pruned = count_for_rate(self.rate, scores.numel())
        order = torch.argsort(scores.to(torch.float64).cpu(), stable=True)  # lowest first; ties by index
        keep = torch.ones(scores.numel(), dtype=torch.bool)
        keep[order[:pruned]] = False
        shared = dict(gradients)
        g = gradients[weight]
        shared[weight] = g * keep.to(device=g.device, dtype=g.dtype).unsqueeze(0)
        return shared, state
