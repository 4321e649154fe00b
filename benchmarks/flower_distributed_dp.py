"""Distributed DP behind secure aggregation on Flower, end to end, with the clients' model checks (issue
49's Flower route): what the server sees, and what the audit's attacks and the active attacks get from it.

The deployment, on Flower's simulation engine (legacy ``ServerApp``/``NumPyClient``, the API Flower's
SecAgg+ runs on in flwr 1.41):

- each of ``--clients`` clients takes one FedSGD step of LeNetZhu on its ``--batch-size`` Fashion-MNIST
  training images (the audit's seeded draw) and replies with the global weights minus its gradient;
- ``ClientApp(mods=[secaggplus_mod, ModelChecksMod(public model), UpdateDefenseMod(DistributedGaussianMechanism(z,
  C, cohort_size=clients))])``: each update clipped to ``C`` with its noise share ``N(0, (z C)^2 / K)``,
  the received model's digest appended, everything masked by SecAgg+ (Bell et al., CCS 2020);
- the server runs ``SecAggPlusWorkflow`` and FedAvg: it is handed only the unmasked mean.

Five rounds, the server honest in the first and malicious after it:

1. honest: the tap keeps the aggregate (the server's whole view). It is checked against the audit's
   model of it (the mean of the clients' defended uploads, computed here with the same seeds), and the
   attacks ``audit_setting(aggregate=True)`` runs on an aggregate attack it: every passive published
   attack, the adaptive attacks with the mechanism's knowledge lifted to the mean, the learned inverter
   trained on the mean of simulated clients (``--attacks`` runs only the published ones named, and says
   so), judged by the audit's leak rule with the prior-only controls, with the advantage over the prior;
2. Robbing the Fed: the server sends every client its imprinted model;
3. LOKI: the server sends each client its own imprinted model;
4. model inconsistency without another architecture (as Fishing's per-client variant needs): one client
   gets a model nudged by ``1e-3``;
5. honest again: what the clients make of round 4's averaged digest.

Each client's refusal is written down by a recording mod, with its reason.

Run: ``python benchmarks/flower_distributed_dp.py [--clients 16] [--batch-size 1] [--noise-multiplier 2]
[--quick]``; writes ``benchmarks/results/<name>.md`` and ``.csv`` (``--name``, default
``flower_distributed_dp_b<B>``). Needs the Flower extra (``make flower-example`` installs it) and full
Fashion-MNIST (``apt-get install dataset-fashion-mnist``; ``--sample`` uses the built-in sample).
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from typing import Any

import numpy as np
import torch
from _common import markdown_table, setting_builder, write_results
from prior_bar import prior_counts
from torch import Tensor, nn

from lightning_gp.attacks import LOKI, RobbingTheFed, parameter_gradients
from lightning_gp.attacks.base import AttackNotApplicable
from lightning_gp.attacks.learned import InverterConfig
from lightning_gp.attacks.threat_models import threat_class_of
from lightning_gp.audit import AttackBudget, LeakRule, attack_record, datamodule_recognition_tests, published_attacks
from lightning_gp.audit.advantage import reconstruction_advantage
from lightning_gp.audit.learned import REFINE_ITERATIONS, learned_inversion_attacks, simulation_refusal
from lightning_gp.audit.prior_control import with_prior_only_control
from lightning_gp.audit.rounds import public_examples, training_examples
from lightning_gp.audit.setting_audit import reference_pixels
from lightning_gp.audit.verdict import worst_case_report
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule
from lightning_gp.defenses import DistributedGaussianMechanism
from lightning_gp.flower import RefusalLog
from lightning_gp.metrics import concatenate_reports
from lightning_gp.models import LeNetZhu
from lightning_gp.records import TappedGradient

ROUNDS = ("honest", "Robbing the Fed", "LOKI", "one client nudged", "honest")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="clients (Flower nodes), all in every round")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--noise-multiplier", type=float, default=2.0, help="z: central noise std over C")
    parser.add_argument("--max-update-norm", type=float, default=1.0, help="C")
    parser.add_argument("--attacks", nargs="*", default=None, help="published attack names (default: all passive)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", action="store_true", help="the built-in Fashion-MNIST sample")
    parser.add_argument("--quick", action="store_true", help="tiny attack budgets (a smoke run)")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    if args.clients < 3 or args.batch_size < 1:
        parser.error("--clients must be at least 3 (SecAgg+ needs 3 shares) and --batch-size at least 1")
    if args.noise_multiplier < 0 or args.max_update_norm <= 0:
        parser.error("--noise-multiplier must be >= 0 and --max-update-norm > 0")
    return args


def mechanism(args: argparse.Namespace) -> DistributedGaussianMechanism:
    return DistributedGaussianMechanism(
        args.noise_multiplier, args.max_update_norm, cohort_size=args.clients, seed=args.seed
    )


def client_gradients(state: dict[str, Tensor], images: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """One FedSGD gradient of LeNetZhu at ``state`` on one client's batch (mean cross-entropy)."""
    model = LeNetZhu()
    model.load_state_dict(state)
    return parameter_gradients(model, nn.CrossEntropyLoss(), images, labels, create_graph=False)


def run_flower(
    args: argparse.Namespace,
    public: nn.Module,
    batches: list[tuple[Tensor, Tensor]],
    public_images: Tensor,
    normalization: tuple[Any, Any],
    refusals: RefusalLog,
) -> tuple[dict[int, list[np.ndarray]], dict[int, list[np.ndarray]]]:
    """The five rounds on Flower's simulation engine: the arrays the strategy was handed per round and
    what it sent each round (``public_images``: the server's public data, the imprint's bins; ``normalization``:
    the data's mean and std; ``refusals``: the clients' :class:`~lightning_gp.flower.RefusalLog`)."""
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow
    from flwr.simulation import run_simulation

    from lightning_gp.flower import ModelChecksMod, UpdateDefenseMod, secaggplus_workflow

    names = list(public.state_dict())
    shape = tuple(batches[0][0].shape[1:])
    seen: dict[int, list[np.ndarray]] = {}
    sent: dict[int, list[np.ndarray]] = {}

    def imprinted(state: dict[str, Tensor]) -> list[np.ndarray]:
        return [t.detach().numpy() for t in state.values()]

    class MaliciousFedAvg(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            instructions = super().configure_fit(server_round, parameters, client_manager)
            arrays = parameters_to_ndarrays(parameters)
            sent[server_round] = arrays
            model = LeNetZhu()
            model.load_state_dict({n: torch.from_numpy(a).float() for n, a in zip(names, arrays)})
            plan = ROUNDS[server_round - 1]
            if plan == "Robbing the Fed":
                evil, _ = RobbingTheFed(num_bins=16).modify_model(
                    model, shape, *normalization, public_data=public_images
                )
                instructions = [(p, FitIns(ndarrays_to_parameters(imprinted(evil.state_dict())), i.config))
                                for p, i in instructions]  # fmt: skip
            elif plan == "LOKI":
                models = LOKI(num_bins=16).client_models(
                    model, len(instructions), shape, *normalization, public_data=public_images
                )
                instructions = [(p, FitIns(ndarrays_to_parameters(imprinted(m.state_dict())), i.config))
                                for (p, i), (m, _) in zip(instructions, models)]  # fmt: skip
            elif plan == "one client nudged":
                proxy, ins = instructions[0]
                nudged = [arrays[0] + np.float32(1e-3), *arrays[1:]]
                instructions[0] = (proxy, FitIns(ndarrays_to_parameters(nudged), ins.config))
            return instructions

        def aggregate_fit(self, server_round, results, failures):
            seen[server_round] = parameters_to_ndarrays(results[0][1].parameters)
            return super().aggregate_fit(server_round, results, failures)

    class Client(NumPyClient):
        def __init__(self, client: int) -> None:
            self.client = client

        def fit(self, parameters, config):
            state = {n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in zip(names, parameters)}
            images, labels = batches[self.client]
            grads = client_gradients(state, images, labels)
            return [(state[n] - grads[n]).numpy() for n in names], int(labels.numel()), {}

    def client_fn(context: Context):
        return Client(int(context.node_config["partition-id"])).to_client()

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        strategy = MaliciousFedAvg(
            fraction_evaluate=0.0,
            min_fit_clients=args.clients,
            min_available_clients=args.clients,
            initial_parameters=ndarrays_to_parameters([t.numpy() for t in public.state_dict().values()]),
        )
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=len(ROUNDS)), strategy=strategy)
        secagg = secaggplus_workflow(args.clients, max_weight=float(args.batch_size))
        DefaultWorkflow(fit_workflow=secagg)(grid, legacy)

    mods = [secaggplus_mod, refusals, ModelChecksMod(public), UpdateDefenseMod(mechanism(args))]
    run_simulation(
        server_app=server_app,
        client_app=ClientApp(client_fn=client_fn, mods=mods),
        num_supernodes=args.clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )
    return seen, sent


def round_rows(args: argparse.Namespace, seen: dict[int, Any], refusals: RefusalLog) -> list[dict[str, Any]]:
    rows = []
    for index, plan in enumerate(ROUNDS, start=1):
        refused = refusals.refusals(index)
        reasons = sorted({text.split(":", 1)[0] for text in refused.values()})
        example = refused[min(refused)][:160] if refused else ""
        rows.append(
            {
                "round": index,
                "server": plan,
                "aggregate": "yes" if index in seen else "none",
                "clients refusing": f"{len(refused)}/{args.clients}",
                "reason": ", ".join(reasons) or "-",
                "first refusal": example or "-",
            }
        )
    return rows


def tapped_aggregate(
    public: nn.Module, sent: list[np.ndarray], aggregate: list[np.ndarray], batches: list[tuple[Tensor, Tensor]]
) -> TappedGradient:
    """The server's round-1 view as the audit's record: the update ``global - aggregate`` (FedSGD at server
    lr 1: the mean of the defended gradients) and, to score against, every client's images."""
    names = list(public.state_dict())
    gradients = {
        n: torch.from_numpy(np.asarray(s, dtype=np.float64) - a).float() for n, s, a in zip(names, sent, aggregate)
    }
    images = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    return TappedGradient(
        round=0,
        client_id=0,
        gradients=gradients,
        model_state={n: t.detach().clone() for n, t in public.state_dict().items()},
        model_class=f"{LeNetZhu.__module__}.{LeNetZhu.__qualname__}",
        batch=(images, labels),
        meta={"aggregate_of": list(range(len(batches))), "local_batch_size": int(labels.numel())},
    )


def tap_attacks(args: argparse.Namespace, datamodule: Any, budget: AttackBudget) -> list[tuple[str, Any, bool]]:
    """``(name, attack, labels known)``: the passive published attacks (or ``--attacks``) and, unless
    ``--attacks`` names a subset, the setting's adaptive attacks with their knowledge lifted to the mean of
    the round's clients (the noise shares of all of them) and the learned inverter trained on that mean,
    as ``audit_setting(aggregate=True)`` builds them."""
    attacks = []
    for spec in published_attacks(budget, args.attacks):
        attack = spec.build(args.seed, LeNetZhu())
        if not threat_class_of(attack).active:  # the active ones' models are the server's moves (rounds 2-3)
            attacks.append((spec.name, attack, False))
    if args.attacks is not None:
        return attacks
    setting = setting_builder(
        f"DistributedGaussianMechanism(noise_multiplier={args.noise_multiplier}, "
        f"max_update_norm={args.max_update_norm}, cohort_size={args.clients})"
    )(args.seed)
    adaptive = setting.adaptive_attacks(
        LeNetZhu(), datamodule, iterations=budget.ig_iterations, lbfgs_iterations=budget.lbfgs_iterations,
        restarts=budget.adaptive_restarts, seed=args.seed,
    )  # fmt: skip
    for attack in adaptive:
        attack.knowledge = attack.knowledge.over_clients(args.clients, noise_shares=args.clients)
        attacks.append((f"adaptive:{type(attack).__name__}", attack, True))
    learned = learned_inversion_attacks(
        setting, datamodule, adaptive=adaptive, config=InverterConfig(max_epochs=budget.learned_max_epochs),
        refine_iterations=min(REFINE_ITERATIONS, budget.ig_iterations), seed=args.seed, aggregate_of=args.clients,
    )  # fmt: skip
    if not learned:
        raise SystemExit(f"the learned inverter cannot simulate {setting.name}: {simulation_refusal(setting)}")
    attacks += [(f"adaptive:{type(a).__name__}", a, True) for a in learned]
    return attacks


def attack_the_tap(args: argparse.Namespace, record: TappedGradient, datamodule: Any, rule: LeakRule):
    """Every attack of :func:`tap_attacks` on the tap, each with its prior-only control; the cells and the
    worst case by the audit's leak rule (a gap for any attack that errs or falls back; a published attack
    that does not apply is named, as the audit's cells name it)."""
    budget = audit_budget(args.quick)
    public = public_examples(datamodule)
    reference = reference_pixels(datamodule, images=public[0])
    reports, rows, gaps = [], [], []

    def row(name: str, status: str, note: str = "", psnr: str = "-", leaked: str = "-", seconds: float = 0.0) -> None:
        rows.append(
            {
                "attack": name,
                "status": status,
                "psnr (mean)": psnr,
                "images over the rule, before the controls": leaked,
                "seconds": f"{seconds:.0f}",
                "note": note[:160],
            }
        )

    for name, attack, labels_known in tap_attacks(args, datamodule, budget):
        print(f"   {name} on the Flower tap ...", flush=True)
        start = time.perf_counter()
        try:
            result = attack_record(
                record, LeNetZhu(), attack, num_classes=10, mean=datamodule.mean, std=datamodule.std,
                public_data=public, tests=rule.tests, labels_known=labels_known,
            )  # fmt: skip
            (result,), errors = with_prior_only_control([attack], [result], rule=rule, reference=reference)
        except AttackNotApplicable as err:
            if name.startswith("adaptive:"):
                gaps.append(f"{name}: could not apply ({err})")
            else:
                gaps.append(f"{name}: n/a ({err})")
            row(name, "n/a", str(err), seconds=time.perf_counter() - start)
            continue
        except Exception as err:  # an attack that errs is a gap in the verdict, named
            gaps.append(f"{name}: error ({type(err).__name__}: {err})")
            row(name, "error", f"{type(err).__name__}: {err}", seconds=time.perf_counter() - start)
            continue
        if result.reconstruction.meta.get("fallback"):
            errors.append(f"fell back ({result.reconstruction.meta.get('fallback_reason', '')})")
        gaps += [f"{name}: {e}" for e in errors]
        report = result.report
        reports.append(report)
        row(
            name,
            "error" if errors else "ok",
            "; ".join(errors),
            psnr=f"{report.means.get('psnr', float('nan')):.2f}",
            leaked=f"{sum(rule.leaked(report))}/{record.targets.numel()}",
            seconds=time.perf_counter() - start,
        )
    if args.attacks is not None:
        gaps.append(f"only the attacks {args.attacks} were run (--attacks)")
    incomplete = [g for g in gaps if ": n/a (" not in g]
    worst = worst_case_report(
        [concatenate_reports([r]) for r in reports],
        leak_thresholds=rule.thresholds,
        noise_ratio_line=rule.noise_ratio_line,
        identification_gate=rule.identification_gate,
        reference_images=reference,
        incomplete=incomplete,
        threat_model="aggregate",
    )
    return rows, worst, gaps


def audit_budget(quick: bool) -> AttackBudget:
    if quick:
        return AttackBudget(ig_iterations=2, lbfgs_iterations=2, rtf_bins=8)
    return AttackBudget()


def main() -> None:
    args = parse_args()
    name = args.name or f"flower_distributed_dp_b{args.batch_size}"
    started = time.time()
    datamodule = FashionMNISTSampleDataModule(batch_size=500) if args.sample else FashionMNISTDataModule(batch_size=500)
    datamodule.setup("fit")
    rule = LeakRule().calibrated(datamodule_recognition_tests(datamodule, log=lambda line: None))
    images, labels = training_examples(datamodule, args.clients * args.batch_size, args.seed)
    batches = [
        (
            images[c * args.batch_size : (c + 1) * args.batch_size],
            labels[c * args.batch_size : (c + 1) * args.batch_size],
        )
        for c in range(args.clients)
    ]
    torch.manual_seed(args.seed)
    public = LeNetZhu()
    with tempfile.TemporaryDirectory() as tmp:
        refusals = RefusalLog(tmp)
        seen, sent = run_flower(
            args, public, batches, public_examples(datamodule)[0], (datamodule.mean, datamodule.std), refusals
        )
        rounds = round_rows(args, seen, refusals)
    print(markdown_table(rounds))
    if 1 not in seen:
        raise SystemExit("round 1 produced no aggregate: the honest deployment failed (see the log)")
    record = tapped_aggregate(public, sent[1], seen[1], batches)
    state = {n: t.detach() for n, t in public.state_dict().items()}
    uploads = [mechanism(args)(client_gradients(state, *b), c) for c, b in enumerate(batches)]
    modelled = {n: torch.stack([u[n] for u in uploads]).mean(0) for n in state}
    gap = max(float((record.gradients[n] - modelled[n]).abs().max()) for n in state)
    clipped_mean = {
        n: torch.stack([DistributedGaussianMechanism(0.0, args.max_update_norm, args.clients)(
            client_gradients(state, *b), c)[n] for c, b in enumerate(batches)]).mean(0)
        for n in state
    }  # fmt: skip
    noise = torch.cat([(record.gradients[n] - clipped_mean[n]).reshape(-1) for n in state])
    attack_rows, worst, gaps = attack_the_tap(args, record, datamodule, rule)
    print(markdown_table(attack_rows))
    prior = prior_counts(datamodule, rule, args.seed)
    advantage = reconstruction_advantage(worst, prior.identified, prior.images)
    images_total = args.clients * args.batch_size
    preamble = (
        f"Distributed DP behind SecAgg+ on Flower's simulation engine (flwr 1.41, legacy API): {args.clients} clients "
        f"of batch {args.batch_size} ({images_total} Fashion-MNIST training images, seed {args.seed}), one FedSGD "
        f"step of LeNetZhu each, `DistributedGaussianMechanism(noise_multiplier={args.noise_multiplier}, "
        f"max_update_norm={args.max_update_norm}, cohort_size={args.clients})` through `UpdateDefenseMod`, "
        "`ModelChecksMod` inside `secaggplus_mod`. "
        f"The server's round-1 view against the audit's model of it (the mean of the clients' defended uploads, "
        f"recomputed here): largest gap {gap:.2e} (SecAgg+'s rounding step is 3.8e-6). Its noise std "
        f"{float(noise.std()):.4f} against z C / K = {args.noise_multiplier * args.max_update_norm / args.clients:.4f}. "
        f"The passive attacks on it, judged by the audit's leak rule: {worst.verdict} "
        f"({worst.leaked}/{images_total} images); identified by any attack "
        f"{advantage.successes}/{images_total}; advantage over the prior (the best fixed guess "
        f"identifies {prior.identified}/{prior.images}) {advantage.advantage:+.3f} "
        f"[{advantage.interval[0]:+.3f}, {advantage.interval[1]:+.3f}]: {advantage.status}. "
        f"Gaps and n/a cells: {'; '.join(gaps) or 'none'}. {(time.time() - started) / 60:.0f} min."
    )
    body = "\n\n## The attacks on round 1's aggregate\n\n" + markdown_table(attack_rows) + "\n\n## The rounds"
    path = write_results(name, rounds, preamble + body)
    with open(path.with_name(f"{path.stem}_attacks.csv"), "w", newline="") as handle:
        fields = list(dict.fromkeys(k for row in attack_rows for k in row))
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(attack_rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
