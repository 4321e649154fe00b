"""Label recovery from the last layer's gradient: a reusable piece every attack can call.

For cross-entropy, ``dL/dz_c = p_c - 1[c = y]``: only the true class gets a negative logit
gradient. The last layer's bias gradient is that vector (averaged over the batch); its weight
gradient is ``dL/dz h^T``, whose rows keep the sign of ``dL/dz_c`` when the features ``h`` are
non-negative (ReLU/sigmoid outputs).

With repeated labels (a batch of more images than classes, or any real client batch) only counts
are recoverable: the batch-mean bias gradient is ``g_c = p_c - n_c / B`` with ``p_c`` the batch's
mean softmax probability of class ``c`` and ``n_c`` its label count, so ``n_c = B (p_c - g_c)``.
The server estimates ``p_c`` by feeding dummy inputs to the model it sent (Geng et al., "Towards
General Deep Leakage in Federated Learning", 2021, Sec. 3.2, :func:`label_counts`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from lightning_gp.attacks.base import AttackNotApplicable
from lightning_gp.attacks.view import ServerView
from lightning_gp.validation import check_positive_int

LabelMethod = Literal["auto", "idlg", "bias", "yin", "counts"]

#: dummy inputs the server feeds its model to estimate the batch's mean softmax (:func:`label_counts`)
DUMMY_INPUTS = 256


def classification_layer(view: ServerView) -> tuple[str, str | None]:
    """Names of the weight and bias of the last ``nn.Linear`` producing ``num_classes`` outputs."""
    found = None
    for module_name, module in view.model.named_modules():
        if isinstance(module, nn.Linear) and module.out_features == view.num_classes:
            found = (module_name, module)
    if found is None:
        raise AttackNotApplicable(
            f"label recovery needs a final nn.Linear with {view.num_classes} outputs; {type(view.model).__name__} has none"
        )
    prefix = f"{found[0]}." if found[0] else ""
    bias = f"{prefix}bias" if found[1].bias is not None and f"{prefix}bias" in view.gradients else None
    return f"{prefix}weight", bias


def recover_labels(view: ServerView, method: LabelMethod = "auto") -> Tensor:
    """Recover the batch's labels from the shared gradient.

    Methods:
        ``"idlg"`` (Zhao et al. 2020, one image): the class whose weight-gradient row sums
        most negative. ``"bias"``: the most negative bias-gradient entries. ``"yin"`` (Yin et al.
        2021, GradInversion Sec. 3.2, distinct labels): the ``B`` classes whose weight-gradient
        rows reach the most negative minimum. ``"counts"`` (Geng et al. 2021, Sec. 3.2, labels
        may repeat): every class as often as :func:`label_counts` estimates. ``"auto"``: ``idlg``
        for one image, else ``counts``.
    Returns:
        ``[B]`` int64 labels, sorted for ``B > 1`` (the batch order is unknowable).
    """
    weight_name, bias_name = classification_layer(view)
    weight_grad = view.gradients[weight_name].detach()
    batch = view.batch_size
    if method == "auto":
        method = "idlg" if batch == 1 else "counts"
    if method == "idlg":
        if batch != 1:
            raise AttackNotApplicable(
                f"iDLG label recovery works for one image, the batch has {batch}; use method='yin'"
            )
        return weight_grad.sum(dim=1).argmin().view(1)
    if method == "counts":
        counts = label_counts(view)
        return torch.repeat_interleave(torch.arange(view.num_classes, device=counts.device), counts)
    if batch > view.num_classes:
        raise AttackNotApplicable(
            f"{method!r} label recovery assumes distinct labels, impossible for {batch} images of {view.num_classes} classes"
        )
    if method == "bias":
        if bias_name is None:
            raise AttackNotApplicable("method='bias' needs a bias on the classification layer")
        scores = view.gradients[bias_name].detach()
    elif method == "yin":
        scores = weight_grad.min(dim=1).values
    else:
        raise ValueError(f"method must be one of 'auto', 'idlg', 'bias', 'yin', 'counts', got {method!r}")
    return scores.argsort()[:batch].sort().values.to(torch.int64)


@torch.no_grad()
def label_counts(view: ServerView, dummy_inputs: int = DUMMY_INPUTS, seed: int = 0) -> Tensor:
    """How many images of each class the batch holds, estimated from the last layer's gradient.

    Geng et al., "Towards General Deep Leakage in Federated Learning" (2021), Sec. 3.2: for the
    batch-mean cross-entropy the classifier's bias gradient is ``g_c = p_c - n_c / B`` (``p_c`` the
    batch's mean softmax probability of class ``c``), so ``n_c = B (p_c - g_c)``. Without a bias
    the weight rows give the same up to the mean feature sum ``O = mean_i sum_j h_ij``:
    ``sum_j dW_cj = O (p_c - n_c / B)``. The server estimates ``p_c`` (and ``O``) by feeding
    ``dummy_inputs`` images drawn uniformly in the data box (seeded by ``seed``) to a copy of the
    model it sent. The estimates are clamped at 0 and rounded to integers summing to ``B`` by the
    largest remainders.

    Returns:
        ``[num_classes]`` int64 counts summing to ``view.batch_size``.
    """
    import copy

    check_positive_int(dummy_inputs, "dummy_inputs")
    weight_name, bias_name = classification_layer(view)
    model = copy.deepcopy(view.model)  # a BatchNorm layer in training mode must not touch the view's statistics
    layer = model.get_submodule(weight_name.rpartition(".")[0]) if "." in weight_name else model
    features: list[Tensor] = []
    handle = layer.register_forward_hook(lambda module, inputs, output: features.append(inputs[0].flatten(1)))
    try:
        dtype = next(model.parameters()).dtype
        low, high = (bound.to(dtype) for bound in view.data_bounds())
        generator = torch.Generator(device=view.device).manual_seed(seed)
        uniform = torch.rand((dummy_inputs, *view.input_shape), generator=generator, device=view.device, dtype=dtype)
        logits = model(low + (high - low) * uniform)
    finally:
        handle.remove()
    probabilities = logits.float().softmax(dim=-1).mean(dim=0)
    if bias_name is not None:
        gradient = view.gradients[bias_name].detach().float()
    else:
        feature_sum = float(features[-1].float().sum(dim=1).mean())
        if feature_sum == 0.0:
            raise AttackNotApplicable("label counts without a bias need features that do not sum to 0 on dummy inputs")
        gradient = view.gradients[weight_name].detach().float().sum(dim=1) / feature_sum
    return _round_to_total(view.batch_size * (probabilities - gradient.to(probabilities.device)), view.batch_size)


def _round_to_total(estimate: Tensor, total: int) -> Tensor:
    """Non-negative integers summing to ``total`` closest to ``estimate`` (clamped at 0, then the
    largest-remainder rounding: floors, and one more for the largest fractional parts)."""
    estimate = estimate.clamp(min=0)
    if float(estimate.sum()) > 0:
        estimate = estimate * (total / float(estimate.sum()))
    else:
        estimate = torch.full_like(estimate, total / estimate.numel())
    counts = estimate.floor().to(torch.int64)
    missing = total - int(counts.sum())
    if missing > 0:
        counts[(estimate - counts).argsort(descending=True)[:missing]] += 1
    return counts
