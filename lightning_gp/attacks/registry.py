"""Which adaptive attack(s) each defense declares: the defense-aware attacker of every defense.

``adaptive_attacks(defense, iterations=..., seed=...)`` returns the attacks that know ``defense``:
a defense of :mod:`lightning_gp.defenses`, its callback (unwrapped to the defense it holds), the
DP-SGD callback, or a wrapping module (``RefinerModule``, ``PriPruneModule``). Defenses are found
by class, walking the method resolution order, so a subclass inherits its parent's attack.

Keys are qualified class names, so this module imports none of the defenses (which may import
Lightning, Opacus or the metrics); a new defense (a baseline, a user's own) plugs in its attack with
:func:`register_adaptive_attack`, or, when its attack is the defense-aware pair on a
:class:`~lightning_gp.attacks.adaptive.DefenseKnowledge`, with :func:`register_defense_knowledge`
(then it also composes with other defenses). A defense with no registered attack gets the published
Inverting Gradients, marked as a fallback (:class:`~lightning_gp.attacks.adaptive.UnmodelledDefenseWarning`).

A client that runs several defenses (``[GaussianNoise, TopKPruning]``, DP-SGD and a pruning, ...)
is attacked by :func:`adaptive_attacks_of`, which models all of them at once: the knowledge of each
stage composed in pipeline order (:func:`~lightning_gp.attacks.adaptive.compose_knowledge`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from lightning_gp.attacks.adaptive import (
    DefenseAwareIDLG,
    DefenseAwareInversion,
    DefenseKnowledge,
    UnmodelledDefenseWarning,
    compose_knowledge,
    coordinate_clip,
    mark_fallback,
    straight_through_quantization,
)
from lightning_gp.attacks.ats_aware import ATSAwareInversion, ATSAwareRobbing
from lightning_gp.attacks.base import GradientAttack
from lightning_gp.attacks.perturbation_aware import graddefense_knowledge, outpost_knowledge
from lightning_gp.attacks.precode_aware import PRECODEAwareInversion
from lightning_gp.attacks.refiner_aware import RefinerAwareInversion
from lightning_gp.attacks.sgi import SGI
from lightning_gp.attacks.view import ServerView

#: ``factory(defense, attack_kwargs) -> attacks``; ``attack_kwargs`` is the budget: ``iterations``
#: (of the Adam attacks), ``lbfgs_iterations``, ``restarts``, ``seed``, and any option of the
#: attacks the factory builds.
AdaptiveFactory = Callable[[Any, dict[str, Any]], list[GradientAttack]]
#: ``knowledge(defense) -> DefenseKnowledge``: what the server knows of ``defense``.
KnowledgeFactory = Callable[[Any], DefenseKnowledge]
#: ``attacks(knowledge, attack_kwargs) -> attacks``: the attacks built on a knowledge
#: (:func:`defense_aware_attacks`, or :func:`defense_aware_inversion` alone).
KnowledgeAttacks = Callable[[DefenseKnowledge, dict[str, Any]], list[GradientAttack]]

_FACTORIES: dict[str, AdaptiveFactory] = {}
#: the knowledge-based declarations: key -> (knowledge factory, attacks built on it)
_KNOWLEDGE: dict[str, tuple[KnowledgeFactory, KnowledgeAttacks]] = {}


def _key(defense_type: type | str) -> str:
    return defense_type if isinstance(defense_type, str) else f"{defense_type.__module__}.{defense_type.__qualname__}"


def register_adaptive_attack(defense_type: type | str, factory: AdaptiveFactory, *, replace: bool = False) -> None:
    """Declare the adaptive attack(s) of ``defense_type`` (a class, or its qualified name
    ``"package.module.Class"``). Registering a class twice needs ``replace=True``."""
    key = _key(defense_type)
    if key.count(".") < 1:
        raise ValueError(f"defense_type must be a class or a qualified name 'module.Class', got {defense_type!r}")
    if key in _FACTORIES and not replace:
        raise ValueError(f"{key} already has an adaptive attack registered; pass replace=True to swap it")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    _FACTORIES[key] = factory
    _KNOWLEDGE.pop(key, None)  # a plain factory replaces a knowledge-based declaration


def register_defense_knowledge(
    defense_type: type | str,
    knowledge: KnowledgeFactory,
    *,
    attacks: KnowledgeAttacks | None = None,
    replace: bool = False,
) -> None:
    """Declare what the server knows of ``defense_type`` (a class or its qualified name):
    ``knowledge(defense)`` gives its :class:`DefenseKnowledge`, and its adaptive attacks are
    ``attacks(knowledge, attack_kwargs)`` (default :func:`defense_aware_attacks`). Unlike
    :func:`register_adaptive_attack`, such a defense composes with the other knowledge-based ones
    in :func:`adaptive_attacks_of`."""
    if not callable(knowledge):
        raise TypeError(f"knowledge must be callable, got {type(knowledge).__name__}")
    if attacks is not None and not callable(attacks):
        raise TypeError(f"attacks must be callable, got {type(attacks).__name__}")
    build = defense_aware_attacks if attacks is None else attacks

    def factory(target: Any, kwargs: dict[str, Any]) -> list[GradientAttack]:
        return build(_knowledge_of(knowledge, target), kwargs)

    register_adaptive_attack(defense_type, factory, replace=replace)
    _KNOWLEDGE[_key(defense_type)] = (knowledge, build)


def _knowledge_of(knowledge: KnowledgeFactory, target: Any) -> DefenseKnowledge:
    built = knowledge(target)
    if not isinstance(built, DefenseKnowledge):
        raise TypeError(
            f"the knowledge factory of {type(target).__name__} returned {type(built).__name__}, not a DefenseKnowledge"
        )
    return built


def modelled_defense(defense: Any) -> Any:
    """The object whose class declares the attack: a callback that declares its own (it may know more
    than its inner defense, e.g. GradDefense's public root set), else its inner defense (``.defense``),
    else ``defense``."""
    inner = getattr(defense, "defense", None)
    if inner is None or _factory(defense) is not None:
        return defense
    return inner


def _declared_key(defense: Any) -> str | None:
    """The key of the nearest class of ``defense`` (method resolution order) with a declaration."""
    for cls in type(defense).__mro__:
        key = _key(cls)
        if key in _FACTORIES:
            return key
    return None


def _factory(defense: Any) -> AdaptiveFactory | None:
    key = _declared_key(defense)
    return None if key is None else _FACTORIES[key]


def _declared_knowledge(defense: Any) -> tuple[KnowledgeFactory, KnowledgeAttacks] | None:
    key = _declared_key(defense)
    return None if key is None else _KNOWLEDGE.get(key)


def _declaration(target: Any) -> tuple[KnowledgeFactory, KnowledgeAttacks]:
    declared = _declared_knowledge(target)
    if declared is None:
        raise ValueError(f"{type(target).__name__} declares no DefenseKnowledge")
    return declared


def _stage_knowledge(target: Any) -> DefenseKnowledge:
    return _knowledge_of(_declaration(target)[0], target)


def defense_knowledge(defense: Any) -> DefenseKnowledge | None:
    """What the server knows of ``defense`` (or of the defense its callback holds), when its
    adaptive attack is built on a :class:`DefenseKnowledge`; ``None`` when its attack is another
    kind (Refiner, ATS, PRECODE, SGI, a factory of :func:`register_adaptive_attack`) or none is
    registered."""
    target = modelled_defense(defense)
    declared = _declared_knowledge(target)
    return None if declared is None else _knowledge_of(declared[0], target)


def has_adaptive_attack(defense: Any) -> bool:
    """Whether ``defense`` (or the defense its callback holds) declares an adaptive attack."""
    return _factory(modelled_defense(defense)) is not None


def adaptive_attacks(defense: Any, **attack_kwargs: Any) -> list[GradientAttack]:
    """The adaptive attacks ``defense`` declares, built with ``attack_kwargs`` (the budget).

    A defense without one gets the published Inverting Gradients as a marked fallback (a warning
    now, ``meta["fallback"]`` on every reconstruction), never a silent substitute.
    """
    target = modelled_defense(defense)
    factory = _factory(target)
    if factory is None:
        name = type(target).__name__
        warnings.warn(
            f"no adaptive attack is registered for {name}: using the published Inverting Gradients, marked as a "
            "fallback (register one with lightning_gp.attacks.register_adaptive_attack)",
            UnmodelledDefenseWarning,
            stacklevel=2,
        )
        knowledge = DefenseKnowledge(defense=name, support=False, fallback_reason=f"{name} is not modelled")
        return defense_aware_attacks(knowledge, dict(attack_kwargs))
    attacks = factory(target, dict(attack_kwargs))
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
    unregistered = [n for n, t in zip(names, targets) if _factory(t) is None]
    special = [n for n, t in zip(names, targets) if _factory(t) is not None and _declared_knowledge(t) is None]
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
      :func:`register_adaptive_attack` factory), or knowledge that does not compose (GradDefense,
      Outpost with another stage): no attack models the composition. Each such defense's own
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
                own = _FACTORIES[_declared_key(target) or ""](target, dict(attack_kwargs))
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
    builders = {_declaration(t)[1] for t in targets}
    return builders.pop() if len(builders) == 1 else defense_aware_attacks


# ------------------------------------------------------------------------------ built-in declarations
def defense_aware_attacks(knowledge: DefenseKnowledge, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """The two defense-aware optimisers on ``knowledge``: Inverting Gradients (Adam, cosine) and
    iDLG (L-BFGS, L2, restarts). Budget keys: ``iterations`` (Adam), ``lbfgs_iterations``,
    ``restarts`` (IG's; iDLG keeps at least 4), ``seed``, ``device``, ``progress_every``; any other
    key goes to :class:`DefenseAwareInversion`."""
    kwargs = dict(kwargs)
    common = {k: kwargs.pop(k) for k in ("seed", "device", "progress_every") if k in kwargs}
    lbfgs_iterations = kwargs.pop("lbfgs_iterations", 100)
    restarts = kwargs.get("restarts", 1)
    return [
        DefenseAwareInversion(knowledge, **kwargs, **common),
        DefenseAwareIDLG(knowledge, iterations=lbfgs_iterations, restarts=max(4, restarts), **common),
    ]


def defense_aware_inversion(knowledge: DefenseKnowledge, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """The defense-aware Inverting Gradients alone (Adam), for a knowledge whose transform L-BFGS
    cannot use (quantisation: without the straight-through rounding iDLG is the published one)."""
    kwargs = dict(kwargs)
    kwargs.pop("lbfgs_iterations", None)
    return [DefenseAwareInversion(knowledge, **kwargs)]


def _knows(target: Any, **options: Any) -> DefenseKnowledge:
    name = type(target).__name__
    return DefenseKnowledge(defense=name, models=(name,), **options)


def _pruning(target: Any) -> DefenseKnowledge:
    return _knows(target, support=True)


def _quantization(target: Any) -> DefenseKnowledge:
    # A zero of a quantised layer says |g| < m / 2L, not "not sent": every entry is matched. The
    # rounding is applied straight-through (stochastic rounding is unbiased: nothing to apply).
    # Only the Adam attack (defense_aware_inversion): L-BFGS cannot use the straight-through
    # rounding, and without it it is the published iDLG.
    transform = None if target.stochastic_rounding else straight_through_quantization(target.bits)
    return _knows(target, support=False, transform=transform)


def _gaussian(target: Any) -> DefenseKnowledge:
    transform = None if target.clip is None else coordinate_clip(target.clip)
    return _knows(target, support=False, transform=transform, noise_std=target.scale)


def _laplace(target: Any) -> DefenseKnowledge:
    return _knows(target, support=False, noise_std=math.sqrt(2) * target.scale)


def _optimal_noise(target: Any) -> DefenseKnowledge:
    # zero-gradient coordinates get no noise (Eq. 8), so the support is known; the per-coordinate
    # variance depends on the client's data, its average power is scale^2
    return _knows(target, support=True, noise_std=target.scale)


def _optimal_dp_sgd(target: Any) -> DefenseKnowledge:
    return _knows(target, support=True, transform=coordinate_clip(target.clip), noise_std=target.scale)


def _dp_sgd(target: Any) -> DefenseKnowledge:
    def noise_std(view: ServerView) -> float:
        sigma = target.noise_multiplier_used if target.noise_multiplier_used is not None else target.noise_multiplier
        if sigma is None:
            raise ValueError("DPSGD has not chosen its noise multiplier yet (it does at fit start)")
        return float(sigma) * target.max_grad_norm / view.batch_size

    return _knows(target, support=False, per_example_clip=target.max_grad_norm, noise_std=noise_std)


def _refiner(target: Any, kwargs: dict[str, Any]) -> list[GradientAttack]:
    config = target.config
    kwargs.pop("lbfgs_iterations", None)
    return [RefinerAwareInversion(eps=config.eps, alpha=config.alpha, projection=config.projection, **kwargs)]


def _ats(target: Any, kwargs: dict[str, Any]) -> list[GradientAttack]:
    # IG recovers the transformed batch, a malicious server's imprint layer recovers it exactly; the
    # policy's inverse maps either back (no L-BFGS part)
    kwargs.pop("lbfgs_iterations", None)
    rtf_kwargs = {k: kwargs[k] for k in ("seed", "device", "progress_every") if k in kwargs}
    return [ATSAwareInversion(target.policy, **kwargs), ATSAwareRobbing(target.policy, **rtf_kwargs)]


def _precode(target: Any, kwargs: dict[str, Any]) -> list[GradientAttack]:
    # the VB encoder's gradient gives the features whatever eps was; invert them (Adam only)
    kwargs.pop("lbfgs_iterations", None)
    return [PRECODEAwareInversion(**kwargs)]


def _graddefense(target: Any) -> DefenseKnowledge:
    # without the root set the slices are unknown: every layer is judged as one slice
    return graddefense_knowledge(target)


def _graddefense_callback(target: Any) -> DefenseKnowledge:
    # the server holds the public root set and the model it sent: it cuts the same slices
    return graddefense_knowledge(
        target.defense, lambda view: target.slice_boundaries_for(view.model, view.gradients, view.loss_fn)
    )


def _sgi(target: Any, kwargs: dict[str, Any]) -> list[GradientAttack]:
    kwargs.pop("lbfgs_iterations", None)
    return [SGI(**kwargs)]


_KNOWLEDGE_DECLARATIONS: dict[str, tuple[KnowledgeFactory, KnowledgeAttacks]] = {
    "lightning_gp.defenses.sparsification.SparsifyingDefense": (_pruning, defense_aware_attacks),
    "lightning_gp.defenses.optimal.OptimalGradientPruning": (_pruning, defense_aware_attacks),
    # Soteria's pruned columns arrive as exact zeros: the support-restricted match skips them
    "lightning_gp.defenses.soteria.Soteria": (_pruning, defense_aware_attacks),
    "lightning_gp.defenses.quantization.GradientQuantization": (_quantization, defense_aware_inversion),
    "lightning_gp.defenses.noise.GaussianNoise": (_gaussian, defense_aware_attacks),
    "lightning_gp.defenses.noise.LaplaceNoise": (_laplace, defense_aware_attacks),
    "lightning_gp.defenses.optimal.OptimalGradientNoise": (_optimal_noise, defense_aware_attacks),
    "lightning_gp.defenses.optimal.OptimalDPSGD": (_optimal_dp_sgd, defense_aware_attacks),
    "lightning_gp.callbacks.dp_sgd.DPSGD": (_dp_sgd, defense_aware_attacks),
    "lightning_gp.defenses.graddefense.GradDefense": (_graddefense, defense_aware_attacks),
    "lightning_gp.callbacks.graddefense.GradDefense": (_graddefense_callback, defense_aware_attacks),
    "lightning_gp.defenses.outpost.Outpost": (outpost_knowledge, defense_aware_attacks),
}
for _name, (_knowledge, _attacks) in _KNOWLEDGE_DECLARATIONS.items():
    register_defense_knowledge(_name, _knowledge, attacks=_attacks)

for _name, _build in {
    "lightning_gp.refiner.module.RefinerModule": _refiner,
    "lightning_gp.priprune.module.PrunedFedAvgModule": _sgi,
    "lightning_gp.models.precode.PRECODE": _precode,
    "lightning_gp.augmentation.module.ATSModule": _ats,
}.items():
    register_adaptive_attack(_name, _build)
