"""ppo_fast inside verl 0.9.1 without editing verl: its estimators and policy losses registered
under ``ppo_fast_*`` names, and an opt-in that puts its GAE, GRPO and whitening under verl's own
names in the two branches verl hard-codes.

    pip install ppo_fast[torch]      # the ``verl.plugins`` entry point comes with the package
    algorithm.adv_estimator=ppo_fast_grpo
    actor_rollout_ref.actor.policy_loss.loss_mode=ppo_fast_cispo

``import verl`` loads every entry point of the ``verl.plugins`` group (unless
``VERL_USE_EXTERNAL_PLUGINS=none``), in the driver and in every Ray worker; ppo_fast's
(``ppo_fast.compat._verl_entry_point``) calls ``load_plugin``. Scripts call ``register`` /
``unregister`` and ``patch_core_algos`` / ``unpatch_core_algos`` themselves.

What is registered, derived from verl's registries and ``ppo_fast.compat.verl`` (``names``):
each entry ``name -> f`` of verl's ``ADV_ESTIMATOR_REGISTRY`` and ``POLICY_LOSS_REGISTRY`` that
verl defines itself, for which ``ppo_fast.compat.verl`` exports a function of the same name as
``f`` (its functions carry the names of the verl functions they reproduce), is registered as
``ppo_fast_<name>``. A function added to ``ppo_fast.compat.verl`` under verl's name is
registered with no edit here. verl's own names are never touched.

- Policy losses: the compat function itself; it reads its settings from verl's ActorConfig as
  verl's does (``clip_ratio*``, ``policy_loss.*``, ``tau_*``, ``global_batch_info``).
- Estimators: the compat function behind a check of what verl passed. verl's registry path
  (``ray_trainer.compute_advantage`` for any name but "gae" and "grpo") passes
  ``token_level_rewards``, ``response_mask``, ``config`` (the AlgoConfig), ``index`` (the uids)
  and ``reward_baselines`` when the batch has them; it passes ``values``, ``non_tensor_batch``,
  ``batch``, ``sum_pi_squared`` and ``old_log_probs`` only under verl's own names "gae", "gdpo"
  and the two optimal-token-baseline names, and the trainer generates ``reward_baselines`` only
  for "remax". A ``ppo_fast_*`` estimator that needs one of those and did not get it raises a
  ValueError saying what to set instead, never computes something else. ``gamma``, ``lam``
  and ``norm_adv_by_std_in_grpo``, which verl's trainer hands to its GAE and GRPO branches
  from the algorithm config, are read from ``config`` for ``ppo_fast_gae`` and
  ``ppo_fast_grpo``; every other estimator gets exactly what verl's registry path gives verl's
  (``ppo_fast_grpo_vectorized`` ignores ``norm_adv_by_std_in_grpo`` as verl's does there, PR
  7893), so each ``ppo_fast_<name>`` equals verl's ``<name>`` in verl's trainer.

The opt-in (``PPO_FAST_VERL_PATCH=1`` in the environment of the driver and the workers, or
``patch_core_algos()``): ``compute_advantage`` calls ``core_algos.compute_gae_advantage_return``
and ``core_algos.compute_grpo_outcome_advantage`` by name, so those two attributes of
``verl.trainer.ppo.core_algos`` and ``verl.utils.torch_functional.masked_whiten`` (which
core_algos calls as ``verl_F.masked_whiten``, in GAE, REINFORCE++ and GDPO) are replaced by the
compat functions; ``unpatch_core_algos()`` puts verl's back. verl's registry entries stay verl's.
That is the way to GAE (verl passes ``values`` and runs the critic only for "gae") and to GRPO
in the v1 trainer (its ``compute_advantage_for_multi_trajectories`` treats the outputs of a
multi-turn session together only when the estimator is "grpo"; with ``ppo_fast_grpo`` it
delegates to ``compute_advantage`` row by row).

Both trainers reach these the same way: the legacy ``RayPPOTrainer.fit`` and the v1 trainer's
``_compute_advantage`` (through ``v1.utils.compute_advantage_for_multi_trajectories``) call
``ray_trainer.compute_advantage``; both actors' ``workers.utils.losses.ppo_loss`` call
``core_algos.get_policy_loss_fn(policy_loss.loss_mode)``.

Refused rather than half-done: a verl other than 0.9.1 (the release ``ppo_fast.compat.verl``
reproduces), a ``ppo_fast_*`` name or a patched attribute that something else already holds, a
``PPO_FAST_VERL_PATCH`` value that is not a boolean. ``load_plugin`` logs any of these at WARNING
with the reason (verl logs a plugin's failure at DEBUG only).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

VERL_VERSION = "0.9.1"
PREFIX = "ppo_fast_"
PATCH_ENV = "PPO_FAST_VERL_PATCH"

_logger = logging.getLogger(__name__)

# The inputs that verl 0.9.1's compute_advantage passes only under its own estimator names: what
# to set instead, when a ppo_fast_* estimator needs one of them.
_NAME_GATED_INPUTS = {
    "values": (
        "algorithm.adv_estimator=gae with PPO_FAST_VERL_PATCH=1 (verl passes values and runs the "
        "critic only for gae; the opt-in runs ppo_fast's GAE there)"
    ),
    "reward_baselines": (
        "algorithm.adv_estimator=remax (verl's trainer generates the greedy baselines only for "
        "remax)"
    ),
    "non_tensor_batch": (
        "algorithm.adv_estimator=gdpo (verl passes the per-reward scores only for gdpo)"
    ),
    "batch": "algorithm.adv_estimator=gdpo (verl passes the batch only for gdpo)",
    "sum_pi_squared": (
        "algorithm.adv_estimator=optimal_token_baseline or tir_optimal_token_baseline (verl "
        "passes sum_pi_squared and old_log_probs only for those)"
    ),
    "old_log_probs": (
        "algorithm.adv_estimator=optimal_token_baseline or tir_optimal_token_baseline (verl "
        "passes sum_pi_squared and old_log_probs only for those)"
    ),
}

# What verl's registry path passes to whichever estimator it calls (ray_trainer.py): dropped
# for a compat function that does not take them (GAE's verl signature has none of them).
_PASSED_TO_EVERY_ESTIMATOR = ("config", "index", "reward_baselines")

# verl's trainer hands these settings to its two hard-coded branches (ray_trainer.py:
# gamma=algorithm.gamma, lam=algorithm.lam, norm_adv_by_std_in_grpo=algorithm.get(..., True));
# the registry path leaves them in `config`. (setting, default when the config lacks it; None:
# required.)
_SETTINGS_FROM_CONFIG = {
    "gae": {"gamma": None, "lam": None},
    "grpo": {"norm_adv_by_std_in_grpo": True},
}


def _modules() -> tuple[Any, Any, Any]:
    """verl's core_algos and torch_functional and ppo_fast.compat.verl, once verl is checked to
    be the release compat.verl reproduces."""
    import verl

    version = getattr(verl, "__version__", None)
    if version != VERL_VERSION:
        raise RuntimeError(
            f"ppo_fast.compat.verl reproduces verl {VERL_VERSION}, this is verl {version}: "
            f"install verl=={VERL_VERSION}, or turn ppo_fast's plugin off with "
            "VERL_USE_EXTERNAL_PLUGINS set to the other plugins' names (or none)"
        )
    import verl.utils.torch_functional as verl_F
    from verl.trainer.ppo import core_algos

    from . import verl as compat

    return core_algos, verl_F, compat


def _own(registry: dict[str, Any], core_algos: Any) -> dict[str, Callable]:
    """verl's own entries of a registry (not another plugin's, not ppo_fast's)."""
    return {
        str(name): fn
        for name, fn in registry.items()
        if getattr(fn, "__module__", None) == core_algos.__name__
        and not str(name).startswith(PREFIX)
    }


def names(kind: str) -> dict[str, tuple[str, Callable]]:
    """``{ppo_fast name: (verl name, compat function)}`` for ``kind`` "estimator" or
    "policy_loss": verl's own registry entries that ``ppo_fast.compat.verl`` reproduces, by the
    name of verl's function (see the module docstring). The list ``register`` registers."""
    core_algos, _, compat = _modules()
    registry = _registry(core_algos, kind)
    exported = set(compat.__all__)
    return {
        PREFIX + name: (name, getattr(compat, fn.__name__))
        for name, fn in sorted(_own(registry, core_algos).items())
        if fn.__name__ in exported
    }


def _registry(core_algos: Any, kind: str) -> dict[str, Any]:
    if kind == "estimator":
        return core_algos.ADV_ESTIMATOR_REGISTRY
    if kind == "policy_loss":
        return core_algos.POLICY_LOSS_REGISTRY
    raise ValueError(f"kind must be 'estimator' or 'policy_loss', got {kind!r}")


def _config_setting(config: Any, field: str, default: Any, name: str) -> Any:
    if config is None:
        raise ValueError(
            f"{name} reads algorithm.{field} from config, and verl passed config=None: pass "
            "the trainer's algorithm config (verl's trainers pass config=self.config.algorithm)"
        )
    value = config.get(field, default) if hasattr(config, "get") else getattr(config, field)
    if value is None:
        raise ValueError(
            f"{name} needs algorithm.{field}, which the config verl passed does not set: set "
            f"algorithm.{field}"
        )
    return value


def _estimator(ppo_fast_name: str, verl_name: str, function: Callable) -> Callable:
    """``function`` (a compat estimator) as verl's registry path calls it: the inputs checked,
    the settings of verl's hard-coded branches read from ``config``."""
    signature = inspect.signature(function)
    required = [
        p.name
        for p in signature.parameters.values()
        if p.kind is not p.VAR_KEYWORD and p.default is p.empty
    ]
    gated = [p for p in signature.parameters if p in _NAME_GATED_INPUTS]
    settings = _SETTINGS_FROM_CONFIG.get(verl_name, {})

    accepts = set(signature.parameters)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        accepts |= set(_PASSED_TO_EVERY_ESTIMATOR)

    def estimator(*args: Any, **kwargs: Any) -> Any:
        arguments = {**signature.bind_partial(*args).arguments, **kwargs}
        for parameter in gated:
            if arguments.get(parameter) is None:
                raise ValueError(
                    f"{ppo_fast_name} needs {parameter}, which verl 0.9.1's compute_advantage "
                    f"does not pass to it: set {_NAME_GATED_INPUTS[parameter]}"
                )
        config = arguments.get("config")
        for field, default in settings.items():
            if field not in arguments:
                arguments[field] = _config_setting(config, field, default, ppo_fast_name)
        for parameter in required:
            if parameter not in arguments:
                where = " (data.non_tensor_batch['uid'])" if parameter == "index" else ""
                raise ValueError(
                    f"{ppo_fast_name} needs {parameter}{where}, which verl did not pass: give "
                    f"the batch a {parameter if where == '' else 'uid'} entry"
                )
        for parameter in _PASSED_TO_EVERY_ESTIMATOR:
            if parameter not in accepts:
                arguments.pop(parameter, None)
        return function(**arguments)

    estimator.__name__ = estimator.__qualname__ = ppo_fast_name
    estimator.__doc__ = f"ppo_fast's {verl_name} in verl's registry: {function.__doc__}"
    estimator.__ppo_fast_compat__ = function
    return estimator


def _is_ours(entry: Any, function: Callable) -> bool:
    return entry is function or getattr(entry, "__ppo_fast_compat__", None) is function


def register() -> dict[str, list[str]]:
    """Register every ``ppo_fast_*`` estimator and policy loss of ``names`` in verl's registries;
    returns the names by kind ("estimator", "policy_loss"). Idempotent; a ``ppo_fast_*`` name
    that something else holds is refused (RuntimeError) before anything is registered."""
    core_algos, _, _ = _modules()
    plan = []
    for kind in ("estimator", "policy_loss"):
        registry = _registry(core_algos, kind)
        for name, (verl_name, function) in names(kind).items():
            entry = registry.get(name)
            if entry is not None and not _is_ours(entry, function):
                raise RuntimeError(
                    f"verl's {kind} registry already holds {name!r} ({entry!r}), which is not "
                    "ppo_fast's: remove the plugin that registers it, or unregister it first"
                )
            if entry is None:
                wrapped = _estimator(name, verl_name, function) if kind == "estimator" else None
                plan.append((registry, name, wrapped or function))
    for registry, name, function in plan:
        registry[name] = function
    return {kind: sorted(names(kind)) for kind in ("estimator", "policy_loss")}


def unregister() -> None:
    """Remove the ``ppo_fast_*`` entries that ``register`` added (only those)."""
    core_algos, _, _ = _modules()
    for kind in ("estimator", "policy_loss"):
        registry = _registry(core_algos, kind)
        for name, (_, function) in names(kind).items():
            if _is_ours(registry.get(name), function):
                del registry[name]


def _patch_targets() -> list[tuple[Any, str, Callable]]:
    core_algos, verl_F, compat = _modules()
    return [
        (core_algos, "compute_gae_advantage_return", compat.compute_gae_advantage_return),
        (core_algos, "compute_grpo_outcome_advantage", compat.compute_grpo_outcome_advantage),
        (verl_F, "masked_whiten", compat.masked_whiten),
    ]


# verl's functions that patch_core_algos replaced, by (module, attribute): what unpatching puts
# back.
_ORIGINALS: dict[tuple[str, str], Callable] = {}


def patch_core_algos() -> None:
    """The opt-in: ``core_algos.compute_gae_advantage_return``,
    ``core_algos.compute_grpo_outcome_advantage`` and ``verl.utils.torch_functional.
    masked_whiten`` become the compat functions. Idempotent; refused (RuntimeError, nothing
    changed) where one of them is neither verl's nor ppo_fast's."""
    targets = _patch_targets()
    for module, attribute, replacement in targets:
        current = getattr(module, attribute)
        if current is not replacement and current.__module__ != module.__name__:
            raise RuntimeError(
                f"{module.__name__}.{attribute} is {current.__module__}.{current.__qualname__}, "
                "neither verl's nor ppo_fast's: something else patched it; undo that first"
            )
    for module, attribute, replacement in targets:
        current = getattr(module, attribute)
        if current is not replacement:
            _ORIGINALS[(module.__name__, attribute)] = current
            setattr(module, attribute, replacement)


def unpatch_core_algos() -> None:
    """Put verl's functions back where ``patch_core_algos`` replaced them."""
    for module, attribute, replacement in _patch_targets():
        original = _ORIGINALS.pop((module.__name__, attribute), None)
        if original is not None and getattr(module, attribute) is replacement:
            setattr(module, attribute, original)


def patched() -> bool:
    """Whether ``patch_core_algos`` is in effect."""
    return all(getattr(m, a) is r for m, a, r in _patch_targets())


def _patch_requested() -> bool:
    value = os.environ.get(PATCH_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{PATCH_ENV} must be 1 or 0 (true/false), got {value!r}")


def load_plugin() -> bool:
    """What the ``verl.plugins`` entry point runs on ``import verl``: ``register()``, and
    ``patch_core_algos()`` when ``PPO_FAST_VERL_PATCH`` is 1. Any failure is logged at WARNING
    with the reason and nothing is left half-done; returns whether it loaded."""
    registered = None
    try:
        patch = _patch_requested()
        registered = register()
        if patch:
            patch_core_algos()
    except Exception as error:
        if registered is not None:
            unregister()
        _logger.warning("ppo_fast's verl plugin did not load: %s", error)
        return False
    _logger.info(
        "ppo_fast's verl plugin registered the estimators %s and the policy losses %s%s",
        ", ".join(registered["estimator"]),
        ", ".join(registered["policy_loss"]),
        "; core_algos GAE, GRPO and masked_whiten patched" if patch else "",
    )
    return True
