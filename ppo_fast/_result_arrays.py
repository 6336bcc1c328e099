"""The stages' result arrays: large ones on memory whose pages are already mapped.

A fresh large array costs its first touch: the OS maps and zeroes each page as the kernel first
writes it, and glibc gives large freed blocks back to the OS (``munmap`` above its mmap
threshold, a trim of the heap's top), so a loop of calls of one shape pays it on every call.
GAE at 1024 x 4096 float32 (two 16 MiB results, an Intel Xeon, median of repeated calls):
3.8 ms with ``out=``, 9.3 ms fresh on one thread; 1.8 and 6.6 ms on two, where the threads'
faults also contend (README, "Fresh pages").

So a result of at least ``POOLED_BYTES`` is a view of a block of bytes kept here. Its base is a
``_Block``, which NumPy keeps as the base of every view made from the result (and torch's
``from_numpy`` keeps the array): when the last of them dies, the block comes back to the free
list. The next result of its size, or down to half of it, reuses its pages. The free list
holds at most ``set_result_cache``'s bytes (else ``PPO_FAST_RESULT_CACHE``'s, else
``DEFAULT_CACHE_BYTES``), the least recently freed dropped first; 0 turns reuse off. A block in
use is the caller's memory, as a fresh array would be: nothing here ever writes it or hands it
out twice.
"""

from __future__ import annotations

import collections
import math
import os
import threading

import numpy as np

# Below this, a result is a plain np.empty: glibc's heap keeps such blocks, and a view costs
# about 3 us more to make than np.empty's 0.3.
POOLED_BYTES = 1 << 20
DEFAULT_CACHE_BYTES = 512 << 20


class _Pool:
    """Free blocks (uint8 arrays), least recently freed first, and their total size."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free: list[np.ndarray] = []
        self.free_bytes = 0
        self.lock = threading.Lock()
        # Blocks freed while the lock was held (by another thread, or by this one when a
        # garbage collection inside the locked section freed a result): kept by whoever next
        # holds the lock. deque.append is atomic, so a finaliser never waits.
        self.returned: collections.deque[np.ndarray] = collections.deque()

    def take(self, nbytes: int) -> np.ndarray:
        """A free block of nbytes to 2 x nbytes (the smallest; of those, the most recently
        freed, whose pages are likeliest in cache), or a new one of nbytes."""
        with self.lock:
            self._keep_returned()
            best = -1
            for k in range(len(self.free) - 1, -1, -1):
                size = self.free[k].nbytes
                if nbytes <= size <= 2 * nbytes and (best < 0 or size < self.free[best].nbytes):
                    best = k
            if best >= 0:
                block = self.free.pop(best)
                self.free_bytes -= block.nbytes
                return block
        return np.empty(nbytes, dtype=np.uint8)

    def give_back(self, block: np.ndarray) -> None:
        if not self.lock.acquire(blocking=False):
            self.returned.append(block)
            return
        try:
            self._keep(block)
            self._keep_returned()
        finally:
            self.lock.release()

    def set_limit(self, limit: int) -> None:
        with self.lock:
            self.limit = limit
            self._keep_returned()
            self._evict()

    def _keep_returned(self) -> None:
        while self.returned:
            self._keep(self.returned.popleft())

    def _keep(self, block: np.ndarray) -> None:
        if block.nbytes > self.limit:  # dropped, rather than every kept block before it
            return
        self.free.append(block)
        self.free_bytes += block.nbytes
        self._evict()

    def _evict(self) -> None:
        while self.free_bytes > self.limit:
            self.free_bytes -= self.free.pop(0).nbytes


_pool = _Pool(DEFAULT_CACHE_BYTES)

ENVIRONMENT_VARIABLE = "PPO_FAST_RESULT_CACHE"
# The limit set_result_cache gave (None: the environment variable's, else the default), and the
# raw value of the variable that _pool.limit was last set from (_NOT_READ: none yet, so the next
# large result sets it, whatever the variable holds, unset included).
_NOT_READ = object()
_explicit_limit: int | None = None
_environment_raw: object = _NOT_READ


def _limit_from(raw: str | None) -> int:
    """The limit that PPO_FAST_RESULT_CACHE's raw value ``raw`` names (None or "": the default)."""
    if raw is None or not raw.strip():
        return DEFAULT_CACHE_BYTES
    try:
        limit = int(raw.strip())
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE} must be a byte count, an int >= 0, got {raw!r}: "
            f"e.g. {ENVIRONMENT_VARIABLE}={DEFAULT_CACHE_BYTES} (the default), or 0 to keep none"
        )
    return limit


def _follow_environment() -> None:
    """Without a ``set_result_cache`` limit, make the pool's limit what PPO_FAST_RESULT_CACHE says
    now (read when a result of at least POOLED_BYTES is made: a variable changed between calls
    is seen by the next such call, and a bad value raises at each)."""
    global _environment_raw
    raw = os.environ.get(ENVIRONMENT_VARIABLE)
    if raw != _environment_raw:
        _pool.set_limit(_limit_from(raw))
        _environment_raw = raw


def _after_fork_in_child() -> None:
    # A thread of the parent may have held the lock at the fork; no thread of the child will
    # release it. The blocks stay valid (the child's copies of the parent's pages).
    _pool.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Block:
    """The base of a result made from a pooled block: gives the block back when it dies."""

    __slots__ = ("__array_interface__", "_block", "_pool")

    def __init__(self, pool: _Pool, block: np.ndarray, shape: tuple[int, ...], dtype: np.dtype):
        self._pool = pool
        self._block = block
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (block.ctypes.data, False),
            "strides": None,
            "version": 3,
        }

    def __del__(self) -> None:
        self._pool.give_back(self._block)


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array, as ``np.empty(shape, dtype)``; from the pool when it
    holds at least POOLED_BYTES and reuse is on."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < POOLED_BYTES:
        return np.empty(shape, dtype)
    if _explicit_limit is None:
        _follow_environment()
    if _pool.limit == 0:
        return np.empty(shape, dtype)
    return np.asarray(_Block(_pool, _pool.take(nbytes), tuple(shape), dtype))


def set_result_cache(max_bytes: int | None) -> None:
    """Keep at most ``max_bytes`` of freed result memory for reuse (default 512 MiB; 0: none).

    Results of at least 1 MiB (a 256 x 1024 float32 array) are made on memory that earlier
    results used, once nothing refers to those any longer: their pages are already mapped, so
    a loop of calls of one shape does not pay the OS's first touch of fresh pages on every
    call (GAE at 1024 x 4096 on two threads: 6.6 -> 1.8 ms on an Intel Xeon). The memory kept
    is what the freed results used, up to ``max_bytes``, the least recently freed given back
    to the allocator first; setting a smaller limit gives back the excess now. Such a result
    is a view (``flags.owndata`` is False, so ``ndarray.resize`` refuses it); it is otherwise
    an ordinary array, and its memory is never reused while any array or tensor refers to it.

    Without a call of this function, the limit is the environment variable
    ``PPO_FAST_RESULT_CACHE`` (a byte count; 0 keeps none), read when a large result is made,
    else the default. ``max_bytes=None`` goes back to the variable, or the default.
    """
    global _explicit_limit, _environment_raw
    if max_bytes is None:
        _explicit_limit = None
        _environment_raw = _NOT_READ  # the next large result sets the limit from the variable
        return
    if type(max_bytes) is bool or not isinstance(max_bytes, (int, np.integer)):
        raise TypeError(
            f"max_bytes must be an int or None, got {type(max_bytes).__name__}: "
            "pass a byte count such as 512 << 20, 0 to keep none, or None for the default"
        )
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}: pass 0 to keep none")
    _explicit_limit = int(max_bytes)
    _pool.set_limit(_explicit_limit)
