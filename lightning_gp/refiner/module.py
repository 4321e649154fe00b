"""``RefinerModule``: train a model on Refiner's robust data instead of the raw batch.

Refiner (Fan et al., USENIX Security 2025) is not a gradient transform: each client optimises a substitute
batch ``x*`` with the live model, then shares the gradient of ``x*`` projected to within ``eps``
(or ``eps ||g||`` with ``eps_relative=True``) of its raw gradient ``g``
(:mod:`lightning_gp.refiner.robust_data`). ``RefinerModule`` wraps a user's model so that this is
what a client computes, wherever the client step runs:

* plain ``Trainer.fit`` (one process = one client) and DDP (one rank = one client): each
  training step refines the rank's own batch and backpropagates a surrogate whose parameter
  gradient is exactly the projected upload, so Lightning's backward, DDP's all-reduce and every
  defense callback see the upload (they compose after Refiner);
* :class:`~lightning_gp.federated.FederatedSimulation` (``FederatedSimulation(module=RefinerModule(...))``):
  the simulation asks the module for each client's gradient (:meth:`client_gradient`),
  with that client's random stream and warm-start cache.

Warm start (Sec. 6.3): with ``warm_start=True`` the robust image of every sample is cached by its
dataset index (per client) and is the next start for the same sample, with
``warm_iterations`` steps. The cache is part of the module's state dict (checkpoints); under
DDP the ranks' caches are gathered into the checkpoint. Batches must then carry the sample
indices: ``(inputs, targets, indices)`` (:class:`IndexedDataset` adds them); the simulation
passes them itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_gp.attacks.refiner_aware import refiner_adaptive_attacks
from lightning_gp.attacks.registry import register_adaptive_attack
from lightning_gp.functional import LossFn
from lightning_gp.models.wrapper import TrainingWrapper
from lightning_gp.normalization import per_channel
from lightning_gp.refiner.robust_data import RefinedBatch, RefinerConfig, refine
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_bool, check_choice, check_positive

WarmCache = dict[int, dict[int, Tensor]]  # client -> dataset index -> robust pixels [C, H, W]


class IndexedDataset(Dataset):
    """``dataset[i]`` as ``(inputs, target, i)``: gives :class:`RefinerModule`'s warm start the
    sample's identity (its cache key)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        inputs, target = self.dataset[index][:2]
        return inputs, target, index


class RefinerModule(TrainingWrapper):
    """Wrap ``module`` so that every client trains on, and shares the gradient of, robust data.

    Args:
        module: the model (an ``nn.Module`` or a ``LightningModule``). A LightningModule's
            ``configure_optimizers`` is used when it defines one; otherwise SGD at ``learning_rate``.
        loss_fn: ``loss_fn(outputs, targets)``, mean over the batch; default: ``module.loss_fn``.
            One of the two is required (Refiner matches gradients of the training loss; it is
            never guessed).
        mean, std: the per-channel normalisation of the inputs (Refiner works on pixels in
            [0, 1]); default: the datamodule's ``mean``/``std``. Pass ``mean=0, std=1`` for inputs
            that are pixels already.
        evaluator: the evaluation network ``D``: ``None`` loads the checkpoint shipped for the
            input's channel count (:func:`~lightning_gp.refiner.load_evaluator`), a path loads that
            file, or an ``nn.Module`` mapping pixels ``[N, C, H, W]`` to noise ratios ``[N]``.
        alpha, beta, iterations, warm_iterations, tau, step_size, step_rule, eps, eps_relative, projection,
            utility: see :class:`~lightning_gp.refiner.RefinerConfig` (defaults: the paper's
            alpha 0.5, beta 1, I = 10, warm I = 5, tau 0.95, eps 0.1 absolute, global projection;
            ``eps_relative=True`` reads ``eps`` as a fraction of the raw gradient's norm).
        warm_start: cache each sample's ``x*`` and start from it next time (Sec. 6.3).
        optimizer, learning_rate: the model's optimizer (``"sgd"`` or ``"adam"``) and its learning rate, used
            when ``module`` configures none. In LightningCLI configs wrap a plain ``nn.Module`` and use these:
            LightningCLI gives a LightningModule nested in another the outer one's hyperparameters.
        seed: seeds every client's noise blend (keyed by seed, client and step).

    Example::

        model = RefinerModule(ImageClassifier(LeNetZhu()), eps=0.1)
        Trainer(max_epochs=1).fit(model, datamodule=FashionMNISTSampleDataModule())
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        loss_fn: nn.Module | LossFn | None = None,
        mean: Sequence[float] | float | None = None,
        std: Sequence[float] | float | None = None,
        evaluator: nn.Module | str | None = None,
        alpha: float = 0.5,
        beta: float = 1.0,
        iterations: int = 10,
        warm_iterations: int = 5,
        tau: float = 0.95,
        step_size: float = 1.0,
        step_rule: Literal["sgd", "adam"] = "sgd",
        eps: float = 0.1,
        eps_relative: bool = False,
        projection: Literal["global", "layer"] = "global",
        utility: Literal["printed", "sentence"] = "printed",
        warm_start: bool = False,
        optimizer: Literal["sgd", "adam"] = "sgd",
        learning_rate: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                f"module ({type(module).__name__}) has no trainable parameters: Refiner has nothing to train"
            )
        self.config = RefinerConfig(
            alpha=alpha,
            beta=beta,
            iterations=iterations,
            warm_iterations=warm_iterations,
            tau=tau,
            step_size=step_size,
            step_rule=step_rule,
            eps=eps,
            eps_relative=eps_relative,
            projection=projection,
            utility=utility,
        )
        resolved_loss = loss_fn if loss_fn is not None else getattr(module, "loss_fn", None)
        if resolved_loss is None or not callable(resolved_loss):
            raise ValueError(
                f"RefinerModule needs the training loss to match gradients, and {type(module).__name__} has no callable "
                "`loss_fn` attribute: pass loss_fn=... (loss(outputs, targets), averaged over the batch)"
            )
        if (mean is None) != (std is None):
            raise ValueError(
                "pass both mean and std (the inputs' normalisation), or neither (taken from the datamodule)"
            )
        if isinstance(evaluator, (str, Path)):
            evaluator = str(evaluator)
        elif evaluator is not None and not isinstance(evaluator, nn.Module):
            raise TypeError(
                f"evaluator must be an nn.Module, a checkpoint path or None, got {type(evaluator).__name__}"
            )
        self.module = module
        self.loss_fn = resolved_loss
        self._mean_std: tuple[Sequence[float] | float, Sequence[float] | float] | None = (
            None if mean is None or std is None else (mean, std)
        )
        # Not submodules: D is a fixed network, neither trained, nor shared, nor checkpointed.
        self.__dict__["_evaluator_spec"] = evaluator
        self.__dict__["_evaluator"] = None
        self.warm_start = check_bool(warm_start, "warm_start")
        self.optimizer_name = check_choice(optimizer, "optimizer", ("sgd", "adam"))
        self.learning_rate = check_positive(learning_rate, "learning_rate")
        self.seed = int(seed)
        self.cache: WarmCache = {}
        self.last_refined: RefinedBatch | None = None
        self.save_hyperparameters(ignore=["module", "loss_fn", "evaluator"])

    # ------------------------------------------------------------------ what the client shares
    def shared_parameters(self) -> dict[str, nn.Parameter]:
        """The trainable parameters a client shares, named as in this module's state dict."""
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def evaluation_network(self, channels: int, device: torch.device) -> nn.Module:
        """The evaluation network ``D`` for ``channels``-channel inputs (loaded once)."""
        net = self.__dict__["_evaluator"]
        if net is None:
            spec: nn.Module | str | None = self.__dict__["_evaluator_spec"]
            if isinstance(spec, nn.Module):
                net = spec
            else:
                from lightning_gp.refiner.evaluator import load_evaluator

                net = load_evaluator(channels, path=spec)
            net.eval()
            for p in net.parameters():
                p.requires_grad_(False)
            self.__dict__["_evaluator"] = net
        channels_of = getattr(net, "in_channels", channels)
        if channels_of != channels:
            raise ValueError(
                f"the evaluation network scores {channels_of}-channel images, the inputs have {channels} channels: "
                "pass evaluator= a network (or checkpoint) for this channel count"
            )
        return net.to(device)

    def normalisation(self, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        if self._mean_std is None:
            datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
            datamodule = datamodule or getattr(self, "_datamodule", None)
            if datamodule is None or not hasattr(datamodule, "mean") or not hasattr(datamodule, "std"):
                raise ValueError(
                    "RefinerModule optimises pixels in [0, 1] and must know the inputs' normalisation: pass mean= and "
                    "std= (mean=0, std=1 for inputs that are pixels), or use a datamodule with `mean` and `std`"
                )
            self._mean_std = (datamodule.mean, datamodule.std)
        mean, std = self._mean_std
        return per_channel(mean, channels, "mean"), per_channel(std, channels, "std", positive=True)

    def refine_batch(
        self,
        inputs: Tensor,
        targets: Tensor,
        *,
        client_id: int,
        round: int,
        stream: int = 0,
        sample_ids: Tensor | Sequence[int] | None = None,
    ) -> RefinedBatch:
        """Refiner's step for one client's batch (its warm-start cache updated); see :func:`refine`."""
        if not isinstance(inputs, Tensor) or inputs.ndim < 2:
            raise ValueError(f"inputs must be a batch tensor [B, C, ...], got {type(inputs).__name__}")
        mean, std = self.normalisation(inputs.shape[1])
        evaluator = self.evaluation_network(inputs.shape[1], inputs.device)
        start, warm, ids = self._cached_start(inputs, client_id, sample_ids)
        refined = refine(
            self.module,
            self.loss_fn,
            inputs,
            targets,
            evaluator=evaluator,
            mean=mean,
            std=std,
            config=self.config,
            start=start,
            warm=warm,
            generator=seeded_generator(self.seed, client_id, round, stream),
            params=self.shared_parameters(),
        )
        if ids is not None:
            cache = self.cache.setdefault(client_id, {})
            for i, image in zip(ids, refined.pixels.detach().cpu()):
                cache[i] = image.clone()
        self.last_refined = refined
        return refined

    def _cached_start(
        self, inputs: Tensor, client_id: int, sample_ids: Tensor | Sequence[int] | None
    ) -> tuple[Tensor | None, bool, list[int] | None]:
        if not self.warm_start:
            return None, False, None
        if sample_ids is None:
            raise ValueError(
                "warm_start=True keys each sample's robust image by its dataset index, but the batch carries none: "
                "yield (inputs, targets, indices) batches, e.g. with lightning_gp.refiner.IndexedDataset(dataset)"
            )
        ids = [int(i) for i in (sample_ids.tolist() if isinstance(sample_ids, Tensor) else sample_ids)]
        if len(ids) != inputs.shape[0]:
            raise ValueError(f"sample_ids holds {len(ids)} indices for a batch of {inputs.shape[0]}")
        cache = self.cache.get(client_id, {})
        hits = [cache.get(i) for i in ids]
        if not any(h is not None for h in hits):
            return None, False, ids
        shape = inputs.shape[1:]
        nan = torch.full(shape, float("nan"), dtype=inputs.dtype)
        rows = [h if h is not None and h.shape == shape else nan for h in hits]
        start = torch.stack(rows).to(device=inputs.device, dtype=inputs.dtype)
        warm = all(h is not None and h.shape == shape for h in hits)
        return start, warm, ids

    def client_gradient(
        self, inputs: Tensor, targets: Tensor, *, client_id: int, round: int, sample_ids: Tensor | None = None
    ) -> tuple[dict[str, Tensor], Tensor]:
        """The upload of one simulated client (``FederatedSimulation`` calls this per client)."""
        refined = self.refine_batch(inputs, targets, client_id=client_id, round=round, sample_ids=sample_ids)
        return refined.upload, refined.loss

    def prepare_clients(self, datamodule: Any) -> None:
        """Called by ``FederatedSimulation`` at setup: the datamodule supplies ``mean``/``std``."""
        self._datamodule = datamodule

    # ------------------------------------------------------------------ Lightning
    def forward(self, x: Tensor) -> Tensor:
        return self.module(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets, sample_ids = _unpack(batch)
        step = self.trainer.global_step
        micro = batch_idx % max(1, self.trainer.accumulate_grad_batches)
        refined = self.refine_batch(
            inputs, targets, client_id=self.global_rank, round=step, stream=micro, sample_ids=sample_ids
        )
        params = self.shared_parameters()
        # d/dtheta sum_p <p, upload_p> = upload: Lightning's backward (DDP's all-reduce, the defense
        # callbacks) sees exactly the projected upload; the value reported is the raw batch's loss.
        surrogate = torch.stack([(p * refined.upload[n].to(p.dtype)).sum() for n, p in params.items()]).sum()
        n = inputs.shape[0]
        self.log("train_loss", refined.loss, prog_bar=True, batch_size=n)
        self.log("refiner/noise_ratio", refined.privacy[-1], batch_size=n)
        self.log("refiner/gradient_distance", refined.distance, batch_size=n)
        self.log("refiner/projected", float(refined.projected), batch_size=n)
        return surrogate - surrogate.detach() + refined.loss

    def inputs_and_targets(self, batch: Any) -> tuple[Tensor, Tensor]:
        inputs, targets = _unpack(batch)[:2]
        return inputs, targets

    # ------------------------------------------------------------------ warm-start state
    def get_extra_state(self) -> dict[str, Any]:
        return {
            "format": "lightning_gp.RefinerCache/1",
            "clients": {
                client: {
                    "indices": torch.tensor(sorted(cache), dtype=torch.long),
                    "pixels": torch.stack([cache[i] for i in sorted(cache)]) if cache else torch.empty(0),
                }
                for client, cache in self.cache.items()
            },
        }

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, Mapping) or state.get("format") != "lightning_gp.RefinerCache/1":
            raise ValueError("the checkpoint's Refiner warm-start cache is not a lightning_gp.RefinerCache/1 record")
        self.cache = {
            int(client): {int(i): image for i, image in zip(entry["indices"].tolist(), entry["pixels"])}
            for client, entry in state["clients"].items()
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Under DDP every rank is a client with its own cache, but only rank 0 writes the file:
        # gather the ranks' caches into it (every rank runs this hook when a checkpoint is saved).
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        mine = self.get_extra_state()["clients"]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged = {client: entry for part in everyone for client, entry in part.items()}
        checkpoint["state_dict"]["_extra_state"] = {"format": "lightning_gp.RefinerCache/1", "clients": merged}


def _unpack(batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    if isinstance(batch, Mapping):
        raise TypeError("RefinerModule expects (inputs, targets) or (inputs, targets, indices) batches, got a mapping")
    if not isinstance(batch, (list, tuple)) or len(batch) not in (2, 3):
        raise TypeError(
            "RefinerModule expects (inputs, targets) or (inputs, targets, indices) batches, got "
            f"{type(batch).__name__}{'' if not isinstance(batch, (list, tuple)) else f' of {len(batch)}'}"
        )
    inputs, targets = batch[0], batch[1]
    return inputs, targets, batch[2] if len(batch) == 3 else None


# Refiner's adaptive attack (declared here, beside the class it attacks).
register_adaptive_attack(RefinerModule, refiner_adaptive_attacks)
