"""Client-level differential privacy for federated learning: DP-FedAvg.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models" (ICLR
2018), Alg. 1 with the fixed-denominator estimator ``f~_f`` (Eq. 2-3): each sampled client's update
``Delta_k`` is clipped to L2 norm ``C`` over all its layers at once, ``Delta_k * min(1, C / ||Delta_k||)``
(:func:`~lightning_gp.defenses.clip_update`); the server adds ``N(0, (z C)^2 I)`` to the **sum** of the round's clipped
updates and divides by the expected number of clients ``W = q N``, so one client moves the release
by at most ``C / W`` and the noise on the mean has std ``z C / W``. The record the guarantee protects
is a whole client (its every example): add or remove one client.

Each round is one Gaussian mechanism with noise multiplier ``z``; ``T`` rounds compose
(:class:`~lightning_gp.privacy.GaussianMechanism`, dp_accounting's PLD). Sampling:

- ``amplification="none"`` (default): every round is charged in full (``q = 1``). This is the sound
  accounting for what :class:`~lightning_gp.federated.FederatedSimulation` and Flower's strategies do,
  drawing exactly ``clients_per_round`` clients, and what Flower's own accountant requires for its
  fixed-clipping strategies (``SamplingMethod.NO_AMPLIFICATION``).
- ``amplification="poisson"``: the paper's accounting, a Poisson-subsampled Gaussian at
  ``q = clients_per_round / num_clients``. It assumes each client joins a round independently with
  probability ``q``; with a fixed number drawn it is an approximation (smaller epsilon than "none").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from lightning_gp.defenses.base import Gradients
from lightning_gp.defenses.clipping import clip_update
from lightning_gp.defenses.clipping import update_norm as update_norm  # re-exported: its home before clipping.py
from lightning_gp.privacy import GaussianMechanism
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_choice, check_int, check_nonnegative, check_number, check_positive

Amplification = Literal["none", "poisson"]
AMPLIFICATION: tuple[Amplification, ...] = ("none", "poisson")


class ClientLevelDP:
    """DP-FedAvg's server side (module docstring): clip each client's update to ``max_update_norm``,
    add ``N(0, (noise_multiplier * max_update_norm)^2)`` to the sum, divide by the expected number of
    clients; account the rounds as a Gaussian mechanism and stop at a budget.

    Args:
        noise_multiplier: ``z``, the noise std on the sum over ``max_update_norm`` (``0``: clipping
            without noise, epsilon infinite).
        max_update_norm: ``C``, the L2 bound of one client's whole update.
        delta: the ``delta`` of the reported ``(epsilon, delta)``; in ``(0, 1)``, well below one over
            the number of clients.
        stop_at_epsilon: a budget: the runner ends training cleanly before the round that would spend
            more than this epsilon at ``delta``. ``None``: no budget.
        amplification: ``"none"`` or ``"poisson"`` (module docstring).
        kappa: a prior-only success rate at which the runner also logs the ReRo bound ``eta`` of the
            rounds so far (``dp_rero_eta``); ``None``: not logged.
        seed: seeds the server's noise (round ``r`` draws from the stream ``(seed, r)``, so a resumed
            run draws the same); ``None`` draws it from torch's global generator. Not a
            cryptographically secure source.
    """

    def __init__(
        self,
        noise_multiplier: float,
        max_update_norm: float = 1.0,
        *,
        delta: float = 1e-5,
        stop_at_epsilon: float | None = None,
        amplification: Amplification = "none",
        kappa: float | None = None,
        seed: int | None = None,
    ) -> None:
        self.noise_multiplier = check_nonnegative(noise_multiplier, "noise_multiplier")
        self.max_update_norm = check_positive(max_update_norm, "max_update_norm")
        self.delta = check_number(delta, "delta", low=0.0, high=1.0, low_open=True, high_open=True)
        self.stop_at_epsilon = None if stop_at_epsilon is None else check_positive(stop_at_epsilon, "stop_at_epsilon")
        self.amplification = check_choice(amplification, "amplification", AMPLIFICATION)
        self.kappa = None if kappa is None else check_number(kappa, "kappa", low=0.0, high=1.0)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self.seed = check_int(seed, "seed", low=0)

    def config(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier,
            "max_update_norm": self.max_update_norm,
            "delta": self.delta,
            "stop_at_epsilon": self.stop_at_epsilon,
            "amplification": self.amplification,
        }

    def __repr__(self) -> str:
        return f"ClientLevelDP({', '.join(f'{k}={v!r}' for k, v in self.config().items())})"

    # ------------------------------------------------------------------ the mechanism
    def clip(self, update: Gradients) -> Gradients:
        """One client's update clipped to :attr:`max_update_norm` (:func:`clip_update`)."""
        return clip_update(update, self.max_update_norm)

    def noised_mean(self, clipped: Sequence[Gradients], expected_clients: int, round: int) -> Gradients:
        """``(sum of clipped + N(0, (z C)^2 I)) / expected_clients``: the release of one round (the
        updates must already be clipped; the noise is drawn from the stream ``(seed, round)``)."""
        check_int(expected_clients, "expected_clients", low=1)
        if not clipped:
            raise ValueError("clipped is empty: no client shared anything this round")
        generator = seeded_generator(self.seed, round)
        std = self.noise_multiplier * self.max_update_norm
        released = {}
        for name in clipped[0]:
            total = torch.stack([c[name] for c in clipped]).sum(0)
            noise = torch.randn(total.shape, generator=generator, dtype=total.dtype) if std > 0 else 0.0
            released[name] = (total + std * torch.as_tensor(noise).to(total.device)) / expected_clients
        return released

    def sample_rate(self, clients_per_round: int, num_clients: int) -> float:
        """The ``q`` the accounting charges: ``1`` without amplification, else the clients' share."""
        return 1.0 if self.amplification == "none" else clients_per_round / num_clients

    def mechanism(self, rounds: int, sample_rate: float) -> GaussianMechanism:
        """The Gaussian mechanism of ``rounds`` releases at rate ``sample_rate`` (one client per record,
        add/remove: the sum moves by at most ``C``)."""
        check_int(rounds, "rounds", low=1)
        return GaussianMechanism(
            noise_std=self.noise_multiplier * self.max_update_norm,
            clip_norm=self.max_update_norm,
            steps=rounds,
            sample_rate=sample_rate,
            neighbouring="add_remove",
            description=(
                f"DP-FedAvg, z = {self.noise_multiplier:g}, C = {self.max_update_norm:g}, {rounds} round(s), "
                f"q = {sample_rate:.4g} ({self.amplification} amplification), a client added or removed"
            ),
        )

    def epsilon(self, rounds: int, sample_rate: float) -> float:
        """The epsilon at :attr:`delta` after ``rounds`` rounds (``0`` before the first)."""
        if check_int(rounds, "rounds", low=0) == 0:
            return 0.0
        return self.mechanism(rounds, sample_rate).epsilon(self.delta)

    def eta(self, rounds: int, sample_rate: float, kappa: float) -> float:
        """The ReRo bound after ``rounds`` rounds at ``kappa`` (``kappa`` itself before the first)."""
        if check_int(rounds, "rounds", low=0) == 0:
            return float(check_number(kappa, "kappa", low=0.0, high=1.0))
        return self.mechanism(rounds, sample_rate).eta(kappa)

    def allows(self, rounds: int, sample_rate: float) -> bool:
        """Whether ``rounds`` rounds stay within :attr:`stop_at_epsilon` (always, without a budget)."""
        return self.stop_at_epsilon is None or self.epsilon(rounds, sample_rate) <= self.stop_at_epsilon
