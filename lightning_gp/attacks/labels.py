"""Label recovery from the last layer's gradient: a reusable piece every attack can call.

For cross-entropy, ``dL/dz_c = p_c - 1[c = y]``: only the true class gets a negative logit
gradient. The last layer's bias gradient is that vector (averaged over the batch); its weight
gradient is ``dL/dz h^T``, whose rows keep the sign of ``dL/dz_c`` when the features ``h`` are
non-negative (ReLU/sigmoid outputs).

With repeated labels (a batch of more images than classes, or any real client batch) only counts
are recoverable: the batch-mean bias gradient is ``g_c = p_c - n_c / B`` with ``p_c`` the batch's
mean softmax probability of class ``c`` and ``n_c`` its label count, so ``n_c = B (p_c - g_c)``
(Geng et al., "Towards General Deep Leakage in Federated Learning", 2021, Sec. 3.2). The server
models ``p`` by class-conditional mean softmaxes, measured on labelled public images it holds (or on
dummy inputs), and solves the resulting linear system for the counts (:func:`label_counts`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from lightning_gp.attacks.base import AttackNotApplicable
from lightning_gp.attacks.view import ServerView
from lightning_gp.validation import check_positive_int

LabelMethod = Literal["auto", "idlg", "bias", "yin", "counts"]
SoftmaxSource = Literal["auto", "public", "dummy"]

#: what batch label recovery computes: 1 Geng et al.'s dummy-input counts; 2 the counts of a least-squares
#: fit of per-class softmax means (from the server's public images where it holds them). Stored results
#: at batch sizes above 1 that an older revision computed are stale.
LABEL_RECOVERY_REVISION = 2

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
def label_counts(
    view: ServerView, dummy_inputs: int = DUMMY_INPUTS, seed: int = 0, softmax_from: SoftmaxSource = "auto"
) -> Tensor:
    """How many images of each class the batch holds, estimated from the last layer's gradient.

    For the batch-mean cross-entropy the classifier's bias gradient is ``g_c = p_c - n_c / B`` (``p_c``
    the batch's mean softmax probability of class ``c``; Geng et al., "Towards General Deep Leakage in
    Federated Learning", 2021, Sec. 3.2). Without a bias the weight rows give the same weighted by
    each image's feature sum ``O_i = sum_j h_ij``: ``sum_j dW_cj = mean_i O_i (p_ic - 1[y_i = c])``.
    The server does not know ``p``; it models each image by the mean of its class, which makes the
    gradient linear in the counts, ``g = M n / B`` with ``M[c, k] = E_k[O p_c] - E_k[O] 1[c = k]``
    (``O = 1`` with a bias), and solves that system with ``sum_k n_k = B`` by least squares (the
    linear system of Ma et al., "Instance-wise Batch Label Restoration via Gradients in Federated
    Learning", ICLR 2023). The class means ``E_k`` come from ``softmax_from``:

    - ``"public"``: the labelled public images the server holds (``view.public_data``), class by
      class (a class with no public image takes the mean over all of them). Needed on a trained
      model, which scores its classes unlike each other and unlike noise.
    - ``"dummy"``: ``dummy_inputs`` images drawn uniformly in the data box (seeded by ``seed``), the
      same for every class: Geng et al.'s estimate ``n_c = B (p_c - g_c)``. Exact at initialisation,
      where the softmax is near uniform on any input; one label off per client batch of 8 on
      LeNetZhu after 50 FedSGD rounds (``benchmarks/results/label_counts_trained.md``).
    - ``"auto"``: ``"public"`` when the view holds public data, else ``"dummy"``.

    The least-squares solution is rounded to non-negative integers summing to ``B`` (the largest
    remainders), then improved by moving one image at a time between classes while that lowers the
    gradient residual ``|M n / B - g|``.

    Returns:
        ``[num_classes]`` int64 counts summing to ``view.batch_size``.
    """
    check_positive_int(dummy_inputs, "dummy_inputs")
    if softmax_from not in ("auto", "public", "dummy"):
        raise ValueError(f"softmax_from must be 'auto', 'public' or 'dummy', got {softmax_from!r}")
    if softmax_from == "auto":
        softmax_from = "public" if view.public_data is not None else "dummy"
    weight_name, bias_name = classification_layer(view)
    classes: Tensor | None = None
    if softmax_from == "public":
        if view.public_data is None:
            raise ValueError("softmax_from='public' needs labelled public images in the view (ServerView.public_data)")
        inputs, classes = view.public_data
    else:
        low, high = view.data_bounds()
        generator = torch.Generator(device=view.device).manual_seed(seed)
        uniform = torch.rand((dummy_inputs, *view.input_shape), generator=generator, device=view.device)
        inputs = low + (high - low) * uniform
    probabilities, weights = _softmax_and_feature_sums(view, weight_name, inputs, per_image_weight=bias_name is None)
    response = _class_response(probabilities, weights, classes, view.num_classes)
    if bias_name is not None:
        observed = view.gradients[bias_name].detach()
    else:
        observed = view.gradients[weight_name].detach().sum(dim=1)
    return _counts_fitting(response, observed.to("cpu", torch.float64), view.batch_size)


def _softmax_and_feature_sums(
    view: ServerView, weight_name: str, inputs: Tensor, per_image_weight: bool
) -> tuple[Tensor, Tensor]:
    """Each input's softmax ``[N, K]`` and its weight ``[N]`` in the class response: the sum of the
    classification layer's input features with ``per_image_weight`` (no bias), else 1 (float64, CPU)."""
    import copy

    model = copy.deepcopy(view.model)  # a BatchNorm layer in training mode must not touch the view's statistics
    layer = model.get_submodule(weight_name.rpartition(".")[0]) if "." in weight_name else model
    features: list[Tensor] = []
    handle = layer.register_forward_hook(lambda module, args, output: features.append(args[0].flatten(1)))
    try:
        dtype = next(model.parameters()).dtype
        logits = model(inputs.to(view.device, dtype))
    finally:
        handle.remove()
    probabilities = logits.detach().to("cpu", torch.float64).softmax(dim=-1)
    if not per_image_weight:
        return probabilities, torch.ones(len(probabilities), dtype=torch.float64)
    weights = features[-1].detach().to("cpu", torch.float64).sum(dim=1)
    if float(weights.mean()) == 0.0:
        raise AttackNotApplicable("label counts without a bias need features that do not sum to 0 on average")
    return probabilities, weights


def _class_response(probabilities: Tensor, weights: Tensor, classes: Tensor | None, num_classes: int) -> Tensor:
    """``M[c, k] = E_k[w p_c] - E_k[w] 1[c = k]``: the last layer's gradient per image of class ``k``,
    averaged over the images of class ``k`` (over all images where ``classes`` is ``None`` or has none
    of class ``k``)."""
    weighted = weights.unsqueeze(1) * probabilities
    overall = weighted.mean(dim=0), weights.mean()
    columns = []
    for k in range(num_classes):
        mask = None if classes is None else classes.to("cpu") == k
        if mask is None or not bool(mask.any()):
            mean_weighted, mean_weight = overall
        else:
            mean_weighted, mean_weight = weighted[mask].mean(dim=0), weights[mask].mean()
        column = mean_weighted.clone()
        column[k] -= mean_weight
        columns.append(column)
    return torch.stack(columns, dim=1)


def _counts_fitting(response: Tensor, observed: Tensor, total: int) -> Tensor:
    """Non-negative integer counts ``n`` summing to ``total`` with ``response @ n / total`` close to
    ``observed``: least squares on the plane ``sum n = total``, the largest-remainder rounding, then
    single moves of one image between classes while they lower the residual."""
    k = response.shape[1]
    # x = n / total = 1/K + Z y, Z an orthonormal basis of the plane's directions (orthogonal to all-ones)
    directions = torch.linalg.qr(
        torch.cat([torch.ones(k, 1, dtype=response.dtype), torch.eye(k)[:, : k - 1].to(response)], 1)
    )
    basis = directions.Q[:, 1:]
    start = torch.full((k,), 1.0 / k, dtype=response.dtype)
    solution = torch.linalg.pinv(response @ basis) @ (observed - response @ start)
    counts = _round_to_total(total * (start + basis @ solution), total)
    step = response / total  # column k: what one more image of class k adds to the gradient
    residual = step @ counts.to(step) - observed
    while True:  # each move lowers the residual by a margin, so no set of counts repeats and the loop ends
        # trial[b, a]: the squared residual after moving one image from class a to class b
        trial = ((residual[:, None, None] + step[:, :, None] - step[:, None, :]) ** 2).sum(dim=0)
        trial[:, counts == 0] = float("inf")
        best = int(trial.argmin())
        to_class, from_class = divmod(best, k)
        if not float(trial[to_class, from_class]) < float((residual**2).sum()) * (1 - 1e-12):
            return counts
        counts[from_class] -= 1
        counts[to_class] += 1
        residual = residual + step[:, to_class] - step[:, from_class]


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
