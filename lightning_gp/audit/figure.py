"""The figure of one audited batch, readable at a glance: the verdict, the rule, the worst case per image.

One figure per audited gradient (:class:`~lightning_gp.audit.PrivacyAudit` writes it): the title says
the verdict and how many images leak; the header states the leak rule once, from the report (its
text is :meth:`~lightning_gp.audit.LeakRule.describe`, never a copy of the thresholds); the grid
shows each original over the attacker's best reconstruction of it (the attack with the best PSNR),
framed red when the image leaks by the rule, green when it does not, captioned with PSNR, SSIM and
the attack; the footer gives each attack's own mean PSNR and share of leaked images.

Size: at most :data:`FIGURE_IMAGES` images in rows of 8 (:func:`shown_images` says which), so a
batch of 64 audited by 3 attacks is a 1340 x ~1000 px figure, not a 7867 x 745 px strip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from lightning_gp.audit.summary import format_score
from lightning_gp.audit.verdict import WorstCaseReport, WorstImage, or_list, threshold_phrases
from lightning_gp.metrics.figures import save_flagged_grid

#: Images an audit figure shows at most (two rows of 8).
FIGURE_IMAGES = 16
#: The colour of each verdict in figures.
VERDICT_COLORS = {"leaks": "#c62828", "inconclusive": "#ef6c00", "private": "#2e7d32"}
#: Which images a figure shows when the batch is larger than it can hold.
SELECTION_RULE = (
    "images ranked leaking first, then by the attacker's best PSNR (highest first); over {limit} images, "
    "{limit} evenly spaced ranks, the first (worst) and the last (best kept) always among them"
)


def shown_images(worst: WorstCaseReport, limit: int = FIGURE_IMAGES) -> list[int]:
    """The batch positions a figure shows, in the order shown (:data:`SELECTION_RULE`).

    Leaking images come first, then the rest, each group by the attacker's best PSNR, highest first
    (an image no attack scored comes last). With more than ``limit`` images, ``limit`` ranks evenly
    spaced from the first to the last are kept, so the sample spans the batch from its worst leak to
    its best-protected image, whatever the batch size."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an int >= 1, got {limit!r}")

    def key(row: WorstImage) -> tuple[bool, float]:
        psnr = row.values["psnr"]
        return (not row.leaks, -psnr if psnr is not None and not math.isnan(psnr) else math.inf)

    ranked = [row.index for row in sorted(worst.rows, key=key)]
    if len(ranked) <= limit:
        return ranked
    if limit == 1:
        return ranked[:1]
    return [ranked[round(k * (len(ranked) - 1) / (limit - 1))] for k in range(limit)]


def verdict_rule(worst: WorstCaseReport) -> str:
    """The leak rule and the verdict's rule of ``worst``, in one sentence (from the report itself)."""
    allowed = (
        "an image leaks"
        if worst.max_leak_fraction == 0
        else f"more than {worst.max_leak_fraction:.0%} of the images leak"
    )
    means = f" or a worst-case mean crosses {or_list(threshold_phrases(worst.thresholds))}" if worst.thresholds else ""
    return (
        f"An image leaks when any attack reaches {worst.rule}. The verdict is 'leaks' when {allowed}{means}; "
        "else 'inconclusive' when the audit is incomplete; else 'private'."
    )


@dataclass(frozen=True)
class FigureText:
    """What an audit figure says (:func:`figure_text`): the images shown (batch positions, in order),
    the line over each original, the caption lines and flag of each reconstruction (``True``: it
    leaks), the title, the header and the footer lines."""

    shown: list[int]
    labels: list[str]
    captions: list[list[str]]
    flags: list[bool | None]
    title: str
    header: list[str]
    footer: list[str]


def figure_text(worst: WorstCaseReport, *, context: str = "", limit: int = FIGURE_IMAGES) -> FigureText:
    """The words and the choice of images of :func:`save_audit_figure` (no drawing)."""
    shown = shown_images(worst, limit)
    rows = {row.index: row for row in worst.rows}
    captions, flags = [], []
    for i in shown:
        row = rows[i]
        psnr, ssim = row.values["psnr"], row.values["ssim"]
        scored = psnr is not None and not math.isnan(psnr)
        captions.append(
            [
                f"{format_score(psnr, '.1f')} dB, SSIM {format_score(ssim, '.2f')}",
                f"by {row.attacks['psnr'] or '-'}",
                "LEAKS" if row.leaks else ("no leak" if scored else "not scored"),
            ]
        )
        flags.append(True if row.leaks else (False if scored else None))
    title = worst.headline() + (f" ({context})" if context else "")
    header = [
        (
            f"Worst case over {len(worst.attacks)} attack{'s' if len(worst.attacks) > 1 else ''} "
            f"({', '.join(worst.attacks)}): mean PSNR {format_score(worst.means['psnr'], '.1f')} dB, "
            f"SSIM {format_score(worst.means['ssim'], '.3f')}."
        ),
        verdict_rule(worst),
    ]
    if worst.verdict != "private" and worst.verdict_reasons:
        why = "; ".join(worst.verdict_reasons)
        header.append("Why: " + (why if len(why) <= 200 else why[:197] + "..."))
    per_attack = "; ".join(
        f"{name} {format_score(worst.attack_means[name].get('psnr'), '.1f')} dB, {worst.attack_leak_fraction(name):.0%}"
        for name in worst.attacks
    )
    which = (
        f"All {worst.batch_size} images, leaking first, then by best PSNR."
        if len(shown) == worst.batch_size
        else f"Showing {len(shown)} of {worst.batch_size} images: {SELECTION_RULE.format(limit=limit)}."
    )
    footer = [
        (
            "Under each original: the attacker's best reconstruction of it (the attack with the best PSNR); "
            "frame red: the image leaks, green: it does not."
        ),
        f"Per attack (mean PSNR, share of images it leaks): {per_attack}.",
        which,
    ]
    return FigureText(shown, [f"image {i}" for i in shown], captions, flags, title, header, footer)


def save_audit_figure(
    worst: WorstCaseReport, path: str | Path, *, context: str = "", limit: int = FIGURE_IMAGES
) -> Path:
    """Write the figure of one audited batch (see the module docstring) to ``path``.

    Args:
        worst: the worst case over the attacks, with its pixels (``original_pixels`` and
            ``best_psnr_pixels``, which every report of :func:`~lightning_gp.audit.worst_case_report`
            keeps when the attacks' reports keep theirs).
        context: what was audited, for the title (e.g. ``"step 0, client 0, passive server"``).
        limit: at most this many images (:func:`shown_images`).
    """
    if worst.original_pixels is None or worst.best_psnr_pixels is None:
        raise ValueError("the worst-case report keeps no pixels (its attacks' reports had none): nothing to draw")
    text = figure_text(worst, context=context, limit=limit)
    return save_flagged_grid(
        worst.original_pixels[text.shown],
        worst.best_psnr_pixels[text.shown],
        path,
        labels=text.labels,
        captions=text.captions,
        flags=text.flags,
        title=text.title,
        title_color=VERDICT_COLORS.get(worst.verdict, "black"),
        header=text.header,
        footer=text.footer,
    )
