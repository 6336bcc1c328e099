"""ppo_fast inside OpenRLHF 0.11.2 without editing OpenRLHF: ``install()`` puts the compat
``PolicyLoss`` and the experience maker's advantages and returns in OpenRLHF's modules, in this
process and, through Ray's ``worker_process_setup_hook``, in every Ray worker.

Re-exported by ``ppo_fast.compat.openrlhf`` (``install``, ``uninstall``, ``installed``,
``runtime_env``, ``setup_worker``); ``python -m ppo_fast.compat.openrlhf ARGS`` is ``main``:

    python -m ppo_fast.compat.openrlhf --pretrain ... --algo.advantage.estimator gae ...
        (exactly the arguments of ``python -m openrlhf.cli.train_ppo_ray``)

What is replaced (each when its module is imported, or at once if it already is; OpenRLHF's
trainer imports them inside its Ray actors, after the setup hook has run):

    openrlhf.models.loss.PolicyLoss, openrlhf.models.PolicyLoss,
    openrlhf.trainer.ray.ppo_actor.PolicyLoss                 -> compat.openrlhf.PolicyLoss
    openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker:
        compute_advantages_and_returns                        -> compat.openrlhf's
        get_advantages_and_returns, get_cumulative_returns    -> compat.openrlhf's (static)

The patches wait for their modules through ``wrapt``'s post-import hooks, so the setup hook
imports nothing of OpenRLHF (vLLM engines and other workers pay no import). OpenRLHF has no
registry: its estimators stay its argparse choices, and the experience maker computes whichever
one ``--algo.advantage.estimator`` names, on ppo_fast's kernels. ``ValueLoss`` (the critic) is
not replaced.

Refused before anything is patched: an OpenRLHF other than 0.11.2 (the release
``ppo_fast.compat.openrlhf`` reproduces), or not installed; a target that OpenRLHF's module does
not have (another release under the same version) fails that module's import with the reason.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Any

OPENRLHF_VERSION = "0.11.2"
SETUP_HOOK = f"{__name__}.setup_worker"

# (module, owner attribute or "" for the module itself, attribute): the names install() replaces.
_MAKER = "openrlhf.trainer.ppo_utils.experience_maker"
_TARGETS = (
    ("openrlhf.models.loss", "", "PolicyLoss"),
    ("openrlhf.models", "", "PolicyLoss"),
    ("openrlhf.trainer.ray.ppo_actor", "", "PolicyLoss"),
    (_MAKER, "RemoteExperienceMaker", "compute_advantages_and_returns"),
    (_MAKER, "RemoteExperienceMaker", "get_advantages_and_returns"),
    (_MAKER, "RemoteExperienceMaker", "get_cumulative_returns"),
)

_state: dict[str, Any] = {"installed": False}
# OpenRLHF's objects that install() replaced, by target: what uninstall() puts back.
_originals: dict[tuple[str, str, str], Any] = {}


def _replacement(attribute: str) -> Any:
    from . import openrlhf as compat

    if attribute == "PolicyLoss":
        return compat.PolicyLoss
    if attribute == "compute_advantages_and_returns":
        return compat.compute_advantages_and_returns  # a method: it reads self
    # OpenRLHF's methods that never read self: called as self.get_...(values, rewards, ...).
    return staticmethod(getattr(compat, attribute))


def _check_version() -> None:
    try:
        version = importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"OpenRLHF is not installed: ppo_fast.compat.openrlhf reproduces OpenRLHF "
            f"{OPENRLHF_VERSION}; pip install openrlhf=={OPENRLHF_VERSION}"
        ) from None
    if version != OPENRLHF_VERSION:
        raise RuntimeError(
            f"ppo_fast.compat.openrlhf reproduces OpenRLHF {OPENRLHF_VERSION}, this is OpenRLHF "
            f"{version}: install openrlhf=={OPENRLHF_VERSION}, or launch without ppo_fast's hook"
        )


def _owner(module: Any, owner: str) -> Any:
    return getattr(module, owner) if owner else module


def _patch(module: Any) -> None:
    """Replace the targets of ``module`` (a post-import hook, or install() for a module already
    imported); all of the module's targets are checked before any is replaced."""
    if not _state["installed"]:
        return
    targets = [t for t in _TARGETS if t[0] == module.__name__]
    for name, owner, attribute in targets:
        if not hasattr(module, owner or "__name__") or (
            attribute not in vars(_owner(module, owner))
        ):
            where = f"{name}.{owner}" if owner else name
            raise RuntimeError(
                f"{where} has no {attribute}: this is not the OpenRLHF {OPENRLHF_VERSION} that "
                f"ppo_fast.compat.openrlhf reproduces; reinstall openrlhf=={OPENRLHF_VERSION}"
            )
    for target in targets:
        name, owner, attribute = target
        holder = _owner(module, owner)
        replacement = _replacement(attribute)
        current = vars(holder)[attribute]
        if target not in _originals:
            if getattr(current, "__func__", current) is getattr(
                replacement, "__func__", replacement
            ):
                # Bound from a module patched before it (ppo_actor's `from openrlhf.models
                # import PolicyLoss`): OpenRLHF's object is the one that module held.
                current = next(v for (_, _, a), v in _originals.items() if a == attribute)
            _originals[target] = current
        setattr(holder, attribute, replacement)


def install() -> None:
    """Put ppo_fast's PolicyLoss and advantages in OpenRLHF's modules in this process (those
    imported later too). Idempotent; undone by ``uninstall``. RuntimeError for an OpenRLHF other
    than 0.11.2, with nothing changed."""
    _check_version()
    import wrapt

    _state["installed"] = True
    for name in dict.fromkeys(t[0] for t in _TARGETS):
        if name in sys.modules:
            _patch(sys.modules[name])
        else:
            # wrapt calls the hook once, when the module has been imported; _patch is
            # idempotent, so a hook registered twice (install, uninstall, install) is harmless.
            wrapt.register_post_import_hook(_patch, name)


def uninstall() -> None:
    """Put OpenRLHF's objects back in the modules imported so far, and patch no module imported
    later."""
    _state["installed"] = False
    for target, original in list(_originals.items()):
        name, owner, attribute = target
        if name in sys.modules:
            setattr(_owner(sys.modules[name], owner), attribute, original)
        del _originals[target]


def installed() -> bool:
    """Whether ``install`` is in effect in this process."""
    return _state["installed"]


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: ``install()`` in each worker as it starts."""
    install()


def runtime_env() -> dict[str, Any]:
    """The runtime_env of ``ray.init`` that runs ``setup_worker`` in every worker, with the
    environment variables OpenRLHF's own ``ray.init`` sets (train_ppo_ray.train), so that a
    launch through ppo_fast differs from OpenRLHF's only by the hook."""
    env_vars = {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get(
            "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"
        ),
    }
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": env_vars}


def main(argv: list[str] | None = None) -> None:
    """``python -m ppo_fast.compat.openrlhf ARGS``: OpenRLHF's ``train_ppo_ray`` with ARGS, on a
    Ray started with ``runtime_env()`` (OpenRLHF's train() then skips its own ray.init). With
    RAY_ADDRESS set it joins that cluster, as ``ray.init`` does; the hook then runs in this job's
    workers."""
    import runpy

    import ray

    argv = sys.argv[1:] if argv is None else argv
    install()
    if ray.is_initialized():
        raise RuntimeError(
            "Ray is already initialised in this process, without ppo_fast's worker hook: start "
            "it with ray.init(runtime_env=ppo_fast.compat.openrlhf.runtime_env())"
        )
    ray.init(runtime_env=runtime_env())
    sys.argv = ["openrlhf.cli.train_ppo_ray", *argv]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
