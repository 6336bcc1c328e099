"""Small numba loops for the NumPy-level modules (``_groups``, ``outcome``).

Where NumPy needs several passes, or a slow generic routine, for something a loop does in one,
the loop is written here once and compiled on first use: per-group counts and sums, gathering
per-group values onto rows, and broadcasting per-row values onto tokens. Each has a NumPy path
in its caller, used where numba is not installed, with the same bits (tests compare the two).

These are not kernels of the table (``_spec``): they move per-row values, they compute no
per-token formula, and they have no oracle or Cython twin.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

EVERY_ROW = np.zeros(0, dtype=bool)  # ``present`` of ``add_by_group``: no mask, every row


def add_by_group(
    ids: np.ndarray, values: np.ndarray, present: np.ndarray, counts: np.ndarray, sums: np.ndarray
) -> None:
    """counts[g] += 1 and sums[g] += values[b] for each row b of group g that is present (every
    row when ``present`` is empty), in row order. A run of adjacent rows of one group adds in
    registers: the same additions in the same order as one row at a time, without a store and a
    load between them."""
    every = present.shape[0] == 0
    n_rows = ids.shape[0]
    b = 0
    while b < n_rows:
        group = ids[b]
        count, total = counts[group], sums[group]
        while b < n_rows and ids[b] == group:
            if every or present[b]:
                count += 1.0
                total += values[b]
            b += 1
        counts[group], sums[group] = count, total


def centre_by_group(
    values: np.ndarray,
    ids: np.ndarray,
    means: np.ndarray,
    present: np.ndarray,
    centred: np.ndarray,
    squares: np.ndarray,
) -> None:
    """centred[b] = values[b] - means[ids[b]] for every row, and squares[g] += centred[b]**2
    for each row b of group g that is present, in row order (as ``add_by_group``): one pass
    for what NumPy does in four (gather, subtract, square, bincount)."""
    every = present.shape[0] == 0
    n_rows = ids.shape[0]
    b = 0
    while b < n_rows:
        group = ids[b]
        mean, total = means[group], squares[group]
        while b < n_rows and ids[b] == group:
            difference = values[b] - mean
            centred[b] = difference
            if every or present[b]:
                total += difference * difference
            b += 1
        squares[group] = total


def take_by_group(per_group: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """out[b] = per_group[ids[b]]: 3x np.take on read-only ids at B=65,536."""
    for b in range(ids.shape[0]):
        out[b] = per_group[ids[b]]


def broadcast_by_mask(per_row: np.ndarray, mask: np.ndarray, out: np.ndarray) -> None:
    """out[b, t] = per_row[b] where the mask byte is not 0, +0.0 elsewhere (whatever the value:
    NaN and inf included). A select, never a product: NaN * 0 is NaN and -x * 0 is -0.0.
    np.copyto with where= takes 20 ms at 1024 x 4096 float32; this, about 1 ms."""
    for b in range(mask.shape[0]):
        value = per_row[b]
        for t in range(mask.shape[1]):
            out[b, t] = value if mask[b, t] != 0 else 0.0


def broadcast_by_lengths(per_row: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    """out[b, t] = per_row[b] for t < lengths[b], +0.0 after."""
    for b in range(out.shape[0]):
        value = per_row[b]
        valid = min(lengths[b], out.shape[1])
        for t in range(valid):
            out[b, t] = value
        for t in range(valid, out.shape[1]):
            out[b, t] = 0.0


def mask_bytes(mask: np.ndarray, out: np.ndarray) -> bool:
    """out[i] = 1 where mask[i] == 1 and 0 elsewhere, for a flat mask of numbers; whether every
    value was 0 or 1 (NaN is neither). One pass that LLVM vectorizes (no early exit: the caller
    finds the first bad value when there is one), where NumPy's check and conversion take four:
    an int64 (1024, 4096) mask, 1.5 ms instead of 6."""
    ok = True
    for i in range(mask.shape[0]):
        value = mask[i]
        is_one = value == 1
        ok &= is_one | (value == 0)
        out[i] = is_one
    return ok


def convert_mask(mask: np.ndarray, out: np.ndarray, n_threads: int) -> bool | None:
    """``mask_bytes(mask, out)`` (flat arrays), on ``n_threads`` consecutive ranges of positions
    at once when that is more than one; None where numba does not import. The bits do not depend
    on the threads (each position is converted on its own). An int64 (1024, 4096) mask on an
    Intel Xeon: 1.54 ms on one thread, 0.82 on two."""
    serial = compiled("mask_bytes")
    if serial is None:
        return None
    if n_threads > 1:
        import numba

        from ._numba_builds import _parallel_lock

        n_threads = min(n_threads, numba.config.NUMBA_NUM_THREADS)
        # numba's workqueue layer runs one parallel region at a time: a call made while another
        # thread's runs converts on this thread alone, as the kernels do (_numba_builds._Kernel)
        if n_threads > 1 and _parallel_lock.acquire(blocking=False):
            try:
                return _mask_bytes_in_parts()(mask, out, n_threads)
            finally:
                _parallel_lock.release()
    return serial(mask, out)


@functools.cache
def _mask_bytes_in_parts() -> Any:
    """A prange over ranges of positions, each run by mask_bytes' own compiled code, called by
    address (``_numba_builds._compiled_caller``): a loop written in the prange body is not
    vectorized (1.8x slower than mask_bytes on two threads)."""
    import numba

    from ._numba_builds import _compiled_caller

    call = _compiled_caller(compiled("mask_bytes"), ("mask", "out"))

    def in_parts(mask, out, n_parts):
        numba.set_num_threads(n_parts)  # compiled: from Python about 1 us a call
        n = mask.shape[0]
        ok = np.empty(n_parts, dtype=np.bool_)
        for p in numba.prange(n_parts):
            low = n * p // n_parts
            high = n * (p + 1) // n_parts
            ok[p] = call(mask[low:high], out[low:high])
        return ok.all()

    return numba.njit(nogil=True, parallel=True)(in_parts)


@functools.cache
def compiled(name: str) -> Any:
    """The loop ``name`` of this module compiled by numba, or None where numba does not import."""
    return jit(globals()[name])


def jit(function: Any) -> Any:
    """``function`` compiled by numba (nogil, no fastmath), or None where numba does not import."""
    try:
        import numba
    except ImportError:
        return None
    return numba.njit(nogil=True)(function)
