"""Per-example gradient norms of ``nn.Conv2d`` by mixed ghost clipping, registered with Opacus.

Bu, Mao and Xu, "Scalable and Efficient Training of Large Convolutional Neural Networks with
Differential Privacy", NeurIPS 2022 (mixed ghost clipping). For example ``i`` let ``a_i`` (``T x d``)
be its unfolded input (``d = C_in / groups * kh * kw`` per group, ``T`` the output positions) and
``g_i`` (``T x p``) its output gradient (``p = C_out / groups``). The per-example weight gradient is
``g_i^T a_i`` (``p x d``) and its squared norm is (their eq. 2, the ghost norm)

    ||g_i^T a_i||_F^2 = sum_{t,s} (a_i a_i^T)_{ts} (g_i g_i^T)_{ts},

which costs ``O(T^2 (d + p))`` instead of ``O(T d p)`` for forming ``g_i^T a_i``. The *mixed* rule
picks, per layer, whichever is cheaper (their section 3.2). The bias gradient is ``sum_t g_i(t)``.
``a_i a_i^T`` itself comes from the unfolded patches or, where cheaper, from the Gram matrix of the
padded input's pixels summed over the ``kh kw`` kernel offsets (:func:`patch_gram`).

Importing this module registers :func:`conv2d_norm_sample` as Opacus' norm sampler for
``nn.Conv2d`` (``opacus.grad_sample.utils.register_norm_sampler``), process-wide: Opacus' ghost
clipping (``GradSampleModuleFastGradientClipping``) then clips Conv2d layers without instantiating
their per-example gradients. Opacus ships no Conv2d norm sampler, so nothing else is replaced.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from opacus.grad_sample.utils import register_norm_sampler
from torch import nn
from torch.nn.grad import conv2d_weight

NormMethod = Literal["mixed", "ghost", "instantiate"]
NORM_METHODS: tuple[NormMethod, ...] = ("mixed", "ghost", "instantiate")


def squared_norms(per_example: torch.Tensor) -> torch.Tensor:
    """``||G_i||^2`` of each example's gradient in ``per_example`` ``(n, ...)``, in whatever memory layout
    it comes (channels-last included), without copying it."""
    dims = tuple(range(1, per_example.dim()))
    return torch.linalg.vector_norm(per_example, dim=dims).square() if dims else per_example.square()


def weighted_sum(weights: torch.Tensor, per_example: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i G_i`` as one vector-matrix product over ``per_example`` ``(n, ...)`` read in its own
    memory order (no copy of a channels-last tensor), returned contiguous."""
    order = [0, *sorted(range(1, per_example.dim()), key=lambda d: (-per_example.stride()[d], d))]
    permuted = per_example.permute(order)
    rows = permuted.reshape(len(per_example), -1)  # a view for any dense layout
    summed = (weights.to(rows.dtype) @ rows).reshape(permuted.shape[1:])
    inverse = sorted(range(len(order) - 1), key=lambda i: order[i + 1])
    return summed.permute(inverse).contiguous()


def ghost_is_cheaper(positions: int, d: int, p: int) -> bool:
    """The mixed rule: the ghost norm's ``T^2 (d + p)`` multiply-adds below instantiation's ``T d p``."""
    return positions * (d + p) < d * p


def padded_input(layer: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x`` as the convolution sees it, and the symmetric zero padding still to apply: non-zero
    padding modes and asymmetric ``padding="same"`` are applied here, as ``nn.Conv2d.forward`` does."""
    if layer.padding_mode != "zeros":
        return F.pad(x, layer._reversed_padding_repeated_twice, mode=layer.padding_mode), (0, 0)
    if isinstance(layer.padding, str):
        if layer.padding == "valid":
            return x, (0, 0)
        totals = [dil * (k - 1) for dil, k in zip(layer.dilation, layer.kernel_size)]
        if all(t % 2 == 0 for t in totals):
            return x, (totals[0] // 2, totals[1] // 2)
        # F.pad's first pair pads the last dimension (width)
        pads = (totals[1] // 2, totals[1] - totals[1] // 2, totals[0] // 2, totals[0] - totals[0] // 2)
        return F.pad(x, pads), (0, 0)
    return x, (int(layer.padding[0]), int(layer.padding[1]))


def unfold_input(layer: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The input patches ``(n, C_in * kh * kw, T)`` the convolution multiplies (im2col, as a strided
    view of the padded input copied once; ``F.unfold`` is several times slower on the CPU)."""
    x = _zero_padded(layer, x)
    n, c, h, w = x.shape
    (kh, kw), (dh, dw), (sh, sw) = layer.kernel_size, layer.dilation, layer.stride
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    sn, sc, s_h, s_w = x.stride()
    view = x.as_strided((n, c, kh, kw, oh, ow), (sn, sc, s_h * dh, s_w * dw, s_h * sh, s_w * sw))
    return view.reshape(n, c * kh * kw, oh * ow)


def _zero_padded(layer: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    x, (ph, pw) = padded_input(layer, x)
    return F.pad(x, (pw, pw, ph, ph)) if ph or pw else x


def patch_gram(layer: nn.Conv2d, x: torch.Tensor, out_hw: tuple[int, int], how: str | None = None) -> torch.Tensor:
    """``a_i a_i^T`` ``(n * groups, T, T)``: the Gram matrix of each example's (and group's) input patches.

    ``how="unfold"`` forms the patches (``T x d``) and multiplies them (``T^2 d``); ``how="input"`` takes
    the Gram matrix of the padded input's ``P`` pixels over the channels (``P^2 C / groups``) and adds up
    its ``kh kw`` shifted blocks, one per kernel offset, since patch entries at the same kernel offset
    are pixels at a fixed distance: several times cheaper for 3x3 stride-1 layers on small maps
    (ResNet-18's last stages). ``None`` picks the cheaper."""
    groups, (kh, kw), (oh, ow) = layer.groups, layer.kernel_size, out_hw
    xp = _zero_padded(layer, x)
    n, c, hp, wp = xp.shape
    d, positions, pixels = c // groups * kh * kw, oh * ow, hp * wp
    if how is None:
        how = "input" if pixels**2 * (c // groups) + kh * kw * positions**2 < positions**2 * d else "unfold"
    if how == "unfold":
        patches = unfold_input(layer, x).reshape(n * groups, d, positions)  # channels are group-major
        return torch.bmm(patches.transpose(1, 2), patches)
    flat = xp.reshape(n * groups, c // groups, pixels)
    pixel_gram = torch.bmm(flat.transpose(1, 2), flat).reshape(n * groups, hp, wp, hp, wp)
    (sh, sw), (dh, dw) = layer.stride, layer.dilation
    total = None
    for i in range(kh):
        rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
        for j in range(kw):
            cols = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            block = pixel_gram[:, rows, cols, rows, cols]
            total = block.clone() if total is None else total.add_(block)
    assert total is not None
    return total.reshape(n * groups, positions, positions)


def patch_gram_norms(patches: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """The ghost norm (Bu et al. 2022, eq. 2): per-example ``||g_i^T a_i||_F^2`` from ``patches``
    ``(n, d, T)`` and ``grads`` ``(n, p, T)`` as ``sum((a_i a_i^T) * (g_i g_i^T))``, never forming
    ``g_i^T a_i`` (the leading dimension may also run over example x group)."""
    aat = torch.bmm(patches.transpose(1, 2), patches)  # (n, T, T)
    ggt = torch.bmm(grads.transpose(1, 2), grads)
    return (aat * ggt).sum(dim=(1, 2))


# How to form per-example weight gradients, measured on the CPU (one thread, mkldnn): a loop of
# batch-1 weight gradients wins above this many multiply-adds per example (mkldnn's backward of a
# convolution grouped over the examples is slow for wide layers); below it the grouped convolution
# wins, about 2x faster in channels-last memory for narrow layers (LeNet's 12 channels) and several
# times slower in it for wider ones. Other devices use the grouped convolution.
_LOOP_ABOVE = 8_000_000
_CHANNELS_LAST_UP_TO = (12, 16)  # (input, output) channels per group


def per_example_strategy(layer: nn.Conv2d, x: torch.Tensor, grads: torch.Tensor) -> str:
    """``"loop"``, ``"grouped"`` or ``"grouped_channels_last"``: how
    :func:`conv2d_per_example_weight_grads` forms the per-example gradients of this layer."""
    if x.device.type != "cpu":
        return "grouped"
    c_in, c_out = layer.in_channels // layer.groups, layer.out_channels // layer.groups
    work = grads[0].numel() // layer.groups * c_in * layer.kernel_size[0] * layer.kernel_size[1]  # T p d
    if work > _LOOP_ABOVE:
        return "loop"
    narrow = c_in <= _CHANNELS_LAST_UP_TO[0] and c_out <= _CHANNELS_LAST_UP_TO[1]
    return "grouped_channels_last" if narrow else "grouped"


def conv2d_per_example_weight_grads(
    layer: nn.Conv2d, x: torch.Tensor, grads: torch.Tensor, strategy: str | None = None
) -> torch.Tensor:
    """Per-example weight gradients ``(n, *weight.shape)``: the convolution's weight gradient with the
    examples as groups, or one example at a time (``strategy``: see :func:`per_example_strategy`)."""
    strategy = per_example_strategy(layer, x, grads) if strategy is None else strategy
    x, padding = padded_input(layer, x)
    n, shape = x.shape[0], layer.weight.shape
    if strategy == "loop":
        return torch.stack(
            [
                conv2d_weight(
                    x[i : i + 1], shape, grads[i : i + 1], layer.stride, padding, layer.dilation, layer.groups
                )
                for i in range(n)
            ]
        )
    x, grads = x.reshape(1, -1, *x.shape[2:]), grads.reshape(1, -1, *grads.shape[2:])
    if strategy == "grouped_channels_last":
        x, grads = x.contiguous(memory_format=torch.channels_last), grads.contiguous(memory_format=torch.channels_last)
    folded = conv2d_weight(
        x, (n * shape[0], *shape[1:]), grads, layer.stride, padding, layer.dilation, n * layer.groups
    )
    return folded.reshape(n, *shape)  # a view, channels-last or not: squared_norms and weighted_sum read either


def conv2d_norms_and_grads(
    layer: nn.Conv2d, x: torch.Tensor, backprops: torch.Tensor, method: NormMethod = "mixed"
) -> tuple[dict[torch.Tensor, torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
    """Each trainable parameter's per-example squared gradient norms ``(n,)`` for a Conv2d layer that
    saw input ``x`` and received the output gradient ``backprops`` (both batch first), and the
    per-example gradients that were instantiated on the way (the weight's, when instantiation is
    the cheaper or asked for; the bias' always, ``(n, C_out)``)."""
    n = x.shape[0]
    norms: dict[torch.Tensor, torch.Tensor] = {}
    grads: dict[torch.Tensor, torch.Tensor] = {}
    x = x.to(backprops.dtype)
    if layer.weight.requires_grad:
        groups, (kh, kw) = layer.groups, layer.kernel_size
        d, p = layer.in_channels // groups * kh * kw, layer.out_channels // groups
        positions = backprops.shape[2] * backprops.shape[3]
        if n == 0:
            norms[layer.weight] = backprops.new_zeros(0)
        elif method == "ghost" or (method == "mixed" and ghost_is_cheaper(positions, d, p)):
            aat = patch_gram(layer, x, (backprops.shape[2], backprops.shape[3]))  # (n * groups, T, T)
            per_group = backprops.reshape(n * groups, p, positions)
            ggt = torch.bmm(per_group.transpose(1, 2), per_group)
            norms[layer.weight] = (aat * ggt).sum(dim=(1, 2)).reshape(n, groups).sum(dim=1)
        else:
            grads[layer.weight] = conv2d_per_example_weight_grads(layer, x, backprops)
            norms[layer.weight] = squared_norms(grads[layer.weight])
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = backprops.sum(dim=(2, 3))
        norms[layer.bias] = grads[layer.bias].square().sum(dim=1)
    return norms, grads


def conv2d_squared_norms(
    layer: nn.Conv2d, x: torch.Tensor, backprops: torch.Tensor, method: NormMethod = "mixed"
) -> dict[torch.Tensor, torch.Tensor]:
    """Each trainable parameter's per-example squared gradient norms ``(n,)`` (see
    :func:`conv2d_norms_and_grads`)."""
    return conv2d_norms_and_grads(layer, x, backprops, method)[0]


def conv2d_norm_sample(
    layer: nn.Conv2d, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[torch.Tensor, torch.Tensor]:
    """Opacus' norm-sampler interface: per-example gradient *norms* (not squared) of each trainable
    parameter; ``activations`` is the list of the layer's forward inputs, ``backprops`` the output
    gradient already rescaled by Opacus for ``loss_reduction``."""
    squared = conv2d_squared_norms(layer, activations[0], backprops)
    return {param: s.clamp(min=0).sqrt() for param, s in squared.items()}


register_norm_sampler(nn.Conv2d)(conv2d_norm_sample)
