"""Backend registry, selection and the thread policy.

A backend is a module exposing the same kernel functions over rows (see ``_reference.py``, the
oracle, for the signatures). ``python`` is the oracle; ``numba`` and ``cython`` are compiled.
``auto`` picks numba, then cython, then python. A backend that is asked for by name and cannot
load raises with the reason; it never silently falls back.

Selection, in order of precedence: the per-call ``backend=`` argument, ``set_backend``, the
environment variable ``PPO_FAST_BACKEND``, then ``auto``.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from types import ModuleType

import numpy as np

BACKENDS = ("numba", "cython", "python")
_MODULES = {
    "python": "ppo_fast._reference",
    "numba": "ppo_fast._numba_kernels",
    "cython": "ppo_fast._cython_backend",
}

# Below this many token positions a batch runs on one thread: starting threads costs more
# than the work (measured on 2-core machines, see bench/).
MIN_POSITIONS_PER_THREAD = 1 << 16

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}
_failed: dict[str, str] = {}
_selected: str | None = None
_num_threads: int | None = None


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


@functools.cache
def _cpu_count() -> int:
    """Cores this process may use: its affinity mask, capped by a cgroup CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        count = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, count)


def _env_threads(variable: str) -> int | None:
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{variable} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{variable} must be a positive integer, got {raw!r}")
    return value


def set_num_threads(n: int | None) -> None:
    """Threads the kernels may use; ``None`` restores the default.

    The default is ``PPO_FAST_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the cores this
    process may use. Batches too small to gain run on one thread whatever this says.
    """
    global _num_threads
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"num_threads must be a positive integer or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    """The number of threads large batches run on."""
    if _num_threads is not None:
        return _num_threads
    for variable in ("PPO_FAST_NUM_THREADS", "OMP_NUM_THREADS"):
        value = _env_threads(variable)
        if value is not None:
            return value
    return _cpu_count()


def threads_for(n_rows: int, n_positions: int) -> int:
    """Threads for one call: never more than rows, none extra for small batches."""
    wanted = min(get_num_threads(), n_rows, n_positions // MIN_POSITIONS_PER_THREAD)
    return max(1, wanted)


def warmup(backend: str | None = None, dtypes: tuple[str, ...] = ("float32", "float64")) -> None:
    """Compile every kernel of ``backend`` for ``dtypes`` now rather than at first use.

    Runs each stage on a small batch and, when more than one thread is in use, on one large
    enough to take the parallel build. Without numba (or for cython and python) it only loads.
    """
    # The stages import this module, so they are imported here, at call time.
    from .gae import gae
    from .loss import clipped_surrogate, value_loss
    from .rewards import kl_penalty, shape_rewards
    from .whiten import whiten

    name = get_backend(backend)
    sizes = [(2, 8)]
    if get_num_threads() > 1:
        sizes.append((2, MIN_POSITIONS_PER_THREAD))
    for dtype in dtypes:
        for shape in sizes:
            x = np.linspace(-1.0, 1.0, shape[0] * shape[1], dtype=dtype).reshape(shape)
            mask = np.ones(shape, dtype=bool)
            kl_penalty(x, x, backend=name)
            shaped = shape_rewards(np.zeros(shape[0]), x, x, kl_coef=0.1, mask=mask, backend=name)
            advantages = gae(shaped, x, mask=mask, backend=name).advantages
            whiten(advantages, mask=mask, backend=name)
            clipped_surrogate(x, x, advantages, mask=mask, backend=name)
            value_loss(x, x, advantages, mask=mask, clip=0.2, backend=name)
