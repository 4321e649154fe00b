"""LightningModule for plain (non-federated) image classification with any model of this package."""

from typing import Literal

import lightning as L
import torch
from torch import nn

from lightning_gp.validation import check_choice, check_model_fits_data, check_nonnegative, check_positive

Batch = tuple[torch.Tensor, torch.Tensor]


class ImageClassifier(L.LightningModule):
    """Cross-entropy training of ``model`` with SGD or Adam; logs loss and top-1 accuracy.

    A model with its own ``loss_fn`` attribute (e.g. :class:`~lightning_gp.models.PRECODE`, whose loss
    adds its KL term) trains with that loss instead of plain cross-entropy.

    Every argument is type-hinted so LightningCLI can build it, e.g.
    ``model: {class_path: lightning_gp.models.LeNetZhu, init_args: {num_classes: 10}}``.
    ``momentum`` applies to SGD only.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.1,
        optimizer: Literal["sgd", "adam"] = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_positive(lr, "lr")
        check_choice(optimizer, "optimizer", ("sgd", "adam"))
        check_nonnegative(momentum, "momentum")
        if optimizer == "adam" and momentum != 0:
            raise ValueError("momentum is only used by optimizer='sgd'; leave it at 0 for 'adam'")
        check_nonnegative(weight_decay, "weight_decay")
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        model_loss = getattr(model, "loss_fn", None)
        if model_loss is not None and not callable(model_loss):
            raise TypeError(f"model.loss_fn must be callable (loss(logits, targets)), got {type(model_loss).__name__}")
        self.loss_fn = model_loss if model_loss is not None else nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def on_fit_start(self) -> None:
        # a model built for other images fails here with both sides named, not deep in a conv
        check_model_fits_data(self.model, getattr(self.trainer, "datamodule", None))

    def _loss_acc(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        images, targets = batch
        logits = self(images)
        loss = self.loss_fn(logits, targets)
        acc = (logits.argmax(dim=1) == targets).float().mean()
        return loss, acc

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss_acc(batch)
        self.log("train_loss", loss, batch_size=batch[0].shape[0])
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        loss, acc = self._loss_acc(batch)
        n = batch[0].shape[0]
        self.log("val_loss", loss, batch_size=n)
        self.log("val_acc", acc, prog_bar=True, batch_size=n)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        loss, acc = self._loss_acc(batch)
        n = batch[0].shape[0]
        self.log("test_loss", loss, batch_size=n)
        self.log("test_acc", acc, batch_size=n)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp["optimizer"] == "adam":
            return torch.optim.Adam(self.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
        return torch.optim.SGD(self.parameters(), lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"])
