"""The thread policy: how many threads a kernel call may use.

Kernels parallelise over rows. The default is ``PPO_FAST_NUM_THREADS``, else ``OMP_NUM_THREADS``,
else the cores this process may use (its affinity mask, capped by a cgroup CPU quota); batches too
small to gain run on one thread whatever the setting. Results never depend on the number of
threads (each row is reduced on its own).
"""

from __future__ import annotations

import functools
import os

# Below this many token positions a batch runs on one thread: starting threads costs more
# than the work (measured on 2-core machines, see bench/).
MIN_POSITIONS_PER_THREAD = 1 << 16

_num_threads: int | None = None


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
