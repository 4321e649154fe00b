"""Refiner against published and adaptive attacks, what it costs in accuracy and time (issue 10, item 7).

LeNetZhu (DLG's sigmoid LeNet at DLG's uniform init) on Fashion-MNIST (the built-in sample; the
full set with ``--full``), FedSGD with 10 clients through ``FederatedSimulation(RefinerModule(...))``;
``GradientTap`` records what each client shares. Refiner at the paper's defaults (alpha 0.5,
beta 1, I = 10, tau 0.95, eps 0.1, global projection) with the shipped evaluation network.

1. Privacy (``refiner_privacy``, per image in ``refiner_privacy_images``): round 0, clients
   holding 1 image (``--images`` clients) and 4 images (``--batch4-clients`` clients). Each
   client's batch is attacked on (i) its raw gradient at the same weights (what it would have
   shared undefended) and (ii) Refiner's upload as tapped: iDLG (batch 1), Inverting Gradients,
   the adaptive :class:`~lightning_gp.attacks.RefinerAwareInversion` (each strategy scored:
   "ball" and "ball_lbfgs" match the eps-ball around the upload with IG's Adam or DLG's L-BFGS,
   "unblend" undoes the noise blend of an IG reconstruction; and the strategy the attacker picks
   without the truth; on the raw gradient the attacker knows eps = 0), and GradInversion on a BatchNorm LeNetZhu
   (defined here; attacked at round ``--bn-round`` so its BatchNorm statistics have seen data).
   The Inverting Gradients row IS the adaptive attack's ``invert`` candidate: same seed, same
   settings, identical images (tests/test_refiner_attack.py checks it), which saves one run.
   Per image the worst case over every attack (max PSNR/SSIM, min LPIPS/noise ratio) and the
   fraction of images that leak (PSNR > 15 or SSIM > 0.5 or LPIPS < 0.05 or noise ratio < 0.4,
   the paper's thresholds; also without the noise ratio), next to two trivial reconstructions
   scored the same way: a blank (black) image and the mean image of the public test split.
2. Utility (``refiner_utility``): PMM = defended / undefended test accuracy after the same
   ``--rounds`` FedSGD rounds (10 clients x ``--utility-batch`` images, server Adam 1e-3 via
   ``ImageClassifier``, same seed).
3. Sweeps (``refiner_sweeps``): alpha in {0, .1, .3, .5, .7, .9} at eps 0.1 and eps in
   {0.01, 0.03, 0.1, 0.3} at alpha 0.5; IG and the adaptive attack on ``--sweep-images``
   one-image clients, the noise ratio, PMM. Ablation in the same table: the upload
   ``g + eps r / ||r||`` (``r`` Gaussian, "random direction") at the same eps values, attacked and
   trained the same way: does robust data matter beyond the projection?
4. Cost (``refiner_cost``): one client step at batch 8 and 128 as a ratio to an undefended
   LeNetZhu step (forward + backward) measured in the same run (median of ``--repeats``), cold
   (I = 10) and warm (I = 5), with the breakdown per iteration (UM gradient: the double backward;
   the evaluation network's forward/backward; the projection) and ``||g||`` next to eps.

Writes benchmarks/results/refiner_{privacy,privacy_images,uploads,utility,sweeps,cost}.{csv,md} and
refiner_tradeoff.png (PSNR vs PMM for both sweeps, with the 15 dB line). Nothing here is tuned to
the sample: the same settings run on any dataset.
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, median_seconds, write_results
from torch import Tensor, nn

from lightning_gp.attacks import (
    IDLG,
    GradInversion,
    Reconstruction,
    RefinerAwareInversion,
    ServerView,
    parameter_gradients,
)
from lightning_gp.audit import quiet_lightning, tap_fedsgd_round
from lightning_gp.federated import FederatedSimulation
from lightning_gp.metrics import LPIPS, reconstruction_report
from lightning_gp.models import ImageClassifier, LeNetZhu
from lightning_gp.normalization import normalize
from lightning_gp.refiner import RefinerConfig, RefinerModule, project_upload, refine, utility_measure, utility_weights
from lightning_gp.refiner.evaluator import load_evaluator, shipped_checkpoint
from lightning_gp.refiner.robust_data import parameter_gradients as model_gradients
from lightning_gp.seeding import seeded_generator

CE = nn.CrossEntropyLoss()
NUM_CLIENTS = 10
ALPHAS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)
EPSILONS = (0.01, 0.03, 0.1, 0.3)
DEFAULT_ALPHA, DEFAULT_EPS = 0.5, 0.1
THRESHOLDS = {"psnr": 15.0, "ssim": 0.5, "lpips": 0.05, "noise_ratio": 0.4}
PAPER = "paper (LeNet, CIFAR-10, IG, eps 0.1): PSNR 13.20 at PMM 90.69; alpha sweep 21.2/16.5/15.0/13.2/12.5/10.5"


# ---------------------------------------------------------------------------------------- models
class LeNetZhuBN(nn.Module):
    """LeNetZhu with a BatchNorm after each convolution (GradInversion's prior needs BatchNorm
    statistics; no model of lightning_gp.models this small has them). DLG's uniform init."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for c_in, stride in ((1, 2), (12, 2), (12, 1)):
            layers += [nn.Conv2d(c_in, 12, 5, stride=stride, padding=2), nn.BatchNorm2d(12), nn.Sigmoid()]
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(12 * 7 * 7, 10)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Conv2d, nn.Linear)):
                    module.weight.uniform_(-0.5, 0.5)
                    module.bias.uniform_(-0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.body(x), 1))


@dataclass(frozen=True)
class Setting:
    """What the client does: Refiner (``direction="refiner"``) or the ablation's random direction."""

    alpha: float = DEFAULT_ALPHA
    eps: float = DEFAULT_EPS
    direction: str = "refiner"

    @property
    def label(self) -> str:
        name = "Refiner" if self.direction == "refiner" else "random direction"
        return (
            f"{name} (alpha {self.alpha:g}, eps {self.eps:g})"
            if self.direction == "refiner"
            else f"{name} (eps {self.eps:g})"
        )


class RecordingRefiner(RefinerModule):
    """RefinerModule that also keeps ``||g* - g||`` of each client step for the tables (upload unchanged)."""

    def client_gradient(
        self, inputs: Tensor, targets: Tensor, *, client_id: int, round: int, sample_ids: Tensor | None = None
    ) -> tuple[dict[str, Tensor], Tensor]:
        upload, loss = super().client_gradient(inputs, targets, client_id=client_id, round=round, sample_ids=sample_ids)
        if "distances" not in self.__dict__:
            self.__dict__["distances"] = {}
        assert self.last_refined is not None
        self.__dict__["distances"][(client_id, round)] = self.last_refined.distance
        return upload, loss


class RandomDirectionUpload(RefinerModule):
    """The ablation: upload ``g + eps r / ||r||``, ``r ~ N(0, I)`` (seeded per client and round): the
    projection's displacement without robust data."""

    def client_gradient(
        self, inputs: Tensor, targets: Tensor, *, client_id: int, round: int, sample_ids: Tensor | None = None
    ) -> tuple[dict[str, Tensor], Tensor]:
        with torch.enable_grad():
            raw, loss = model_gradients(self.module, self.loss_fn, inputs, targets, self.shared_parameters(), False)
        generator = seeded_generator(self.seed, client_id, round, 7)
        r = {n: torch.randn(g.shape, generator=generator).to(g) for n, g in raw.items()}
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in r.values()))
        return {n: raw[n].detach() + self.config.eps * r[n] / norm for n in raw}, loss.detach()


def client_module(net: nn.Module, setting: Setting, evaluator: nn.Module, seed: int) -> RefinerModule:
    cls = RandomDirectionUpload if setting.direction == "random" else RecordingRefiner
    return cls(net, loss_fn=CE, evaluator=evaluator, alpha=setting.alpha, eps=setting.eps, seed=seed)


# ---------------------------------------------------------------------------------------- taps
@dataclass
class ClientRound:
    """One attacked client's round: its batch, the model that round, its raw gradient and its upload."""

    client: int
    inputs: Tensor
    targets: Tensor
    net: nn.Module
    raw: dict[str, Tensor]
    upload: dict[str, Tensor]
    refined_distance: float | None

    @property
    def batch(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def g_norm(self) -> float:
        return math.sqrt(sum(float(g.double().pow(2).sum()) for g in self.raw.values()))

    @property
    def upload_distance(self) -> float:
        return math.sqrt(sum(float((self.upload[n] - self.raw[n]).double().pow(2).sum()) for n in self.raw))


def strip(named: dict[str, Tensor], prefix: str = "module.") -> dict[str, Tensor]:
    return {n[len(prefix) :] if n.startswith(prefix) else n: t for n, t in named.items()}


def tap_rounds(
    datamodule: Any,
    make_net: Callable[[], nn.Module],
    setting: Setting,
    evaluator: nn.Module,
    *,
    clients: Sequence[int],
    batch: int,
    round: int,
    seed: int,
) -> list[ClientRound]:
    """Run FedSGD with every client refining (or the ablation) through ``round``; tap ``clients``,
    each holding the first ``batch`` images of its own partition in that round."""
    torch.manual_seed(seed)
    module = client_module(make_net(), setting, evaluator, seed)
    records, _, _ = tap_fedsgd_round(
        module,
        datamodule,
        clients=list(clients),
        positions=[list(range(batch))] * len(clients),
        local_batch_size=batch,
        num_clients=NUM_CLIENTS,
        round=round,
        seed=seed,
    )
    distances = module.__dict__.get("distances", {})
    out = []
    for record in records:
        net = make_net()
        net.load_state_dict(strip(record.model_state))
        assert record.inputs is not None and record.targets is not None
        raw = parameter_gradients(net, CE, record.inputs, record.targets, create_graph=False)
        out.append(
            ClientRound(
                client=record.client_id,
                inputs=record.inputs,
                targets=record.targets,
                net=net,
                raw={n: g.detach() for n, g in raw.items()},
                upload=strip(record.gradients),
                refined_distance=distances.get((record.client_id, round)),
            )
        )
    return out


# ---------------------------------------------------------------------------------------- scoring
class Scorer:
    """Scores reconstructions per image against the client's batch (PSNR, SSIM, LPIPS, noise ratio, labels)."""

    def __init__(self, datamodule: Any, dataset: str) -> None:
        self.datamodule, self.dataset = datamodule, dataset
        self.mean, self.std = tuple(datamodule.mean), tuple(datamodule.std)
        self.lpips = LPIPS()
        datamodule.setup("test")
        public = torch.stack([datamodule.test_dataset[i][0] for i in range(min(1000, len(datamodule.test_dataset)))])
        self.mean_image = public.mean(0, keepdim=True)  # normalised; public data, never the client's

    def view(self, cr: ClientRound, gradients: dict[str, Tensor]) -> ServerView:
        return ServerView(
            model=copy.deepcopy(cr.net),
            gradients=gradients,
            batch_size=cr.batch,
            input_shape=tuple(cr.inputs.shape[1:]),
            num_classes=10,
            mean=self.mean,
            std=self.std,
        )

    def rows(
        self, cr: ClientRound, reconstruction: Reconstruction, *, model: str, defense: str, attack: str, **extra: Any
    ) -> list[dict]:
        report = reconstruction_report(
            reconstruction, cr.inputs, (self.mean, self.std), true_labels=cr.targets, lpips_fn=self.lpips
        )
        ratios: list[float | None] = [r.noise_ratio for r in report.rows]
        if any(r is None for r in ratios):  # a report without the noise-ratio column: score it here
            from lightning_gp.metrics.noise_ratio import noise_ratio

            assert report.reconstructed_pixels is not None
            ratios = [float(v) for v in noise_ratio(report.reconstructed_pixels)]
        return [
            {
                "dataset": self.dataset,
                "model": model,
                "batch": cr.batch,
                "client": cr.client,
                "image": r.index,
                "defense": defense,
                "attack": attack,
                "psnr": r.psnr,
                "ssim": r.ssim,
                "lpips": r.lpips if r.lpips is not None else math.nan,
                "noise_ratio": float(ratio) if ratio is not None else math.nan,
                "label_acc": report.label_accuracy if report.label_accuracy is not None else math.nan,
                "strategy": "",
                **extra,
            }
            for r, ratio in zip(report.rows, ratios)
        ]

    def baselines(self, cr: ClientRound, model: str) -> list[dict]:
        blank = normalize(torch.zeros_like(cr.inputs), self.mean, self.std)
        mean = self.mean_image.expand_as(cr.inputs).clone()
        rows = []
        for name, images in (("baseline: blank image", blank), ("baseline: mean image", mean)):
            rows += self.rows(
                cr, Reconstruction(images=images, labels=None, attack=name), model=model, defense="-", attack=name
            )
        return rows


def leaks(row: dict, with_noise_ratio: bool = True) -> bool:
    """The paper's thresholds (Sec. 5.3, App. N): any metric on the leaking side."""
    similar = row["psnr"] > THRESHOLDS["psnr"] or row["ssim"] > THRESHOLDS["ssim"] or row["lpips"] < THRESHOLDS["lpips"]
    return similar or (with_noise_ratio and row["noise_ratio"] < THRESHOLDS["noise_ratio"])


def worst_case(
    rows: list[dict], group_keys: Sequence[str] = ("dataset", "batch", "client", "image", "defense")
) -> list[dict]:
    """Per image, the least private value of each metric over every attack (not the baselines)."""
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if not row["attack"].startswith("baseline"):
            grouped[tuple(row[k] for k in group_keys)].append(row)
    out = []
    for key, items in grouped.items():
        out.append(
            {
                **dict(zip(group_keys, key)),
                "model": "any",
                "attack": "WORST CASE (per image, over attacks)",
                "psnr": max(r["psnr"] for r in items),
                "ssim": max(r["ssim"] for r in items),
                "lpips": min(r["lpips"] for r in items),
                "noise_ratio": min(r["noise_ratio"] for r in items),
                "label_acc": max(r["label_acc"] for r in items),
            }
        )
    return out


def summarise(rows: list[dict], keys: Sequence[str]) -> list[dict]:
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        grouped[tuple(row[k] for k in keys)].append(row)
    out = []
    for key, items in grouped.items():
        finite_psnr = [min(r["psnr"], 150.0) for r in items]  # an exact copy has PSNR inf: cap for the mean
        labels = [r["label_acc"] for r in items if not math.isnan(r["label_acc"])]
        out.append(
            {
                **dict(zip(keys, key)),
                "images": len(items),
                "psnr_mean": statistics.fmean(finite_psnr),
                "psnr_max": max(finite_psnr),
                "ssim_mean": statistics.fmean(r["ssim"] for r in items),
                "lpips_mean": statistics.fmean(r["lpips"] for r in items),
                "noise_ratio_mean": statistics.fmean(r["noise_ratio"] for r in items),
                "label_acc": statistics.fmean(labels) if labels else math.nan,
                "leak_frac": sum(leaks(r) for r in items) / len(items),
                "leak_frac_no_nr": sum(leaks(r, False) for r in items) / len(items),
            }
        )
    return out


# ---------------------------------------------------------------------------------------- privacy
def adaptive_attack(setting: Setting | None, args: argparse.Namespace) -> RefinerAwareInversion:
    """The adaptive attacker for ``setting`` (``None``: it knows the gradient is undefended: eps 0, no blend)."""
    budget = {"iterations": args.ig_iterations, "lbfgs_iterations": args.dlg_iterations, "seed": args.seed}
    if setting is None:
        return RefinerAwareInversion(eps=0.0, alpha=0.0, strategies=("ball", "ball_lbfgs", "invert"), **budget)
    return RefinerAwareInversion(eps=setting.eps, alpha=setting.alpha, **budget)


def adaptive_rows(
    scorer: Scorer, cr: ClientRound, view: ServerView, attack: RefinerAwareInversion, **common: Any
) -> list[dict]:
    """IG (the ``invert`` candidate), every other strategy, and the attacker's own pick."""
    result = attack.reconstruct(view)
    rows = []
    for strategy, images in result.meta["candidates"].items():
        name = "Inverting Gradients" if strategy == "invert" else f"adaptive: {strategy}"
        rows += scorer.rows(cr, Reconstruction(images=images, labels=result.labels, attack=name), attack=name, **common)
    rows += scorer.rows(cr, result, attack="adaptive (attacker's pick)", strategy=result.meta["selected"], **common)
    return rows


def privacy(
    datamodule: Any, dataset: str, args: argparse.Namespace, evaluator: nn.Module
) -> tuple[list[dict], list[dict]]:
    scorer = Scorer(datamodule, dataset)
    setting = Setting()
    rows: list[dict] = []
    uploads: list[dict] = []
    groups = ((1, list(range(args.images))), (4, list(range(args.images, args.images + args.batch4_clients))))
    for batch, clients in groups:
        if not clients:
            continue
        for model_name, make_net, round_ in (("LeNetZhu", LeNetZhu, 0), ("LeNetZhu-BN", LeNetZhuBN, args.bn_round)):
            start = time.perf_counter()
            taps = tap_rounds(
                datamodule, make_net, setting, evaluator, clients=clients, batch=batch, round=round_, seed=args.seed
            )
            for cr in taps:
                uploads.append(
                    {
                        "dataset": dataset,
                        "model": model_name,
                        "round": round_,
                        "batch": batch,
                        "client": cr.client,
                        "g_norm": cr.g_norm,
                        "eps": setting.eps,
                        "eps_over_g": setting.eps / cr.g_norm,
                        "robust_distance": cr.refined_distance if cr.refined_distance is not None else math.nan,
                        "upload_distance": cr.upload_distance,
                        "projected": cr.upload_distance >= setting.eps * (1 - 1e-4),
                    }
                )
                if model_name == "LeNetZhu":
                    rows += scorer.baselines(cr, model_name)
                for defense, gradients, known in (("undefended", cr.raw, None), ("Refiner", cr.upload, setting)):
                    view = scorer.view(cr, gradients)
                    common = {"model": model_name, "defense": defense}
                    if model_name == "LeNetZhu-BN":
                        attack = GradInversion(iterations=args.ig_iterations, seed=args.seed)
                        rows += scorer.rows(cr, attack.reconstruct(view), attack="GradInversion", **common)
                        continue
                    if batch == 1:
                        rows += scorer.rows(
                            cr,
                            IDLG(iterations=args.dlg_iterations, seed=args.seed).reconstruct(view),
                            attack="iDLG",
                            **common,
                        )
                    rows += adaptive_rows(scorer, cr, view, adaptive_attack(known, args), **common)
            done = [r for r in rows if r["batch"] == batch and r["model"] == model_name and r["dataset"] == dataset]
            print(
                f"privacy {dataset} {model_name} batch {batch}: {len(taps)} clients, {len(done)} image scores "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return rows, uploads


# ---------------------------------------------------------------------------------------- utility
def train_accuracy(datamodule: Any, setting: Setting | None, evaluator: nn.Module, args: argparse.Namespace) -> float:
    """Test accuracy after ``args.rounds`` FedSGD rounds (server Adam 1e-3), undefended when ``setting`` is None."""
    torch.manual_seed(args.seed)
    classifier = ImageClassifier(LeNetZhu(), lr=1e-3, optimizer="adam")
    module: nn.Module = classifier if setting is None else client_module(classifier, setting, evaluator, args.seed)
    simulation = FederatedSimulation(
        module,
        datamodule=datamodule,
        num_clients=NUM_CLIENTS,
        clients_per_round=NUM_CLIENTS,
        local_batch_size=args.utility_batch,
        seed=args.seed,
    )
    L.seed_everything(args.seed, verbose=False)
    with quiet_lightning():
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=args.rounds,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(simulation)
        return float(trainer.test(simulation, verbose=False)[0]["test_acc"])


def utility(
    datamodule: Any, dataset: str, settings: Sequence[Setting], evaluator: nn.Module, args: argparse.Namespace
) -> dict[Any, float]:
    accuracies: dict[Any, float] = {}
    for setting in (None, *settings):
        start = time.perf_counter()
        accuracies[setting] = train_accuracy(datamodule, setting, evaluator, args)
        label = "undefended" if setting is None else setting.label
        print(
            f"utility {dataset} {label}: test acc {accuracies[setting]:.4f} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    return accuracies


# ---------------------------------------------------------------------------------------- sweeps
def sweep_settings(alphas: Sequence[float], epsilons: Sequence[float]) -> list[tuple[str, Setting]]:
    out = [("alpha", Setting(alpha=a, eps=DEFAULT_EPS)) for a in alphas]
    out += [("eps", Setting(alpha=DEFAULT_ALPHA, eps=e)) for e in epsilons]
    out += [("random direction", Setting(alpha=DEFAULT_ALPHA, eps=e, direction="random")) for e in epsilons]
    return out


def sweeps(
    datamodule: Any, dataset: str, args: argparse.Namespace, evaluator: nn.Module, accuracies: dict[Any, float]
) -> tuple[list[dict], list[dict]]:
    scorer = Scorer(datamodule, dataset)
    cache: dict[Setting, list[dict]] = {}
    table, per_image = [], []
    base_acc = accuracies[None]
    for sweep, setting in sweep_settings(args.alphas, args.epsilons):
        start = time.perf_counter()
        if setting not in cache:
            taps = tap_rounds(
                datamodule,
                LeNetZhu,
                setting,
                evaluator,
                clients=range(args.sweep_images),
                batch=1,
                round=0,
                seed=args.seed,
            )
            rows = []
            for cr in taps:
                info = {
                    "g_norm": cr.g_norm,
                    "robust_distance": cr.refined_distance if cr.refined_distance is not None else math.nan,
                    "upload_distance": cr.upload_distance,
                }
                attack = adaptive_attack(setting, args)
                for row in adaptive_rows(
                    scorer, cr, scorer.view(cr, cr.upload), attack, model="LeNetZhu", defense=setting.label
                ):
                    rows.append({**row, **info})
            cache[setting] = rows
        rows = cache[setting]
        per_image += [{**r, "sweep": sweep} for r in rows]
        ig = [r for r in rows if r["attack"] == "Inverting Gradients"]
        pick = [r for r in rows if r["attack"] == "adaptive (attacker's pick)"]
        worst = worst_case(rows)
        acc = accuracies.get(setting, math.nan)
        table.append(
            {
                "sweep": sweep,
                "upload": "Refiner" if setting.direction == "refiner" else "random direction",
                "alpha": setting.alpha if setting.direction == "refiner" else math.nan,
                "eps": setting.eps,
                "images": len(ig),
                "g_norm": statistics.fmean(r["g_norm"] for r in ig),
                "eps_over_g": statistics.fmean(setting.eps / r["g_norm"] for r in ig),
                "robust_distance": statistics.fmean(r["robust_distance"] for r in ig),
                "ig_psnr": statistics.fmean(r["psnr"] for r in ig),
                "ig_noise_ratio": statistics.fmean(r["noise_ratio"] for r in ig),
                "adaptive_pick_psnr": statistics.fmean(r["psnr"] for r in pick),
                "adaptive_picks": "/".join(sorted({r["strategy"] for r in pick})),
                "worst_psnr": statistics.fmean(r["psnr"] for r in worst),
                "worst_ssim": statistics.fmean(r["ssim"] for r in worst),
                "worst_noise_ratio": statistics.fmean(r["noise_ratio"] for r in worst),
                "worst_leak_frac": sum(leaks(r) for r in worst) / len(worst),
                "worst_leak_frac_no_nr": sum(leaks(r, False) for r in worst) / len(worst),
                "test_acc": acc,
                "pmm": acc / base_acc if base_acc > 0 else math.nan,
            }
        )
        r = table[-1]
        print(
            f"sweep {sweep} {setting.label}: eps/||g|| {r['eps_over_g']:.4f}, IG PSNR {r['ig_psnr']:.2f}, adaptive "
            f"{r['adaptive_pick_psnr']:.2f}, worst {r['worst_psnr']:.2f}, PMM {r['pmm']:.3f} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    return table, per_image


# ---------------------------------------------------------------------------------------- cost
def cost(
    datamodule: Any, evaluator: nn.Module, repeats: int, seed: int, clock: Callable[[], float] = time.perf_counter
) -> list[dict]:
    """One client step of Refiner, cold and warm, and its parts, over an undefended LeNetZhu step at batch
    8 and 128, each the median of ``repeats`` on ``clock``."""
    datamodule.setup("fit")
    mean, std = tuple(datamodule.mean), tuple(datamodule.std)
    rows = []
    for batch in (8, 128):
        x = torch.stack([datamodule.train_dataset[i][0] for i in range(batch)])
        y = torch.tensor([int(datamodule.train_dataset[i][1]) for i in range(batch)])
        torch.manual_seed(seed)
        model = LeNetZhu()
        params = dict(model.named_parameters())

        def step() -> None:
            model.zero_grad()
            CE(model(x), y).backward()

        config = RefinerConfig()
        cold = refine(model, CE, x, y, evaluator=evaluator, mean=mean, std=std, config=config)
        start = cold.pixels

        def refine_cold() -> None:
            refine(
                model,
                CE,
                x,
                y,
                evaluator=evaluator,
                mean=mean,
                std=std,
                config=config,
                generator=torch.Generator().manual_seed(0),
            )

        def refine_warm() -> None:
            refine(model, CE, x, y, evaluator=evaluator, mean=mean, std=std, config=config, start=start, warm=True)

        raw, _ = model_gradients(model, CE, x, y, params, create_graph=False)
        raw = {n: g.detach() for n, g in raw.items()}
        weights = utility_weights(raw, params, config.tau)
        pixels = start.clone().requires_grad_(True)

        def um_gradient() -> None:
            robust, _ = model_gradients(model, CE, normalize(pixels, mean, std), y, params, create_graph=True)
            torch.autograd.grad(utility_measure(robust, raw, weights, config.utility), [pixels])

        def evaluator_pass() -> None:
            torch.autograd.grad(evaluator(pixels).mean(), [pixels])

        robust_grads = {
            n: g.detach()
            for n, g in model_gradients(model, CE, normalize(start, mean, std), y, params, False)[0].items()
        }

        def projection() -> None:
            project_upload(robust_grads, raw, config.eps)

        times = {
            name: median_seconds(fn, repeats, clock=clock)
            for name, fn in (
                ("step", step),
                ("cold", refine_cold),
                ("warm", refine_warm),
                ("um", um_gradient),
                ("evaluator", evaluator_pass),
                ("projection", projection),
            )
        }
        g_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in raw.values()))
        s = times["step"]
        # the algorithm's floor: I iterations of (UM gradient + D forward/backward), plus the raw and final gradients
        floor = config.iterations * (times["um"] + times["evaluator"]) + 2 * s + times["projection"]
        rows.append(
            {
                "batch": batch,
                "step_ms": 1e3 * s,
                "cold_ms": 1e3 * times["cold"],
                "cold_ratio": times["cold"] / s,
                "warm_ms": 1e3 * times["warm"],
                "warm_ratio": times["warm"] / s,
                "um_grad_ratio": times["um"] / s,
                "evaluator_ratio": times["evaluator"] / s,
                "projection_ratio": times["projection"] / s,
                "um_x10_ratio": config.iterations * times["um"] / s,
                "evaluator_x10_ratio": config.iterations * times["evaluator"] / s,
                "floor_cold_ratio": floor / s,
                "overhead_ratio": (times["cold"] - floor) / s,
                "g_norm": g_norm,
                "eps": config.eps,
                "eps_over_g": config.eps / g_norm,
            }
        )
        print(
            f"cost batch {batch}: step {1e3 * s:.2f} ms, cold {times['cold'] / s:.1f}x, warm {times['warm'] / s:.1f}x "
            f"(UM grad {times['um'] / s:.2f}x, D {times['evaluator'] / s:.2f}x, projection {times['projection'] / s:.3f}x per "
            f"iteration); ||g|| {g_norm:.3f}",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------------------------------- plot
def plot(table: list[dict], output_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, sweep, key in ((axes[0], "alpha", "alpha"), (axes[1], "eps", "eps")):
        pts = [r for r in table if r["sweep"] == sweep]
        for column, label, marker in (
            ("ig_psnr", "Inverting Gradients", "o"),
            ("adaptive_pick_psnr", "adaptive (attacker's pick)", "s"),
            ("worst_psnr", "worst case per image", "^"),
        ):
            ax.plot([p["pmm"] for p in pts], [p[column] for p in pts], marker=marker, ls="none", label=label)
            if column == "worst_psnr":
                for p in pts:
                    ax.annotate(
                        f"{key} {p[key]:g}",
                        (p["pmm"], p[column]),
                        fontsize=7,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
        if sweep == "eps":
            rand = [r for r in table if r["sweep"] == "random direction"]
            ax.plot(
                [p["pmm"] for p in rand],
                [p["worst_psnr"] for p in rand],
                marker="x",
                ls="none",
                label="random direction, worst case",
            )
        ax.axhline(THRESHOLDS["psnr"], color="red", ls=":", label="15 dB (paper's threshold)")
        ax.set(
            xlabel="PMM (defended / undefended test accuracy)",
            ylabel="PSNR (dB, lower = more private)",
            title=f"{sweep} sweep",
        )
        ax.legend(fontsize=7)
    fig.suptitle("Refiner on LeNetZhu / Fashion-MNIST sample, 1 image per client, round 0")
    fig.tight_layout()
    fig.savefig(output_dir / "refiner_tradeoff.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- main
def _fill_unset(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def configure(args: argparse.Namespace) -> None:
    if args.tiny:
        args.quick = True
    if args.quick:
        defaults = {
            "images": 2,
            "batch4_clients": 1,
            "ig_iterations": 300,
            "dlg_iterations": 20,
            "rounds": 20,
            "sweep_images": 1,
            "repeats": 3,
            "bn_round": 2,
        }
        _fill_unset(args, defaults)
        args.alphas = args.alphas or [0.0, 0.5, 0.9]
        args.epsilons = args.epsilons or [0.01, 0.1]
    if args.tiny:
        args.images, args.batch4_clients, args.ig_iterations, args.dlg_iterations = 1, 1, 10, 2
        args.rounds, args.sweep_images, args.repeats, args.bn_round = 2, 1, 1, 1
        args.alphas, args.epsilons = [0.5], [0.1]
    full_defaults = {
        "images": 6,
        "batch4_clients": 2,
        "ig_iterations": 2000,
        "dlg_iterations": 100,
        "rounds": 100,
        "sweep_images": 3,
        "repeats": 10,
        "bn_round": 10,
    }
    _fill_unset(args, full_defaults)
    args.alphas = args.alphas or list(ALPHAS)
    args.epsilons = args.epsilons or list(EPSILONS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="thinned sweeps and small budgets (a few minutes)")
    parser.add_argument("--tiny", action="store_true", help="smoke test: every part at a toy budget (seconds)")
    parser.add_argument(
        "--full", action="store_true", help="privacy and PMM on the full Fashion-MNIST too, when installed"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["privacy", "utility", "sweeps", "cost"],
        choices=["privacy", "utility", "sweeps", "cost", "plot"],
        help="plot: redraw refiner_tradeoff.png from the refiner_sweeps.csv of an earlier run",
    )
    parser.add_argument("--images", type=int, help="one-image clients attacked in the privacy table (default 6)")
    parser.add_argument(
        "--batch4-clients", type=int, help="four-image clients attacked in the privacy table (default 2)"
    )
    parser.add_argument(
        "--ig-iterations", type=int, help="Adam steps of IG, the adaptive attack and GradInversion (default 2000)"
    )
    parser.add_argument("--dlg-iterations", type=int, help="L-BFGS steps of iDLG (default 100, 20 inner each)")
    parser.add_argument(
        "--bn-round", type=int, help="FedSGD round at which GradInversion attacks the BatchNorm model (default 10)"
    )
    parser.add_argument("--rounds", type=int, help="FedSGD rounds of every utility run (default 100)")
    parser.add_argument("--utility-batch", type=int, default=8, help="images per client per round in the utility runs")
    parser.add_argument("--sweep-images", type=int, help="one-image clients attacked per sweep setting (default 3)")
    parser.add_argument("--alphas", type=float, nargs="+", help=f"alpha sweep (default {ALPHAS})")
    parser.add_argument("--epsilons", type=float, nargs="+", help=f"eps sweep (default {EPSILONS})")
    parser.add_argument("--repeats", type=int, help="timing repeats (median; default 10)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: immune to other jobs on shared cores)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    configure(args)
    torch.set_num_threads(args.threads)
    output: Path = args.output_dir
    output.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {vars(args)}", flush=True)
    evaluator = load_evaluator(1)
    checkpoint = hashlib.sha256(shipped_checkpoint(1).read_bytes()).hexdigest()[:12]
    datasets = fashion_mnist_datasets(args.full)
    budget = (
        f"IG / adaptive / GradInversion {args.ig_iterations} Adam steps, iDLG {args.dlg_iterations} L-BFGS steps, seed {args.seed}; "
        f"Refiner defaults (alpha 0.5, beta 1, I = 10, tau 0.95, eps 0.1, global projection), shipped evaluation network "
        f"(width {getattr(evaluator, 'width', '?')}, evaluator_1ch.pt sha256 {checkpoint}...); LPIPS-AlexNet; thresholds PSNR 15, SSIM 0.5, LPIPS 0.05, noise ratio 0.4"
    )

    if "cost" in args.parts:
        rows = cost(datasets["sample"], evaluator, args.repeats, args.seed)
        write_results(
            "refiner_cost",
            rows,
            "One client step of Refiner vs an undefended LeNetZhu step (forward + backward) on the same CPU in the same run, "
            f"{args.threads} thread(s), median of {args.repeats}; real Fashion-MNIST sample images. cold = I 10 from the noise "
            "blend, warm = I 5 from a cached x*. um_grad / evaluator / projection: one iteration's UM gradient (double "
            "backward), one evaluation-network forward+backward, one projection, each as a ratio to the step; floor_cold = "
            "10 x (UM + D) + 2 steps (raw and final gradients) + projection; overhead = cold - floor (refine's 11th "
            "double-backward graph, built only to record the final UM/PM, the optimiser, clamps and copies). Paper (A10 GPU, batch 128): 0.33 s cold / 0.14 s "
            "warm vs 0.019 s for pruning (~18x / ~7.6x). No GPU was available to this run.",
            output,
        )

    accuracies: dict[str, dict[Any, float]] = {}
    if "utility" in args.parts or "sweeps" in args.parts:
        settings = [s for _, s in sweep_settings(args.alphas, args.epsilons)]
        if "sweeps" not in args.parts:
            settings = [Setting()]
        for name, dm in datasets.items():
            utility_dm = type(dm)(batch_size=500)
            chosen = settings if name == "sample" else [Setting()]
            accuracies[name] = utility(utility_dm, name, list(dict.fromkeys(chosen)), evaluator, args)
        rows = [
            {
                "dataset": name,
                "defense": "undefended" if s is None else s.label,
                "rounds": args.rounds,
                "test_acc": acc,
                "pmm": acc / accs[None] if accs[None] > 0 else math.nan,
            }
            for name, accs in accuracies.items()
            for s, acc in accs.items()
        ]
        write_results(
            "refiner_utility",
            rows,
            f"FedSGD, LeNetZhu (DLG init), {NUM_CLIENTS} clients x {args.utility_batch} images every round, {args.rounds} rounds, "
            f"server Adam 1e-3, seed {args.seed}; test accuracy on each dataset's test split; PMM = defended / undefended. "
            "Paper: PMM 90.69 at eps 0.1 (LeNet, CIFAR-10, 8000 rounds, batch 128).",
            output,
        )

    if "privacy" in args.parts:
        rows, uploads = [], []
        for name, dm in datasets.items():
            r, u = privacy(dm, name, args, evaluator)
            rows += r
            uploads += u
        keys = ("dataset", "batch", "defense", "attack")
        summary = summarise(rows, keys)
        summary += summarise(worst_case(rows), keys)
        summary.sort(
            key=lambda r: (
                r["dataset"],
                r["batch"],
                r["defense"] != "-",
                r["defense"],
                r["attack"].startswith("WORST"),
                r["attack"],
            )
        )
        write_results(
            "refiner_privacy",
            summary,
            f"Round 0 of FedSGD ({NUM_CLIENTS} clients), LeNetZhu at DLG's init, {args.images} clients x 1 image and "
            f"{args.batch4_clients} clients x 4 images (the first images of each client's partition); GradInversion on "
            f"LeNetZhu-BN at round {args.bn_round}, same images. 'undefended' = the raw gradient at the same weights; "
            "'Refiner' = the tapped upload. Inverting Gradients = the adaptive attack's invert candidate (identical by "
            "construction). leak_frac: PSNR > 15 or SSIM > 0.5 or LPIPS < 0.05 or noise ratio < 0.4; leak_frac_no_nr: "
            f"without the noise ratio. psnr of exact copies capped at 150 for means. {budget}. {PAPER}.",
            output,
        )
        write_results("refiner_privacy_images", rows, f"Per image scores behind refiner_privacy. {budget}.", output)
        write_results(
            "refiner_uploads",
            uploads,
            "What each attacked client shared: ||g|| (raw gradient), eps and eps/||g||, ||g* - g|| before the projection "
            "(robust_distance), ||u - g|| after it (upload_distance; = eps when projected). The attacker on u sees the raw "
            "gradient up to a displacement of relative size eps/||g||.",
            output,
        )

    if "sweeps" in args.parts:
        table, per_image = sweeps(
            datasets["sample"], "sample", args, evaluator, accuracies.get("sample", {None: math.nan})
        )
        write_results(
            "refiner_sweeps",
            table,
            f"Fashion-MNIST sample, round 0, {args.sweep_images} clients x 1 image, LeNetZhu; IG and the adaptive attack "
            f"(each strategy; worst case per image over them) on the tapped upload; PMM after {args.rounds} FedSGD rounds "
            "(refiner_utility). random direction = upload g + eps r/||r|| (the ablation). robust_distance = ||g* - g||. "
            f"{budget}. {PAPER}.",
            output,
        )
        write_results("refiner_sweeps_images", per_image, f"Per image scores behind refiner_sweeps. {budget}.", output)
        plot(table, output)
    if "plot" in args.parts:
        with open(output / "refiner_sweeps.csv") as handle:
            table = [
                {k: v if k in ("sweep", "upload", "adaptive_picks") else float(v) for k, v in r.items()}
                for r in csv.DictReader(handle)
            ]
        plot(table, output)
    print(f"total wall time {time.perf_counter() - wall:.0f} s", flush=True)


if __name__ == "__main__":
    main()
