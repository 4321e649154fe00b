"""What the server sees of one round: the only input an attack gets.

A ``ServerView`` holds the model the server sent (its weights that round), the gradient a
client shared exactly as it arrived (after every defense), and what the threat model lets the
server know (batch size, input shape, classes, the data's normalisation). It never holds the
client's data: that stays in :class:`~lightning_gp.records.TappedGradient` for scoring.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.functional import set_batchnorm_mode
from lightning_gp.normalization import denormalize, input_bounds, per_channel
from lightning_gp.records import TappedGradient
from lightning_gp.validation import check_int, check_positive_int


@dataclass
class ServerView:
    """The server's knowledge of one client's round.

    Attributes:
        model: the model as sent to the client that round; for an active attack, the
            server-modified model (e.g. with an imprint block in front).
        gradients: the shared gradient, named like ``model.named_parameters()``.
        batch_size: images behind the gradient (known to the server in FedSGD).
        input_shape: ``(C, H, W)`` of one input.
        num_classes: classes of the task.
        mean, std: per-channel normalisation of the inputs (to keep reconstructions in range).
        labels: the client's labels, only if the threat model grants them (else recovered).
        loss_fn: the client's loss (mean over the batch).
        server_secrets: what an active server built into its model (e.g. an imprint block's
            layer names and bins); empty for passive attacks.
        meta: anything else the tap recorded about the round (algorithm, local steps, ...).
        public_data: labelled images the server holds, never a client's: ``(inputs, labels)``
            with inputs ``[N, *input_shape]`` normalised like the client's and labels ``[N]`` in
            ``[0, num_classes)``. Batch label recovery measures the model's per-class softmax on
            them (:func:`~lightning_gp.attacks.label_counts`); ``None``: it uses dummy inputs.
        label_softmax: where batch label recovery reads the per-class softmax: ``"auto"`` (the public
            data where the view holds it, else dummy inputs), ``"public"`` or ``"dummy"``; the audit's
            second label estimate is ``"dummy"`` on a view that still holds the public data an
            attack's prior trains on.
    """

    model: nn.Module
    gradients: dict[str, Tensor]
    batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    labels: Tensor | None = None
    loss_fn: Callable[[Tensor, Tensor], Tensor] = field(default_factory=nn.CrossEntropyLoss)
    server_secrets: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    public_data: tuple[Tensor, Tensor] | None = None
    label_softmax: str = "auto"

    def __post_init__(self) -> None:
        if self.label_softmax not in ("auto", "public", "dummy"):
            raise ValueError(f"label_softmax must be 'auto', 'public' or 'dummy', got {self.label_softmax!r}")
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(self.model).__name__}")
        check_positive_int(self.batch_size, "batch_size")
        self.input_shape = tuple(int(s) for s in self.input_shape)
        if len(self.input_shape) < 1 or any(s < 1 for s in self.input_shape):
            raise ValueError(f"input_shape must be positive sizes like (C, H, W), got {self.input_shape}")
        check_int(self.num_classes, "num_classes", low=2)
        channels = self.input_shape[0]
        self.mean = per_channel(self.mean, channels, "mean")
        self.std = per_channel(self.std, channels, "std", positive=True)
        if self.labels is not None and self.labels.shape != (self.batch_size,):
            raise ValueError(f"labels must have shape ({self.batch_size},), got {tuple(self.labels.shape)}")
        # The view owns its tensors: an attack that works on them in place, or a caller that keeps
        # training on the originals, must not change what the other sees.
        self.gradients = {n: g.detach().clone() for n, g in self.gradients.items()}
        self.labels = None if self.labels is None else self.labels.detach().clone()
        self.check_gradients()
        self.check_input_shape()
        self.public_data = checked_public_data(self.public_data, self.input_shape, self.num_classes)

    def check_gradients(self) -> None:
        """The shared gradient must name exactly the model's trainable parameters, with their shapes."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        missing = [n for n in params if n not in self.gradients]
        unexpected = [n for n in self.gradients if n not in params]
        wrong = [
            f"{n}: gradient {tuple(g.shape)} vs parameter {tuple(params[n].shape)}"
            for n, g in self.gradients.items()
            if n in params and g.shape != params[n].shape
        ]
        if missing or unexpected or wrong:
            raise ValueError(
                "the shared gradient does not match the model: "
                f"missing {missing}, unexpected {unexpected}, shape mismatches {wrong}"
            )

    @torch.no_grad()
    def check_input_shape(self) -> None:
        """One input of ``input_shape`` must pass through the model (in eval mode, so no BatchNorm
        statistics change), and a ``[1, K]`` output must have ``K = num_classes``."""
        modes = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            probe = torch.zeros((1, *self.input_shape), device=self.device, dtype=next(self.model.parameters()).dtype)
            output = self.model(probe)
        except Exception as err:
            raise ValueError(
                f"input_shape {self.input_shape} does not fit the model: a forward pass on one input of that shape "
                f"fails ({type(err).__name__}: {err}); give the shape of one client input, e.g. (C, H, W)"
            ) from err
        finally:
            for module, training in modes.items():
                module.training = training
        if isinstance(output, Tensor) and output.ndim == 2 and output.shape[1] != self.num_classes:
            raise ValueError(
                f"num_classes is {self.num_classes}, but the model gives {output.shape[1]} outputs per input"
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> ServerView:
        """A copy of the view on ``device`` (model and gradients)."""
        import copy

        view = copy.copy(self)
        view.model = copy.deepcopy(self.model).to(device)
        view.gradients = {n: g.to(device) for n, g in self.gradients.items()}
        view.labels = None if self.labels is None else self.labels.to(device)
        if self.public_data is not None:
            view.public_data = (self.public_data[0].to(device), self.public_data[1].to(device))
        return view

    def data_bounds(self) -> tuple[Tensor, Tensor]:
        """Lower and upper bounds of a valid normalised input (pixels in [0, 1]), shaped ``[1, C, 1, 1]``."""
        low, high = input_bounds(self.mean, self.std, sample_ndim=len(self.input_shape), device=self.device)
        return low.unsqueeze(0), high.unsqueeze(0)

    def denormalize(self, images: Tensor) -> Tensor:
        """Normalised inputs back to pixel values in [0, 1] (clamped)."""
        return denormalize(images, self.mean, self.std, sample_ndim=len(self.input_shape))

    @classmethod
    def from_tap(
        cls,
        record: TappedGradient,
        model: nn.Module,
        *,
        num_classes: int,
        mean: tuple[float, ...] = (0.0,),
        std: tuple[float, ...] = (1.0,),
        labels_known: bool = False,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        server_secrets: Mapping[str, Any] | None = None,
        public_data: tuple[Tensor, Tensor] | None = None,
        label_softmax: str = "auto",
    ) -> ServerView:
        """Build the server's view of a tapped round; ``model`` gets the round's weights.

        The tapped batch gives only what the server knows anyway (its size and input shape) and,
        with ``labels_known``, the labels; never the images. ``public_data``: the server's own
        labelled images, ``label_softmax`` where label recovery reads the softmax (see the class). The model's BatchNorm layers run in the mode the client's
        pass ran them in (``meta["batchnorm"]``, ``"train"`` where the record does not say): the
        attacker models the batch statistics, or the frozen running ones.
        """
        if record.inputs is None:
            raise ValueError(
                "the tapped round has no batch recorded (GradientTap(record_data=False)): batch size unknown"
            )
        model.load_state_dict(record.model_state)
        set_batchnorm_mode(model, str(record.meta.get("batchnorm", "train")))
        return cls(
            model=model,
            gradients=dict(record.gradients),
            batch_size=int(record.inputs.shape[0]),
            input_shape=tuple(record.inputs.shape[1:]),
            num_classes=num_classes,
            mean=mean,
            std=std,
            labels=record.targets.clone() if labels_known and record.targets is not None else None,
            loss_fn=loss_fn or nn.CrossEntropyLoss(),
            server_secrets=dict(server_secrets or {}),
            meta=dict(record.meta),
            public_data=public_data,
            label_softmax=label_softmax,
        )


def checked_public_data(
    public_data: Any, input_shape: tuple[int, ...] | None = None, num_classes: int | None = None
) -> tuple[Tensor, Tensor] | None:
    """``public_data`` (:attr:`ServerView.public_data`) checked and detached: a pair ``(inputs,
    labels)`` of N >= 1 finite inputs (of ``input_shape`` when given) and N integer labels (in
    ``[0, num_classes)`` when given); ``None`` stays ``None``."""
    if public_data is None:
        return None
    if not isinstance(public_data, (tuple, list)) or len(public_data) != 2:
        raise TypeError(f"public_data must be a pair (inputs, labels), got {type(public_data).__name__}")
    inputs, labels = public_data
    if not isinstance(inputs, Tensor) or not isinstance(labels, Tensor):
        raise TypeError("public_data must hold two tensors (inputs, labels)")
    if labels.ndim != 1 or len(labels) != len(inputs) or not len(labels) or labels.is_floating_point():
        raise ValueError(
            f"public_data must be N >= 1 inputs and N integer labels, got inputs {tuple(inputs.shape)} and labels "
            f"{labels.dtype} {tuple(labels.shape)}"
        )
    if input_shape is not None and tuple(inputs.shape[1:]) != tuple(input_shape):
        raise ValueError(
            f"public_data inputs must have shape [N, {', '.join(map(str, input_shape))}], got {tuple(inputs.shape)}"
        )
    if num_classes is not None and (bool((labels < 0).any()) or bool((labels >= num_classes).any())):
        raise ValueError(
            f"public_data labels must lie in [0, {num_classes}), got {int(labels.min())}..{int(labels.max())}"
        )
    if not bool(torch.isfinite(inputs).all()):
        raise ValueError("public_data inputs hold NaN or inf")
    return inputs.detach(), labels.detach()
