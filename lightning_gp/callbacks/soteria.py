"""The Soteria callback: scores the defended layer's features on the client's batch, then prunes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lightning_gp.callbacks.data_dependent import DataDependentGradientDefense
from lightning_gp.defenses import soteria
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_choice, check_positive_int


class Soteria(DataDependentGradientDefense, defense=soteria.Soteria):
    """Soteria (Sun et al., CVPR 2021) on every path (plain Trainer, DDP, FederatedSimulation).

    For each client's batch, scores the features of the representation feeding ``layer`` (default:
    the first ``nn.Linear`` after the model's feature extractor) and zeroes that layer's weight-gradient columns of the ``rate``
    fraction with the smallest scores. See :class:`lightning_gp.defenses.Soteria`. It defends one
    layer only and, like every data-dependent defense here, carries no formal guarantee; the
    literature reports it fails against Robbing the Fed.

    Args:
        rate: fraction of the layer's input features pruned, in [0, 1] (the paper's 80%).
        layer: the defended ``nn.Linear``'s module name (a wrapper's prefix may be left out, e.g.
            ``"fc"`` for ``ImageClassifier(model).model.fc``); ``None``: the first ``nn.Linear`` called
            after the last convolution (see :func:`lightning_gp.defenses.defended_layer`).
        method: ``"jacobian"`` (one vmapped forward-mode Jacobian) or ``"loop"`` (the official one
            backward pass per feature): exact, they agree to float precision; ``"probes"``: an
            unbiased estimate of the squared Jacobian row norms from ``probes`` forward-mode probes
            (seeded by ``seed``, the step and the client).
        probes: the number of random probes of ``method="probes"``.

    ``layer``, ``method`` and (with ``method="probes"``) ``probes`` are part of :attr:`state_key`:
    a resume with other values is refused.
    """

    defense: soteria.Soteria
    statistic_name = "feature scores"

    def adapt(
        self, *, layer: str | None = None, method: str = "jacobian", probes: int = 10, refresh_every: int = 1
    ) -> None:
        super().adapt(refresh_every=refresh_every)
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise ValueError(f"layer must be a module name or None, got {layer!r}")
        self.layer = layer
        self.method = check_choice(method, "method", soteria.METHODS)
        self.probes = check_positive_int(probes, "probes")

    def adapter_config(self) -> dict[str, Any]:
        config = {**super().adapter_config(), "layer": self.layer, "method": self.method}
        if self.method == "probes":  # the exact methods use no probes
            config["probes"] = self.probes
        return config

    def batch_statistic(
        self, module: nn.Module, inputs: Tensor, targets: Tensor, *, seed_words: tuple[int, ...]
    ) -> Any:
        name, _ = soteria.defended_layer(module, self.layer, inputs)
        generator = seeded_generator(self.defense.seed, *seed_words, device=inputs.device)
        scores = soteria.representation_scores(
            module,
            inputs,
            name,
            method=self.method,  # type: ignore[arg-type]
            probes=self.probes,
            generator=generator,
        )
        return name, scores

    def combine(self, total: Any, new: Any) -> Any:
        return total[0], total[1] + new[1]  # the score is a sum over the step's examples

    def statistic_inputs(self, gradients: Mapping[str, Tensor], statistic: Any) -> dict[str, Any]:
        name, scores = statistic
        return {"scores": scores, "layer": name}
