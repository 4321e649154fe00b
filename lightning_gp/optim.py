"""Adam for the networks a server trains on public data, with torch's fused kernel.

The learned inverter, the generative prior's GAN and ROG's restoration network are trained with
Adam over millions of weights. torch's default Adam on CPU loops over the parameters, about a dozen
kernels each; its fused implementation updates each parameter in one pass. On the learned
inverter's MLP (5.9M weights, one CPU thread) a step takes 6.5-6.9 ms fused against 29-31 ms
looped, which was 40% of the inverter's training time (``docs/results/performance.md``). The update
is Adam's (Kingma & Ba, ICLR 2015, Algorithm 1) either way, equal up to float rounding.

Not for the attacks' dummy images: one small tensor per problem, where the default costs 20 us more a
step and switching would move every attack's trajectory by rounding for nothing measurable.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

#: Devices whose Adam has a fused kernel in every torch this package supports (2.4 and later).
FUSED_DEVICES = frozenset({"cpu", "cuda"})


def fused_adam(
    parameters: Iterable[Tensor], *, lr: float, betas: tuple[float, float] = (0.9, 0.999)
) -> torch.optim.Adam:
    """:class:`torch.optim.Adam` over ``parameters``, fused where every parameter is a floating-point
    tensor on a device with a fused kernel (:data:`FUSED_DEVICES`), else the default implementation
    (the same update)."""
    params = list(parameters)
    if not params:
        raise ValueError("parameters: fused_adam got no parameters to optimise")
    fused = all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params)
    return torch.optim.Adam(params, lr=lr, betas=betas, fused=True if fused else None)
