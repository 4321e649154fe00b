"""Which adaptive attack(s) a client's defenses get, read from the registry.

``adaptive_attacks(defense, iterations=..., seed=...)`` returns the attacks that know ``defense``:
a defense of :mod:`lightning_gp.defenses`, its callback (unwrapped to the defense it holds), the
DP-SGD callback, or a wrapping module (``RefinerModule``, ``PriPruneModule``). Defenses are found
by class, walking the method resolution order, so a subclass inherits its parent's attack.

Each attack is registered beside its definition, keyed by the defense class
(:func:`~lightning_gp.attacks.registry.register_adaptive_attack`, or, when the attack is the
defense-aware pair on a :class:`~lightning_gp.attacks.adaptive.DefenseKnowledge`,
:func:`~lightning_gp.attacks.registry.register_defense_knowledge`, which also composes with other
defenses); :mod:`lightning_gp.attacks.registry` lists where. A defense with no registered attack
gets the published Inverting Gradients, marked as a fallback
(:class:`~lightning_gp.attacks.adaptive.UnmodelledDefenseWarning`).

A client that runs several defenses (``[GaussianNoise, TopKPruning]``, DP-SGD and a pruning, ...)
is attacked by :func:`adaptive_attacks_of`, which models all of them at once: the knowledge of each
stage composed in pipeline order (:func:`~lightning_gp.attacks.adaptive.compose_knowledge`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from lightning_gp.attacks.adaptive import (
    DefenseKnowledge,
    UnmodelledDefenseWarning,
    compose_knowledge,
    defense_aware_attacks,
    mark_fallback,
)
from lightning_gp.attacks.base import GradientAttack
from lightning_gp.attacks.registry import (
    AdaptiveDeclaration,
    KnowledgeAttacks,
    KnowledgeFactory,
    declaration_of,
)


def _knowledge_of(knowledge: KnowledgeFactory, target: Any) -> DefenseKnowledge:
    built = knowledge(target)
    if not isinstance(built, DefenseKnowledge):
        raise TypeError(
            f"the knowledge factory of {type(target).__name__} returned {type(built).__name__}, not a DefenseKnowledge"
        )
    return built


def _builder(declared: AdaptiveDeclaration) -> KnowledgeAttacks:
    return defense_aware_attacks if declared.attacks is None else declared.attacks


def _build(declared: AdaptiveDeclaration, target: Any, kwargs: dict[str, Any]) -> list[GradientAttack]:
    if declared.knowledge is None:
        assert declared.factory is not None
        return declared.factory(target, kwargs)
    return _builder(declared)(_knowledge_of(declared.knowledge, target), kwargs)


def _knowledge_based(target: Any) -> AdaptiveDeclaration | None:
    declared = declaration_of(target)
    return declared if declared is not None and declared.knowledge is not None else None


def _declared(target: Any) -> AdaptiveDeclaration:
    declared = declaration_of(target)
    if declared is None:
        raise ValueError(f"{type(target).__name__} declares no adaptive attack")
    return declared


def _declaration(target: Any) -> AdaptiveDeclaration:
    declared = _knowledge_based(target)
    if declared is None:
        raise ValueError(f"{type(target).__name__} declares no DefenseKnowledge")
    return declared


def _stage_knowledge(target: Any) -> DefenseKnowledge:
    declared = _declaration(target)
    assert declared.knowledge is not None
    return _knowledge_of(declared.knowledge, target)


def modelled_defense(defense: Any) -> Any:
    """The object whose class declares the attack: a callback that declares its own (it may know more
    than its inner defense, e.g. GradDefense's public root set), else its inner defense (``.defense``),
    else ``defense``."""
    inner = getattr(defense, "defense", None)
    if inner is None or declaration_of(defense) is not None:
        return defense
    return inner


def defense_knowledge(defense: Any) -> DefenseKnowledge | None:
    """What the server knows of ``defense`` (or of the defense its callback holds), when its
    adaptive attack is built on a :class:`DefenseKnowledge`; ``None`` when its attack is another
    kind (Refiner, ATS, PRECODE, SGI, a factory of
    :func:`~lightning_gp.attacks.registry.register_adaptive_attack`) or none is registered."""
    target = modelled_defense(defense)
    return None if _knowledge_based(target) is None else _stage_knowledge(target)


def has_adaptive_attack(defense: Any) -> bool:
    """Whether ``defense`` (or the defense its callback holds) declares an adaptive attack."""
    return declaration_of(modelled_defense(defense)) is not None


def adaptive_attacks(defense: Any, **attack_kwargs: Any) -> list[GradientAttack]:
    """The adaptive attacks ``defense`` declares, built with ``attack_kwargs`` (the budget).

    A defense without one gets the published Inverting Gradients as a marked fallback (a warning
    now, ``meta["fallback"]`` on every reconstruction), never a silent substitute.
    """
    target = modelled_defense(defense)
    declared = declaration_of(target)
    if declared is None:
        name = type(target).__name__
        warnings.warn(
            f"no adaptive attack is registered for {name}: using the published Inverting Gradients, marked as a "
            "fallback (register one with lightning_gp.attacks.register_adaptive_attack)",
            UnmodelledDefenseWarning,
            stacklevel=2,
        )
        knowledge = DefenseKnowledge(defense=name, support=False, fallback_reason=f"{name} is not modelled")
        return defense_aware_attacks(knowledge, dict(attack_kwargs))
    attacks = _build(declared, target, dict(attack_kwargs))
    if not attacks:
        raise RuntimeError(f"the adaptive attack factory of {type(target).__name__} returned no attack")
    return attacks


def _stages(defenses: Sequence[Any]) -> list[Any]:
    if isinstance(defenses, (str, bytes)) or not isinstance(defenses, Sequence):
        raise TypeError(
            f"defenses must be a sequence of defenses in pipeline order (a list), got {type(defenses).__name__}; "
            "for one defense use adaptive_attacks(defense)"
        )
    for i, defense in enumerate(defenses):
        if defense is None:
            raise TypeError(f"defenses[{i}] is None, not a defense")
    return list(defenses)


def _plan_composition(defenses: Sequence[Any]) -> tuple[list[Any], list[str], list[str], list[str], str | None]:
    """``(targets, names, unregistered, not knowledge-based, reason the knowledge cannot compose)``."""
    targets = [modelled_defense(d) for d in _stages(defenses)]
    names = [type(t).__name__ for t in targets]
    declared = [declaration_of(t) for t in targets]
    unregistered = [n for n, d in zip(names, declared) if d is None]
    special = [n for n, d in zip(names, declared) if d is not None and d.knowledge is None]
    refused = None
    if not unregistered and not special and len(targets) > 1:
        try:
            compose_knowledge([_stage_knowledge(t) for t in targets])
        except ValueError as err:
            refused = str(err)
    return targets, names, unregistered, special, refused


def composition_fallback_reason(defenses: Sequence[Any]) -> str | None:
    """Why :func:`adaptive_attacks_of` would fall back on ``defenses`` (a defense with no adaptive
    attack, an attack that models its own defense only, knowledge that does not compose), or
    ``None`` when its attacks model every defense of the composition (the analogue of
    :func:`has_adaptive_attack`; ``None`` for no defense)."""
    targets, names, unregistered, special, refused = _plan_composition(defenses)
    if unregistered:
        return f"not modelled: {unregistered} (no adaptive attack registered)"
    if special and len(targets) > 1:
        return (
            f"the adaptive attacks of {special} model their own defense only; in the composition {names} they do not "
            f"model {[n for n in names if n not in special] or 'the other stages'}"
        )
    if refused is not None:
        return refused
    return None


def composed_knowledge(defenses: Sequence[Any]) -> DefenseKnowledge:
    """The one :class:`DefenseKnowledge` of a client that ran ``defenses`` in this order (pipeline
    order): each defense's knowledge, composed by :func:`compose_knowledge`. Raises ``ValueError``
    when a defense has no knowledge-based attack or the knowledge does not compose."""
    targets, names, unregistered, special, _ = _plan_composition(defenses)
    if not targets:
        raise ValueError("defenses must hold at least one defense")
    if unregistered or special:
        raise ValueError(
            f"no composable knowledge for {unregistered + special} in {names}: "
            + (f"{unregistered} declare no adaptive attack" if unregistered else "")
            + ("; " if unregistered and special else "")
            + (f"the attacks of {special} are not built on a DefenseKnowledge" if special else "")
        )
    return compose_knowledge([_stage_knowledge(t) for t in targets])


def adaptive_attacks_of(defenses: Sequence[Any], **attack_kwargs: Any) -> list[GradientAttack]:
    """The adaptive attacks of a client that ran every defense of ``defenses``, in this order (the
    order the pipeline applies them: DP-SGD's per-example clip and noise, then the defense stages
    as given to the Trainer; a model wrapper anywhere), built with ``attack_kwargs`` (the budget).

    - No defense: no attack (``[]``). One defense: exactly :func:`adaptive_attacks` of it.
    - Every defense knowledge-based (pruning, noise, clipping, quantisation, DP-SGD, Soteria, the
      optimal defenses): their knowledge composed in order (:func:`composed_knowledge`) and the
      attacks built on it: the defense-aware pair (:func:`defense_aware_attacks`), or the attacks
      every stage declares when they all declare the same builder (quantisation: Adam only). The
      attacks model every stage: ``meta["fallback"]`` is false where the view's
      ``meta["defenses"]`` names no other defense. A defense given twice is two stages (the
      pipeline runs it twice: two noises add in variance, two clips compose).
    - A defense with no adaptive attack: the published Inverting Gradients and iDLG, marked as a
      fallback whose reason names it (:class:`UnmodelledDefenseWarning`), as for one defense.
    - A defense whose attack is not knowledge-based (Refiner, ATS, PRECODE, PriPrune's SGI, a
      :func:`~lightning_gp.attacks.registry.register_adaptive_attack` factory), or knowledge that
      does not compose (GradDefense, Outpost with another stage): no attack models the composition. Each such defense's own
      attacks, and the knowledge-based attack of the other stages composed, are returned with
      every reconstruction marked ``meta["fallback"]`` and a ``fallback_reason`` naming what they
      do not model (:class:`UnmodelledDefenseWarning`): useful attempts, never a claim to model it.
    """
    targets, names, unregistered, special, refused = _plan_composition(defenses)
    if not targets:
        return []
    if len(targets) == 1:
        return adaptive_attacks(targets[0], **attack_kwargs)
    reason = composition_fallback_reason(defenses)
    if reason is not None:
        warnings.warn(
            f"no adaptive attack models the composition {names}: {reason}; its attacks are marked as fallbacks",
            UnmodelledDefenseWarning,
            stacklevel=2,
        )
    if unregistered:
        knowledge = DefenseKnowledge(defense="+".join(names), support=False, fallback_reason=reason)
        return defense_aware_attacks(knowledge, dict(attack_kwargs))
    if refused is not None or special:
        assert reason is not None
        attacks: list[GradientAttack] = []
        for target, name in zip(targets, names):
            if name in special:
                others = [n for n in names if n != name]
                own = _build(_declared(target), target, dict(attack_kwargs))
                attacks += [mark_fallback(attack, f"models {name} only; {reason}", others) for attack in own]
        rest = [t for t, n in zip(targets, names) if n not in special]
        partial = _partial_knowledge(rest, special) if refused is None else None
        if partial is not None:
            modelled = [type(t).__name__ for t in rest]
            others = [n for n in names if n not in modelled]
            for attack in _composed_builder(rest)(partial, dict(attack_kwargs)):
                attacks.append(mark_fallback(attack, f"models {modelled} only; {reason}", others))
        elif rest:
            knowledge = DefenseKnowledge(defense="+".join(names), support=False, fallback_reason=reason)
            attacks += defense_aware_attacks(knowledge, dict(attack_kwargs))
        return attacks
    knowledge = composed_knowledge(targets)
    attacks = _composed_builder(targets)(knowledge, dict(attack_kwargs))
    if not attacks:
        raise RuntimeError(f"the attacks of the composition {names} came out empty")
    return attacks


def _partial_knowledge(rest: Sequence[Any], special: Sequence[str]) -> DefenseKnowledge | None:
    """The knowledge of the knowledge-based stages ``rest`` of a composition, composed (``None`` when
    there are none or it does not compose); it lets the stages ``special`` through the check of the
    view's ``meta["defenses"]`` (its attacks are marked as fallbacks instead)."""
    if not rest:
        return None
    try:
        knowledge = compose_knowledge([_stage_knowledge(t) for t in rest])
    except ValueError:
        return None
    if len(rest) == 1:  # compose_knowledge returns a single stage itself: do not change the factory's object
        knowledge = dataclasses.replace(knowledge)
    if knowledge.models:
        knowledge.models = tuple(dict.fromkeys([*knowledge.models, *special]))
    return knowledge


def _composed_builder(targets: Sequence[Any]) -> KnowledgeAttacks:
    """The builder every stage declares when they agree, else the defense-aware pair."""
    builders = {_builder(_declaration(t)) for t in targets}
    return builders.pop() if len(builders) == 1 else defense_aware_attacks
