"""``lightning-gp attack --config configs/attack_<x>.yaml``: attack tapped FedSGD gradients.

Runs FedSGD with the configured defense callbacks through round ``round``, taps the gradients
``clients`` shared in it (or loads tapped files given with ``tap_files``), attacks each from the
server's view, and writes ``report.json``, ``report.md`` and ``reconstructions.png`` to
``output_dir``. Beside the measured leaks the report states the defense's ReRo bound ``eta`` at the
kappa of the leak rule on the attacked images (:mod:`lightning_gp.audit.bounds`), or "no formal bound". ``indices`` (training-set indices, one list per attacked client) or ``positions``
(within each attacked client's partition) choose the images behind each attacked gradient.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_gp.attacks import GradientAttack, monitored
from lightning_gp.audit import (
    AttackResult,
    FormalBound,
    LeakRule,
    WorstCaseReport,
    attack_record,
    mean_scores,
    prior_only_kappa,
    setting_bound,
    tap_fedsgd_round,
    trivial_baselines,
    worst_case_report,
)
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.recognition import datamodule_recognition_tests
from lightning_gp.audit.rounds import public_examples
from lightning_gp.audit.setting_audit import reference_pixels
from lightning_gp.cli.help import short_help
from lightning_gp.cli.shapes import data_built_first, instantiate
from lightning_gp.data import ImageClassificationDataModule
from lightning_gp.metrics import (
    PRIVACY_THRESHOLDS,
    concatenate_reports,
    privacy_flags,
    save_reconstruction_grid,
)
from lightning_gp.records import TappedGradient


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="lightning-gp attack", description=__doc__, env_prefix="LIGHTNING_GP", default_env=False
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config (see configs/attack_*.yaml)")
    parser.add_argument("--model", type=nn.Module, required=True, help="the client model (class_path + init_args)")
    parser.add_argument("--data", type=ImageClassificationDataModule, required=True, help="the clients' data")
    parser.add_argument("--attack", type=GradientAttack, required=True, help="the attack (class_path + init_args)")
    parser.add_argument("--defenses", type=list[Callback], default=[], help="defense callbacks, applied in order")
    parser.add_argument("--round", type=int, default=0, help="FedSGD round to attack (0: the initial model)")
    parser.add_argument(
        "--clients",
        type=list[int] | None,
        default=None,
        help="client ids whose shared gradients are attacked (default [0], or one per list of indices/positions)",
    )
    parser.add_argument("--num_clients", type=int, default=10, help="clients the training set is split among")
    parser.add_argument(
        "--local_batch_size",
        type=int | None,
        default=None,
        help="images behind each client's gradient (default: the length of the indices/positions lists, else 1)",
    )
    parser.add_argument(
        "--indices",
        type=list[list[int]] | None,
        default=None,
        help="attack these training images: one list of training-set indices per attacked client, e.g. "
        "[[12, 7], [301, 5]]; in the attacked round each client's batch is exactly those images",
    )
    parser.add_argument(
        "--positions",
        type=list[list[int]] | None,
        default=None,
        help="like indices, as positions within each attacked client's own partition",
    )
    parser.add_argument("--labels_known", type=bool, default=False, help="threat model grants the server the labels")
    parser.add_argument(
        "--tap_files", type=list[str], default=[], help="attack these GradientTap files instead of simulating"
    )
    parser.add_argument("--lpips", type=bool, default=True, help="score LPIPS (needs the pretrained AlexNet weights)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, the partition and the attack")
    parser.add_argument("--output_dir", type=str, default="attack_output", help="where the report and figures go")
    return parser


def run(config: Any, rule: LeakRule | None = None) -> list[AttackResult]:
    """Tap (or load) the configured round and attack each client's gradient; each report is scored with
    ``rule``'s recognisable-image tests (default: :func:`calibrated_rule` of the data)."""
    datamodule: ImageClassificationDataModule = config.data
    attack: GradientAttack = config.attack
    secrets: dict[str, Any]
    if config.tap_files:
        if hasattr(attack, "modify_model"):
            raise ValueError(f"{type(attack).__name__} is an active attack: it needs a simulated round, not tap_files")
        if config.indices is not None or config.positions is not None:
            raise ValueError("indices/positions choose the images of a simulated round; tap_files already hold theirs")
        records = [TappedGradient.load(path) for path in config.tap_files]
        model, secrets = config.model, {}
    else:
        records, model, secrets = tap_fedsgd_round(
            config.model,
            datamodule,
            defenses=config.defenses,
            attack=attack,
            round=config.round,
            clients=config.clients,
            num_clients=config.num_clients,
            local_batch_size=config.local_batch_size,
            indices=config.indices,
            positions=config.positions,
            seed=config.seed,
        )
    public = public_examples(datamodule)  # the server's own labelled images (batch label recovery)
    rule = calibrated_rule(datamodule, public) if rule is None else rule
    results = []
    for record in records:
        print(f"attacking client {record.client_id}, round {record.round} with {type(attack).__name__}", flush=True)
        with monitored():  # a line at least every 30 s while the attack runs
            result = attack_record(
                record,
                model,
                attack,
                num_classes=datamodule.num_classes,
                mean=datamodule.mean,
                std=datamodule.std,
                server_secrets=secrets,
                labels_known=config.labels_known,
                lpips=config.lpips,
                public_data=public,
                tests=rule.tests,
            )
        results.append(result)
    return results


def calibrated_rule(datamodule: ImageClassificationDataModule, public: Any = None) -> LeakRule:
    """The leak rule with the recognisable-image tests calibrated on ``datamodule``'s public split."""
    return LeakRule().calibrated(datamodule_recognition_tests(datamodule, public))


#: Why one attack's verdict is never "private".
ONE_ATTACK = (
    "one attack alone: only the worst case over every attack, the defense's adaptive attack included, can say "
    "private (audit_setting, benchmarks/matrix.py, PrivacyAudit)"
)


def write_outputs(
    results: list[AttackResult],
    output_dir: Path,
    attack: str,
    defenses: list[str],
    threat: str = "passive",
    bound: FormalBound | None = None,
    rule: LeakRule | None = None,
) -> Path:
    """Write ``report.json``, ``report.md`` and ``reconstructions.png``; ``bound``: the defense's ReRo
    bound (:func:`formal_bound`; ``None``: not computed, said so); ``rule``: the leak rule the reports
    were scored for (its semantic line; default :class:`LeakRule`)."""
    rule = LeakRule() if rule is None else rule
    output_dir.mkdir(parents=True, exist_ok=True)
    means = mean_scores(results)
    flags = privacy_flags(means, PRIVACY_THRESHOLDS)
    unavailable = {k: v for r in results for k, v in r.report.unavailable.items()}  # metric -> why "n/a"
    # one attack: its leak fraction and the trivial baselines (the worst case over several attacks is
    # benchmarks/matrix.py's and PrivacyAudit's)
    judged = worst_case_report(
        [concatenate_reports([r.report for r in results])],
        leak_thresholds=rule.thresholds,
        noise_ratio_line=rule.noise_ratio_line,
        identification_gate=rule.identification_gate,
        dataset_mean=_pixel_mean(results),
        incomplete=[ONE_ATTACK],
        threat_model=threat,
    )
    payload = _report_json(results, attack, defenses, threat, bound, means, flags, unavailable, judged)
    (output_dir / "report.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = _report_markdown(results, attack, defenses, threat, bound, means, unavailable, judged)
    (output_dir / "report.md").write_text("\n".join(lines) + "\n")
    originals = torch.cat([r.pixels()[0] for r in results])
    reconstructed = torch.cat([r.pixels()[1] for r in results])
    scores = [{"psnr": row.psnr, "ssim": row.ssim} for r in results for row in r.report.rows]
    save_reconstruction_grid(originals, reconstructed, output_dir / "reconstructions.png", scores=scores)
    return output_dir / "report.md"


def _report_json(
    results: list[AttackResult],
    attack: str,
    defenses: list[str],
    threat: str,
    bound: FormalBound | None,
    means: dict[str, float | None],
    flags: dict[str, bool | None],
    unavailable: dict[str, str],
    judged: WorstCaseReport,
) -> dict[str, Any]:
    """The content of ``report.json``: the scores, the verdict of this attack alone, the bound, per client."""
    return {
        "attack": attack,
        "defenses": defenses,
        "mean": {k: (str(v) if isinstance(v, float) and v == float("inf") else v) for k, v in means.items()},
        "private": flags,
        "leak_fraction": judged.leak_fraction,
        "leaked": judged.leaked,
        "verdict": judged.verdict,
        "verdict_reasons": judged.verdict_reasons,
        "threat_model": threat,
        "baselines": {b.name: b.means for b in judged.baselines},
        "rero": _bound_json(bound),
        "unavailable": unavailable,
        "clients": [
            {
                "client_id": r.record.client_id,
                "round": r.record.round,
                "dataset_indices": r.record.meta.get("dataset_indices"),
                "seconds": r.seconds,
                **r.report.to_dict(),
            }
            for r in results
        ],
    }


def _report_markdown(
    results: list[AttackResult],
    attack: str,
    defenses: list[str],
    threat: str,
    bound: FormalBound | None,
    means: dict[str, float | None],
    unavailable: dict[str, str],
    judged: WorstCaseReport,
) -> list[str]:
    """The lines of ``report.md``: the score table, the leak rule's verdict, the bound, then each client."""
    lines = [f"# {attack} against {', '.join(defenses) or 'no defense'}", ""]
    # the scores, then the one leak rule and its verdict (the rule is stated once, below the table)
    lines += ["| metric | mean over the images |", "|---|---|"]
    for metric in ("psnr", "ssim", "lpips", "semantic", "noise_ratio", "mse", "nmi", "label_accuracy"):
        value = means.get(metric)
        shown = "—" if value is None else f"{value:.4g}"
        if value is None and metric in unavailable:
            shown = f"n/a ({unavailable[metric]})"
        lines.append(f"| {metric} | {shown} |")
    server = "malicious (active: it sent a modified model)" if threat == "active" else "honest-but-curious (passive)"
    lines += [
        "",
        (
            f"Threat model: a {server} server. Images leaked ({judged.rule}): {judged.leaked} of {judged.batch_size} "
            f"({judged.leak_fraction:.0%}); verdict of this attack alone: {judged.verdict} "
            f"({'; '.join(judged.verdict_reasons)}). A blank guess scores PSNR "
            f"{judged.baseline('blank').means['psnr']:.2f} dB."
        ),
        "",
        bound.describe() if bound is not None else "ReRo bound: not computed.",
    ]
    for r in results:
        lines += [
            "",
            f"## client {r.record.client_id}, round {r.record.round}{_images_note(r.record)} ({r.seconds:.1f} s)",
            "",
            r.report.to_markdown(),
        ]
    return lines


def formal_bound(config: Any, results: list[AttackResult], rule: LeakRule | None = None) -> FormalBound:
    """The ReRo bound of the configured defenses at the kappa of the leak rule on the attacked images:
    one clipped Gaussian mechanism (DPSGD, GaussianNoise with clip) has one; anything else says why not.
    Tap files name their defenses but do not carry the objects: no bound is derived from them."""
    if config.tap_files:
        return FormalBound(None, "tap files name their defenses, not the mechanism objects a bound needs")
    # every client of tap_fedsgd_round takes part in every round: rounds 0 .. round are composed
    bound = setting_bound(DefenseSetting("configured", list(config.defenses)), config.model, round=config.round)
    if bound.mechanism is None:
        return bound
    originals = torch.cat([r.pixels()[0] for r in results])
    labels = torch.cat([r.record.targets.reshape(-1) for r in results if r.record.targets is not None])
    pixel_mean = _pixel_mean(results)
    kappa = prior_only_kappa(
        originals,
        reference_pixels(config.data),
        labels=labels,
        rule=calibrated_rule(config.data) if rule is None else rule,
        dataset_mean=pixel_mean,
        # the trivial guesses write_outputs' verdict is judged against
        baselines=trivial_baselines(originals, dataset_mean=pixel_mean),
    )
    return bound.at(kappa)


def _bound_json(bound: FormalBound | None) -> dict[str, Any]:
    if bound is None:
        return {"eta": None, "reason": "not computed"}
    if bound.mechanism is None:
        return {"eta": None, "reason": f"no formal bound ({bound.reason})"}
    return {"eta": bound.eta, "kappa": bound.kappa, "mechanism": bound.mechanism.description}


def recorded_defenses(results: list[AttackResult]) -> list[str]:
    """The defenses the tapped clients ran, as their records say (``meta["defenses"]``), in order,
    each once: what a report on tap files must name, whatever the config's ``defenses`` say."""
    names: list[str] = []
    for result in results:
        for entry in result.record.meta.get("defenses", []):
            name = entry["name"] if isinstance(entry, dict) else str(entry)
            config = entry.get("config", {}) if isinstance(entry, dict) else {}
            described = f"{name}({', '.join(f'{k}={v!r}' for k, v in config.items())})"
            if described not in names:
                names.append(described)
    return names


def _images_note(record: TappedGradient) -> str:
    indices = record.meta.get("dataset_indices")
    return f", training images {list(indices)}" if indices is not None else ""


#: what ``lightning-gp attack --help`` shows as examples
EXAMPLES = (
    "lightning-gp attack --config configs/attack_inverting_gradients.yaml",
    "lightning-gp attack --config configs/attack_rgap.yaml --indices '[[3]]' --output_dir out",
    "lightning-gp attack --config configs/attack_inverting_gradients.yaml --tap_files '[taps/round0_client0.pt]'",
)


def help_text() -> str:
    """What ``lightning-gp attack --help`` prints (stored in :mod:`lightning_gp.cli.help_texts`)."""
    return short_help(
        build_parser(),
        usage="lightning-gp attack --config CONFIG [options]",
        examples=EXAMPLES,
        full_flag="lightning-gp attack --help-full",
    )


def main(argv: list[str] | None = None) -> list[AttackResult]:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(help_text())
        return []
    parser = build_parser()
    if "--help-full" in args:
        argv = ["--help" if a == "--help-full" else a for a in args]
    parsed = parser.parse_args(argv)
    # seeded before anything is built: the model's initial weights come from the generator too
    L.seed_everything(parsed.seed, verbose=False)
    with data_built_first(parsed, lambda spec: instantiate(parser, Namespace(data=spec)).data) as note:
        if note:
            print(note)
        config = instantiate(parser, parsed)
    rule = calibrated_rule(config.data)
    results = run(config, rule)
    threat = "active" if callable(getattr(config.attack, "modify_model", None)) else "passive"
    defenses = recorded_defenses(results) if config.tap_files else [repr(d) for d in config.defenses]
    bound = formal_bound(config, results, rule)
    report = write_outputs(
        results, Path(config.output_dir), type(config.attack).__name__, defenses, threat, bound, rule
    )
    print(report.read_text())
    print(f"written to {report.parent}/ (report.md, report.json, reconstructions.png)")
    return results


def _pixel_mean(results: list[AttackResult]) -> tuple[float, ...] | None:
    """The per-channel mean the server knows (the inputs' normalisation), when it is a pixel mean."""
    mean = results[0].view.mean
    return tuple(mean) if all(0.0 <= v <= 1.0 for v in mean) else None
