"""Argument checks at the API boundary: every error names the argument and the value it got.

One module for the number and choice checks of the whole package (defenses, attacks, the
simulation, DP-SGD, metrics), so a rate, a count or a scale is validated the same way
everywhere. Gradient-specific checks (named layer tensors, NaN/inf) live in
:mod:`lightning_gp.defenses.validation`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def is_number(value: Any) -> bool:
    """A real Python number (``int`` or ``float``), not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(
    value: float,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite float within the given bounds, or an error naming ``name``.

    ``low``/``high`` are inclusive unless ``low_open``/``high_open``. A non-number (or a
    ``bool``) is a ``TypeError``; NaN, infinities and values out of range are ``ValueError``.
    """
    if not is_number(value):
        raise TypeError(
            f"{name} must be {_describe(low, high, low_open, high_open)}, got {type(value).__name__} {value!r}"
        )
    out_of_range = (
        not math.isfinite(value)
        or (low is not None and (value < low or (low_open and value == low)))
        or (high is not None and (value > high or (high_open and value == high)))
    )
    if out_of_range:
        raise ValueError(f"{name} must be {_describe(low, high, low_open, high_open)}, got {value!r}")
    return float(value)


def check_rate(value: float, name: str) -> float:
    """A fraction in [0, 1]."""
    return check_number(value, name, low=0.0, high=1.0)


def check_nonnegative(value: float, name: str, *, strict: bool = False) -> float:
    """A finite number ``>= 0`` (``> 0`` with ``strict``)."""
    return check_number(value, name, low=0.0, low_open=strict)


def check_positive(value: float, name: str) -> float:
    """A finite number ``> 0``."""
    return check_number(value, name, low=0.0, low_open=True)


def check_int(value: int, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """An ``int`` (not a ``bool``) within ``[low, high]``; any failure is a ``ValueError`` naming ``name``."""
    wrong_type = isinstance(value, bool) or not isinstance(value, int)
    if wrong_type or (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an int{_int_bounds(low, high)}, got {value!r}")
    return value


def as_int(value: Any) -> Any:
    """Numpy and 0-d torch integers as ``int``; anything else unchanged (for :func:`check_int`)."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def check_positive_int(value: int, name: str) -> int:
    """An ``int >= 1`` (not a ``bool``); any failure is a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_bool(value: bool, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_choice(value: T, name: str, choices: Sequence[T]) -> T:
    """One of ``choices`` (compared with ``==``)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _describe(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return "a finite number"


def _int_bounds(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def check_int_list(value: int | Sequence[int], name: str) -> list[int]:
    """An int or a non-empty sequence of ints ``>= 0`` (a selection of clients or rounds), sorted, unique."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be an int or a sequence of ints, got {value!r}")
    values = list(value) if isinstance(value, Sequence) else [value]
    if not values:
        raise ValueError(f"{name} must name at least one entry, got an empty sequence")
    return sorted({check_int(v, name, low=0) for v in values})


def check_model_fits_data(model: Any, datamodule: Any) -> None:
    """Refuse, naming both sides, a model that cannot take the datamodule's images or predicts
    another number of classes; a no-op for a datamodule that does not declare ``image_shape`` and
    ``num_classes`` (a user's own). One forward pass of a zero image, without gradients."""
    shape, classes = getattr(datamodule, "image_shape", None), getattr(datamodule, "num_classes", None)
    if shape is None or classes is None:
        return
    import torch

    name, data = type(model).__name__, type(datamodule).__name__
    hint = f"set the model's in_channels / image_size / num_classes to the data's ({tuple(shape)}, {classes} classes)"
    parameter = next(iter(model.parameters()), None)
    probe = torch.zeros(1, *shape, device=parameter.device if parameter is not None else None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(probe)
    except RuntimeError as err:
        raise ValueError(f"{name} cannot take {data}'s images of shape {tuple(shape)}: {err}. {hint}") from err
    finally:
        model.train(was_training)
    if not isinstance(logits, torch.Tensor):
        return  # a wrapper with its own output (a tuple, a dict): only the input side is checked
    if logits.ndim != 2 or logits.shape[1] != classes:
        raise ValueError(
            f"{name} predicts {tuple(logits.shape[1:])} outputs per image, but {data} has {classes} classes; {hint}"
        )
