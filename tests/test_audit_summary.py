"""The one-screen summary's choice (which setting to pick, and why) and the audit figure's size and words.

Pure functions on hand-made candidates and on tiny seeded worst-case reports; figures on matplotlib's
Agg canvas, measured in pixels from the PNG header.
"""

from __future__ import annotations

import struct

import pytest
import torch

from lightning_gp.attacks import Reconstruction
from lightning_gp.audit import LeakRule, worst_case_report
from lightning_gp.audit.figure import FIGURE_IMAGES, figure_text, save_audit_figure, shown_images
from lightning_gp.audit.summary import Candidate, choice_sentence, choose, combined_verdict, summary_markdown
from lightning_gp.metrics import reconstruction_report

IDENTITY = ((0.0,), (1.0,))
PIXEL_RULE = {"psnr": 20.0, "ssim": 0.5}  # synthetic images: the pixel lines alone (no semantic classifier)
MAX_WIDTH_PX = 1400


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# ------------------------------------------------------------------ the choice
def test_the_pick_is_the_private_setting_with_the_highest_accuracy() -> None:
    candidates = [
        Candidate("noise", "leaks", 1.0, 25.0, accuracy=0.99),  # the best accuracy, but it leaks
        Candidate("dp strong", "private", 0.0, 6.0, accuracy=0.40, cost="upload 100%"),
        Candidate("dp mild", "private", 0.0, 9.0, accuracy=0.71, cost="upload 100%"),
        Candidate("half audited", "inconclusive", 0.0, 5.0, accuracy=0.95),  # never counted as private
    ]
    choice = choose(candidates)
    assert choice.pick is not None and choice.pick.name == "dp mild"
    assert [c.name for c in choice.private] == ["dp mild", "dp strong"] and choice.by_accuracy
    assert choice.closest is None and choice.inconclusive == 1
    sentence = choice_sentence(choice, "PMM")
    assert "Pick: dp mild" in sentence and "highest PMM (0.710) of 2 private" in sentence
    assert "upload 100%" in sentence and "1 inconclusive setting not counted as private" in sentence


def test_an_inconclusive_setting_is_never_picked_however_good_it_looks() -> None:
    candidates = [
        Candidate("incomplete", "inconclusive", 0.0, 4.0, accuracy=1.0, reason="DefenseAwareIDLG fell back"),
        Candidate("leaky", "leaks", 0.25, 14.0, accuracy=0.9),
    ]
    choice = choose(candidates)
    assert choice.pick is None and choice.private == ()
    assert choice.closest is not None and choice.closest.name == "incomplete"  # closest, not private
    sentence = choice_sentence(choice)
    assert (
        sentence.startswith("**None private.**") and "incomplete, inconclusive (DefenseAwareIDLG fell back)" in sentence
    )


def test_with_none_private_the_closest_is_the_lowest_leak_fraction_then_psnr() -> None:
    candidates = [
        Candidate("a", "leaks", 1.0, 12.0),
        Candidate("b", "leaks", 0.25, 30.0),
        Candidate("c", "leaks", 0.25, 14.0),
        Candidate("d", "leaks", None, None),  # nothing known sorts last
    ]
    choice = choose(candidates)
    assert choice.pick is None and choice.closest is not None and choice.closest.name == "c"
    text = summary_markdown("t", candidates, rule=LeakRule().describe())
    assert "**None private.** Closest: c" in text
    table = [line for line in text.splitlines() if line.startswith("| ") and "verdict" not in line]
    assert [line.split(" | ")[0] for line in table] == ["| c", "| b", "| a", "| d"]


def test_without_accuracy_the_private_pick_is_the_lowest_worst_case_psnr() -> None:
    choice = choose([Candidate("x", "private", 0.0, 9.0), Candidate("y", "private", 0.0, 6.0)])
    assert choice.pick is not None and choice.pick.name == "y" and not choice.by_accuracy
    assert "not measured, so the lowest worst-case PSNR" in choice_sentence(choice)


def test_combined_verdicts_leak_first_and_never_read_a_gap_as_privacy() -> None:
    assert combined_verdict(["private", "private"]) == "private"
    assert combined_verdict(["private", "inconclusive"]) == "inconclusive"
    assert combined_verdict(["inconclusive", "leaks", "private"]) == "leaks"
    assert combined_verdict([]) == "inconclusive"
    with pytest.raises(ValueError, match="verdict must be one of"):
        combined_verdict(["safe"])
    with pytest.raises(ValueError, match="verdict must be one of"):
        Candidate("x", "ok")


def test_the_summary_fits_one_screen_and_states_the_rule_once() -> None:
    rule = LeakRule().describe()
    candidates = [Candidate(f"setting {i}", "leaks", i / 30, 10.0 + i, accuracy=0.9) for i in range(30)]
    candidates.append(Candidate("the one", "private", 0.0, 5.0, accuracy=0.5, cost="upload 23%"))
    text = summary_markdown("Matrix", candidates, rule=rule, context=["what was audited"], accuracy_name="PMM")
    lines = text.splitlines()
    assert len(lines) <= 40
    assert lines[0] == "# Matrix" and lines[2].startswith("**Pick: the one**")
    assert text.count(rule) == 1
    assert "| **the one** | private | 0% | 5.0 | 0.500 | upload 23% |" in text
    assert "19 more, all further from private" in text  # 31 rows, 12 shown


# ------------------------------------------------------------------ the figure
def worst_of(batch: int, attacks: int, seed: int = 0, sigmas: list[float] | None = None):
    g = torch.Generator().manual_seed(seed)
    truth = torch.rand(batch, 1, 16, 16, generator=g)
    reports = []
    for k in range(attacks):
        sigma = torch.tensor(sigmas or [0.05 + 0.3 * k] * batch).view(-1, 1, 1, 1)
        images = (truth + sigma * torch.randn(truth.shape, generator=g)).clamp(0, 1)
        reports.append(
            reconstruction_report(
                Reconstruction(images, None, attack=f"Attack{k}WithALongName"),
                truth,
                IDENTITY,
                lpips=False,
                noise_ratio=False,
            )
        )
    return worst_case_report(reports, leak_thresholds=PIXEL_RULE)


@pytest.mark.parametrize(("batch", "attacks"), [(16, 3), (64, 4)])
def test_the_audit_figure_is_bounded_whatever_the_batch_and_the_attacks(tmp_path, batch, attacks) -> None:
    # the old grid drew a column per image and a row per attack: 64 images x 3 attacks was 7867 x 745 px
    worst = worst_of(batch, attacks)
    width, height = png_size(save_audit_figure(worst, tmp_path / "audit.png", context="step 0, client 0"))
    assert width <= MAX_WIDTH_PX and height <= 1100
    assert height >= 600  # two rows of eight originals over their reconstructions, not a strip


def test_the_figure_says_the_verdict_and_the_rule_once_from_the_leak_rule() -> None:
    worst = worst_of(5, 2, sigmas=[0.02, 0.02, 0.6, 0.6, 0.6])  # images 0 and 1 come back
    text = figure_text(worst, context="step 3, client 1")
    assert text.title == "LEAKS: 2 of 5 images leak (step 3, client 1)"
    words = " ".join([text.title, *text.header, *text.footer])
    rule = LeakRule(PIXEL_RULE).describe()
    assert words.count(rule) == 1 and rule.startswith("PSNR > 20 dB, SSIM > 0.5")  # the report's rule, once
    assert set(text.shown[:2]) == {0, 1}  # the leaks first
    assert text.flags == [True, True, False, False, False]
    assert [c[-1] for c in text.captions] == ["LEAKS", "LEAKS", "no leak", "no leak", "no leak"]
    assert text.captions[0][1] == f"by {worst.rows[text.shown[0]].attacks['psnr']}"  # the attack that got it


def test_a_large_batch_is_sampled_evenly_over_the_ranking_with_the_worst_leak_kept() -> None:
    sigmas = [0.5] * 64
    sigmas[37] = 0.01  # the one image that leaks
    worst = worst_of(64, 1, sigmas=sigmas)
    shown = shown_images(worst)
    assert len(shown) == FIGURE_IMAGES and len(set(shown)) == FIGURE_IMAGES and shown[0] == 37
    psnr = {r.index: r.values["psnr"] for r in worst.rows}
    least = min(range(64), key=lambda i: psnr[i])
    assert shown[-1] == least  # the best-protected image closes the sample
    assert "Showing 16 of 64 images" in figure_text(worst).footer[-1]
    assert shown_images(worst, limit=1) == [37]
    with pytest.raises(ValueError, match="limit"):
        shown_images(worst, limit=0)


def test_a_single_run_is_judged_in_words_never_picked_or_called_closest() -> None:
    # Before: one run read "None private. Closest: <the run>", or "Pick: <the run>" when private
    candidates = [Candidate("my run", "leaks", 0.25, 21.0, accuracy=0.8, reason="2 of 8 images leak")]
    assert choice_sentence(choose(candidates), "PMM") == (
        "**Not private: leaks.** my run (2 of 8 images leak): 25% of the images leak, worst-case PSNR 21.0 dB, PMM 0.800."
    )
    private = [Candidate("my run", "private", 0.0, 9.0)]
    assert choice_sentence(choose(private)) == "**Private.** my run: 0% of the images leak, worst-case PSNR 9.0 dB."
