"""What the defenses and attacks cost, as ratios to the undefended step measured in one process (issue 15).

The performance page (docs/results/performance.md) quotes this script. Every ratio is a pair of times taken in the
same run on the same thread count, so a shared, noisy machine moves both alike.

1. ``optimal``: one defended FedSGD step of ConvNet at batch 16 (forward, backward, sensitivity,
   defense, optimizer step) for OptimalGradientNoise, OptimalGradientPruning and OptimalDPSGD,
   for each way of estimating the sensitivity: the paper's batch estimator (k = 10), the
   per-example estimator (k = 2), each fresh every step or refreshed every 4 steps, and the
   per-example estimator refreshed every 8 steps (the time is the mean over 8 consecutive steps,
   so the refresh is amortised as in training). Next to each mode, its estimator error: the
   median relative error against the exact per-example Jacobian of the same batch, mean over 3
   probe seeds; for a mode refreshed every N steps also the error of the estimate at its oldest,
   N - 1 steps stale, against the exact sensitivity at the step that uses it (another batch,
   weights after N - 1 Adam updates): the staleness the refresh buys its speed with.
2. ``pruning``: Top-k, magnitude, DGP and ADGP on a ResNet18 gradient (batch 32, 3x32x32) as a
   share of the training step (forward + backward); ADGP twice: with its own mask, and with a
   round mask from another client (what every client but the provider does). Each defense writes
   the shared gradient into the parameters' ``.grad`` tensors (``out=``), as the Trainer's local
   path does; a call without ``out`` pays for fresh model-sized memory on top (page faults: about
   3% of this step, measured on the issue's machine).
3. ``client``: a LeNetZhu FedSGD client step at batch 1 and 8 with and without
   LocalGaussianMechanism (issue 28's cost target: <= 1.2x the undefended step), in interleaved
   blocks (the ratio is the median of the blocks' ratios), as the process's CPU time and as wall time.
4. ``attacks``: Inverting Gradients on LeNetZhu, one client at a time vs clients attacked together
   in one vmapped optimisation (``benchmarks/attack_throughput.py``): ms per iteration and the time
   to reach 25 dB mean PSNR.
5. ``dp_sgd`` (issue 48): a DP-SGD step (forward, backward, per-example clipping, noise, SGD step) over
   the plain step, for LeNetZhu at batch 64 (Fashion-MNIST, 1x28x28) and ResNet18(norm="group") at
   batch 32 (3x32x32), one thread, in interleaved blocks (the ratio is the median of the blocks'
   ratios), as CPU time and as wall time: Opacus' per-example hooks, Opacus' ghost clipping as it
   ships (Conv2d by instantiation: Opacus has no Conv2d norm sampler), Opacus' ghost clipping with
   this package's Conv2d norm sampler, and book-keeping (``lightning_gp.dp_sgd.BookKeeping``, what
   ``DPSGD`` runs by default). Target: book-keeping <= 1.5x the plain step. Measured twice: with
   glibc's malloc as it comes, then with freed memory kept (``mallopt``, as jemalloc and tcmalloc do):
   glibc's per-step heap trimming charges page faults to the step with the larger transient peak.

6. ``refiner`` (issue 48): a Refiner client step (``lightning_gp.refiner.robust_data.refine`` at the
   paper's defaults) over an undefended LeNetZhu step, cold (I = 10 from the noise blend) and warm (I = 5
   from a cached x*), batch 8 and 128, one thread, medians of the process's CPU time (the measurement of
   ``benchmarks/refiner.py``'s cost part), with the floor the algorithm sets: I utility-measure gradients
   (a double backward each) and evaluation-network passes. Target: cold <= 25x.

``--device cuda`` runs parts 1 and 2 on a GPU (absolute times are then meaningful too; the
script synchronises before reading the clock). Writes benchmarks/results/speed.{csv,md}
(``speed_<parts>`` when ``--parts`` names only some).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from _common import RESULTS_DIR, write_results
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

from lightning_gp import callbacks, defenses
from lightning_gp.callbacks.data_dependent import DataDependentGradientDefense
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import gradient_sensitivity
from lightning_gp.defenses.base import share_in_process
from lightning_gp.dp_sgd import BookKeeping
from lightning_gp.frontier.workers import keep_freed_memory
from lightning_gp.models import ConvNet, LeNetZhu, ResNet18
from lightning_gp.pipeline import ClientSetup, StageCall

CE = nn.functional.cross_entropy
# (mode label, gradient_sensitivity/callback keyword arguments, refresh_every)
SENSITIVITY_MODES: tuple[tuple[str, dict, int], ...] = (
    ("batch k=10 (paper)", {"method": "batch", "probes": 10}, 1),
    ("per-example k=2", {"method": "per_example", "probes": 2}, 1),
    ("batch k=10, refresh every 4", {"method": "batch", "probes": 10}, 4),
    ("per-example k=2, refresh every 4", {"method": "per_example", "probes": 2}, 4),
    ("per-example k=2, refresh every 8", {"method": "per_example", "probes": 2}, 8),
)
OPTIMAL_DEFENSES: tuple[tuple[str, Callable[..., DataDependentGradientDefense]], ...] = (
    ("OptimalGradientNoise", lambda **kw: callbacks.OptimalGradientNoise(scale=0.01, seed=0, loss_fn=CE, **kw)),
    ("OptimalGradientPruning", lambda **kw: callbacks.OptimalGradientPruning(rate=0.8, seed=0, loss_fn=CE, **kw)),
    ("OptimalDPSGD", lambda **kw: callbacks.OptimalDPSGD(clip=0.01, scale=0.01, seed=0, loss_fn=CE, **kw)),
)


def synchronized(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def median_of_means(fn: Callable[[], object], calls: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` consecutive calls (after one warm-up group)."""
    means = []
    for repeat in range(repeats + 1):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        if repeat:
            means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)


def sample_batches(count: int, size: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` consecutive batches of real Fashion-MNIST images (the built-in sample)."""
    datamodule = FashionMNISTSampleDataModule()
    datamodule.setup("fit")
    dataset = datamodule.train_dataset
    batches = []
    for b in range(count):
        items = [dataset[i] for i in range(b * size, (b + 1) * size)]
        x = torch.stack([item[0] for item in items]).to(device)
        y = torch.tensor([int(item[1]) for item in items], device=device)
        batches.append((x, y))
    return batches


def median_relative_error(estimate: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    """The per-coordinate median of |estimate - exact| / exact over the coordinates with exact > 0."""
    relative = [((estimate[n] - exact[n]).abs() / exact[n])[exact[n] > 0] for n in exact]
    return float(torch.cat([r.flatten() for r in relative]).median())


def staleness_of(refresh: int) -> int | None:
    """Steps the estimate of a mode refreshed every ``refresh`` steps is stale at its oldest."""
    return refresh - 1 if refresh > 1 else None


def estimator_errors(batches: list, seeds: int) -> dict[str, tuple[float, float | None]]:
    """Per mode: (error of a fresh estimate, error at its oldest, ``refresh - 1`` steps stale);
    ``"exact N"``: (0, error of the exact sensitivity N steps stale). Exact Jacobians, CPU."""
    stalenesses = sorted({s for _, _, refresh in SENSITIVITY_MODES if (s := staleness_of(refresh))})
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x0, y0 = (t.cpu() for t in batches[0])
    print(
        f"estimator: exact per-example Jacobians of {1 + len(stalenesses)} ConvNet batches (a minute each on one core)",
        flush=True,
    )
    exact_now = gradient_sensitivity(model, CE, x0, y0, exact=True, method="per_example", chunk_size=196)
    estimates = {
        label: [
            gradient_sensitivity(model, CE, x0, y0, generator=torch.Generator().manual_seed(seed), **kwargs)
            for seed in range(seeds)
        ]
        for label, kwargs, _ in SENSITIVITY_MODES
    }
    exact_later: dict[int, dict[str, torch.Tensor]] = {}
    errors: dict[str, tuple[float, float | None]] = {}
    for step in range(1, stalenesses[-1] + 1 if stalenesses else 1):
        x, y = (t.cpu() for t in batches[step - 1])
        optimizer.zero_grad()
        CE(model(x), y).backward()
        optimizer.step()
        if step in stalenesses:
            xs, ys = (t.cpu() for t in batches[step])
            exact_later[step] = gradient_sensitivity(
                model, CE, xs, ys, exact=True, method="per_example", chunk_size=196
            )
            # the floor of any estimate this stale: the exact sensitivity of the earlier step
            errors[f"exact {step}"] = (0.0, median_relative_error(exact_now, exact_later[step]))
            print(f"estimator: the exact sensitivity {step} steps stale errs {errors[f'exact {step}'][1]:.3f}")
    for label, _, refresh in SENSITIVITY_MODES:
        fresh = statistics.mean(median_relative_error(e, exact_now) for e in estimates[label])
        staleness = staleness_of(refresh)
        stale = (
            None
            if staleness is None
            else statistics.mean(median_relative_error(e, exact_later[staleness]) for e in estimates[label])
        )
        errors[label] = (fresh, stale)
        print(f"estimator {label}: fresh {fresh:.3f}" + (f", {staleness} steps stale {stale:.3f}" if stale else ""))
    return errors


def cost_row(
    part: str,
    model: str,
    setting: str,
    step: float,
    seconds: float,
    target: float,
    target_text: str,
    *,
    estimator_error: float = float("nan"),
    stale_error: float = float("nan"),
    ratio: float | None = None,
) -> dict:
    """One row of a cost measured as a ratio to the undefended ``step`` (seconds), met when ``<= target``;
    ``ratio``: one measured otherwise (e.g. the median of paired ratios), else ``seconds / step``."""
    ratio = seconds / step if ratio is None else ratio
    return {
        "part": part,
        "model": model,
        "setting": setting,
        "estimator_error": estimator_error,
        "stale_error": stale_error,
        "step_ms": 1e3 * step,
        "cost_ms": 1e3 * seconds,
        "ratio_to_step": ratio,
        "target": target_text,
        "met": "yes" if ratio <= target else "no",
    }


def optimal_rows(
    device: torch.device, repeats: int, errors: dict[str, tuple[float, float | None]], calls: int = 8
) -> list[dict]:
    """Each optimal mode's step time as the mean over ``calls`` consecutive steps (8 amortises a refresh
    every 8 steps; the quick run's 2 only checks that every mode runs)."""
    sync = synchronized(device)
    batches = sample_batches(8, 16, device)
    torch.manual_seed(0)
    model = ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: p.shape for n, p in model.named_parameters()}
    counter = {"step": 0}

    def step(callback: DataDependentGradientDefense | None) -> None:
        x, y = batches[counter["step"] % len(batches)]
        optimizer.zero_grad()
        gradients = dict(zip(names, torch.autograd.grad(CE(model(x), y), list(model.parameters()))))
        if callback is not None:
            gradients = callback.defend(gradients, StageCall(0, counter["step"], model, (x, y), {"path": "benchmark"}))
        for name, p in model.named_parameters():
            p.grad = gradients[name]
        optimizer.step()
        counter["step"] += 1

    undefended = median_of_means(lambda: step(None), calls, repeats, sync)
    rows = []
    for defense_name, make in OPTIMAL_DEFENSES:
        for label, kwargs, refresh in SENSITIVITY_MODES:
            callback = make(refresh_every=refresh, **kwargs)
            callback.bind(ClientSetup(1, model, shapes, passes_client_batches=True))
            counter["step"] = 0
            seconds = median_of_means(lambda c=callback: step(c), calls, repeats, sync)
            fresh, stale = errors.get(label, (float("nan"), None))
            target = 2.0 if refresh > 1 else 4.0
            rows.append(
                cost_row(
                    "optimal", "ConvNet b16", f"{defense_name}, {label}", undefended, seconds, target,
                    f"<= {target:g}x", estimator_error=fresh, stale_error=float("nan") if stale is None else stale,
                )
            )  # fmt: skip
            print(f"optimal {rows[-1]['setting']}: {seconds / undefended:.2f}x a step", flush=True)
    return rows


def pruning_rows(device: torch.device, repeats: int) -> list[dict]:
    sync = synchronized(device)
    torch.manual_seed(0)
    model = ResNet18().to(device)
    x, y = torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device)

    def train_step() -> None:
        model.zero_grad()
        CE(model(x), y).backward()

    step = median_of_means(train_step, 1, repeats, sync)
    gradients = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    other = {n: torch.randn_like(g) * g.std() for n, g in gradients.items()}
    foreign = defenses.AlignedDualGradientPruning(seed=0)
    # a round whose mask another client (id 1) provides
    provider = next(r for r in range(100) if foreign.provider(r, [0, 1]) == 1)
    foreign.begin_round(provider, [0, 1], {1: other}, share_in_process)
    rows = []
    for label, defense, target in (
        ("Top-k 20%", defenses.TopKPruning(rate=0.8), 0.10),
        ("magnitude 80%", defenses.MagnitudePruning(0.8), 0.10),
        ("DGP (5%, 75%)", defenses.DualGradientPruning(), 0.10),
        ("ADGP (20%, 5%), own mask", defenses.AlignedDualGradientPruning(), 0.15),
        ("ADGP (20%, 5%), another client's mask", foreign, 0.15),
    ):
        # as the Trainer's local path calls it: the shared gradient written into the .grad tensors
        seconds = median_of_means(lambda d=defense: d(gradients, 0, out=grads), 1, repeats, sync)
        rows.append(cost_row("pruning", "ResNet18 b32", label, step, seconds, target, f"<= {target:.0%}"))
        print(f"pruning {label}: {seconds / step:.1%} of a step", flush=True)
    return rows


def interleaved_ratio(
    reference: Callable[[], object],
    candidate: Callable[[], object],
    calls: int,
    repeats: int,
    clock: Callable[[], float],
) -> tuple[float, float, float]:
    """``(reference, candidate, ratio)``: the median over ``repeats`` of each one's mean time per call in
    blocks of ``calls``, and the median of the per-repeat ratios, the blocks taken in turn (reference,
    candidate, reference, ...) after one warm-up block each, so a load that drifts moves both alike."""

    def block(fn: Callable[[], object]) -> float:
        start = clock()
        for _ in range(calls):
            fn()
        return (clock() - start) / calls

    block(reference), block(candidate)
    pairs = [(block(reference), block(candidate)) for _ in range(repeats)]
    return (
        statistics.median(r for r, _ in pairs),
        statistics.median(c for _, c in pairs),
        statistics.median(c / r for r, c in pairs),
    )


def client_step_ratio(
    defense: defenses.Defense,
    batch_size: int,
    repeats: int,
    clock: Callable[[], float],
    device: torch.device,
    local_steps: int = 1,
    block: int = 64,
) -> tuple[float, float, float]:
    """``(undefended, defended, ratio)`` of a LeNetZhu client's round without and with ``defense``, in
    interleaved blocks of ``block`` rounds (:func:`interleaved_ratio`) timed by ``clock``. FedSGD
    (``local_steps=1``): forward, backward, the update written into ``.grad``, SGD step. FedAvg
    (``local_steps=S``): ``S`` local SGD steps on the batch, then the update ``w_global - w_local``
    written out (through the defense, once) and the weights put back."""
    batches = sample_batches(8, batch_size, device)
    torch.manual_seed(0)
    model = LeNetZhu().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    names = [n for n, _ in model.named_parameters()]
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    counter = {"step": 0}

    def local_step() -> dict[str, torch.Tensor]:
        x, y = batches[counter["step"] % len(batches)]
        optimizer.zero_grad()
        return dict(zip(names, torch.autograd.grad(CE(model(x), y), list(model.parameters()))))

    def share(update: dict[str, torch.Tensor], with_defense: defenses.Defense | None) -> None:
        if with_defense is None:
            for name in names:
                grads[name].copy_(update[name])
        else:
            with_defense(update, 0, out=grads)

    def fedsgd(with_defense: defenses.Defense | None) -> None:
        share(local_step(), with_defense)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        optimizer.step()
        counter["step"] += 1

    def fedavg(with_defense: defenses.Defense | None) -> None:
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        for _ in range(local_steps):
            for name, g in local_step().items():
                model.get_parameter(name).grad = g
            optimizer.step()
        share({n: start[n] - p.detach() for n, p in model.named_parameters()}, with_defense)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(start[name])
        counter["step"] += 1

    step = fedsgd if local_steps == 1 else fedavg
    return interleaved_ratio(lambda: step(None), lambda: step(defense), block, repeats, clock)


def client_rows(device: torch.device, repeats: int) -> list[dict]:
    """Issue 28's cost: a client's FedSGD step with and without LocalGaussianMechanism (clip the whole
    update, add its noise; :func:`client_step_ratio`). Measured on the CPU as the process's CPU time (on
    a shared machine other processes' load moves wall time, not the step's own work; one torch thread)
    and as wall time."""
    if device.type != "cpu":
        raise SystemExit("--parts client measures a CPU client step: run it without --device cuda")
    rows = []
    for batch_size in (1, 8):
        mechanism = defenses.LocalGaussianMechanism(noise_multiplier=0.5, max_update_norm=1.0, seed=0)
        label = "LocalGaussianMechanism(z=0.5, C=1)"
        for clock_name, clock in (("CPU time", time.process_time), ("wall time", time.perf_counter)):
            undefended, defended, ratio = client_step_ratio(mechanism, batch_size, 3 * repeats, clock, device)
            measured = f"LeNetZhu b{batch_size}, {clock_name}"
            rows.append(cost_row("client", measured, label, undefended, defended, 1.2, "<= 1.2x", ratio=ratio))
            print(f"client {label}, batch {batch_size}, {clock_name}: {ratio:.2f}x a step", flush=True)
    return rows


@contextmanager
def stock_opacus() -> Iterator[None]:
    """Opacus' ghost clipping as it ships: without the Conv2d norm sampler that importing
    ``lightning_gp.dp_sgd`` registers (Conv2d layers then instantiate their per-example gradients)."""
    samplers = GradSampleModuleFastGradientClipping.NORM_SAMPLERS
    ours = samplers.pop(nn.Conv2d)
    try:
        yield
    finally:
        samplers[nn.Conv2d] = ours


def _dp_sgd_steps(model: nn.Module, batches: list, clip: float, sigma: float) -> dict[str, Callable[[], None]]:
    """One step function per mode, each on its own copy of ``model`` (the same weights at the start)."""
    batch = len(batches[0][0])
    counter = {"step": 0}

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        counter["step"] += 1
        return batches[counter["step"] % len(batches)]

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=1e-3)

    def dp(optimizer_class: type, m: nn.Module) -> torch.optim.Optimizer:
        return optimizer_class(sgd(m), noise_multiplier=sigma, max_grad_norm=clip, expected_batch_size=batch)

    steps: dict[str, Callable[[], None]] = {}
    plain = copy.deepcopy(model)
    plain_opt = sgd(plain)

    def plain_step() -> None:
        x, y = data()
        plain_opt.zero_grad()
        CE(plain(x), y).backward()
        plain_opt.step()

    steps["plain"] = plain_step
    hooks = GradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    hooks_opt = dp(DPOptimizer, hooks)

    def hooks_step() -> None:
        x, y = data()
        hooks_opt.zero_grad()
        CE(hooks(x), y).backward()
        hooks_opt.step()

    steps["Opacus hooks"] = hooks_step
    for label, stock in (
        ("Opacus ghost, stock (Conv2d instantiated)", True),
        ("Opacus ghost + our Conv2d norm", False),
    ):
        ghost = GradSampleModuleFastGradientClipping(copy.deepcopy(model), loss_reduction="mean", max_grad_norm=clip)
        ghost_opt = dp(DPOptimizerFastGradientClipping, ghost)
        criterion = DPLossFastGradientClipping(ghost, ghost_opt, nn.CrossEntropyLoss())

        def ghost_step(ghost=ghost, ghost_opt=ghost_opt, criterion=criterion, stock=stock) -> None:
            x, y = data()
            with stock_opacus() if stock else nullcontext():
                ghost_opt.zero_grad()
                criterion(ghost(x), y).backward()
                ghost_opt.step()

        steps[label] = ghost_step
    ours = copy.deepcopy(model)
    engine = BookKeeping(ours, max_grad_norm=clip)
    ours_opt = dp(DPOptimizerFastGradientClipping, ours)

    def book_keeping_step() -> None:
        x, y = data()
        ours_opt.zero_grad()
        engine.backward(CE(ours(x), y))
        ours_opt.step()

    steps["book-keeping (ours, DPSGD's default)"] = book_keeping_step
    return steps


def dp_sgd_rows(repeats: int, quick: bool) -> list[dict]:
    """Issue 48's cost: each DP-SGD mode's step over the plain step, one thread, interleaved blocks; first
    with glibc's malloc as it comes, then with freed memory kept (``keep_freed_memory``: mmap above 32 MiB
    only, trim the heap above 64 MiB only, as jemalloc and tcmalloc do)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for allocator in ("glibc default", "freed memory kept"):
            if allocator != "glibc default" and not keep_freed_memory(32 << 20, 64 << 20):
                print("dp_sgd: no second allocator setting (not glibc, or glibc's set in the environment)", flush=True)
                break
            rows += _dp_sgd_allocator_rows(allocator, repeats, quick)
    finally:
        torch.set_num_threads(threads)
    return rows


def _dp_sgd_allocator_rows(allocator: str, repeats: int, quick: bool) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    cifar = [(torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))) for _ in range(2)]
    setups = [
        ("LeNetZhu b64", LeNetZhu(), sample_batches(4, 64, torch.device("cpu")), 16),
        ("ResNet18(group) b32", ResNet18(norm="group"), cifar, 1),
    ]
    for model_name, model, batches, calls in setups:
        steps = _dp_sgd_steps(model, batches, clip=1.0, sigma=1.0)
        plain = steps.pop("plain")
        for label, step in steps.items():
            ours = label.startswith("book-keeping")
            for clock_name, clock in (("CPU time", time.process_time), ("wall time", time.perf_counter)):
                if quick:
                    blocks, block_calls = 1, 1
                else:
                    blocks, block_calls = (2 * repeats + 1) if calls > 1 else repeats, calls
                base, cost, ratio = interleaved_ratio(plain, step, block_calls, blocks, clock)
                measured = f"{model_name}, {clock_name}, {allocator}"
                target, text = (1.5, "<= 1.5x") if ours else (math.inf, "")
                row = cost_row("dp_sgd", measured, label, base, cost, target, text, ratio=ratio)
                row["met"] = row["met"] if ours else ""
                rows.append(row)
                print(f"dp_sgd {measured}, {label}: {ratio:.2f}x the plain step", flush=True)
        del steps, plain
    return rows


#: Issue 48's target for a cold Refiner step (I = 10 iterations from the noise blend), in plain steps.
REFINER_COLD_TARGET = 25.0


def refiner_rows(repeats: int) -> list[dict]:
    """Issue 48's cost: a Refiner client step (``refine`` at the paper's defaults) over an undefended
    LeNetZhu step, cold (I = 10 from the noise blend) and warm (I = 5 from a cached x*), batch 8 and 128,
    one thread, CPU time (``benchmarks/refiner.py``'s cost part); ``floor``: what I iterations of the
    utility measure's gradient (a double backward) and the evaluation network's forward and backward cost
    alone, with the raw and final gradients and the projection."""
    from refiner import cost  # the Refiner benchmark's own measurement (one implementation)

    from lightning_gp.refiner.evaluator import load_evaluator

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        datamodule = FashionMNISTSampleDataModule(batch_size=500)
        measured = cost(datamodule, load_evaluator(1), max(repeats, 3), seed=0, clock=time.process_time)
    finally:
        torch.set_num_threads(threads)
    rows = []
    for row in measured:
        for start, ratio in (("cold (I = 10)", row["cold_ratio"]), ("warm (I = 5)", row["warm_ratio"])):
            cold = start.startswith("cold")
            rows.append(
                {
                    "part": "refiner",
                    "setting": f"Refiner {start}, LeNetZhu b{row['batch']}",
                    "step_ms": row["step_ms"],
                    "cost_ms": row["cold_ms" if cold else "warm_ms"],
                    "ratio_to_step": ratio,
                    "floor": row["floor_cold_ratio"] if cold else float("nan"),
                    "um_grad_ratio": row["um_grad_ratio"],
                    "evaluator_ratio": row["evaluator_ratio"],
                    "target": f"<= {REFINER_COLD_TARGET:g}x" if cold else "",
                    "met": ("yes" if ratio <= REFINER_COLD_TARGET else "no") if cold else "",
                }
            )
    return rows


def attack_rows(iterations: int, clients: int, threads: int, quick: bool) -> list[dict]:
    from attack_throughput import measure

    rows = []
    for row in measure(iterations=iterations, clients=clients, threads=threads, quick=quick):
        rows.append(
            {
                "part": "attacks",
                "model": "LeNetZhu",
                "setting": f"IG {row['mode']}, {row['clients']} clients",
                "estimator_error": float("nan"),
                "stale_error": float("nan"),
                "step_ms": float("nan"),
                "cost_ms": row["ms_per_iteration"],
                "ratio_to_step": float("nan"),
                # only the batched attack carries the target; the other rows are comparisons
                "target": ">= 2x iterations/s" if row["mode"] == "batched" else "",
                "met": ("yes" if row["speedup"] >= 2 else "no") if row["mode"] == "batched" else "",
                "speedup": row["speedup"],
                "mean_psnr": row["mean_psnr"],
                "time_to_25db_s": row["time_to_25db_s"],
            }
        )
    return rows


PARTS = ("optimal", "pruning", "client", "attacks", "refiner", "dp_sgd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=PARTS,
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (the issue's targets: 2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (parts optimal and pruning)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--attack-iterations", type=int, default=2500)
    parser.add_argument("--attack-clients", type=int, default=8)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a CI-size run: one repeat of 2 steps per optimal mode, estimator errors on 2-image batches",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    repeats = 1 if args.quick else args.repeats
    rows: list[dict] = []
    stale_floor = ""
    if "optimal" in args.parts:
        # the quick run's exact Jacobians are of 2-image batches (the full run's take a minute each)
        errors = estimator_errors(sample_batches(8, 2 if args.quick else 16, torch.device("cpu")), 3)
        rows += optimal_rows(device, repeats, errors, calls=2 if args.quick else 8)
        floors = [(int(key.split()[1]), stale) for key, (_, stale) in errors.items() if key.startswith("exact ")]
        stale_floor = (
            " The exact sensitivity itself errs "
            + ", ".join(f"{stale:.2f} {steps} steps stale" for steps, stale in floors)
            + " (the floors of stale_error)."
        )
    if "pruning" in args.parts:
        rows += pruning_rows(device, repeats)
    if "client" in args.parts:
        rows += client_rows(device, repeats)
    if "attacks" in args.parts:
        rows += attack_rows(args.attack_iterations, args.attack_clients, 1, args.quick)
    if "refiner" in args.parts:  # before dp_sgd, which changes the process's malloc settings
        if device.type != "cpu":
            raise SystemExit("--parts refiner measures a CPU step: run it without --device cuda")
        rows += refiner_rows(repeats)
    if "dp_sgd" in args.parts:
        if device.type != "cpu":
            raise SystemExit("--parts dp_sgd measures a CPU step: run it without --device cuda")
        rows += dp_sgd_rows(repeats, args.quick)
    columns = list(dict.fromkeys(c for row in rows for c in row))
    rows = [{c: row.get(c, float("nan")) for c in columns} for row in rows]
    where = f"{device.type}, {args.threads} threads" if device.type == "cpu" else str(torch.cuda.get_device_name())
    write_results(
        "speed"
        + ("" if len(args.parts) == len(PARTS) else "_" + "_".join(args.parts))
        + ("_quick" if args.quick else ""),
        rows,
        f"Ratios to the undefended step measured in one process ({where}). Optimal defenses: ConvNet, "
        "batch 16, mean over 8 consecutive steps (refresh amortised), median of repeats; estimator_error: "
        "median relative error vs the exact per-example Jacobian (mean of 3 probe seeds); stale_error: the same "
        "estimate against the exact sensitivity N - 1 Adam steps later on another batch (refreshed every N "
        "steps). Pruning: share of a ResNet18 forward+backward at batch 32, the shared gradient written into "
        ".grad. Client: a LeNetZhu FedSGD client step with and without LocalGaussianMechanism, blocks of 64 "
        "steps taken in turn (undefended, defended, ...), step_ms and cost_ms the medians of the blocks' means, "
        "ratio_to_step the median of the blocks' ratios; as the process's CPU time and as wall time. Attacks: Inverting Gradients on LeNetZhu, 1 thread, ms per "
        "iteration (cost_ms), speed-up over attacking the clients one at a time. Refiner: a client step at the "
        "paper's defaults over an undefended LeNetZhu step, one thread, medians of the process's CPU time; floor: "
        "I x (the utility measure's gradient + the evaluation network's pass) + 2 steps + the projection; target "
        "<= 25x for the cold step. DP-SGD: a step (forward, "
        "backward, per-example clipping at C = 1, noise sigma = 1, SGD step) over the plain step, one thread, "
        "LeNetZhu b64 in interleaved blocks of 16 steps, ResNet18(norm='group') b32 of 1 step, step_ms and "
        "cost_ms the medians of the blocks' means, ratio_to_step the median of the blocks' ratios; target "
        "<= 1.5x for book-keeping only (the other rows are comparisons). Each DP-SGD row twice: with glibc's "
        "malloc as it comes, which returns the heap's top to the OS whenever a step's transient peak passes its "
        "(dynamic) trim threshold, so a step with a larger peak pays page faults on fresh memory every time "
        "(book-keeping at LeNet's size: about a thousand a step, depending on the order of allocations); then "
        "with freed memory kept (mallopt M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 64 MiB, as jemalloc and "
        "tcmalloc behave; the same as MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=67108864)."
        + stale_floor
        + (
            " QUICK RUN: one repeat (of 2 steps per optimal mode), estimator errors on 2-image batches; no conclusions."
            if args.quick
            else ""
        ),
        args.output_dir,
    )


if __name__ == "__main__":
    main()
