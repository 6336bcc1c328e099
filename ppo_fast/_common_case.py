"""The stages' fast paths start by asking whether their inputs are the common case: these tests,
in C where ppo_fast._checks is built (src/_checks.pyx: 0.05 us, not 0.6 us for three arrays and a
mask), else the Python ones here (the same answers: tests/test_checks.py). ``_validate``
re-exports them, and the stages call them from there.

- ``common_case(arrays, mask)``: padded rows. NumPy arrays (not subclasses) of one float dtype
  (float32 or float64, native byte order), 2-D, of one shape, C-contiguous, aligned and writeable
  (``flags.carray``; see ``_validate.kernel_array``), with no mask or such a bool mask of that
  shape: exactly the inputs that ``_validate.token_arrays`` returns unchanged and
  ``_validate.rows`` accepts as they are.
- ``common_packed(arrays, cu_seqlens)``: packed rows. Such arrays, 1-D of one length N, and
  ``cu_seqlens`` an exact 1-D NumPy array of int64 or int32 (native byte order), C-contiguous and
  aligned (read-only allowed: it is only read), of B + 1 >= 1 entries from 0 to N, never
  decreasing: the rows' (starts, spans), int64 arrays of their own, as ``_validate.rows`` makes
  them; else None.

- ``common_outputs(outputs, like, inputs)``: preallocated outputs (``out=``, ``grad_out=``),
  exact NumPy arrays of ``like``'s dtype and shape, C-contiguous, aligned and writeable, whose
  bytes lie apart from every input's and each other's.
- ``lengths_mask(arrays, lengths)``: beside padded arrays of the common case (no mask), lengths
  that the fast paths take as the bool mask of the positions t < lengths[b]: an exact 1-D NumPy
  array of int64 or int32 (native byte order; any strides, read-only allowed) of B entries in
  [0, T], for at most LENGTHS_AS_MASK_POSITIONS positions: that mask, an array of its own; else
  False.

Anything else goes the general way, which returns the same or raises.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_NDARRAY = np.ndarray
_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)
_BOOL = np.dtype(np.bool_)
_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)


def _tokens(arrays: tuple[Any, ...], ndim: int) -> bool:
    """Whether ``arrays`` are exact NumPy arrays of one float dtype and one ``ndim``-D shape,
    C-contiguous, aligned and writeable (dtypes compared by identity: a byte-swapped float32,
    or one with metadata, is another dtype object)."""
    first = arrays[0]
    if type(first) is not _NDARRAY or not first.flags.carray:
        return False
    dtype, shape = first.dtype, first.shape
    if (dtype is not _FLOAT32 and dtype is not _FLOAT64) or len(shape) != ndim:
        return False
    for array in arrays[1:]:
        if (
            type(array) is not _NDARRAY
            or array.dtype is not dtype
            or array.shape != shape
            or not array.flags.carray
        ):
            return False
    return True


def python_common_case(arrays: tuple[Any, ...], mask: Any) -> bool:
    """Whether the token ``arrays`` (a tuple) and the ``mask`` are the padded common case."""
    if not _tokens(arrays, 2):
        return False
    return mask is None or (
        type(mask) is _NDARRAY
        and mask.dtype is _BOOL
        and mask.shape == arrays[0].shape
        and mask.flags.carray
    )


def python_common_packed(
    arrays: tuple[Any, ...], cu_seqlens: Any
) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows' (starts, spans) where the token ``arrays`` (a tuple) and ``cu_seqlens`` are the
    packed common case, else None."""
    if not _tokens(arrays, 1) or type(cu_seqlens) is not _NDARRAY:
        return None
    flags = cu_seqlens.flags
    if (
        (cu_seqlens.dtype is not _INT64 and cu_seqlens.dtype is not _INT32)
        or cu_seqlens.ndim != 1
        or cu_seqlens.shape[0] < 1
        or not (flags.aligned and flags.c_contiguous)
    ):
        return None
    cu = cu_seqlens.astype(np.int64)
    spans = np.diff(cu)
    if cu[0] != 0 or cu[-1] != arrays[0].shape[0] or np.any(spans < 0):
        return None
    return cu[:-1], spans


def python_common_outputs(
    outputs: tuple[Any, ...], like: np.ndarray, inputs: tuple[Any, ...]
) -> bool:
    """Whether preallocated ``outputs`` (``out=``, ``grad_out=``) are the common case beside
    ``inputs`` of the common case (``common_case``, ``like`` the first of them): NumPy arrays (not
    subclasses) of ``like``'s dtype and shape, C-contiguous, aligned and writeable, whose bytes
    lie apart from every input's and each other's: ``out_array`` accepts those as they are.
    Anything else goes the general way, which accepts it or says why not. ``inputs`` are arrays
    and Nones (the stages pass what passed their common case).

    Every array here is C-contiguous, so overlapping bounds (``np.may_share_memory``, no search)
    mean shared bytes. Two distinct arrays that each own their data (NumPy allocated it) cannot
    share any: that test first, since bounds cost 0.2 us a pair (gae's two outputs beside three
    inputs are seven pairs, 1.4 us of a 2.5 us call).
    """
    dtype, shape = like.dtype, like.shape
    for k, out in enumerate(outputs):
        if type(out) is not _NDARRAY or out.dtype is not dtype or out.shape != shape:
            return False
        out_flags = out.flags
        if not out_flags.carray:
            return False
        owns = out_flags.owndata
        for other in (*inputs, *outputs[:k]):
            if other is None or (owns and other is not out and other.flags.owndata):
                continue
            if _may_share_memory(out, other):
                return False
    return True


_may_share_memory = np.may_share_memory

# Up to this many positions lengths take the fast paths as the bool mask of their valid
# positions (the same bits); above, writing and reading B x T bytes costs more than the general
# way's checks (8 x 128: gae 15.4 us the general way, 7.3 us as a mask in Python, 3.4 us in C).
LENGTHS_AS_MASK_POSITIONS = 1 << 16
_LENGTH_DTYPES = frozenset((np.dtype(np.int64), np.dtype(np.int32)))
_row_positions: dict[int, np.ndarray] = {}  # np.arange(T) by T, bounded as _rows' caches


def python_lengths_mask(arrays: tuple[Any, ...], lengths: Any) -> Any:
    """``lengths_mask`` in Python (see the module's docstring)."""
    if (
        type(lengths) is not _NDARRAY
        or lengths.dtype not in _LENGTH_DTYPES
        or lengths.ndim != 1
        or not python_common_case(arrays, None)
    ):
        return False
    n_rows, width = arrays[0].shape
    if lengths.shape[0] != n_rows or n_rows * width > LENGTHS_AS_MASK_POSITIONS:
        return False
    # one reduction for both bounds: a negative length is past T as an unsigned integer
    unsigned = lengths.view(np.uint64 if lengths.itemsize == 8 else np.uint32)
    if n_rows and unsigned.max() > width:
        return False
    positions = _row_positions.get(width)
    if positions is None:
        if len(_row_positions) >= 64:
            _row_positions.clear()
        positions = _row_positions[width] = np.arange(width)
    return positions < lengths[:, None]


try:
    from ._checks import common_case, common_outputs, common_packed, lengths_mask
except ImportError:  # not built (setup.py warned): the same tests in Python
    common_case = python_common_case
    common_outputs = python_common_outputs
    common_packed = python_common_packed
    lengths_mask = python_lengths_mask
