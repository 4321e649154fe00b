"""Per-round client data: round ``r`` is a fixed function of ``(seed, r)``.

Keying the sampled clients and their local batches by the round index (and starting each epoch
at the trainer's current step) makes a resumed run see exactly the data an uninterrupted run sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_gp.seeding import seeded_generator


def _round_generator(seed: int, round_idx: int, stream: int) -> torch.Generator:
    return seeded_generator(seed, round_idx, stream)


class ClientRounds(Dataset):
    """Item ``r``: the clients sampled in round ``r`` and each one's local data.

    Returns a dict with ``round`` (int), ``client_ids`` (int64 ``[C]``, ascending), ``inputs``
    (``[C, S, B, ...]``) and ``targets`` (``[C, S, B]``), where C clients per round each draw S
    local batches of B samples from their own partition, without replacement when the client
    holds at least ``S * B`` samples and with replacement otherwise. :meth:`choose` fixes a
    client's local data in one round instead (an audit of chosen images).
    """

    def __init__(
        self,
        dataset: Dataset,
        client_indices: Sequence[Tensor],
        clients_per_round: int,
        local_batch_size: int,
        local_steps: int = 1,
        seed: int = 0,
    ) -> None:
        num_clients = len(client_indices)
        if not 1 <= clients_per_round <= num_clients:
            raise ValueError(f"clients_per_round must be in [1, {num_clients}] (num_clients), got {clients_per_round}")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}")
        empty = [c for c, idx in enumerate(client_indices) if len(idx) == 0]
        if empty:
            raise ValueError(f"clients {empty} hold no samples; use another partition or fewer clients")
        self.dataset = dataset
        self.client_indices = list(client_indices)
        self.clients_per_round = clients_per_round
        self.local_batch_size = local_batch_size
        self.local_steps = local_steps
        self.seed = seed
        self.chosen: dict[tuple[int, int], Tensor] = {}

    def choose(self, round_idx: int, client_id: int, indices: Sequence[int] | Tensor) -> None:
        """Client ``client_id``'s local data in round ``round_idx`` is exactly these dataset
        indices (``local_steps * local_batch_size`` of them, in order)."""
        chosen = torch.as_tensor(indices, dtype=torch.long).flatten()
        needed = self.local_steps * self.local_batch_size
        if chosen.numel() != needed:
            raise ValueError(
                f"client {client_id} needs local_steps * local_batch_size = {needed} chosen samples in round "
                f"{round_idx}, got {chosen.numel()}"
            )
        size = len(self.dataset)  # type: ignore[arg-type]
        if bool(((chosen < 0) | (chosen >= size)).any()):
            raise ValueError(f"chosen indices must be in [0, {size - 1}] (the training set), got {chosen.tolist()}")
        self.chosen[(round_idx, client_id)] = chosen

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    def __len__(self) -> int:
        return 2**62  # rounds are unbounded; the sampler decides which are drawn

    def sample_clients(self, round_idx: int) -> Tensor:
        order = torch.randperm(self.num_clients, generator=_round_generator(self.seed, round_idx, 0))
        return order[: self.clients_per_round].sort().values

    def sample_local_indices(self, round_idx: int, client_id: int) -> Tensor:
        chosen = self.chosen.get((round_idx, client_id))
        if chosen is not None:
            return chosen
        owned = self.client_indices[client_id]
        needed = self.local_steps * self.local_batch_size
        g = _round_generator(self.seed, round_idx, 1 + client_id)
        if len(owned) >= needed:
            picks = torch.randperm(len(owned), generator=g)[:needed]
        else:
            picks = torch.randint(len(owned), (needed,), generator=g)
        return owned[picks]

    def __getitem__(self, round_idx: int) -> dict[str, Any]:
        client_ids = self.sample_clients(round_idx)
        inputs, targets, indices = [], [], []
        for client in client_ids.tolist():
            local = self.sample_local_indices(round_idx, client)
            indices.append(local)
            items = [self.dataset[i] for i in local.tolist()]
            inputs.append(torch.stack([torch.as_tensor(x) for x, _ in items]))
            targets.append(torch.stack([torch.as_tensor(y) for _, y in items]))
        shape = (self.clients_per_round, self.local_steps, self.local_batch_size)
        x = torch.stack(inputs)
        y = torch.stack(targets)
        return {
            "round": round_idx,
            "client_ids": client_ids,
            "inputs": x.reshape(*shape, *x.shape[2:]),
            "targets": y.reshape(*shape, *y.shape[2:]),
            "indices": torch.stack(indices).reshape(shape),
        }


class RoundSampler(Sampler[int]):
    """Yields ``rounds_per_epoch`` consecutive round indices, starting at the current step."""

    def __init__(self, first_round: Callable[[], int], rounds_per_epoch: int) -> None:
        if rounds_per_epoch < 1:
            raise ValueError(f"rounds_per_epoch must be >= 1, got {rounds_per_epoch}")
        self.first_round = first_round
        self.rounds_per_epoch = rounds_per_epoch

    def __iter__(self) -> Iterator[int]:
        start = int(self.first_round())
        return iter(range(start, start + self.rounds_per_epoch))

    def __len__(self) -> int:
        return self.rounds_per_epoch


class RoundLoader(DataLoader):
    """The loader of client rounds. Resumable by construction: the data of round ``r`` depends
    on ``r`` alone and the sampler starts at the current step, so there is no state to restore;
    the state methods tell Lightning so instead of warning about mid-epoch checkpoints."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
