"""CMA-ES: the gradient-free search GGL runs where the defense's transform has no useful gradient.

Hansen, "The CMA Evolution Strategy: A Tutorial" (arXiv:1604.00772, 2016), Algorithm in Sec. C
with the default parameters of its Table 1: a ``(mu/mu_w, lambda)`` evolution strategy that samples
``x_k = m + sigma B D z_k`` (``z_k ~ N(0, I)``, ``C = B D^2 B^T``), moves the mean to the weighted
recombination of the ``mu`` best (Eq. 41), adapts the covariance by the rank-one update of the
evolution path ``p_c`` (Eqs. 45-47) and the rank-mu update of the selected steps (Eq. 47), and the
step size by cumulative step-size adaptation (CSA, Eqs. 43-44). Li et al. (GGL, CVPR 2022, Sec. 3.3)
search a generator's latent space this way through quantisation and compression, whose gradient is
zero almost everywhere.

It stops on the first of: ``max_generations`` (the cap); ``tol_fun`` (the best values of the
last ``10 + ceil(30 n / lambda)`` generations and all of the current one lie within ``tol_fun``:
Hansen's TolFun); ``tol_x`` (``sigma`` times every axis of ``C`` below ``tol_x``: TolX); or
``f_target`` reached. Everything random comes from one seeded ``torch.Generator``; the arithmetic
is in float64, so a run is a function of its seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gp.validation import check_nonnegative, check_positive, check_positive_int

#: ``f(x [lambda, n]) -> values [lambda]``: one value per candidate (float64 in, any float out).
BatchObjective = Callable[[Tensor], Tensor]


@dataclass
class CMAResult:
    """A CMA-ES run: the best point and value found, the generations and evaluations spent, why it
    stopped, and the best value of each generation (``trace``)."""

    x: Tensor
    value: float
    generations: int
    evaluations: int
    stopped: str
    trace: list[float] = field(default_factory=list)


@dataclass
class _Parameters:
    """The strategy parameters of Hansen's Table 1 for dimension ``n`` and population ``lam``."""

    n: int
    lam: int
    mu: int
    weights: Tensor
    mu_eff: float
    c_sigma: float
    d_sigma: float
    c_c: float
    c_1: float
    c_mu: float
    chi_n: float

    @classmethod
    def default(cls, n: int, lam: int | None) -> _Parameters:
        lam = 4 + math.floor(3 * math.log(n)) if lam is None else check_positive_int(lam, "population")
        if lam < 2:
            raise ValueError(f"population must be >= 2, got {lam}")
        mu = lam // 2
        raw = torch.tensor([math.log((lam + 1) / 2) - math.log(i + 1) for i in range(mu)], dtype=torch.float64)
        weights = raw / raw.sum()
        mu_eff = float(1 / weights.pow(2).sum())
        c_sigma = (mu_eff + 2) / (n + mu_eff + 5)
        d_sigma = 1 + 2 * max(0.0, math.sqrt((mu_eff - 1) / (n + 1)) - 1) + c_sigma
        c_c = (4 + mu_eff / n) / (n + 4 + 2 * mu_eff / n)
        c_1 = 2 / ((n + 1.3) ** 2 + mu_eff)
        c_mu = min(1 - c_1, 2 * (mu_eff - 2 + 1 / mu_eff) / ((n + 2) ** 2 + mu_eff))
        chi_n = math.sqrt(n) * (1 - 1 / (4 * n) + 1 / (21 * n**2))
        return cls(n, lam, mu, weights, mu_eff, c_sigma, d_sigma, c_c, c_1, c_mu, chi_n)


@dataclass
class _State:
    """The distribution: mean, step size, covariance (and its eigen decomposition), the two paths."""

    mean: Tensor
    sigma: float
    cov: Tensor
    axes: Tensor  # B: eigenvectors of C as columns
    scales: Tensor  # D: square roots of the eigenvalues
    p_sigma: Tensor
    p_c: Tensor

    @classmethod
    def start(cls, x0: Tensor, sigma0: float) -> _State:
        n = x0.numel()
        eye = torch.eye(n, dtype=torch.float64)
        zeros = torch.zeros(n, dtype=torch.float64)
        return cls(
            x0.double().flatten().clone(),
            sigma0,
            eye,
            eye.clone(),
            torch.ones(n, dtype=torch.float64),
            zeros,
            zeros.clone(),
        )

    def decompose(self) -> None:
        """``C = B D^2 B^T`` (symmetrised first; eigenvalues floored at a tiny positive number)."""
        self.cov = (self.cov + self.cov.T) / 2
        values, vectors = torch.linalg.eigh(self.cov)
        self.scales = values.clamp_min(1e-20).sqrt()
        self.axes = vectors


def cma_es(
    objective: BatchObjective,
    x0: Tensor,
    sigma0: float,
    *,
    generator: torch.Generator,
    population: int | None = None,
    max_generations: int = 200,
    tol_fun: float = 1e-8,
    tol_x: float = 1e-8,
    f_target: float | None = None,
    report: Callable[[int, int, float], None] | None = None,
) -> CMAResult:
    """Minimise ``objective`` from ``x0`` (any shape; searched flattened) with initial step ``sigma0``
    (module docstring). ``population``: ``lambda`` (default ``4 + floor(3 ln n)``). ``report(generation,
    max_generations, best)`` is called after every generation. The result's ``x`` has ``x0``'s shape."""
    if x0.numel() < 1:
        raise ValueError("x0 must have at least one coordinate")
    sigma0 = check_positive(sigma0, "sigma0")
    check_positive_int(max_generations, "max_generations")
    check_nonnegative(tol_fun, "tol_fun")
    check_nonnegative(tol_x, "tol_x")
    params = _Parameters.default(x0.numel(), population)
    state = _State.start(x0, sigma0)
    history = 10 + math.ceil(30 * params.n / params.lam)
    best_x, best_value = state.mean.clone(), math.inf
    trace: list[float] = []
    stopped, generation = "max_generations", 0
    for generation in range(1, max_generations + 1):
        steps, values = _sample_and_evaluate(objective, state, params, generator, x0.dtype)
        order = torch.argsort(values)
        if float(values[order[0]]) < best_value:
            best_value = float(values[order[0]])
            best_x = state.mean + state.sigma * steps[order[0]]
        trace.append(float(values[order[0]]))
        _update(state, params, steps[order[: params.mu]], generation)
        if report is not None:
            report(generation - 1, max_generations, best_value)
        reason = _stop_reason(trace, values, state, history, tol_fun, tol_x, best_value, f_target)
        if reason is not None:
            stopped = reason
            break
    return CMAResult(
        best_x.reshape(x0.shape).to(x0.dtype), best_value, generation, generation * params.lam, stopped, trace
    )


def _sample_and_evaluate(
    objective: BatchObjective, state: _State, params: _Parameters, generator: torch.Generator, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``lambda`` steps ``y_k = B D z_k`` and the objective at ``m + sigma y_k`` (non-finite values
    rank last)."""
    z = torch.randn(params.lam, params.n, generator=generator, dtype=torch.float64)
    steps = (z * state.scales) @ state.axes.T
    candidates = state.mean + state.sigma * steps
    values = objective(candidates.to(dtype)).detach().double().flatten().cpu()
    if values.shape != (params.lam,):
        raise ValueError(f"the objective must return one value per candidate ({params.lam}), got {tuple(values.shape)}")
    return steps, torch.where(torch.isfinite(values), values, torch.full_like(values, math.inf))


def _update(state: _State, params: _Parameters, selected: Tensor, generation: int) -> None:
    """Recombination (Eq. 41), the step-size path and CSA (Eqs. 43-44), the covariance path and the
    rank-one plus rank-mu update (Eqs. 45-47), for the ``mu`` best steps ``selected`` (best first)."""
    w = params.weights
    y_w = w @ selected
    state.mean = state.mean + state.sigma * y_w
    inv_sqrt = state.axes @ torch.diag(1 / state.scales) @ state.axes.T  # C^{-1/2}
    state.p_sigma = (1 - params.c_sigma) * state.p_sigma + math.sqrt(
        params.c_sigma * (2 - params.c_sigma) * params.mu_eff
    ) * (inv_sqrt @ y_w)
    norm = float(state.p_sigma.norm())
    corrected = norm / math.sqrt(1 - (1 - params.c_sigma) ** (2 * generation))
    h_sigma = 1.0 if corrected < (1.4 + 2 / (params.n + 1)) * params.chi_n else 0.0
    state.p_c = (1 - params.c_c) * state.p_c + h_sigma * math.sqrt(params.c_c * (2 - params.c_c) * params.mu_eff) * y_w
    delta = (1 - h_sigma) * params.c_c * (2 - params.c_c)
    rank_one = torch.outer(state.p_c, state.p_c) + delta * state.cov
    rank_mu = (selected.T * w) @ selected
    state.cov = (1 - params.c_1 - params.c_mu) * state.cov + params.c_1 * rank_one + params.c_mu * rank_mu
    state.sigma *= math.exp((params.c_sigma / params.d_sigma) * (norm / params.chi_n - 1))
    state.decompose()


def _stop_reason(
    trace: list[float],
    values: Tensor,
    state: _State,
    history: int,
    tol_fun: float,
    tol_x: float,
    best: float,
    f_target: float | None,
) -> str | None:
    """Why the run stops after this generation (``None``: it goes on)."""
    if f_target is not None and best <= f_target:
        return f"f_target (best {best:.3g} <= {f_target:.3g})"
    recent = trace[-history:]
    finite = values[torch.isfinite(values)]
    if len(trace) >= history and finite.numel():
        spread = max(max(recent), float(finite.max())) - min(min(recent), float(finite.min()))
        if spread < tol_fun:
            return f"tol_fun (values of the last {history} generations within {tol_fun:g})"
    axes = state.sigma * torch.sqrt(torch.diagonal(state.cov))
    if bool((axes < tol_x).all()) and bool((state.sigma * state.p_c.abs() < tol_x).all()):
        return f"tol_x (every step below {tol_x:g})"
    if not math.isfinite(state.sigma) or state.sigma <= 0:
        return "step size degenerate"
    return None


__all__ = ["BatchObjective", "CMAResult", "cma_es"]
