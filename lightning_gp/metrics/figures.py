"""PNG grids of originals over reconstructions.

Every grid has a bounded width: at most :data:`MAX_COLUMNS` images a row (longer batches wrap into
blocks), so a batch of 64 is a readable figure, not a 7867-pixel strip.

Drawn on matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``): no pyplot, no global
backend switch, safe in headless runs and threads.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from lightning_gp.metrics.report import ReconstructionReport

# Inches per image cell (width, height: a little taller for the caption) and output resolution.
CELL_WIDTH_IN = 1.2
CELL_HEIGHT_IN = 1.45
LABEL_WIDTH_IN = 1.3  # least left margin of save_comparison_grid for run titles
LABEL_CHAR_IN = 0.075  # width of one title character at fontsize 8
TOP_MARGIN_IN = 0.2  # room for the first row's captions
DPI = 100
#: Images a row when ``columns`` is not given: a row of a grid is at most ~1.6k pixels wide.
MAX_COLUMNS = 12


def _as_images(images: Tensor, name: str) -> Tensor:
    if not isinstance(images, Tensor) or images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(
            f"{name} must be a [B, C, H, W] tensor with 1 or 3 channels, got {getattr(images, 'shape', type(images))}"
        )
    return images.detach().float().cpu().clamp(0, 1)


def _show(ax: Any, image: Tensor) -> None:
    if image.shape[0] == 1:
        ax.imshow(image[0].numpy(), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    else:
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


def _captions(scores: ReconstructionReport | Sequence[Mapping[str, float]] | None, count: int) -> list[str]:
    if scores is None:
        return [""] * count
    rows = (
        [{"psnr": r.psnr, "ssim": r.ssim} for r in scores.rows]
        if isinstance(scores, ReconstructionReport)
        else list(scores)
    )
    if len(rows) != count:
        raise ValueError(f"scores has {len(rows)} entries for {count} reconstructions")
    return [f"{_num(r.get('psnr'), '.1f')} dB, SSIM {_num(r.get('ssim'), '.2f')}" for r in rows]


def _num(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else format(value, spec)


def _check_pair(originals: Tensor, reconstructed: Tensor) -> tuple[Tensor, Tensor]:
    originals, reconstructed = _as_images(originals, "originals"), _as_images(reconstructed, "reconstructed")
    if originals.shape != reconstructed.shape:
        raise ValueError(
            f"originals {tuple(originals.shape)} and reconstructed {tuple(reconstructed.shape)} must have the same "
            "shape (align them first, e.g. report.reconstructed_pixels)"
        )
    return originals, reconstructed


def label_width_inches(labels: Sequence[str]) -> float:
    """Left margin wide enough for the longest run title."""
    return max(LABEL_WIDTH_IN, 0.3 + LABEL_CHAR_IN * max((len(label) for label in labels), default=0))


def grid_size_inches(
    batch: int,
    columns: int | None = None,
    runs: int = 1,
    label_margin: bool = False,
    label_width: float = LABEL_WIDTH_IN,
) -> tuple[float, float]:
    """Figure size of a grid of ``batch`` images in rows of ``columns`` (default :data:`MAX_COLUMNS`):
    (width, height) in inches."""
    cols = min(batch, columns or MAX_COLUMNS)
    blocks = math.ceil(batch / cols)
    width = cols * CELL_WIDTH_IN + (label_width if label_margin else 0.0)
    return width, blocks * (1 + runs) * CELL_HEIGHT_IN + TOP_MARGIN_IN


def save_reconstruction_grid(
    originals: Tensor,
    reconstructed: Tensor,
    path: str | Path,
    scores: ReconstructionReport | Sequence[Mapping[str, float]] | None = None,
    titles: Sequence[str] | None = None,
    columns: int | None = None,
) -> Path:
    """Write a PNG: originals on top, each aligned reconstruction below, captioned "PSNR dB, SSIM".

    Args:
        originals, reconstructed: ``[B, C, H, W]`` pixel images in [0, 1], already aligned
            (``report.original_pixels`` / ``report.reconstructed_pixels``). Grayscale uses cmap gray.
        path: the PNG to write (folders are created).
        scores: a :class:`ReconstructionReport` or one mapping with "psnr"/"ssim" per image.
        titles: one caption per original (e.g. class names).
        columns: images per row (default :data:`MAX_COLUMNS`); longer batches wrap into several
            original/reconstruction blocks.
    """
    originals, reconstructed = _check_pair(originals, reconstructed)
    return _save([("", originals, reconstructed, scores)], path, titles, columns, label_margin=False)


def save_comparison_grid(
    rows: Sequence[tuple[str, Tensor, Tensor, ReconstructionReport | Sequence[Mapping[str, float]] | None]],
    path: str | Path,
    titles: Sequence[str] | None = None,
    columns: int | None = None,
) -> Path:
    """Write a PNG of several runs on one batch (e.g. undefended vs defended) stacked.

    ``rows``: ``(title, originals, reconstructed, report)`` per run; all runs show the same
    originals (the first run's are drawn once, on top), then one captioned reconstruction row
    per run, labelled with its title on the left.
    """
    if not rows:
        raise ValueError("rows must hold at least one (title, originals, reconstructed, report) run")
    runs: list[tuple[str, Tensor, Tensor, Any]] = []
    for i, row in enumerate(rows):
        if len(row) != 4:
            raise ValueError(f"rows[{i}] must be (title, originals, reconstructed, report), got {len(row)} items")
        title, originals, reconstructed, scores = row
        originals, reconstructed = _check_pair(originals, reconstructed)
        if runs and (originals.shape != runs[0][1].shape or not torch.allclose(originals, runs[0][1], atol=1e-4)):
            raise ValueError(
                f"rows[{i}] shows other originals than rows[0]: a comparison grid compares runs on one batch"
            )
        runs.append((str(title), originals, reconstructed, scores))
    return _save(runs, path, titles, columns, label_margin=True)


def _save(
    runs: list[tuple[str, Tensor, Tensor, Any]],
    path: str | Path,
    titles: Sequence[str] | None,
    columns: int | None,
    label_margin: bool,
) -> Path:
    originals = runs[0][1]
    batch = originals.shape[0]
    if columns is not None and columns < 1:
        raise ValueError(f"columns must be >= 1, got {columns}")
    if titles is not None and len(titles) != batch:
        raise ValueError(f"titles has {len(titles)} entries for {batch} images")
    cols = min(batch, columns or MAX_COLUMNS)
    blocks = math.ceil(batch / cols)
    rows_per_block = 1 + len(runs)
    label_width = label_width_inches([run[0] for run in runs])
    width, height = grid_size_inches(batch, columns, runs=len(runs), label_margin=label_margin, label_width=label_width)
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    left = (label_width / width) if label_margin else 0.01
    fig.subplots_adjust(left=left, right=0.99, top=1 - TOP_MARGIN_IN / height, bottom=0.01, wspace=0.05, hspace=0.3)
    axes = fig.subplots(blocks * rows_per_block, cols, squeeze=False)
    captions = [_captions(scores, batch) for _, _, _, scores in runs]
    for b in range(blocks):
        for c in range(cols):
            i = b * cols + c
            for r in range(rows_per_block):
                ax = axes[b * rows_per_block + r][c]
                if i >= batch:
                    ax.set_axis_off()
                    continue
                if r == 0:
                    _show(ax, originals[i])
                    ax.set_title(titles[i] if titles is not None else f"original {i}", fontsize=7)
                else:
                    _show(ax, runs[r - 1][2][i])
                    ax.set_title(captions[r - 1][i] or f"reconstruction {i}", fontsize=7)
                if c == 0 and label_margin:
                    label = "original" if r == 0 else runs[r - 1][0]
                    ax.set_ylabel(label, fontsize=8, rotation=0, ha="right", va="center", labelpad=6)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path


# ---------------------------------------------------------------------------- the flagged grid
#: Colours of a flagged grid: a reconstruction's frame and its last caption line.
FLAG_COLORS = {True: "#c62828", False: "#2e7d32", None: "#616161"}
FLAGGED_CELL_IN = 1.6  # one image's column
FLAGGED_IMAGE_IN = 1.2  # the image itself (square)
FLAGGED_PAD_IN = 0.3  # left/right/top margin
FLAGGED_COLUMNS = 8  # at most, whatever ``columns`` says: 8 * 1.6 in + margins = 1340 px at DPI 100
TITLE_PT, TEXT_PT, CAPTION_PT = 14, 10, 9  # 19, 14 and 12.5 px at DPI 100: legible at 100% zoom


def _line_in(points: float) -> float:
    """Height of one text line of ``points`` in inches (with the line spacing)."""
    return points * 1.4 / 72


def wrap_to_width(text: str, width_in: float, points: float) -> list[str]:
    """``text`` wrapped into lines that fit ``width_in`` inches at ``points`` (DejaVu Sans averages
    ~0.55 em a character in prose)."""
    return textwrap.wrap(text, max(16, int(width_in * 72 / (0.55 * points)))) or [""]


def _fit(text: str, width_in: float, points: float) -> str:
    """``text`` cut (with "...") to one line of ``width_in`` inches at ``points``."""
    room = max(4, int(width_in * 72 / (0.6 * points)))
    return text if len(text) <= room else text[: room - 3] + "..."


def save_flagged_grid(
    originals: Tensor,
    reconstructed: Tensor,
    path: str | Path,
    *,
    labels: Sequence[str],
    captions: Sequence[Sequence[str]],
    flags: Sequence[bool | None],
    title: str = "",
    title_color: str = "black",
    header: Sequence[str] = (),
    footer: Sequence[str] = (),
    columns: int = FLAGGED_COLUMNS,
) -> Path:
    """Write a PNG of originals over reconstructions, each reconstruction framed and captioned by a flag.

    A figure to read at a glance: at most :data:`FLAGGED_COLUMNS` images a row (longer sequences
    wrap into blocks), so its width is bounded (<= 1340 px) whatever the number of images; text is
    10-14 pt at :data:`DPI` (12-19 px). The caller chooses which images to show (cap their number to
    bound the height).

    Args:
        originals, reconstructed: ``[N, C, H, W]`` pixel images in [0, 1], aligned pairs.
        labels: one line above each original (e.g. its position in the batch).
        captions: the lines under each reconstruction; the last one is drawn in its flag's colour.
        flags: per reconstruction, ``True`` (framed red, e.g. it leaks), ``False`` (green) or
            ``None`` (grey: unknown).
        title: the first line, bold, in ``title_color``; ``header``: lines under it (wrapped to the
            width); ``footer``: lines under the grid (wrapped).
        columns: images a row (capped at :data:`FLAGGED_COLUMNS`).
    """
    originals, reconstructed = _check_pair(originals, reconstructed)
    count = originals.shape[0]
    for name, values in (("labels", labels), ("captions", captions), ("flags", flags)):
        if len(values) != count:
            raise ValueError(f"{name} has {len(values)} entries for {count} images")
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
        raise ValueError(f"columns must be an int >= 1, got {columns!r}")
    layout = _flagged_layout(count, columns, captions, title, header, footer)
    fig = Figure(figsize=(layout.width, layout.height), dpi=DPI)
    FigureCanvasAgg(fig)
    y = layout.height - FLAGGED_PAD_IN  # the cursor, in inches from the bottom
    for line in layout.title_lines:
        y = _flagged_text(fig, layout, y, line, TITLE_PT, color=title_color, fontweight="bold")
    for line in layout.header_lines:
        y = _flagged_text(fig, layout, y, line, TEXT_PT)
    y -= 0.15
    for b in range(layout.blocks):
        top = y
        for c in range(layout.cols):
            i = b * layout.cols + c
            if i >= count:
                break
            _flagged_cell(fig, layout, top, c, originals[i], reconstructed[i], labels[i], captions[i], flags[i])
        y = top - layout.block_in
    y -= 0.1
    for line in layout.footer_lines:
        y = _flagged_text(fig, layout, y, line, CAPTION_PT, color="#333333")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path


@dataclass(frozen=True)
class _FlaggedLayout:
    """Where everything of a flagged grid goes: its size and text lines (inches, at :data:`DPI`)."""

    cols: int
    blocks: int
    width: float
    height: float
    label_in: float
    block_in: float
    title_lines: list[str]
    header_lines: list[str]
    footer_lines: list[str]


def _flagged_layout(
    count: int,
    columns: int,
    captions: Sequence[Sequence[str]],
    title: str,
    header: Sequence[str],
    footer: Sequence[str],
) -> _FlaggedLayout:
    """The layout of a flagged grid of ``count`` images: columns, blocks, wrapped text and page size."""
    cols = min(count, columns, FLAGGED_COLUMNS)
    blocks = math.ceil(count / cols)
    width = max(cols, 4) * FLAGGED_CELL_IN + 2 * FLAGGED_PAD_IN  # room for the text over a short row
    text_width = width - 2 * FLAGGED_PAD_IN
    title_lines = wrap_to_width(title, text_width, TITLE_PT) if title else []
    header_lines = [line for text in header for line in wrap_to_width(text, text_width, TEXT_PT)]
    footer_lines = [line for text in footer for line in wrap_to_width(text, text_width, CAPTION_PT)]
    caption_rows = max((len(c) for c in captions), default=0)
    label_in = _line_in(CAPTION_PT) + 0.04
    block_in = label_in + 2 * FLAGGED_IMAGE_IN + 0.1 + caption_rows * _line_in(CAPTION_PT) + 0.2
    head_in = len(title_lines) * _line_in(TITLE_PT) + len(header_lines) * _line_in(TEXT_PT) + 0.15
    foot_in = len(footer_lines) * _line_in(CAPTION_PT) + (0.1 if footer_lines else 0.0)
    height = FLAGGED_PAD_IN + head_in + blocks * block_in + foot_in + 0.1
    return _FlaggedLayout(cols, blocks, width, height, label_in, block_in, title_lines, header_lines, footer_lines)


def _flagged_text(fig: Figure, layout: _FlaggedLayout, y: float, line: str, points: float, **style: Any) -> float:
    """Draw one left-aligned text line at height ``y`` (inches); the height of the next line."""
    fig.text(FLAGGED_PAD_IN / layout.width, y / layout.height, line, fontsize=points, va="top", ha="left", **style)
    return y - _line_in(points)


def _flagged_cell(
    fig: Figure,
    layout: _FlaggedLayout,
    top: float,
    c: int,
    original: Tensor,
    reconstructed: Tensor,
    label: str,
    captions: Sequence[str],
    flag: bool | None,
) -> None:
    """Draw one column of a block from ``top`` (inches) down: label, original, framed reconstruction, captions."""
    width, height = layout.width, layout.height
    x = FLAGGED_PAD_IN + c * FLAGGED_CELL_IN + (FLAGGED_CELL_IN - FLAGGED_IMAGE_IN) / 2
    centre = (x + FLAGGED_IMAGE_IN / 2) / width
    fig.text(
        centre,
        top / height,
        _fit(label, FLAGGED_CELL_IN, CAPTION_PT),
        fontsize=CAPTION_PT,
        ha="center",
        va="top",
    )
    image_top = top - layout.label_in
    ax = fig.add_axes(
        (
            x / width,
            (image_top - FLAGGED_IMAGE_IN) / height,
            FLAGGED_IMAGE_IN / width,
            FLAGGED_IMAGE_IN / height,
        )
    )
    _show(ax, original)
    below = image_top - FLAGGED_IMAGE_IN - 0.1
    ax = fig.add_axes(
        (x / width, (below - FLAGGED_IMAGE_IN) / height, FLAGGED_IMAGE_IN / width, FLAGGED_IMAGE_IN / height)
    )
    _show(ax, reconstructed)
    for spine in ax.spines.values():
        spine.set_visible(True)
        spine.set_color(FLAG_COLORS[flag])
        spine.set_linewidth(4)
    line_y = below - FLAGGED_IMAGE_IN - 0.06
    for k, line in enumerate(captions):
        color = FLAG_COLORS[flag] if k == len(captions) - 1 else "black"
        weight = "bold" if k == len(captions) - 1 else "normal"
        fig.text(
            centre,
            line_y / height,
            _fit(line, FLAGGED_CELL_IN, CAPTION_PT),
            fontsize=CAPTION_PT,
            ha="center",
            va="top",
            color=color,
            fontweight=weight,
        )
        line_y -= _line_in(CAPTION_PT)
