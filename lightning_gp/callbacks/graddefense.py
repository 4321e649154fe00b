"""The GradDefense callback: sensitivity on a public root set, then slice, perturb and compensate.

Where the sensitivity is computed (docs/architecture.md, "Flow 1"):

* single device and DDP: at ``on_train_batch_start``, under the weights the coming backward pass
  uses (no autograd work runs inside DDP's communication hook);
* :class:`~lightning_gp.federated.FederatedSimulation`: in ``defend``, under the server model,
  once per round for all of its clients (the root set and the weights are the same for each).

It is recomputed every ``refresh_every`` rounds (default 1: every round, as Plato's trainer
recomputes it at the start of each round's local training; the official demos compute it once);
the sensitivity in use is checkpointed, so a resumed run reuses it as the uninterrupted run would.
The root set is public, so unlike Soteria or the optimal defenses this defense reads no client
data, and it may run after DP-SGD.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_gp.attacks.noise_aware import noise_aware_attacks
from lightning_gp.attacks.perturbation_aware import graddefense_callback_knowledge
from lightning_gp.attacks.registry import register_defense_knowledge
from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.callbacks.data_dependent import sensitivity_of_layers
from lightning_gp.defenses import graddefense
from lightning_gp.functional import LossFn
from lightning_gp.pipeline.stages import ClientSetup, StageCall
from lightning_gp.validation import check_positive_int

#: the datamodule splits ``root_data`` may name
ROOT_SPLITS = ("train", "val", "test")


class GradDefense(GradientDefense, defense=graddefense.GradDefense):
    """GradDefense (Wang et al., INFOCOM 2022) on every path (plain Trainer, DDP, FederatedSimulation).

    See :class:`lightning_gp.defenses.GradDefense` for the slicing, noise and compensation.

    Args:
        root_data: the public root set. ``(inputs, targets)`` tensors; a ``Dataset`` of
            ``(input, target)`` items; the path of a ``torch.save``'d ``(inputs, targets)`` pair
            (or a dict with those keys); or ``"train"``, ``"val"``, ``"test"``: that split of the
            fit's datamodule (``trainer.fit(datamodule=...)``, or a FederatedSimulation's). From a
            dataset the first ``root_per_class`` items of each class are taken, in dataset order
            (Plato's ``extract_root_set``; the official code draws it from the training set).
        slices, perturbed_slices, sigma, clip, q: see :class:`lightning_gp.defenses.GradDefense`.
        root_per_class: items per class taken from a dataset (Plato's 5).
        refresh_every: rounds between sensitivity updates, ``>= 1``.
        loss_fn: ``loss_fn(logits, targets)`` of the root set; default: the LightningModule's
            (or FederatedSimulation's) ``loss_fn`` attribute.

    The root set (a datamodule split by name, any other root set by a digest of its tensors),
    ``root_per_class`` and ``refresh_every`` are part of :attr:`state_key`: a resume with other
    values is refused.
    """

    defense: graddefense.GradDefense

    def adapt(  # type: ignore[override]  # root_data is required: no default root set is right
        self,
        *,
        root_data: Any,
        root_per_class: int = 5,
        refresh_every: int = 1,
        loss_fn: LossFn | None = None,
    ) -> None:
        self.root_per_class = check_positive_int(root_per_class, "root_per_class")
        self.refresh_every = check_positive_int(refresh_every, "refresh_every")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.root_data = root_data
        self._root: tuple[Tensor, Tensor] | None = None
        #: how the checkpoint names the root set: the split, else a digest of the root tensors
        self._root_id = root_data if isinstance(root_data, str) and root_data in ROOT_SPLITS else ""
        if not self._root_id:
            self._root = root_batch(root_data, self.root_per_class)  # fail early on a bad tensor, dataset or file
            self._root_id = root_digest(*self._root)
        self._module_loss: LossFn | None = None
        self._batches_given = False
        self._cache: tuple[int, dict[str, Tensor]] | None = None

    # ---------------------------------------------------------------- Lightning hooks
    def bind(self, setup: ClientSetup) -> None:
        super().bind(setup)
        self._batches_given = setup.passes_client_batches

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        module_loss = getattr(pl_module, "loss_fn", None)
        self._module_loss = module_loss if callable(module_loss) else None
        if self.loss_fn is None and self._module_loss is None:
            raise ValueError(
                f"GradDefense needs the loss of the root set, and {type(pl_module).__name__} has no callable "
                "`loss_fn` attribute: pass loss_fn=... (loss(logits, targets), averaged over the batch)"
            )
        if self._root is None:
            self.resolve_root_set(getattr(trainer, "datamodule", None) or getattr(pl_module, "source_datamodule", None))

    # ---------------------------------------------------------------- settings and checkpointed state
    def adapter_config(self) -> dict[str, Any]:
        return {
            **super().adapter_config(),
            "root_data": self._root_id,
            "root_per_class": self.root_per_class,
            "refresh_every": self.refresh_every,
        }

    def adapter_state(self) -> dict[str, Any]:
        return {"cache": self._cache}

    def load_adapter_state(self, state: Mapping[str, Any]) -> None:
        cache = state.get("cache")
        valid = cache is None or (
            isinstance(cache, (tuple, list))
            and len(cache) == 2
            and isinstance(cache[1], Mapping)
            and all(isinstance(s, Tensor) for s in cache[1].values())
        )
        if set(state) != {"cache"} or not valid:
            raise ValueError(f"GradDefense: not a saved sensitivity cache: keys {sorted(state)}")
        self._cache = None if cache is None else (int(cache[0]), {n: s.clone() for n, s in cache[1].items()})

    def reset_adapter_state(self) -> None:
        self._cache = None

    def resolve_root_set(self, datamodule: pl.LightningDataModule | None) -> None:
        """Take the root set from ``datamodule`` when ``root_data`` names one of its splits (a fit does
        this at start; a server auditing the defense does it with the same public data)."""
        if self._root is None:
            self._root = root_batch(self.root_data, self.root_per_class, datamodule=datamodule)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._batches_given:  # local and DDP: not inside the communication hook
            self.round_sensitivity(trainer.global_step, pl_module)

    def defense_inputs(self, gradients: Mapping[str, Tensor], call: StageCall) -> dict[str, Any]:
        if self._batches_given:
            sensitivity = self.round_sensitivity(call.round, call.model)
        else:
            cached = self._cache
            if cached is None or cached[0] > call.round or call.round - cached[0] >= self.refresh_every:
                raise RuntimeError(
                    "GradDefense computes the sensitivity at the start of each training batch, and saw none for "
                    f"step {call.round} (manual optimization is not supported)"
                )
            sensitivity = cached[1]
        return {**super().defense_inputs(gradients, call), "sensitivity": sensitivity_of_layers(sensitivity, gradients)}

    # ---------------------------------------------------------------- the sensitivity
    def round_sensitivity(self, round: int, model: nn.Module) -> dict[str, Tensor]:
        """The sensitivity of ``round``: reused within ``refresh_every`` rounds, else recomputed."""
        cached = self._cache
        if cached is not None and 0 <= round - cached[0] < self.refresh_every:
            return cached[1]
        sensitivity = self.sensitivity_for(model)
        self._cache = (round, sensitivity)
        return sensitivity

    def sensitivity_for(self, model: nn.Module, loss_fn: LossFn | None = None) -> dict[str, Tensor]:
        """:func:`~lightning_gp.defenses.graddefense.root_set_sensitivity` of the root set under
        ``model``'s weights (what a server that holds the root set computes too); ``loss_fn``
        defaults to the callback's, else the fitted module's."""
        if self._root is None:
            raise RuntimeError(
                f"GradDefense's root set {self.root_data!r} names a datamodule split: it is taken at fit start"
            )
        loss_fn = loss_fn or self.loss_fn or self._module_loss
        if loss_fn is None:
            raise RuntimeError(
                "GradDefense has no loss: it computes the sensitivity during a fit (or pass loss_fn=...)"
            )
        device = next(model.parameters()).device
        inputs, targets = (t.to(device) for t in self._root)
        return graddefense.root_set_sensitivity(model, loss_fn, inputs, targets)

    def slice_boundaries_for(
        self, model: nn.Module, gradients: Mapping[str, Tensor], loss_fn: LossFn | None = None
    ) -> list[int]:
        """The slices GradDefense cuts ``gradients`` into under ``model``'s weights (for the adaptive attack)."""
        return self.defense.slice_boundaries(gradients, self.sensitivity_for(model, loss_fn))


def root_batch(
    root_data: Any, per_class: int, *, datamodule: pl.LightningDataModule | None = None
) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of a root set given as tensors, a dataset, a saved file or a datamodule split."""
    if isinstance(root_data, str) and root_data in ROOT_SPLITS:
        if datamodule is None:
            raise ValueError(
                f"root_data={root_data!r} names a split of the fit's datamodule, and this fit has none: pass "
                "trainer.fit(module, datamodule=...), or give the root set as tensors, a dataset or a file"
            )
        dataset = getattr(datamodule, f"{root_data}_dataset", None)
        if dataset is None:
            datamodule.setup("fit")
            dataset = getattr(datamodule, f"{root_data}_dataset", None)
        if dataset is None:
            raise ValueError(f"{type(datamodule).__name__} has no {root_data}_dataset for root_data={root_data!r}")
        return _per_class(dataset, per_class)
    if isinstance(root_data, (str, Path)):
        path = Path(root_data)
        if not path.is_file():
            raise FileNotFoundError(
                f"root_data {str(root_data)!r} is neither one of {list(ROOT_SPLITS)} nor a file holding a torch.save'd "
                "(inputs, targets) pair"
            )
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(loaded, Mapping):
            loaded = (loaded.get("inputs"), loaded.get("targets"))
        return _checked_pair(loaded, f"the file {str(path)!r}")
    if isinstance(root_data, (tuple, list)):
        return _checked_pair(root_data, "root_data")
    if isinstance(root_data, Dataset):
        return _per_class(root_data, per_class)
    raise TypeError(
        f"root_data must be (inputs, targets) tensors, a Dataset, a file path or one of {list(ROOT_SPLITS)}, "
        f"got {type(root_data).__name__}"
    )


def root_digest(inputs: Tensor, targets: Tensor) -> str:
    """A short digest of a root set's tensors (dtype, shape and bytes), how checkpoints name it."""
    digest = hashlib.sha256()
    for tensor in (inputs, targets):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()[:16]}"


def _checked_pair(pair: Any, where: str) -> tuple[Tensor, Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(t, Tensor) for t in pair)):
        raise TypeError(f"{where} must hold an (inputs, targets) pair of tensors")
    inputs, targets = pair
    if not inputs.is_floating_point():
        raise TypeError(f"{where}: the root inputs must be floating point, got {inputs.dtype}")
    if inputs.ndim < 1 or inputs.shape[0] == 0 or targets.shape[:1] != inputs.shape[:1]:
        raise ValueError(
            f"{where}: one target per input and at least one example, got inputs {tuple(inputs.shape)} and "
            f"targets {tuple(targets.shape)}"
        )
    return inputs.detach().cpu(), targets.detach().cpu()


def _per_class(dataset: Any, per_class: int) -> tuple[Tensor, Tensor]:
    """The first ``per_class`` items of each class, in dataset order."""
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        labels = torch.as_tensor(targets).view(-1)
        chosen: Sequence[int] = sorted(
            i for c in labels.unique().tolist() for i in (labels == c).nonzero().view(-1)[:per_class].tolist()
        )
    else:
        counts: dict[int, int] = {}
        picked = []
        for i in range(len(dataset)):
            label = int(dataset[i][1])
            if counts.get(label, 0) < per_class:
                counts[label] = counts.get(label, 0) + 1
                picked.append(i)
        chosen = picked
    if not chosen:
        raise ValueError("the root set's dataset is empty")
    items = [dataset[i] for i in chosen]
    inputs = torch.stack([torch.as_tensor(x) for x, _ in items])
    labels_out = torch.as_tensor([int(y) for _, y in items], dtype=torch.int64)
    return _checked_pair((inputs, labels_out), "the root set")


# The server's adaptive attack on a GradDefense client (declared here, beside the class it models).
register_defense_knowledge(GradDefense, graddefense_callback_knowledge, attacks=noise_aware_attacks)
