"""Defenses that share a subset of gradient entries, with optional error feedback."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping
from typing import ClassVar

import torch
from torch import Tensor

from lightning_gp.defenses.base import Defense, DefenseCall, Gradients


class SparsifyingDefense(Defense):
    """Shares the entries a mask selects and zeros the rest, per client.

    With ``error_feedback`` the client keeps what it did not send and adds it to its next
    gradient (Stich et al. 2018; DGC, Lin et al. 2018; DGP Alg. 2):
    ``P = g + e``, ``shared = P * mask(P)``, ``e' = P - shared``.
    Subclasses implement :meth:`select`, which sees all layers so a mask may be global, and may
    override :meth:`layer_masks`, the masks :meth:`transform` applies, to hand them out one layer
    at a time from a reused buffer and as 0/1 in the values' dtype (on CPU, a product with a
    bool mask converts it elementwise and costs several times the product itself).
    """

    #: Whether a client's mask is a function of its (error-compensated) gradient alone, so that a server
    #: can compute it on a dummy gradient (false for random masks, and for masks aligned across clients).
    mask_reads_gradient_alone: ClassVar[bool] = False

    def __init__(self, *, error_feedback: bool = False, seed: int | None = None, nonfinite: str = "error") -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
        self.error_feedback = error_feedback

    @abstractmethod
    def select(self, values: Mapping[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
        """Boolean keep-masks, one per layer, for the (error-compensated) values."""

    def layer_masks(self, values: Mapping[str, Tensor], generator: torch.Generator) -> Iterator[tuple[str, Tensor]]:
        """``(name, keep-mask)`` per layer, the masks :meth:`select` returns: bool, or 0/1 in any
        floating dtype, of the layer's shape or flat. A mask may be overwritten once the next
        one is drawn. Default: :meth:`select`'s masks."""
        return iter(self.select(values, generator).items())

    def share_layer(self, values: Tensor, mask: Tensor, out: Tensor) -> Tensor:
        """``values * mask`` (a mask as :meth:`layer_masks` gives it) into ``out`` (the call's
        :meth:`~lightning_gp.defenses.base.DefenseCall.output`); with error feedback, ``values`` (the
        client's ``P``) becomes the residual ``P - shared`` in place."""
        # A product with a 0/1 mask in the values' dtype is faster than torch.where on CPU and
        # gives the same bits as a product with the bool mask (dropped entries are +-0, as v * 0).
        # The values are finite here. Without error feedback the values are the gradient, which
        # the output may alias: the product reads each entry before it writes it.
        mask = (mask if mask.dtype == values.dtype else mask.to(values.dtype)).view(values.shape)
        shared = torch.mul(values, mask, out=out)
        if self.error_feedback:
            values.sub_(shared)  # each layer while its mask is valid
        return shared

    def check_inputs(self, gradients: Gradients) -> None:
        """Raise on inputs :meth:`select` cannot take, before any state is touched (default: none)."""

    def init_client_state(self, gradients: Gradients) -> Gradients:
        if not self.error_feedback:
            return {}
        return {name: torch.zeros_like(grad) for name, grad in gradients.items()}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        self.check_inputs(gradients)
        # The residual buffers belong to this defense, so P = g + e is accumulated into them in
        # place and they become e' = P - shared: fresh model-sized allocations (page faults)
        # cost more than the arithmetic on CPU.
        values = {n: state[n].add_(g) for n, g in gradients.items()} if self.error_feedback else gradients
        shared = {
            name: self.share_layer(values[name], mask, call.output(name, values[name]))
            for name, mask in self.layer_masks(values, call.generator)
        }
        if shared.keys() != values.keys():
            raise RuntimeError(f"{type(self).__name__}.layer_masks must give one mask per layer")
        return {n: shared[n] for n in values}, ({n: values[n] for n in values} if self.error_feedback else {})
