"""The attack registries: the adaptive attack(s) each defense class declares, and the published attacks by name.

Registration is a declaration keyed by the defense class itself (never its name), so renaming or
moving a defense breaks an import instead of silently turning its attack into a fallback:

- :mod:`lightning_gp.attacks.adaptive`: the defense-aware pair on the pruning, quantisation,
  Soteria and optimal-pruning defenses;
- :mod:`lightning_gp.attacks.noise_aware`: the pair and the noise-aware MAP on Gaussian, Laplace
  and optimal noise, LocalGaussianMechanism and OptimalDPSGD (DP-SGD's callback declares the same in its module);
- :mod:`lightning_gp.attacks.perturbation_aware`: GradDefense, Outpost;
- :mod:`~lightning_gp.attacks.ats_aware`, :mod:`~lightning_gp.attacks.precode_aware`: ATS, PRECODE;
- a class defined above the attacks declares its attack in its own module (the attacks may not
  import it): ``DPSGD`` and the ``GradDefense`` callback (:mod:`lightning_gp.callbacks`),
  ``RefinerModule`` (:mod:`lightning_gp.refiner.module`), ``PrunedFedAvgModule``
  (:mod:`lightning_gp.priprune.module`, SGI);
- the published attacks (:func:`register_attack`) in :mod:`~lightning_gp.attacks.optimization`,
  :mod:`~lightning_gp.attacks.rgap`, :mod:`~lightning_gp.attacks.robbing_the_fed` and
  :mod:`~lightning_gp.attacks.fedavg`.

``import lightning_gp.attacks`` imports every attack module, so the pure defenses' declarations
are complete once the package is imported; a higher class is declared whenever its module is
imported, which holding an instance of it implies. A new defense (a
baseline, a user's own) plugs in its attack the same way, in the module that defines the attack.

This module holds the tables only; building the attacks of a client's defenses (the fallback for an
unregistered defense, compositions) is :mod:`lightning_gp.attacks.resolution`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

if TYPE_CHECKING:
    from torch import nn

    from lightning_gp.attacks.base import GradientAttack

#: ``factory(defense, attack_kwargs) -> attacks``; ``attack_kwargs`` is the budget: ``iterations``
#: (of the Adam attacks), ``lbfgs_iterations``, ``restarts``, ``seed``, and any option of the
#: attacks the factory builds.
AdaptiveFactory = Callable[[Any, dict[str, Any]], "list[GradientAttack]"]
#: ``knowledge(defense) -> DefenseKnowledge``: what the server knows of ``defense``. Typed ``Any``
#: here: :mod:`lightning_gp.attacks.adaptive`, which defines ``DefenseKnowledge``, registers through
#: this module, and the registry stays below it (no import cycle, not even for type checking).
KnowledgeFactory = Callable[[Any], Any]
#: ``attacks(knowledge, attack_kwargs) -> attacks``: the attacks built on a knowledge
#: (:func:`~lightning_gp.attacks.adaptive.defense_aware_attacks` when none is given).
KnowledgeAttacks = Callable[[Any, dict[str, Any]], "list[GradientAttack]"]

F = TypeVar("F", bound=Callable[..., Any])
A = TypeVar("A", bound=type)


def _qualified(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


@dataclass(frozen=True)
class AdaptiveDeclaration:
    """What a defense class declares: its attacks' factory, or, for a knowledge-based declaration,
    the knowledge factory and the attacks built on it (``attacks=None``: the defense-aware pair)."""

    defense_type: type
    factory: AdaptiveFactory | None = None
    knowledge: KnowledgeFactory | None = None
    attacks: KnowledgeAttacks | None = None

    @property
    def registrant(self) -> str:
        """The qualified name of the function registered (where the declaration lives)."""
        return _qualified(self.knowledge if self.knowledge is not None else self.factory)


#: defense class -> its declaration, in registration order
_DECLARATIONS: dict[type, AdaptiveDeclaration] = {}


def _declare(declaration: AdaptiveDeclaration, replace: bool) -> None:
    defense_type = declaration.defense_type
    if not isinstance(defense_type, type):
        raise TypeError(
            f"defense_type must be the defense class itself, got {type(defense_type).__name__} {defense_type!r} "
            "(a name would turn a renamed defense's attack into a silent fallback)"
        )
    existing = _DECLARATIONS.get(defense_type)
    if existing is not None and not replace:
        raise ValueError(
            f"{_qualified(defense_type)} already has an adaptive attack registered, {existing.registrant}; "
            f"{declaration.registrant} registers another (pass replace=True to swap it)"
        )
    _DECLARATIONS[defense_type] = declaration


_DECORATE: Any = object()  # the factory argument left out: return a decorator


@overload
def register_adaptive_attack(defense_type: type, *, replace: bool = False) -> Callable[[F], F]: ...
@overload
def register_adaptive_attack(defense_type: type, factory: F, *, replace: bool = False) -> F: ...
def register_adaptive_attack(defense_type: type, factory: Any = _DECORATE, *, replace: bool = False) -> Any:
    """Declare the adaptive attack(s) of ``defense_type`` (the class; subclasses inherit it):
    ``factory(defense, attack_kwargs)`` builds them. Used as a decorator beside the attack's
    definition, ``@register_adaptive_attack(RefinerModule)``, or called with the factory.
    Registering a class twice is an error naming both registrants, unless ``replace=True``."""

    def register(factory: F) -> F:
        if not callable(factory):
            raise TypeError(f"factory must be callable, got {type(factory).__name__}")
        _declare(AdaptiveDeclaration(defense_type, factory=factory), replace)
        return factory

    return register if factory is _DECORATE else register(factory)


@overload
def register_defense_knowledge(
    defense_type: type, *, attacks: KnowledgeAttacks | None = None, replace: bool = False
) -> Callable[[F], F]: ...
@overload
def register_defense_knowledge(
    defense_type: type, knowledge: F, *, attacks: KnowledgeAttacks | None = None, replace: bool = False
) -> F: ...
def register_defense_knowledge(
    defense_type: type, knowledge: Any = _DECORATE, *, attacks: KnowledgeAttacks | None = None, replace: bool = False
) -> Any:
    """Declare what the server knows of ``defense_type`` (the class; subclasses inherit it):
    ``knowledge(defense)`` gives its :class:`~lightning_gp.attacks.adaptive.DefenseKnowledge`, and
    its adaptive attacks are ``attacks(knowledge, attack_kwargs)`` (default: the defense-aware pair,
    :func:`~lightning_gp.attacks.adaptive.defense_aware_attacks`). Used as a decorator on the
    knowledge factory, or called with it. Unlike :func:`register_adaptive_attack`, such a defense
    composes with the other knowledge-based ones in :func:`~lightning_gp.attacks.adaptive_attacks_of`."""
    if attacks is not None and not callable(attacks):
        raise TypeError(f"attacks must be callable, got {type(attacks).__name__}")

    def register(knowledge: F) -> F:
        if not callable(knowledge):
            raise TypeError(f"knowledge must be callable, got {type(knowledge).__name__}")
        _declare(AdaptiveDeclaration(defense_type, knowledge=knowledge, attacks=attacks), replace)
        return knowledge

    return register if knowledge is _DECORATE else register(knowledge)


def declaration_of(defense: Any) -> AdaptiveDeclaration | None:
    """The declaration of the nearest class of ``defense`` (method resolution order) that has one."""
    for cls in type(defense).__mro__:
        declared = _DECLARATIONS.get(cls)
        if declared is not None:
            return declared
    return None


def declared_defenses() -> list[type]:
    """Every defense class with a declared adaptive attack, in registration order."""
    return list(_DECLARATIONS)


# ------------------------------------------------------------------------------ published attacks
class Budget(Protocol):
    """The iterations a published attack is built with (:class:`~lightning_gp.audit.AttackBudget`)."""

    @property
    def ig_iterations(self) -> int: ...
    @property
    def lbfgs_iterations(self) -> int: ...
    @property
    def rtf_bins(self) -> int: ...
    @property
    def lbfgs_restarts(self) -> int: ...


#: ``build(budget, seed, model) -> attack``: a fresh attack for one client of the model ``model``.
AttackBuilder = Callable[[Budget, int, "nn.Module"], "GradientAttack"]


@dataclass(frozen=True)
class PublishedAttack:
    """A published attack: its name (a column of the audit), its class, how it is built from a
    budget, and its position among the published attacks (``order``)."""

    name: str
    attack_type: type
    build: AttackBuilder
    order: int


_PUBLISHED: dict[str, PublishedAttack] = {}


def register_attack(name: str, *, build: AttackBuilder, order: int) -> Callable[[A], A]:
    """Class decorator: publish the attack as ``name``, built by ``build(budget, seed, model)``,
    ``order``-th among the published attacks (the audit's columns). Applied on the attack's class
    where it is defined; a name registered twice is an error naming both classes."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(build):
        raise TypeError(f"build must be callable, got {type(build).__name__}")

    def register(attack_type: A) -> A:
        existing = _PUBLISHED.get(name)
        if existing is not None:
            raise ValueError(
                f"the published attack {name!r} is already {_qualified(existing.attack_type)}; "
                f"{_qualified(attack_type)} cannot take the name"
            )
        _PUBLISHED[name] = PublishedAttack(name, attack_type, build, order)
        return attack_type

    return register


def published_attack_names() -> list[str]:
    """The names of the published attacks, in their order."""
    return [p.name for p in sorted(_PUBLISHED.values(), key=lambda p: p.order)]


def attacks_by_name(names: Sequence[str] | None = None) -> list[PublishedAttack]:
    """The published attacks (all, in their order, or the ``names`` given, in that order); an
    unknown name is an error listing the choices."""
    known = published_attack_names()
    if names is None:
        return [_PUBLISHED[n] for n in known]
    unknown = [n for n in names if n not in _PUBLISHED]
    if unknown:
        raise ValueError(f"unknown attack(s) {unknown}; published attacks: {known}")
    return [_PUBLISHED[n] for n in names]
