"""Split a training set among clients: IID, Dirichlet label skew, or label shards. Seeded."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor

from lightning_gp.validation import check_positive_int

PartitionScheme = Literal["iid", "dirichlet", "shards"]
PARTITION_SCHEMES = ("iid", "dirichlet", "shards")


def _check_split(num_samples: int, num_clients: int) -> None:
    check_positive_int(num_clients, "num_clients")
    if num_samples < num_clients:
        raise ValueError(
            f"cannot split {num_samples} samples among num_clients={num_clients}: fewer samples than clients"
        )


def _labels(targets: Tensor | np.ndarray) -> np.ndarray:
    labels = np.asarray(targets.cpu() if isinstance(targets, Tensor) else targets)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"targets must be a 1-D integer array of class labels, got shape {labels.shape} dtype {labels.dtype}"
        )
    return labels


def iid_partition(num_samples: int, num_clients: int, seed: int = 0) -> list[Tensor]:
    """Shuffle, then deal the samples into ``num_clients`` parts whose sizes differ by at most 1."""
    _check_split(num_samples, num_clients)
    order = np.random.default_rng(seed).permutation(num_samples)
    return [torch.from_numpy(np.sort(part)) for part in np.array_split(order, num_clients)]


def dirichlet_partition(
    targets: Tensor | np.ndarray, num_clients: int, alpha: float, seed: int = 0, min_size: int = 1, max_tries: int = 100
) -> list[Tensor]:
    """Label skew (Hsu et al. 2019): each class is split among clients by proportions ~ Dir(alpha).

    Small ``alpha`` gives each client few classes; large ``alpha`` approaches IID. The draw is
    repeated until every client holds at least ``min_size`` samples.
    """
    labels = _labels(targets)
    _check_split(len(labels), num_clients)
    if not alpha > 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha!r}")
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for cls in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == cls))
            cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * len(members)).astype(int)[:-1]
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        merged = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in merged) >= min_size:
            return [torch.from_numpy(p) for p in merged]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split gave every one of {num_clients} clients >= {min_size} samples in "
        f"{max_tries} draws; raise alpha or lower num_clients"
    )


def shard_partition(
    targets: Tensor | np.ndarray, num_clients: int, shards_per_client: int = 2, seed: int = 0
) -> list[Tensor]:
    """Pathological non-IID split of McMahan et al. (2017): sort by label, cut into
    ``num_clients * shards_per_client`` equal shards, give each client ``shards_per_client`` at random."""
    labels = _labels(targets)
    check_positive_int(shards_per_client, "shards_per_client")
    num_shards = num_clients * shards_per_client
    _check_split(len(labels), num_clients)
    if len(labels) < num_shards:
        raise ValueError(f"{len(labels)} samples cannot fill {num_shards} shards (num_clients * shards_per_client)")
    rng = np.random.default_rng(seed)
    by_label = np.argsort(labels, kind="stable")
    shards = np.array_split(by_label, num_shards)
    order = rng.permutation(num_shards)
    return [
        torch.from_numpy(
            np.sort(np.concatenate([shards[s] for s in order[c * shards_per_client : (c + 1) * shards_per_client]]))
        )
        for c in range(num_clients)
    ]


def partition(
    scheme: PartitionScheme,
    num_clients: int,
    *,
    num_samples: int | None = None,
    targets: Tensor | np.ndarray | None = None,
    dirichlet_alpha: float = 0.5,
    shards_per_client: int = 2,
    seed: int = 0,
) -> list[Tensor]:
    """Dispatch to one of the schemes; label-based schemes need ``targets``."""
    if scheme == "iid":
        if num_samples is None:
            num_samples = len(_labels(targets)) if targets is not None else None
        if num_samples is None:
            raise ValueError("iid partition needs num_samples or targets")
        return iid_partition(num_samples, num_clients, seed)
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(f"partition must be one of {PARTITION_SCHEMES}, got {scheme!r}")
    if targets is None:
        raise ValueError(f"the {scheme!r} partition splits by label and needs the dataset's targets")
    if scheme == "dirichlet":
        return dirichlet_partition(targets, num_clients, dirichlet_alpha, seed)
    return shard_partition(targets, num_clients, shards_per_client, seed)


def label_histogram(parts: list[Tensor], targets: Tensor | np.ndarray, num_classes: int) -> Tensor:
    """Samples per (client, class): a quick look at how skewed a partition is."""
    labels = torch.as_tensor(_labels(targets))
    return torch.stack([torch.bincount(labels[p], minlength=num_classes) for p in parts])
