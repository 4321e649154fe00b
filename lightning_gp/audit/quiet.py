"""The package's own short Trainer runs, without Lightning's console chatter.

:func:`quiet_lightning` silences Lightning's rank-zero info lines and deprecation noise while the
audit's internal Trainers are built and run; :func:`internal_trainer` is such a Trainer (CPU, no
validation, logger, checkpoints, progress bar or summary). The user's own Trainers are untouched.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

#: Loggers of Lightning's rank-zero info lines: device banners, logger/model-registry tips,
#: "`Trainer.fit` stopped". ``lightning_utilities``' own logger is added at run time.
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
#: Opacus' note on the hooks its DP-SGD runs put on our models (silenced by both filters below).
_OPACUS_FULL_HOOK = r".*Full backward hook is firing when gradients are computed with respect to module outputs"
#: Advice about the internal Trainers' own set-up, and Opacus' hook note, which the user cannot act on.
_IGNORED_MESSAGES = (
    r".*does not have many workers",
    r".*GPU available but not used",
    r".*You defined a `validation_step` but have no `val_dataloader`",
    _OPACUS_FULL_HOOK,
)


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Build and run this package's internal Trainers without Lightning's console chatter.

    Inside the block Lightning's rank-zero info lines (GPU/TPU/HPU availability, the litlogger /
    litmodels tips, "`Trainer.fit` stopped") are dropped, and deprecation warnings, Lightning's
    advice about the internal Trainers' set-up (dataloader workers, the skipped validation loop)
    and Opacus' note on its hooks are ignored; other warnings and errors still show. The logger
    levels and warning filters are restored on exit, so a Trainer the user builds afterwards
    prints as usual. Process-wide while it runs: not for use around concurrent user Trainers.
    """
    from lightning_utilities.core import rank_zero

    names = sorted({*_RANK_ZERO_LOGGERS, rank_zero.log.name})
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        for message in _IGNORED_MESSAGES:
            warnings.filterwarnings("ignore", message=message)
        try:
            for logger in loggers:
                logger.setLevel(max(logger.level, logging.WARNING))
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


#: Known library noise a user cannot act on, dropped by the suite's own entry points
#: (:func:`library_noise_silenced`): Lightning's tips about its paid add-ons, its tensorboardX notice,
#: a pytree deprecation inside Lightning, and Opacus' notes about its own internals (its hooks).
_NOISE_MESSAGES = (
    r".*`tensorboardX` has been removed as a dependency",
    r".*`isinstance\(treespec, LeafSpec\)` is deprecated",
    r".*Secure RNG turned off",
    r".*Using a non-full backward hook",
    _OPACUS_FULL_HOOK,
    r".*Optimal order is the (largest|smallest) alpha",
)


class _DropTips(logging.Filter):
    """Drops Lightning's "💡 Tip: try installing litlogger / litmodels" lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Tip:" in message and ("litlogger" in message or "litmodels" in message))


@contextmanager
def library_noise_silenced() -> Iterator[None]:
    """Run one of the suite's own entry points (``lightning-gp``, the demo) without known library
    noise (:data:`_NOISE_MESSAGES`, Lightning's add-on tips). Every other line, warning and error
    still shows; filters and logger state are restored on exit, so a user's own Trainer, built
    outside the block, prints as usual."""
    from lightning_utilities.core import rank_zero

    loggers = [logging.getLogger(name) for name in sorted({*_RANK_ZERO_LOGGERS, rank_zero.log.name})]
    tips = _DropTips()
    with warnings.catch_warnings():
        for message in _NOISE_MESSAGES:
            warnings.filterwarnings("ignore", message=message)
        for logger in loggers:
            logger.addFilter(tips)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(tips)


def internal_trainer(*, max_steps: int, callbacks: Sequence[Callback], **kwargs: Any) -> L.Trainer:
    """A ``Trainer`` for this package's own short runs (taps, catalogue training): CPU, no validation,
    logger, checkpoints, progress bar or model summary. Build it inside :func:`quiet_lightning`."""
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **kwargs,
    )
