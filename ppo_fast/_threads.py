"""The thread policy: how many threads a kernel call may use.

Kernels parallelise over rows (GAE over its rows and the chunks of its long rows). The default
is ``PPO_FAST_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the cores this process may use (its
affinity mask, capped by a cgroup CPU quota); batches too small to gain run on one thread whatever
the setting. Results never depend on the number of threads (each row, or chunk, is reduced on its
own, and a chunk's bounds depend on its row only). ``leaving_one_core()`` lowers the count by
one for the calls of one Python thread (the dataset path, whose Parquet writer runs beside it).

The two variables are read differently, because they belong to different owners:

- ``PPO_FAST_NUM_THREADS`` is ours: anything but a positive integer is a ValueError naming it, on
  every call, until it is fixed.
- ``OMP_NUM_THREADS`` is shared with every OpenMP runtime in the process (torch, BLAS). Its nested
  form ``"4,2"`` (threads per nesting level, OpenMP 3.0) is legal, and torch accepts it: ppo_fast
  parallelises at one level and takes the first number. A value that is not a list of positive
  integers (``"auto"``, ``"0"``, ``"4,x"``) is ignored with a RuntimeWarning, once per value, as
  OpenMP runtimes ignore it: a variable set for another library must not break every call here.

Every kernel call reads both variables (as raw values, in a dict lookup each) and works out what
they mean once per pair of values: a change made while the process runs is seen by the next call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections.abc import Callable

# Below this many token positions a batch runs on one thread: starting threads costs more
# than the work (measured on 2-core machines, see bench/).
MIN_POSITIONS_PER_THREAD = 1 << 16

_num_threads: int | None = None
_this_thread = threading.local()  # .cap: at most this many threads for calls from this thread


def _environ_reader(name: str) -> Callable[[], object]:
    """A function returning the raw value of environment variable ``name`` (None when unset).

    ``os.environ.get`` of an unset name costs about a microsecond (Mapping.get catches a
    KeyError), on every kernel call; the mapping's own table (``os.environ._data``, which
    ``os.environ`` updates on every change) answers in a dict lookup. The value is only a cache
    key: what it means is read through ``os.environ`` as before.
    """
    table = getattr(os.environ, "_data", None)
    encodekey = getattr(os.environ, "encodekey", None)
    if isinstance(table, dict) and encodekey is not None:
        key = encodekey(name)
        return functools.partial(table.get, key)
    return functools.partial(os.environ.get, name)


_ppo_fast_threads_raw = _environ_reader("PPO_FAST_NUM_THREADS")
_omp_threads_raw = _environ_reader("OMP_NUM_THREADS")
# get_num_threads() by the raw values of the two variables: the policy is read from the
# environment once per value, not on every call (an error is never cached: it repeats).
_default_threads: dict[tuple[object, object], int] = {}


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


def _positive_int(text: str) -> int | None:
    text = text.strip()
    # int() would also take "+4", "4_000" and non-ASCII digits; OpenMP takes plain digits only.
    if not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value >= 1 else None


def _ppo_fast_threads() -> int | None:
    raw = os.environ.get("PPO_FAST_NUM_THREADS", "").strip()
    if not raw:
        return None
    value = _positive_int(raw)
    if value is None:
        raise ValueError(f"PPO_FAST_NUM_THREADS must be a positive integer, got {raw!r}")
    return value


def _omp_threads() -> int | None:
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    levels = [_positive_int(level) for level in raw.split(",")]
    if None in levels:
        _warn_ignored_omp(raw)
        return None
    return levels[0]


@functools.cache
def _warn_ignored_omp(raw: str) -> None:
    warnings.warn(
        f"OMP_NUM_THREADS={raw!r} is not a positive integer nor a comma-separated list of them: "
        "ppo_fast ignores it and uses the cores this process may use",
        RuntimeWarning,
        stacklevel=4,
    )


def set_num_threads(n: int | None) -> None:
    """Threads the kernels may use; ``None`` restores the default.

    The default is ``PPO_FAST_NUM_THREADS``, else ``OMP_NUM_THREADS`` (its first level), else the
    cores this process may use. Batches too small to gain run on one thread whatever this says.
    """
    global _num_threads
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"num_threads must be a positive integer or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    """The number of threads large batches run on."""
    if _num_threads is not None:
        return _num_threads
    for read in (_ppo_fast_threads, _omp_threads):
        value = read()
        if value is not None:
            return value
    return _cpu_count()


def _threads_setting() -> int:
    """``get_num_threads()``, cached by the raw values of the environment variables it reads."""
    if _num_threads is not None:
        return _num_threads
    key = (_ppo_fast_threads_raw(), _omp_threads_raw())
    threads = _default_threads.get(key)
    if threads is None:
        threads = get_num_threads()
        if len(_default_threads) > 64:  # bounded: a program that keeps changing the variables
            _default_threads.clear()
        _default_threads[key] = threads
    return threads


def threads_for(units: int, n_positions: int) -> int:
    """Threads for one call: never more than its units of work (its rows, or for GAE its rows
    and its long rows' chunks: ``_spec.Kernel.parallel_units``), none extra for small
    batches."""
    setting = _threads_setting()  # read even for a small batch: a bad variable always raises
    if n_positions < 2 * MIN_POSITIONS_PER_THREAD:
        return 1
    cap = getattr(_this_thread, "cap", None)
    if cap is not None:
        setting = min(setting, cap)
    return max(1, min(setting, units, n_positions // MIN_POSITIONS_PER_THREAD))


@contextlib.contextmanager
def leaving_one_core():
    """Within the block, kernels called from this thread use one thread fewer than the policy
    gives (at least one): another thread of the caller keeps a core busy (the dataset path's
    Parquet writer). On two cores the kernels then run on one thread, and no OpenMP team spins
    on the writer's core between calls (measured: a sixth of the CPU time of
    ``ppo-fast advantages`` was libgomp's waiting threads)."""
    before = getattr(_this_thread, "cap", None)
    threads = _threads_setting() if before is None else min(before, _threads_setting())
    _this_thread.cap = max(1, threads - 1)  # nested blocks: a core each
    try:
        yield
    finally:
        _this_thread.cap = before
