"""Sequential optimisers side by side: one vmapped objective for the L-BFGS restarts of an attack, and
for the runs of a cell's clients (:meth:`DLG.reconstruct_side_by_side
<lightning_gp.attacks.DLG.reconstruct_side_by_side>`, ``groups``: each client's restarts a group).

At a client batch of one image on LeNetZhu most of an objective evaluation is per-call overhead, so
independent problems evaluated together cost little more than one (the objective of four restarts
of iDLG at batch 1, vmapped: 4.2 ms, against 2.4 ms for one alone; :data:`BATCHED_IMAGES`). Only the
objective is shared: each run's own L-BFGS bookkeeping (its two-loop recursion over up to 100 pairs)
still runs per problem, about a quarter of a run alone: the defense-aware iDLG of 4 restarts (the
first alone, three side by side) takes 0.75-0.83 of its time one by one at batch 1, and 0.95-0.97 at
batch 8, where three rows vmapped cost nearly three of one (``benchmarks/results/lbfgs_restarts.md``). Adam moves each problem
elementwise and batches by stacking (:func:`~lightning_gp.attacks.searches.adam_searches`). L-BFGS
does not: its strong-Wolfe line search asks for the objective a data-dependent number of times per
step, differently for every problem, so stacking its problems by hand would mean a second L-BFGS with
its own trajectories. Instead every problem runs :class:`torch.optim.LBFGS` unchanged, each in its
own thread, and its closure hands its iterate to a shared evaluator (:func:`lockstep`): the evaluator
waits until every problem still running has asked, evaluates them all in one call of ``value_of``,
and gives each its value and gradient.

Only one thread computes at a time (the others wait for their answer), so the threads act as
coroutines: each call's rows are the problems still running, in their order, whatever the
scheduling, and every problem follows the trajectory it follows alone, up to the summation order
inside batched kernels (:mod:`lightning_gp.attacks.batched`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from lightning_gp.validation import check_positive_int

#: ``value_of(iterates [A, ...], rows [A]) -> [A]``: the objectives of problems ``rows`` at their iterates.
RowObjective = Callable[[Tensor, Tensor], Tensor]
#: Images per vmapped evaluation (problems x client batch): at a batch of one image on LeNetZhu a
#: step of 31 problems together costs about a sixth of 31 steps alone; at batch 8 about as much.
BATCHED_IMAGES = 64
#: ``evaluate(iterate) -> (value, gradient)``: one problem's objective at its iterate, and its gradient.
Evaluate = Callable[[Tensor], tuple[Tensor, Tensor]]

Result = TypeVar("Result")


def values_and_gradients(
    iterates: Tensor, rows: Tensor, value_of: RowObjective, rows_per_call: int
) -> tuple[Tensor, Tensor]:
    """The objectives ``[A]`` of problems ``rows`` and their gradients with respect to ``iterates``,
    ``rows_per_call`` problems per call (the objectives are independent, so chunks do not interact)."""
    values, gradients = [], []
    for start in range(0, len(rows), rows_per_call):
        chunk = iterates[start : start + rows_per_call].clone().requires_grad_(True)
        with torch.enable_grad():
            value = value_of(chunk, rows[start : start + rows_per_call])
            (gradient,) = torch.autograd.grad(value.sum(), chunk)
        values.append(value.detach())
        gradients.append(gradient)
    return torch.cat(values), torch.cat(gradients)


class Cancelled(Exception):
    """Raised in a run :func:`lockstep` has cancelled, at its next evaluation."""


class _Evaluator:
    """Gathers the problems' requests and answers them together once every running problem has asked."""

    def __init__(self, count: int, value_of: RowObjective, rows_per_call: int, groups: Sequence[int]) -> None:
        self._value_of = value_of
        self._rows_per_call = rows_per_call
        self._groups = groups
        self._changed = threading.Condition()
        self._running = set(range(count))
        self._asked: dict[int, Tensor] = {}
        self._answers: dict[int, tuple[Tensor, Tensor] | BaseException] = {}

    def evaluate(self, problem: int, iterate: Tensor) -> tuple[Tensor, Tensor]:
        with self._changed:
            if problem not in self._running:
                raise Cancelled(f"problem {problem} was cancelled")
            self._asked[problem] = iterate.detach()
            self._answer_if_every_problem_asked()
            while problem not in self._answers:
                self._changed.wait()
            answer = self._answers.pop(problem)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def finish(self, problem: int, cancel_later: bool = False) -> None:
        """``problem`` has ended; with ``cancel_later`` every problem of its group after it is cancelled
        too (no evaluation has run since ``problem``'s last answer: it had not asked again, so the rows of
        every later evaluation are the same whenever its thread gets here)."""
        with self._changed:
            self._running.discard(problem)
            if cancel_later:
                group = self._groups[problem]
                for later in [p for p in self._running if p > problem and self._groups[p] == group]:
                    self._cancel(later)
                self._changed.notify_all()
            self._answer_if_every_problem_asked()

    def cancel_all(self) -> None:
        """Every run ends at its next evaluation (:class:`Cancelled`)."""
        with self._changed:
            for problem in list(self._running):
                self._cancel(problem)
            self._changed.notify_all()

    def _cancel(self, problem: int) -> None:
        """``problem`` is cancelled: out of the running ones, its pending request answered with :class:`Cancelled`
        (the caller holds the lock)."""
        self._running.discard(problem)
        if problem in self._asked:
            del self._asked[problem]
            self._answers[problem] = Cancelled(f"problem {problem} was cancelled")

    def _answer_if_every_problem_asked(self) -> None:
        if not self._asked or len(self._asked) < len(self._running):
            return
        order = sorted(self._asked)
        iterates = torch.stack([self._asked[p] for p in order])
        rows = torch.tensor(order, device=iterates.device)
        try:
            values, gradients = values_and_gradients(iterates, rows, self._value_of, self._rows_per_call)
            for i, problem in enumerate(order):
                self._answers[problem] = (values[i], gradients[i])
        except BaseException as err:  # every waiting problem gets it: no thread is left waiting
            for problem in order:
                self._answers[problem] = err
        self._asked.clear()
        self._changed.notify_all()


def lockstep(
    count: int,
    value_of: RowObjective,
    run: Callable[[int, Evaluate], Result],
    *,
    rows_per_call: int,
    cancels_later: Callable[[Result], bool] | None = None,
    groups: Sequence[int] | None = None,
) -> list[Result | None]:
    """``[run(p, evaluate_p) for p in range(count)]``, the runs side by side (module docstring):
    ``evaluate_p(iterate)`` is problem ``p``'s objective ``value_of(iterate[None], [p])`` and its
    gradient, computed in one call with every other running problem's pending request
    (``rows_per_call`` problems per call of ``value_of`` at most). A run that raises ends only itself;
    once every run has ended, the first problem's exception (in problem order) is raised.

    ``cancels_later(result)``: whether problem ``p``'s result makes the problems after ``p`` moot (as
    a sequential loop that stops at it would never run them); they are cancelled at their next
    evaluation (:class:`Cancelled`) and their entry is ``None``. ``groups``: problem ``p``'s group
    ``groups[p]`` (e.g. the client whose restarts they are; default: one group), and a result cancels
    only the later problems of its own group. Which problems run together in each evaluation still
    depends on the runs alone, not on the threads' timing."""
    count = check_positive_int(count, "count")
    rows_per_call = check_positive_int(rows_per_call, "rows_per_call")
    groups = [0] * count if groups is None else [int(g) for g in groups]
    if len(groups) != count:
        raise ValueError(f"groups needs one group per problem: {len(groups)} for {count} problems")
    evaluator = _Evaluator(count, value_of, rows_per_call, groups)
    results: list[Result | None] = [None] * count
    errors: dict[int, BaseException] = {}

    def work(problem: int) -> None:
        cancel_later = False
        try:
            results[problem] = result = run(problem, lambda iterate: evaluator.evaluate(problem, iterate))
            cancel_later = cancels_later is not None and cancels_later(result)
        except Cancelled:
            pass
        except BaseException as err:
            errors[problem] = err
        finally:
            evaluator.finish(problem, cancel_later)

    threads = [threading.Thread(target=work, args=(p,), name=f"lockstep-{p}", daemon=True) for p in range(count)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # e.g. Ctrl-C while waiting: the runs end at their next evaluation, not in the background
        evaluator.cancel_all()
        raise
    if errors:
        raise errors[min(errors)]
    return results
