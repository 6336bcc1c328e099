"""The memory floor (the roofline, 1.0x) of every benchmark row (DESIGN.md section 7).

A kernel's floor is the time its compulsory bytes take at the machine's copy bandwidth:

    floor seconds = compulsory bytes / copy bandwidth

- compulsory bytes: each input read once at its dtype (a bool mask at one byte) and each output
  written once (``Kernel.traffic``);
- copy bandwidth: 2 x bytes / seconds of ``np.copyto`` over a buffer of ``COPY_BYTES`` (64 MiB,
  larger than the last-level caches), the best of ``COPY_REPEATS`` copies, measured in the same
  run with as many threads as the kernel uses (the buffer cut into that many slices, copied at
  once: NumPy's copy releases the GIL). A copy reads and writes each byte, hence the 2.

``ppo-fast bench`` measures the bandwidth again for each table, half of the copies just before
ppo_fast's rows of the table are timed and half just after (``copies_around``): on a shared VM
the bandwidth moves within seconds (measured on an Intel Xeon VM, best of 10 copies every 4 s
for a minute: 14.4-28.3 GB/s on one thread, 32.9-54.5 on two). Measured once at the start of a
ten-minute run, as before 0.8.26, it was 18.2 GB/s on two threads in a run a minute before those
copies, and that run put GAE at 0.43x of its two-thread floor: a ratio of one moment's copy.

Every row reports its time over its floor: 1.0x is the floor, 1.2x is 20% above it. Nothing
can beat it by much.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

COPY_BYTES = 64 << 20
COPY_REPEATS = 10
_SLICE_BYTES = 1 << 20  # a copy is split over threads only in slices of at least 1 MiB


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="ppo_fast-floor")


class Copy:
    """``np.copyto`` of ``nbytes`` bytes into a preallocated buffer, split over ``threads``."""

    def __init__(self, threads: int = 1, nbytes: int = COPY_BYTES):
        self.nbytes = max(1, nbytes)
        self.source = np.ones(self.nbytes, dtype=np.uint8)
        self.target = np.empty_like(self.source)
        pieces = min(threads, max(1, self.nbytes // _SLICE_BYTES))
        bounds = np.linspace(0, self.nbytes, pieces + 1).astype(np.int64)
        self.slices = [slice(a, b) for a, b in itertools.pairwise(bounds)]

    def _copy(self, part: slice) -> None:
        np.copyto(self.target[part], self.source[part])

    def __call__(self) -> None:
        if len(self.slices) == 1:
            np.copyto(self.target, self.source)
            return
        pool = _pool(len(self.slices))
        for future in [pool.submit(self._copy, part) for part in self.slices]:
            future.result()

    def bandwidth(self, seconds: float) -> float:
        """Bytes per second of a copy that took ``seconds``: it read and wrote every byte."""
        return 2 * self.nbytes / seconds


@functools.cache
def _touched_copy(threads: int) -> Copy:
    """The copy on ``threads`` threads, made (and its pages touched) once a process."""
    copy = Copy(threads)
    copy()
    return copy


def copy_times(threads: int, repeats: int) -> list[float]:
    """The seconds of ``repeats`` copies on ``threads`` threads, now."""
    copy = _touched_copy(threads)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
    return times


def copies_around(threads: int, timed: Callable[[], Any]) -> float:
    """Run ``timed``, with half of ``COPY_REPEATS`` copies on ``threads`` threads just before it
    and half just after; the copy bandwidth of the best of them, bytes per second."""
    before = copy_times(threads, COPY_REPEATS // 2)
    timed()
    after = copy_times(threads, COPY_REPEATS - COPY_REPEATS // 2)
    return _touched_copy(threads).bandwidth(min(before + after))


@functools.cache
def copy_bandwidth(threads: int) -> float:
    """The copy bandwidth on ``threads`` threads, in bytes per second, measured once a process
    (the best of ``COPY_REPEATS`` copies): the floor of a row given no bandwidth of its own
    (``timing.floor_row``); ``ppo-fast bench`` and ``bench/compute_floor.py`` measure it around
    the rows they time instead (``copies_around``)."""
    return _touched_copy(threads).bandwidth(min(copy_times(threads, COPY_REPEATS)))


def floor_seconds(read_bytes: int, write_bytes: int, bandwidth: float) -> float:
    """The floor: the compulsory bytes at the copy bandwidth."""
    return (read_bytes + write_bytes) / bandwidth
