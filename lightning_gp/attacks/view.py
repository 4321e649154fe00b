"""What the server sees of one round: the only input an attack gets.

A ``ServerView`` holds the model the server sent (its weights that round), the gradient a
client shared exactly as it arrived (after every defense), and what the threat model lets the
server know (batch size, input shape, classes, the data's normalisation). It never holds the
client's data: that stays in :class:`~lightning_gp.callbacks.TappedGradient` for scoring.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.callbacks.tap import TappedGradient


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
    """

    model: nn.Module
    gradients: dict[str, Tensor]
    batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    labels: Tensor | None = None
    loss_fn: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    server_secrets: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(self.model).__name__}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        self.input_shape = tuple(int(s) for s in self.input_shape)
        if len(self.input_shape) < 1 or any(s < 1 for s in self.input_shape):
            raise ValueError(f"input_shape must be positive sizes like (C, H, W), got {self.input_shape}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        channels = self.input_shape[0]
        for name in ("mean", "std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) == 1 and channels > 1:
                value = value * channels
            if len(value) != channels:
                raise ValueError(f"{name} needs one value per channel ({channels}), got {value}")
            setattr(self, name, value)
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")
        if self.labels is not None and self.labels.shape != (self.batch_size,):
            raise ValueError(f"labels must have shape ({self.batch_size},), got {tuple(self.labels.shape)}")
        self.check_gradients()

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
        return view

    def data_bounds(self) -> tuple[Tensor, Tensor]:
        """Lower and upper bounds of a valid normalised input (pixels in [0, 1]), shaped ``[1, C, 1, 1]``."""
        mean = torch.tensor(self.mean, device=self.device).view(1, -1, *([1] * (len(self.input_shape) - 1)))
        std = torch.tensor(self.std, device=self.device).view_as(mean)
        return (0 - mean) / std, (1 - mean) / std

    def denormalize(self, images: Tensor) -> Tensor:
        """Normalised inputs back to pixel values in [0, 1] (clamped)."""
        low, high = self.data_bounds()
        return ((images - low.to(images.device)) / (high - low).to(images.device)).clamp(0, 1)

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
        loss_fn: nn.Module | None = None,
        server_secrets: Mapping[str, Any] | None = None,
    ) -> ServerView:
        """Build the server's view of a tapped round; ``model`` gets the round's weights.

        The tapped batch gives only what the server knows anyway (its size and input shape) and,
        with ``labels_known``, the labels; never the images.
        """
        if record.inputs is None:
            raise ValueError(
                "the tapped round has no batch recorded (GradientTap(record_data=False)): batch size unknown"
            )
        model.load_state_dict(record.model_state)
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
        )
