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

import copy
from typing import Literal, cast

import torch
from torch import Tensor, nn

from lightning_gp.attacks.base import AttackNotApplicable
from lightning_gp.attacks.view import ServerView
from lightning_gp.validation import check_positive_int

LabelMethod = Literal["auto", "idlg", "bias", "yin", "counts"]
SoftmaxSource = Literal["auto", "public", "dummy"]

#: what batch label recovery computes: 1 Geng et al.'s dummy-input counts; 2 the counts of a least-squares
#: fit of per-class softmax means (from the server's public images where it holds them); 3 the audit runs
#: each label-recovering attack under both estimates where they differ (:func:`label_estimates_differ`).
#: Stored results at batch sizes above 1 that an older revision computed are stale.
LABEL_RECOVERY_REVISION = 3

#: the largest ``|sum_c db_c| / sum_c |db_c|`` of a bias gradient :func:`label_counts` takes as untouched
#: (float32 rounding of a batch mean is ~1e-7; Gaussian noise of 0.01 on 10 classes gives ~1e-2)
BIAS_SUM_TOLERANCE = 1e-4

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
    A FedAvg update is read as a gradient first (:func:`as_gradient`).

    Returns:
        ``[B]`` int64 labels, sorted for ``B > 1`` (the batch order is unknowable).
    """
    view = as_gradient(view)
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


def label_estimates_differ(view: ServerView) -> bool:
    """Whether the batch's label counts from the view's public images (:func:`label_counts`,
    ``softmax_from="public"``) differ from those of dummy inputs (``"dummy"``, Geng et al.'s).
    The public estimate is the better one on average, not on every batch, so where the two differ
    an audit runs each label-recovering attack under both and judges the worst case. ``False`` for
    one image (its label comes from the weight rows) or a view without public images."""
    if view.batch_size == 1 or view.public_data is None:
        return False
    return not torch.equal(label_counts(view, softmax_from="public"), label_counts(view, softmax_from="dummy"))


def update_as_gradient(view: ServerView, lr: float, steps: int) -> ServerView:
    """A FedAvg update ``Δ = w - w_T`` of ``steps`` local SGD steps at ``lr`` read as one batch-mean
    gradient of the client's images (Dimitrov et al., TMLR 2022, label recovery from the update): ``Δ``
    divided by ``lr T``, with the model moved to ``w - a Δ``, ``a = (T - 1) / 2T``, the mean of the models
    ``w - (t / T) Δ`` the ``T`` steps were taken at. Its ``meta["algorithm"]`` is ``"fedsgd"``."""
    along = (steps - 1) / (2 * steps)
    model = copy.deepcopy(view.model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in view.gradients:
                param.sub_(along * view.gradients[name].to(param))
    scaled = copy.copy(view)
    scaled.model = model
    scaled.gradients = {n: g / (lr * steps) for n, g in view.gradients.items()}
    scaled.meta = {**view.meta, "algorithm": "fedsgd", "read_from": "fedavg update"}
    return scaled


def as_gradient(view: ServerView) -> ServerView:
    """``view`` as a batch-mean gradient: a FedAvg update whose ``meta`` holds ``local_lr`` and
    ``local_steps`` through :func:`update_as_gradient`, anything else as it is."""
    meta = view.meta
    if meta.get("algorithm") != "fedavg" or meta.get("local_lr") is None or meta.get("local_steps") is None:
        return view
    return update_as_gradient(view, float(meta["local_lr"]), int(meta["local_steps"]))


@torch.no_grad()
def label_counts(
    view: ServerView, dummy_inputs: int = DUMMY_INPUTS, seed: int = 0, softmax_from: SoftmaxSource = "auto"
) -> Tensor:
    """How many images of each class the batch holds, estimated from the last layer's gradient.

    For the batch-mean cross-entropy the classifier's gradient is ``dW_c = mean_i (p_ic - 1[y_i = c])
    h_i`` and ``db_c = mean_i (p_ic - 1[y_i = c])`` (``p_i`` image ``i``'s softmax, ``h_i`` its
    features): the bias gives ``n_c = B (p_c - db_c)`` with ``p`` the batch's mean softmax (Geng et
    al., "Towards General Deep Leakage in Federated Learning", 2021, Sec. 3.2). The server does not
    know ``p_i`` or ``h_i``; it models each image by the mean of its class, which makes the gradient
    linear in the counts, ``g = M n / B`` with column ``k`` of ``M`` the mean gradient of one image
    of class ``k``, and solves that system with ``sum_k n_k = B`` by least squares (the linear
    system of Ma et al., "Instance-wise Batch Label Restoration via Gradients in Federated
    Learning", ICLR 2023). The class means come from ``softmax_from``:

    - ``"public"``: the labelled public images the server holds (``view.public_data``), class by
      class (a class with no public image takes the mean over all of them); the equations are the
      bias and, where a defense touched the bias (it does not sum to 0, :data:`BIAS_SUM_TOLERANCE`),
      the weight rows' sums ``sum_j dW_cj = mean_i (p_ic - 1[y_i = c]) sum_j h_ij`` too. Needed
      on a trained model, which scores its classes unlike each other and unlike noise. (More
      equations, the rows along the features' leading principal directions, changed at most 4 of 64
      labels on LeNetZhu, so they are left out.)
    - ``"dummy"``: ``dummy_inputs`` images drawn uniformly in the data box (seeded by ``seed``), one
      mean for every class, and the bias alone (the weight rows' sums without a bias): Geng et al.'s
      estimate. Right at initialisation, where the softmax is near uniform on any input; one label
      off per client batch of 8 on LeNetZhu after 50 FedSGD rounds
      (``benchmarks/results/label_counts_trained.md``).
    - ``"auto"``: ``"public"`` when the view holds public data, else ``"dummy"``.

    The least-squares solution is rounded to non-negative integers summing to ``B`` (the largest
    remainders), then improved by moving one image at a time between classes while that lowers the
    gradient residual ``|M n / B - g|``.

    A FedAvg update is read as a gradient first (:func:`as_gradient`).

    Returns:
        ``[num_classes]`` int64 counts summing to ``view.batch_size``.
    """
    view = as_gradient(view)
    check_positive_int(dummy_inputs, "dummy_inputs")
    if softmax_from not in ("auto", "public", "dummy"):
        raise ValueError(f"softmax_from must be 'auto', 'public' or 'dummy', got {softmax_from!r}")
    if softmax_from == "auto":
        softmax_from = cast(SoftmaxSource, view.label_softmax)
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
    probabilities, features = _softmax_and_features(view, weight_name, inputs)
    # each equation: a gradient entry per class and what one image's error p_i - e_y multiplies there
    per_image: list[Tensor] = []  # [N, 1] each
    observed: list[Tensor] = []  # [K, 1] each
    if bias_name is not None:
        per_image.append(torch.ones(len(features), 1, dtype=torch.float64))
        observed.append(view.gradients[bias_name].detach().to("cpu", torch.float64).unsqueeze(1))
    if bias_name is None or (softmax_from == "public" and not _untouched_bias(observed[0])):
        sums = features.sum(dim=1, keepdim=True)
        if bias_name is None and float(sums.mean()) == 0.0:
            raise AttackNotApplicable("label counts without a bias need features that do not sum to 0 on average")
        per_image.append(sums)
        observed.append(view.gradients[weight_name].detach().to("cpu", torch.float64).sum(dim=1, keepdim=True))
    response = _class_response(probabilities, torch.cat(per_image, 1), classes, view.num_classes)
    return _counts_fitting(response, torch.cat(observed, 1).flatten(), view.batch_size)


def _untouched_bias(gradient: Tensor) -> bool:
    """Whether a classifier's bias gradient ``[K, 1]`` sums to 0, as cross-entropy's always does
    (``sum_c (p_c - 1[y = c]) = 0``) up to float rounding: then no defense pruned, noised or quantised
    it, and it alone gives the counts (the weight rows add only the features' class-mean error)."""
    return float(gradient.sum().abs()) <= BIAS_SUM_TOLERANCE * float(gradient.abs().sum())


def _softmax_and_features(view: ServerView, weight_name: str, inputs: Tensor) -> tuple[Tensor, Tensor]:
    """Each input's softmax ``[N, K]`` and the classification layer's input features ``[N, F]`` (float64, CPU)."""
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
    return logits.detach().to("cpu", torch.float64).softmax(dim=-1), features[-1].detach().to("cpu", torch.float64)


def _class_response(probabilities: Tensor, per_image: Tensor, classes: Tensor | None, num_classes: int) -> Tensor:
    """``M[(c, d), k] = E_k[(p_c - 1[c = k]) x_d]``, ``x = per_image`` ``[N, D]``: the gradient one
    image of class ``k`` adds, averaged over the images of class ``k`` (over all images where
    ``classes`` is ``None`` or has none of class ``k``), flattened to ``[K * D, K]``."""
    classes = None if classes is None else classes.to("cpu")
    columns = []
    for k in range(num_classes):
        mask = torch.ones(len(probabilities), dtype=torch.bool) if classes is None else classes == k
        if not bool(mask.any()):
            mask = torch.ones(len(probabilities), dtype=torch.bool)
        error = probabilities[mask].clone()
        error[:, k] -= 1.0
        columns.append((error.t() @ per_image[mask] / int(mask.sum())).flatten())
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
    gram = step.t() @ step  # [K, K], so a trial costs K^2 numbers, not K^2 times the equations
    while True:  # each move lowers the residual by more than rounding, so no counts repeat and the loop ends
        # trial[b, a] = |residual + step_b - step_a|^2: the squared residual after moving an image from a to b
        along = step.t() @ residual
        diagonal = gram.diagonal()
        trial = (
            (residual**2).sum()
            + diagonal[:, None]
            + diagonal[None, :]
            - 2 * gram
            + 2 * (along[:, None] - along[None, :])
        )
        trial.fill_diagonal_(float("inf"))  # a move within one class changes nothing
        trial[:, counts == 0] = float("inf")
        best = int(trial.argmin())
        to_class, from_class = divmod(best, k)
        current = float((residual**2).sum())
        # a move must gain more than the trial's rounding (relative to the terms it sums), so none repeats
        if not float(trial[to_class, from_class]) < current - 1e-12 * (current + float(diagonal.max())):
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
