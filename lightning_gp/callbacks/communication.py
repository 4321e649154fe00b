"""What a client puts on the wire: bytes of the shared gradient under a realistic encoding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gp.callbacks.base import SharedGradientObserver
from lightning_gp.pipeline.stages import StageCall

INDEX_BYTES = 4  # int32 positions


def dense_nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def encoded_nbytes(tensor: Tensor) -> int:
    """Bytes of the cheapest of three encodings of one layer's shared tensor.

    dense (every value), values + a bitmap of nonzero positions (n/8 bytes), or values + int32
    positions. A layer is encoded on its own, as a real upload would frame it.
    """
    n = tensor.numel()
    nonzero = int(torch.count_nonzero(tensor))
    values = nonzero * tensor.element_size()
    return min(dense_nbytes(tensor), values + (n + 7) // 8, values + nonzero * INDEX_BYTES)


class CommunicationMeter(SharedGradientObserver):
    """Count the bytes every client uploads and downloads each round, against dense baselines.

    Upload: each client's shared gradient. Download: the aggregated update, which every
    participating client receives; DGP's aggregate is as dense as the union of the clients'
    supports, ADGP's lies in the round's mask. Both use :func:`encoded_nbytes`.

    Clients that share weights (FedAvg through a ``ClientUpdateProvider``, marked by
    ``meta["upload"] == "weights"``, e.g. pruned FedAvg and PriPrune) are counted by what is on
    their wire: upload = the weights sent, ``w_shared = w_global - update`` (zero where base or
    defense pruning removed a weight, so a pruned upload costs its kept entries), download = the
    (pruned) global model the client received that round, both encoded per layer as above.
    Logs ``comm/upload_bytes`` and ``comm/download_bytes`` (per client in the step) and the
    ratios to dense; :attr:`total_upload_bytes`, :attr:`total_download_bytes` and
    :attr:`total_dense_bytes` sum over client-rounds, :attr:`uploads` counts client uploads.
    """

    def __init__(self) -> None:
        self.total_upload_bytes = 0
        self.total_download_bytes = 0
        self.total_dense_bytes = 0
        self.uploads = 0
        self._step_upload = 0
        self._step_download = 0
        self._step_dense = 0
        self._step_uploads = 0
        self._weights_round = False

    def observe(self, gradients: Mapping[str, Tensor], call: StageCall) -> None:
        model, meta = call.model, call.meta
        if meta.get("upload") == "weights":
            params = dict(model.named_parameters())
            with torch.no_grad():
                sent = {n: params[n].detach() for n in gradients}
                self._step_upload += sum(encoded_nbytes(sent[n] - g.to(sent[n].dtype)) for n, g in gradients.items())
                self._step_download += sum(encoded_nbytes(w) for w in sent.values())
            self._weights_round = True
        else:
            self._step_upload += sum(encoded_nbytes(g) for g in gradients.values())
        self._step_dense += sum(dense_nbytes(g) for g in gradients.values())
        self._step_uploads += 1

    def observe_aggregate(self, update: Mapping[str, Tensor], *, round: int, clients: int) -> None:
        if self._weights_round:  # weight-sharing clients download the model (counted in observe)
            return
        self._step_download += clients * sum(encoded_nbytes(u) for u in update.values())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step_uploads == 0:
            return
        self.total_upload_bytes += self._step_upload
        self.total_download_bytes += self._step_download
        self.total_dense_bytes += self._step_dense
        self.uploads += self._step_uploads
        per_client = 1 / self._step_uploads
        dense = max(self._step_dense, 1)
        pl_module.log("comm/upload_bytes", self._step_upload * per_client, on_step=True, on_epoch=False)
        pl_module.log("comm/upload_ratio", self._step_upload / dense, on_step=True, on_epoch=False)
        pl_module.log("comm/download_bytes", self._step_download * per_client, on_step=True, on_epoch=False)
        pl_module.log("comm/download_ratio", self._step_download / dense, on_step=True, on_epoch=False)
        self._step_upload = self._step_download = self._step_dense = self._step_uploads = 0
        self._weights_round = False

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # epoch-level values are written whatever log_every_n_steps is: a run shorter than the
        # logging interval still records what it sent
        if self.total_dense_bytes:
            pl_module.log("comm/run_upload_ratio", self.upload_ratio, on_step=False, on_epoch=True)
            pl_module.log("comm/run_download_ratio", self.download_ratio, on_step=False, on_epoch=True)

    @property
    def upload_ratio(self) -> float:
        return self.total_upload_bytes / self.total_dense_bytes if self.total_dense_bytes else float("nan")

    @property
    def download_ratio(self) -> float:
        return self.total_download_bytes / self.total_dense_bytes if self.total_dense_bytes else float("nan")

    def state_dict(self) -> dict[str, Any]:
        return {
            "total_upload_bytes": self.total_upload_bytes,
            "total_download_bytes": self.total_download_bytes,
            "total_dense_bytes": self.total_dense_bytes,
            "uploads": self.uploads,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total_upload_bytes = int(state_dict["total_upload_bytes"])
        self.total_download_bytes = int(state_dict.get("total_download_bytes", 0))
        self.total_dense_bytes = int(state_dict["total_dense_bytes"])
        self.uploads = int(state_dict["uploads"])
