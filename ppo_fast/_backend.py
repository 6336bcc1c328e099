"""Backend registry and selection, and the call of a kernel by its table entry.

A backend is a module exposing one function per kernel of the table, ``_spec.KERNELS``, with the
table's arguments (tests/test_kernels.py checks it for every backend that loads). ``python`` is
the oracle; ``numba`` and ``cython`` are compiled.
``auto`` picks cython, then numba, then python. Cython first: it is compiled at install, so its
first call costs under 0.1 ms, where numba compiles each kernel at its first call (0.1-0.9 s each
in a fresh process, seconds when several processes share a cold cache), which every short-lived
process and every spawned worker would pay; and it is as fast as numba or faster on every kernel
but the float32 policy loss (README, benchmarks). A backend that is asked for by name and cannot
load raises with the reason; it never silently falls back.

Selection, in order of precedence: the per-call ``backend=`` argument, ``set_backend``, the
environment variable ``PPO_FAST_BACKEND``, then ``auto``. Each call reads the variable (its raw
value, in a dict lookup) and resolves a combination of the three once (``_cached_resolve``).
"""

from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType

from . import _threads
from ._spec import KERNELS

BACKENDS = ("cython", "numba", "python")  # the order auto tries them
_MODULES = {
    "python": "ppo_fast._reference",
    "numba": "ppo_fast._numba_kernels",
    "cython": "ppo_fast._cython_backend",
}

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}
_failed: dict[str, str] = {}
_selected: str | None = None
_environment_backend = _threads._environ_reader("PPO_FAST_BACKEND")
# The module each (backend=, set_backend, raw PPO_FAST_BACKEND) resolves to: the selection is
# worked out once per combination, not on every call (a failure is never cached: it repeats).
_resolved: dict[tuple[str | None, str | None, object], ModuleType] = {}


class BackendUnavailableError(ImportError):
    """A backend was asked for by name and cannot be loaded here."""


def _load(name: str) -> ModuleType:
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _failed:
            raise BackendUnavailableError(f"the {name} backend cannot be used: {_failed[name]}")
        try:
            module = importlib.import_module(_MODULES[name])
        except Exception as error:  # any failure to load makes the backend unavailable
            _failed[name] = f"{type(error).__name__}: {error}"
            raise BackendUnavailableError(
                f"the {name} backend cannot be used: {_failed[name]}"
            ) from error
        _loaded[name] = module
        return module


def _check_name(name: str, source: str) -> str:
    if name not in (*BACKENDS, "auto"):
        raise ValueError(
            f"{source} must be one of 'auto', {', '.join(map(repr, BACKENDS))}; got {name!r}"
        )
    return name


def available_backends() -> list[str]:
    """The backends that load on this machine, in the order ``auto`` tries them."""
    names = []
    for name in BACKENDS:
        try:
            _load(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names


def set_backend(name: str | None) -> None:
    """Select the default backend for this process ('auto', 'numba', 'cython', 'python').

    ``None`` goes back to ``PPO_FAST_BACKEND`` or ``auto``. A named backend is loaded now, so
    that a backend which cannot load fails here rather than at the first call.
    """
    global _selected
    if name is not None:
        _check_name(name, "backend")
        if name != "auto":
            _load(name)
    _selected = name


def _requested(name: str | None) -> str:
    if name is not None:
        return _check_name(name, "backend")
    if _selected is not None:
        return _selected
    env = os.environ.get("PPO_FAST_BACKEND", "").strip()
    return _check_name(env, "PPO_FAST_BACKEND") if env else "auto"


def get_backend(name: str | None = None) -> str:
    """The name of the backend a call with ``backend=name`` would use."""
    requested = _requested(name)
    if requested != "auto":
        _load(requested)
        return requested
    for candidate in BACKENDS:
        try:
            _load(candidate)
        except BackendUnavailableError:
            continue
        return candidate
    raise AssertionError("unreachable: the python backend always loads")


def resolve(name: str | None = None) -> ModuleType:
    """The backend module a call with ``backend=name`` uses."""
    return _load(get_backend(name))


def _cached_resolve(name: str | None) -> ModuleType:
    """``resolve(name)``, once per combination of the settings it depends on."""
    key = (name, _selected, _environment_backend())
    module = _resolved.get(key)
    if module is None:
        module = resolve(name)
        if len(_resolved) > 64:  # bounded: a program that keeps changing the variable
            _resolved.clear()
        _resolved[key] = module
    return module


def run(name: str, backend: str | None, **arguments) -> None:
    """Run kernel ``name`` of the table on ``backend``, its arguments given by name.

    Every argument but ``n_threads`` is required (``Kernel.bind`` raises on a missing one, so a
    stage cannot pass them out of order); the threads follow the thread policy for the batch.
    """
    kernel = KERNELS[name]
    n_positions = arguments[kernel.inputs[0].name].size
    units = kernel.parallel_units(arguments["starts"].shape[0], n_positions)
    arguments["n_threads"] = _threads.threads_for(units, n_positions)
    getattr(_cached_resolve(backend), name)(*kernel.bind(arguments))


# The kernel function each (kernel, backend=, set_backend, raw PPO_FAST_BACKEND) resolves to, for
# ``call`` (as ``_resolved``; a failure is never cached).
_functions: dict[tuple[str, str | None, str | None, object], object] = {}


def call(name: str, backend: str | None, units: int, n_positions: int, *arguments) -> None:
    """Run kernel ``name`` on ``backend`` with every argument but ``n_threads`` given in the
    table's order: the stages' fast paths (binding them by name, as ``run`` does, costs about a
    microsecond). The threads follow the thread policy for the batch, as in ``run``: ``units``
    is the kernel's ``parallel_units`` for the batch (its rows, unless it has ``chunks``)."""
    key = (name, backend, _selected, _environment_backend())
    function = _functions.get(key)
    if function is None:
        function = getattr(_cached_resolve(backend), name)
        if len(_functions) > 256:  # bounded, as _resolved
            _functions.clear()
        _functions[key] = function
    function(*arguments, _threads.threads_for(units, n_positions))
