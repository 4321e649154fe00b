"""An adaptive attack on ATS: the server knows the policy, not the client's random draw.

ATS (Gao et al., CVPR 2021; :mod:`lightning_gp.augmentation.ats`) shares the gradient of ``T(x)``,
the batch after the policy, so a gradient attack recovers ``T(x)``. The paper scores its attacks
against ``T(x)``; an attacker after the client's raw ``x`` who knows the policy goes one step
further, which is this attack:

1. Inverting Gradients on the shared gradient (:class:`~lightning_gp.attacks.InvertingGradients`,
   unchanged): an estimate ``y`` of ``T(x)``;
2. for every draw the policy can make for one image (:meth:`ATSPolicy.candidates`: the sub-policy
   and the direction of each transformation, 8 for ``"3-1-7"``, 16 for ``"hybrid"``) the policy's
   inverse gives a raw estimate ``x_c = T_c^-1(y)`` (exact where the transforms are invertible: the
   pixels the translations kept, contrast changes that clipped nothing);
3. the draw is picked per image by the gradient match: image ``i`` of ``y`` is replaced by
   ``T_c(x_c)`` (what that draw would have produced from its own raw estimate) and the batch's
   cosine distance to the shared gradient is computed. A wrong translation direction blanks a band
   of content and matches worse; draws that explain ``y`` equally well (for instance both
   directions of a contrast change that clipped nothing: the gradient of ``T(x)`` cannot tell them
   apart) tie, and their raw estimates are averaged (the posterior mean under a uniform prior on
   the tied draws).

The reconstruction is the raw estimate; ``meta["transformed"]`` keeps IG's estimate of ``T(x)`` so
a benchmark can score both against both truths.

:class:`ATSAwareRobbing` runs steps 2-3 on Robbing the Fed's reconstruction instead: a malicious
server's imprint layer returns ``T(x)`` exactly, so only the policy's inverse stands between it and
``x`` (ATS does not hide the image from an active server, it moves it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_gp.attacks.base import GradientAttack, Reconstruction
from lightning_gp.attacks.gradient_matching import cosine_distance, parameter_gradients
from lightning_gp.attacks.labels import recover_labels
from lightning_gp.attacks.optimization import InvertingGradients
from lightning_gp.attacks.registry import register_adaptive_attack
from lightning_gp.attacks.robbing_the_fed import RobbingTheFed
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView
from lightning_gp.augmentation.ats import ATSPolicy
from lightning_gp.augmentation.module import ATSModule
from lightning_gp.normalization import normalize
from lightning_gp.validation import check_nonnegative


class ATSAwareInversion(GradientAttack):
    """Inverting Gradients, then the ATS policy's inverse with the draw picked by the gradient match.

    Args:
        policy: the client's policy (an :class:`~lightning_gp.augmentation.ATSPolicy` or a published name).
        iterations, lr, tv_weight, restarts, signed, boxed, lr_decay: Inverting Gradients' options
            (:class:`~lightning_gp.attacks.InvertingGradients`).
        tie_tolerance: draws whose gradient-match scores lie within this of the best are tied (>= 0).
    """

    # class C: it knows the client's augmentation policy
    requires = requirements("basic_knowledge", "training_details")

    def __init__(
        self,
        policy: str | ATSPolicy = "3-1-7",
        iterations: int = 4800,
        lr: float = 0.1,
        tv_weight: float = 1e-4,
        restarts: int = 1,
        signed: bool = True,
        boxed: bool = True,
        lr_decay: bool = True,
        tie_tolerance: float = 1e-5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.policy = ATSPolicy(policy)
        self.inversion = InvertingGradients(
            iterations=iterations,
            lr=lr,
            tv_weight=tv_weight,
            restarts=restarts,
            signed=signed,
            boxed=boxed,
            lr_decay=lr_decay,
            seed=self.seed,
            device=self.device,
            progress_every=self.progress_every,
        )
        self.tie_tolerance = check_nonnegative(tie_tolerance, "tie_tolerance")

    def estimate_raw(self, view: ServerView, transformed: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """Raw images from ``transformed`` (an estimate of the client's ``T(x)``, normalised): step 2-3
        of the module docstring. Returns the normalised raw estimate and the selection's details."""
        sample_ndim = len(view.input_shape)
        y = view.denormalize(transformed.detach())
        batch = y.shape[0]
        candidates = self.policy.candidates()
        estimates, replays = [], []
        for candidate in candidates:
            draw = self.policy.uniform_draw(candidate, batch)
            estimate = self.policy.invert(y, draw)
            estimates.append(estimate)
            replays.append(self.policy.apply(estimate, draw))
        scores = torch.empty(batch, len(candidates), dtype=torch.float64)
        with torch.enable_grad():
            for i in range(batch):
                for c, replay in enumerate(replays):
                    trial = y.clone()
                    trial[i] = replay[i]
                    guess = parameter_gradients(
                        view.model, view.loss_fn, normalize(trial, view.mean, view.std, sample_ndim=sample_ndim),
                        labels, create_graph=False,
                    )  # fmt: skip
                    scores[i, c] = float(cosine_distance(guess, view.gradients))
        tied = scores <= scores.min(dim=1, keepdim=True).values + self.tie_tolerance
        stacked = torch.stack(estimates, dim=1)  # [B, candidates, C, H, W]
        weights = tied.to(stacked.dtype).to(stacked.device)
        weights = (weights / weights.sum(dim=1, keepdim=True)).view(batch, len(candidates), *([1] * sample_ndim))
        raw = (stacked * weights).sum(dim=1)
        details = {
            "candidates": [self._describe(c) for c in candidates],
            "selection_scores": scores,
            "chosen": [[self._describe(candidates[c]) for c in row.nonzero().flatten().tolist()] for row in tied],
        }
        return normalize(raw, view.mean, view.std, sample_ndim=sample_ndim), details

    def _describe(self, candidate: tuple[int, tuple[int, ...]]) -> str:
        p, signs = candidate
        steps = zip(self.policy.subpolicies[p], signs)
        return " -> ".join(f"{t.operation}{'+' if s > 0 else '-'}{t.magnitude:.3f}" for t, s in steps)

    def reconstruct(self, view: ServerView) -> Reconstruction:
        view, _ = self._prepare(view)
        transformed = self.inversion.reconstruct(view)
        assert transformed.labels is not None  # Inverting Gradients always returns labels
        raw, details = self.estimate_raw(view, transformed.images, transformed.labels)
        return Reconstruction(
            images=raw,
            labels=transformed.labels,
            loss_trace=transformed.loss_trace,
            attack=type(self).__name__,
            meta={
                **details,
                "policy": self.policy.name,
                "transformed": transformed.images.detach(),
                "objective": transformed.meta.get("objective"),
            },
        )


class ATSAwareRobbing(RobbingTheFed):
    """Robbing the Fed (the malicious server's imprint layer), then the ATS policy's inverse.

    The imprint recovers the transformed images the client trained on; the draw of each is picked
    by the gradient match as in :meth:`ATSAwareInversion.estimate_raw`, with the labels recovered
    from the shared gradient (:func:`~lightning_gp.attacks.recover_labels`: exact for one image;
    for a batch the pairing of labels to images is unknown, which makes the choice less reliable).

    Args:
        policy: the client's policy (an :class:`~lightning_gp.augmentation.ATSPolicy` or a published name).
        tie_tolerance: as :class:`ATSAwareInversion`'s.
        **kwargs: :class:`~lightning_gp.attacks.RobbingTheFed`'s options (``num_bins``, ``seed``, ...).
    """

    def __init__(self, policy: str | ATSPolicy = "3-1-7", *, tie_tolerance: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inverse = ATSAwareInversion(policy, iterations=1, tie_tolerance=tie_tolerance)
        self.policy = self.inverse.policy

    def reconstruct(self, view: ServerView) -> Reconstruction:
        view, _ = self._prepare(view)
        transformed = super().reconstruct(view)
        labels = transformed.labels if transformed.labels is not None else recover_labels(view)
        if labels.shape[0] != transformed.images.shape[0]:
            raise ValueError(
                f"Robbing the Fed separated {transformed.images.shape[0]} images of a batch of {labels.shape[0]}: "
                "the ATS draw of each cannot be matched to the gradient (use more bins)"
            )
        raw, details = self.inverse.estimate_raw(view, transformed.images, labels)
        return Reconstruction(
            images=raw,
            labels=labels,
            loss_trace=transformed.loss_trace,
            attack=type(self).__name__,
            meta={**transformed.meta, **details, "policy": self.policy.name, "transformed": transformed.images},
        )


__all__ = ["ATSAwareInversion", "ATSAwareRobbing"]


@register_adaptive_attack(ATSModule)
def _ats(target: ATSModule, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """ATS's adaptive attacks: IG recovers the transformed batch, a malicious server's imprint layer
    recovers it exactly; the policy's inverse maps either back (no L-BFGS part)."""
    kwargs.pop("lbfgs_iterations", None)
    rtf_kwargs = {k: kwargs[k] for k in ("seed", "device", "progress_every") if k in kwargs}
    return [ATSAwareInversion(target.policy, **kwargs), ATSAwareRobbing(target.policy, **rtf_kwargs)]
