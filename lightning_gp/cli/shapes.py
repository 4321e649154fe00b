"""The model's shape arguments come from the datamodule: ``in_channels``, ``image_size`` and
``num_classes`` left at a model class's defaults take the datamodule's values before anything is built.

LightningCLI's ``link_arguments`` cannot say this: a link has one fixed target path, while the
network sits at ``model.init_args.model`` (``ImageClassifier``), ``model.init_args.module``
(``RefinerModule``, ``FederatedSimulation``) or at the top (``lightning-gp attack``), and a config
whose model has no such argument fails to parse. So the config is walked instead: every class spec
(``class_path`` + ``init_args``) whose constructor takes one of the shape arguments, and whose value
is still that constructor's default, gets the data's. A value the config sets is kept; a model that
still does not fit the data is refused at fit start, naming both sides
(:func:`lightning_gp.validation.check_model_fits_data`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from jsonargparse import Namespace

SHAPE_ARGUMENTS = ("in_channels", "image_size", "num_classes")


def data_shape_arguments(datamodule: Any) -> dict[str, Any] | None:
    """``{in_channels, image_size, num_classes}`` of a datamodule that declares ``image_shape``
    ``(C, H, W)`` and ``num_classes``; ``image_size`` is ``H`` for square images, else ``(H, W)``.
    None for a datamodule that declares neither (a user's own)."""
    shape, classes = getattr(datamodule, "image_shape", None), getattr(datamodule, "num_classes", None)
    if shape is None or classes is None:
        return None
    channels, height, width = (int(n) for n in shape)
    return {
        "in_channels": channels,
        "image_size": height if height == width else (height, width),
        "num_classes": int(classes),
    }


def fill_shape_arguments(spec: Any, values: dict[str, Any], key: str = "model") -> list[tuple[str, str, Any]]:
    """Set, in place, every shape argument still at its default in ``spec`` (a parsed config
    section) and the class specs nested in it to ``values``; returns ``(class spec key, argument,
    value)`` for each change.

    A nested ``datamodule`` is not a model and is left alone.
    """
    changed: list[tuple[str, str, Any]] = []
    if isinstance(spec, list):
        for i, item in enumerate(spec):
            changed += fill_shape_arguments(item, values, f"{key}[{i}]")
        return changed
    if not isinstance(spec, Namespace):
        return changed
    init_args = spec.get("init_args")
    if isinstance(spec.get("class_path"), str) and isinstance(init_args, Namespace):
        defaults = _constructor_defaults(spec.class_path)
        for name in SHAPE_ARGUMENTS:
            current = init_args.get(name)
            if name in defaults and _same(current, defaults[name]) and not _same(values[name], current):
                init_args[name] = values[name]
                changed.append((key, name, values[name]))
        for name, value in vars(init_args).items():
            if name != "datamodule":
                changed += fill_shape_arguments(value, values, f"{key}.init_args.{name}")
    return changed


@contextmanager
def data_built_first(config: Namespace, instantiate_data: Callable[[Namespace], Any]) -> Iterator[str | None]:
    """Build the datamodule of ``config`` (its ``data`` section, else a ``FederatedSimulation``'s
    ``model.init_args.datamodule``) with ``instantiate_data``, fill the model's shape arguments from
    it, and yield a line saying what changed (None when nothing did). While open, the built
    datamodule stands in the config in place of its spec (so it is built once); the spec is put
    back on exit, for the saved config."""
    found = _data_spec(config)
    if found is None:
        yield None
        return
    holder, section, spec = found
    datamodule = instantiate_data(spec)
    values = data_shape_arguments(datamodule)
    changed = [] if values is None else fill_shape_arguments(config.get("model"), values)
    holder[section] = datamodule
    try:
        yield _describe(changed, type(datamodule).__name__) if changed else None
    finally:
        holder[section] = spec


def instantiate(parser: Any, config: Namespace) -> Namespace:
    """``parser.instantiate(config)``; the method was ``instantiate_classes`` before jsonargparse 4.49."""
    return (getattr(parser, "instantiate", None) or parser.instantiate_classes)(config)


def _describe(changed: list[tuple[str, str, Any]], data: str) -> str:
    keys = dict.fromkeys(key for key, _, _ in changed)
    parts = [f"{key}: " + ", ".join(f"{n}={v}" for k, n, v in changed if k == key) for key in keys]
    return f"shape arguments from {data} (the model's defaults do not fit it): {'; '.join(parts)}"


def _data_spec(config: Namespace) -> tuple[Namespace, str, Namespace] | None:
    """``(holder, key, spec)`` of the config's datamodule spec: ``data``, else the model's ``datamodule``."""
    for section, holder in (("data", config), ("datamodule", _init_args(config.get("model")))):
        spec = None if holder is None else holder.get(section)
        if holder is not None and isinstance(spec, Namespace) and isinstance(spec.get("class_path"), str):
            return holder, section, spec
    return None


def _init_args(spec: Any) -> Namespace | None:
    init_args = spec.get("init_args") if isinstance(spec, Namespace) else None
    return init_args if isinstance(init_args, Namespace) else None


def _constructor_defaults(class_path: str) -> dict[str, Any]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}  # not resolvable here: jsonargparse reports it when it builds the class
    return {n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return list(a) == list(b)
    return a == b
