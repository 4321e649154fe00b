"""Which setting to pick, and why: the one-screen summary of an audit (the matrix, a ``PrivacyAudit`` run).

The choice (:func:`choose`) is one rule, pure and small:

- among the candidates whose verdict is ``"private"``, pick the one with the highest accuracy (ties:
  the smaller leak fraction, then the lower worst-case PSNR, then the order given); without any
  accuracy measured, the one with the lowest worst-case PSNR;
- ``"inconclusive"`` is never counted as private (the audit is incomplete: a missing piece never
  reads as privacy);
- with no private candidate there is no pick: the summary says "none private" and names the
  closest point, the lowest leak fraction, then the lowest worst-case PSNR.

:func:`summary_markdown` writes the choice, the reasons and a short table (at most ``max_rows`` rows,
~one screen). The verdicts themselves come from :func:`~lightning_gp.audit.worst_case_report`; this
module only reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

VERDICTS = ("private", "leaks", "inconclusive")


@dataclass(frozen=True)
class Candidate:
    """One setting (or one audited point) as the summary sees it.

    Attributes:
        name: what to call it (e.g. the defense setting).
        verdict: ``"private"``, ``"leaks"`` or ``"inconclusive"``.
        leak_fraction: the share of attacked images that leak in the worst case (``None``: unknown).
        worst_psnr: the worst-case mean PSNR in dB (``None``: unknown).
        accuracy: what the setting keeps of the task, higher is better (e.g. PMM; ``None``: not measured).
        cost: what else it costs, in words (e.g. ``"upload 23%"``).
        reason: why the verdict is what it is (its first reason), for the table.
    """

    name: str
    verdict: str
    leak_fraction: float | None = None
    worst_psnr: float | None = None
    accuracy: float | None = None
    cost: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r} for {self.name!r}")


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided.

    Attributes:
        pick: the private candidate with the highest accuracy (``None``: none is private).
        closest: with no pick, the candidate closest to private (lowest leak fraction, then PSNR).
        private: every private candidate, best first.
        inconclusive: how many candidates were inconclusive (never counted as private).
        by_accuracy: whether the pick was made by accuracy (else by the lowest worst-case PSNR).
        candidates: how many candidates there were (one: a single run, which is judged, not picked).
    """

    pick: Candidate | None
    closest: Candidate | None
    private: tuple[Candidate, ...]
    inconclusive: int
    by_accuracy: bool
    candidates: int = 0


def _low(value: float | None) -> float:
    """Sort key: lower is closer to private; unknown sorts last."""
    return math.inf if value is None or math.isnan(value) else value


def combined_verdict(verdicts: Iterable[str]) -> str:
    """One verdict over several (threat models, audited steps): ``"leaks"`` if any leaks, else
    ``"inconclusive"`` if any is (or there are none), else ``"private"``."""
    verdicts = list(verdicts)
    for verdict in verdicts:
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
    if "leaks" in verdicts:
        return "leaks"
    if not verdicts or "inconclusive" in verdicts:
        return "inconclusive"
    return "private"


def choose(candidates: Sequence[Candidate]) -> Choice:
    """The pick among ``candidates`` (see the module docstring for the rule)."""
    candidates = list(candidates)
    private = [c for c in candidates if c.verdict == "private"]
    by_accuracy = any(c.accuracy is not None and not math.isnan(c.accuracy) for c in private)
    order = {id(c): i for i, c in enumerate(candidates)}

    def best(c: Candidate) -> tuple[float, float, float, int]:
        accuracy = -c.accuracy if c.accuracy is not None and not math.isnan(c.accuracy) else math.inf
        return (accuracy if by_accuracy else 0.0, _low(c.leak_fraction), _low(c.worst_psnr), order[id(c)])

    private.sort(key=best)
    closest = min(candidates, key=_closeness) if not private and candidates else None  # the first of equals
    return Choice(
        pick=private[0] if private else None,
        closest=closest,
        private=tuple(private),
        inconclusive=sum(c.verdict == "inconclusive" for c in candidates),
        by_accuracy=by_accuracy,
        candidates=len(candidates),
    )


def format_score(value: float | None, spec: str) -> str:
    """A score for people: ``"-"`` when unknown (``None``/NaN), ``"inf"`` for an exact copy, else ``spec``."""
    if value is None or math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else format(value, spec)


def _leaked(c: Candidate) -> str:
    return "-" if c.leak_fraction is None else f"{c.leak_fraction:.0%}"


def choice_sentence(choice: Choice, accuracy_name: str = "accuracy", what: str = "setting") -> str:
    """The choice in one Markdown sentence: the pick and why, or "none private" and the closest point."""
    skipped = (
        f" {choice.inconclusive} inconclusive {what}{'s' if choice.inconclusive != 1 else ''} "
        "not counted as private (their audit is incomplete)."
        if choice.inconclusive
        else ""
    )
    if choice.candidates == 1:  # one run or setting: a verdict, not a choice among several
        c = choice.pick or choice.closest
        assert c is not None
        why = f" ({c.reason})" if c.reason and c.verdict != "private" else ""
        accuracy = f", {accuracy_name} {format_score(c.accuracy, '.3f')}" if c.accuracy is not None else ""
        verdict = {"private": "Private", "leaks": "Not private: leaks", "inconclusive": "Not private: inconclusive"}
        return (
            f"**{verdict[c.verdict]}.** {c.name}{why}: {_leaked(c)} of the images leak, worst-case PSNR "
            f"{format_score(c.worst_psnr, '.1f')} dB{accuracy}."
        )
    if choice.pick is not None:
        c = choice.pick
        among = f"of {len(choice.private)} private {what}s"
        if len(choice.private) == 1:
            why = f"the only private {what} ({accuracy_name} {format_score(c.accuracy, '.3f')})"
        elif choice.by_accuracy:
            why = f"the highest {accuracy_name} ({format_score(c.accuracy, '.3f')}) {among}"
        else:
            why = f"{accuracy_name} not measured, so the lowest worst-case PSNR {among}"
        cost = f"; cost: {c.cost}" if c.cost else ""
        return (
            f"**Pick: {c.name}**: private ({_leaked(c)} of the images leak, worst-case PSNR "
            f"{format_score(c.worst_psnr, '.1f')} dB), {why}{cost}.{skipped}"
        )
    if choice.closest is None:
        return f"**None private**: nothing was audited.{skipped}"
    c = choice.closest
    why = f" ({c.reason})" if c.reason else ""
    accuracy = f", {accuracy_name} {format_score(c.accuracy, '.3f')}" if c.accuracy is not None else ""
    return (
        f"**None private.** Closest: {c.name}, {c.verdict}{why}: {_leaked(c)} of the images leak, worst-case "
        f"PSNR {format_score(c.worst_psnr, '.1f')} dB{accuracy}.{skipped}"
    )


def summary_markdown(
    title: str,
    candidates: Sequence[Candidate],
    *,
    rule: str,
    context: Sequence[str] = (),
    notes: Sequence[str] = (),
    table: Sequence[Candidate] | None = None,
    accuracy_name: str = "accuracy",
    what: str = "setting",
    table_label: str | None = None,
    max_rows: int = 12,
) -> str:
    """A one-screen Markdown summary (<= ~40 lines): the choice among ``candidates``, why, and a table.

    Args:
        title: the heading.
        candidates: what to choose among (:func:`choose`).
        rule: the leak rule in words (:meth:`~lightning_gp.audit.LeakRule.describe`), said once.
        context: lines on what was audited (model, data, attacks), under the choice.
        notes: more lines under the choice (e.g. the pick for another threat model).
        table: the rows of the table (default ``candidates``), shown private first (best first), then
            the closest to private; past ``max_rows`` the rest are counted, not shown.
        accuracy_name: what ``Candidate.accuracy`` is (e.g. ``"PMM"``); ``what``: what a candidate is
            (``"setting"``); ``table_label``: what a table row is (default ``what``).
    """
    choice = choose(candidates)
    rows = list(candidates if table is None else table)
    ranked = [*choose(rows).private, *sorted((c for c in rows if c.verdict != "private"), key=_closeness)]
    lines = [f"# {title}", "", choice_sentence(choice, accuracy_name, what), ""]
    lines += [f"- {line}" for line in notes]
    if notes:
        lines.append("")
    lines += list(context)
    if context:
        lines.append("")
    lines += [
        f"| {table_label or what} | verdict | images leaked | worst PSNR (dB) | {accuracy_name} | cost |",
        "|---|---|---|---|---|---|",
    ]
    for c in ranked[:max_rows]:
        name = f"**{c.name}**" if choice.pick is not None and c is choice.pick else c.name
        lines.append(
            f"| {name} | {c.verdict} | {_leaked(c)} | {format_score(c.worst_psnr, '.1f')} | {format_score(c.accuracy, '.3f')} | "
            f"{c.cost or '-'} |"
        )
    if len(ranked) > max_rows:
        lines.append(f"| ... {len(ranked) - max_rows} more, all further from private | | | | | |")
    lines += [
        "",
        (
            f"Leak rule (per image, any attack): {rule}. 'private' needs no leaked image and a complete audit; "
            "'inconclusive' is never counted as private."
        ),
    ]
    return "\n".join(lines) + "\n"


def _closeness(c: Candidate) -> tuple[float, float]:
    return (_low(c.leak_fraction), _low(c.worst_psnr))
