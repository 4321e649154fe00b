"""DP-SGD at close to the cost of plain training (issue 48): per-example gradient norms of Conv2d by
mixed ghost clipping (Bu et al., NeurIPS 2022) and book-keeping clipping, the per-example norms and the
clipped sum from one backward pass (Bu et al., ICML 2023). Floor 1: no other layer of lightning_gp.

Importing this package registers :func:`~lightning_gp.dp_sgd.conv_norm.conv2d_norm_sample` as Opacus'
norm sampler for ``nn.Conv2d`` (process-wide), so Opacus' own ghost clipping uses it too.
"""

from lightning_gp.dp_sgd.book_keeping import BookKeeping, is_supported, trainable_layers, unsupported_layers
from lightning_gp.dp_sgd.conv_norm import (
    NORM_METHODS,
    conv2d_norm_sample,
    conv2d_squared_norms,
    ghost_is_cheaper,
    unfold_input,
)

__all__ = [
    "NORM_METHODS",
    "BookKeeping",
    "conv2d_norm_sample",
    "conv2d_squared_norms",
    "ghost_is_cheaper",
    "is_supported",
    "trainable_layers",
    "unfold_input",
    "unsupported_layers",
]
