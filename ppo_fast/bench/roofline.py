"""The memory floor (the roofline, 1.0x) of every benchmark row (DESIGN.md section 7).

A kernel's floor is the time its compulsory bytes take at the machine's copy bandwidth:

    floor seconds = compulsory bytes / copy bandwidth

- compulsory bytes: each input read once at its dtype (a bool mask at one byte) and each output
  written once (``Kernel.traffic``);
- copy bandwidth: 2 x bytes / seconds of ``np.copyto`` over a buffer of ``COPY_BYTES`` (64 MiB,
  larger than most last-level caches, but not every VM's: below), the best of ``COPY_REPEATS``
  copies, measured in the same run with as many threads as the kernel uses (the buffer cut into
  that many slices, copied at once: NumPy's copy releases the GIL). A copy reads and writes each
  byte, hence the 2.

``ppo-fast bench`` measures the bandwidth again for each table, half of the copies just before
ppo_fast's rows of the table are timed and half just after (``copies_around``): on a shared VM
the bandwidth moves within seconds (measured on an Intel Xeon VM, best of 10 copies every 4 s
for a minute: 14.4-28.3 GB/s on one thread, 32.9-54.5 on two). Measured once at the start of a
ten-minute run, as before 0.8.26, it was 18.2 GB/s on two threads in a run a minute before those
copies, and that run put GAE at 0.43x of its two-thread floor: a ratio of one moment's copy.

Every row reports its time over its floor: 1.0x is the floor, 1.2x is 20% above it. Nothing
can beat it by much from memory; but a batch that fits the last-level cache partly stays there
from one call to the next (and so does the copy's 64 MiB), and a VM's cache can be far larger
than 64 MiB (this machine class's Intel Xeon reports an L3 of 480 MiB). ``ppo-fast bench
--cold`` therefore reads a buffer of twice the largest cache the OS reports before every
sample and every copy (``Evict``): each call and each copy then starts from memory, as a
trainer's does after a forward and backward pass. Measured on that Xeon, 1024x4096 float32, one
thread: the clipped surrogate 3.43 ms a call in a loop, 5.17 ms from memory; the 64 MiB copy
17.9 and 14.8 GB/s.
"""

from __future__ import annotations

import functools
import glob
import itertools
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

COPY_BYTES = 64 << 20
COPY_REPEATS = 10
EVICT_MIN_BYTES = 256 << 20  # Evict's buffer where the OS names no cache, or a small one
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


def largest_cache_bytes() -> int | None:
    """The size of the largest CPU cache the OS reports (Linux's sysfs, else glibc's sysconf),
    in bytes; None where it reports none."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    for name in ("SC_LEVEL4_CACHE_SIZE", "SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            sizes.append(os.sysconf(name))
        except (AttributeError, OSError, ValueError):
            continue
    largest = max(sizes, default=0)
    return largest if largest > 0 else None


def evict_bytes() -> int:
    """``Evict``'s buffer: twice the largest cache the OS reports, at least EVICT_MIN_BYTES."""
    return max(2 * (largest_cache_bytes() or 0), EVICT_MIN_BYTES)


class Evict:
    """Reads a buffer of ``nbytes`` (default ``evict_bytes()``), a cache line at a time: what a
    call timed after it reads comes from memory. Only read, so that it leaves no dirty line
    whose write-back a timed call would pay. It runs on the calling thread: another core's
    private cache keeps what it held (2 MiB of L2 a core on this machine class, against the
    68 MiB a 1024x4096 float32 loss call moves)."""

    def __init__(self, nbytes: int | None = None):
        self.nbytes = evict_bytes() if nbytes is None else nbytes
        self.buffer = np.ones(max(1, self.nbytes // 8), dtype=np.int64)  # its pages touched

    def __call__(self) -> int:
        return int(self.buffer[::8].sum())  # one 8-byte word a 64-byte line


@functools.cache
def _touched_copy(threads: int) -> Copy:
    """The copy on ``threads`` threads, made (and its pages touched) once a process."""
    copy = Copy(threads)
    copy()
    return copy


def copy_times(threads: int, repeats: int, evict: Evict | None = None) -> list[float]:
    """The seconds of ``repeats`` copies on ``threads`` threads, now; each after ``evict``
    (not timed) where given."""
    copy = _touched_copy(threads)
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict()
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
    return times


def copies_around(threads: int, timed: Callable[[], Any], evict: Evict | None = None) -> float:
    """Run ``timed``, with half of ``COPY_REPEATS`` copies on ``threads`` threads just before it
    and half just after (each after ``evict`` where given, as the timed calls then are); the
    copy bandwidth of the best of them, bytes per second."""
    before = copy_times(threads, COPY_REPEATS // 2, evict)
    timed()
    after = copy_times(threads, COPY_REPEATS - COPY_REPEATS // 2, evict)
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
