"""What a long attack tells the person waiting for it, and how a waiting person stops it.

An audit runs attacks of minutes each inside a training step. Within :func:`monitored`, every
iteration an attack reports (:meth:`GradientAttack._report`) is also a chance to print a heartbeat
(at most every ``heartbeat`` seconds: the attack, its iteration and objective, the time so far) and to
stop: when ``stop()`` says so (``PrivacyAudit`` asks the Trainer whether SIGTERM arrived) the attack
raises :class:`AttackInterrupted`. Outside :func:`monitored` attacks neither print nor check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["HEARTBEAT_SECONDS", "AttackInterrupted", "monitored", "tick"]

#: The longest a person waits for a line from a running attack within :func:`monitored`, by default.
HEARTBEAT_SECONDS = 30.0


class AttackInterrupted(BaseException):
    """A stop was requested while an attack ran. A ``BaseException``, as ``KeyboardInterrupt`` is, so
    no audit records it as one attack's failure and goes on to the next attack: it ends the audit."""


@dataclass
class _Monitor:
    heartbeat: float | None
    stop: Callable[[], bool] | None
    write: Callable[[str], None]
    last: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)


_active: list[_Monitor] = []


@contextmanager
def monitored(
    *,
    heartbeat: float | None = HEARTBEAT_SECONDS,
    stop: Callable[[], bool] | None = None,
    write: Callable[[str], None] = lambda line: print(line, flush=True),
) -> Iterator[None]:
    """Within the block, attacks print a progress line at least every ``heartbeat`` seconds while they
    iterate (``None``: never) and raise :class:`AttackInterrupted` at their next iteration once
    ``stop()`` is true. Blocks nest; the innermost one applies."""
    if heartbeat is not None and not heartbeat > 0:
        raise ValueError(f"heartbeat must be a positive number of seconds or None, got {heartbeat!r}")
    _active.append(_Monitor(heartbeat, stop, write))
    try:
        yield
    finally:
        _active.pop()


def tick(attack: str, iteration: int, total: int, objective: float) -> None:
    """One iteration of ``attack`` (0-based ``iteration`` of ``total``) is done: stop if asked, else
    print the heartbeat when it is due."""
    if not _active:
        return
    monitor = _active[-1]
    if monitor.stop is not None and monitor.stop():
        raise AttackInterrupted(f"{attack} stopped at iteration {iteration + 1}/{total}: a stop was requested")
    now = time.monotonic()
    if monitor.heartbeat is not None and now - monitor.last >= monitor.heartbeat:
        monitor.last = now
        monitor.write(
            f"  [{attack}] iteration {iteration + 1}/{total}, objective {objective:.4g}, "
            f"{now - monitor.started:.0f} s into the audit"
        )
