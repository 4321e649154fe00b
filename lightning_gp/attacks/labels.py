"""Label recovery from the last layer's gradient: a reusable piece every attack can call.

For cross-entropy, ``dL/dz_c = p_c - 1[c = y]``: only the true class gets a negative logit
gradient. The last layer's bias gradient is that vector (averaged over the batch); its weight
gradient is ``dL/dz h^T``, whose rows keep the sign of ``dL/dz_c`` when the features ``h`` are
non-negative (ReLU/sigmoid outputs).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from lightning_gp.attacks.base import AttackNotApplicable
from lightning_gp.attacks.view import ServerView

LabelMethod = Literal["auto", "idlg", "bias", "yin"]


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
        rows reach the most negative minimum. ``"auto"``: ``idlg`` for one image, else ``yin``.
    Returns:
        ``[B]`` int64 labels, sorted for ``B > 1`` (the batch order is unknowable).
    """
    weight_name, bias_name = classification_layer(view)
    weight_grad = view.gradients[weight_name].detach()
    batch = view.batch_size
    if method == "auto":
        method = "idlg" if batch == 1 else "yin"
    if method == "idlg":
        if batch != 1:
            raise AttackNotApplicable(
                f"iDLG label recovery works for one image, the batch has {batch}; use method='yin'"
            )
        return weight_grad.sum(dim=1).argmin().view(1)
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
        raise ValueError(f"method must be one of 'auto', 'idlg', 'bias', 'yin', got {method!r}")
    return scores.argsort()[:batch].sort().values.to(torch.int64)
