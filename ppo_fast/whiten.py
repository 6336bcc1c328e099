"""Masked whitening, and the moments that data-parallel ranks all-reduce to whiten globally.

Over the valid positions of the batch (count n),

    mean = sum(x) / n,    var = sum((x - mean)**2) / n        (population, the default)
                          var = sum((x - mean)**2) / (n - 1)  (unbiased=True)
    whiten(x) = (x - mean) / sqrt(var + eps)  [+ mean when shift_mean=False]

and 0 at positions that are not valid. With no valid position there is nothing to normalise and
``whiten`` raises ValueError (as does unbiased=True with a single valid position). It computes
in float64 (x - mean) * (1 / sqrt(var + eps)) (verl's and TRL's ``masked_whiten`` multiply by
``rsqrt`` too), with the moments taken in one pass over the batch about its first row's mean
where that is as exact as two passes (``_batch_mean_and_variance``).

``masked_moments`` returns the sums a caller all-reduces across ranks: the count, and the sums of
``x - shift`` and ``(x - shift)**2`` in float64. For an exact global variance use two rounds:
all-reduce the moments with ``shift=0`` to get the global mean, then all-reduce
``masked_moments(x, shift=mean)`` and pass it as ``whiten(x, moments=...)``; one round with
shift 0 is accurate while |mean| / std is far below 1e8 (float64 cancellation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _result_arrays, _rows, _threads, _validate


@dataclass(frozen=True)
class Moments:
    """count, sum and sum of squares of ``x - shift`` over the valid positions (float64)."""

    count: float
    sum: float
    sum_sq: float
    shift: float = 0.0

    def __post_init__(self) -> None:
        # Checked here, not where they are used: an all-reduce gone wrong shows at once. The sums
        # may be NaN or inf (non-finite data propagate); the count and the shift are numbers.
        fields = {
            "count": _validate.scalar("Moments.count", self.count, lo=0.0),
            "sum": _validate.scalar("Moments.sum", self.sum, allow_inf=True, allow_nan=True),
            "sum_sq": _validate.scalar(
                "Moments.sum_sq", self.sum_sq, lo=0.0, allow_inf=True, allow_nan=True
            ),
            "shift": _validate.scalar("Moments.shift", self.shift),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @classmethod
    def _of_sums(cls, count: float, total: float, total_sq: float, shift: float) -> Moments:
        """From a kernel's float sums about a checked shift: what ``__post_init__`` checks
        holds by construction (a count >= 0, a sum of squares >= 0, NaN or inf), so the fast
        path skips its four checks (about 2 us of a 3 us call at 8 x 128)."""
        moments = object.__new__(cls)
        object.__setattr__(moments, "count", count)
        object.__setattr__(moments, "sum", total)
        object.__setattr__(moments, "sum_sq", total_sq)
        object.__setattr__(moments, "shift", shift)
        return moments

    def __add__(self, other: Moments) -> Moments:
        if not isinstance(other, Moments):
            return NotImplemented
        if other.shift != self.shift:
            raise ValueError(
                f"cannot add moments taken about different shifts ({self.shift} and "
                f"{other.shift}): take them with the same shift"
            )
        return Moments(
            self.count + other.count, self.sum + other.sum, self.sum_sq + other.sum_sq, self.shift
        )

    def to_array(self) -> np.ndarray:
        """[count, sum, sum_sq] as float64, ready for an all-reduce (SUM)."""
        return np.array([self.count, self.sum, self.sum_sq], dtype=np.float64)

    @classmethod
    def from_array(cls, array: ArrayLike, shift: float = 0.0) -> Moments:
        """The inverse of ``to_array`` (for example after an all-reduce)."""
        count, total, total_sq = (float(v) for v in np.asarray(array, dtype=np.float64))
        return cls(count, total, total_sq, float(shift))

    @property
    def mean(self) -> float:
        return _mean(self.count, self.sum, self.shift)

    def var(self, unbiased: bool = False) -> float:
        """Population variance, or the unbiased (n - 1) one."""
        return _variance(self.count, self.sum, self.sum_sq, unbiased)


def _mean(count: float, total: float, shift: float) -> float:
    """The mean of moments (count, total) taken about ``shift``."""
    if count <= 0:
        raise ValueError("no valid position: the mean of nothing is undefined")
    return shift + total / count


def _variance(count: float, total: float, total_sq: float, unbiased: bool) -> float:
    """The variance of moments (count, total, total_sq) taken about any shift."""
    if count <= 0:
        raise ValueError("no valid position: there is nothing to normalise")
    if unbiased and count < 2:
        raise ValueError(
            "unbiased variance needs at least two valid positions, got one: pass unbiased=False"
        )
    centred_sq = max(total_sq - total * total / count, 0.0)
    return centred_sq / (count - 1.0 if unbiased else count)


def _batch_mean_and_variance(
    sums_about: Callable[[float], tuple[float, float, float]],
    sample_sums: Callable[[], tuple[float, float, float]],
    unbiased: bool,
) -> tuple[float, float]:
    """The mean and variance of a batch from ``sums_about(shift)``, its (count, sum, sum of
    squares) of x - shift, in one pass over the batch where that is as exact as two.

    The pass is taken about the mean of a sample (``sample_sums()``: the sums about 0 of the
    first row), so that sum_sq - sum**2 / count, the centred sum of squares, cancels little: its
    float64 error is about (1 + 2 * count * (mean - shift)**2 / centred) units in the last place,
    at most 3 when the shift lies within one standard deviation of the mean. When it does not (a
    first row unlike the rest, or with no valid position) a second pass is taken about the mean
    of the first, as a two-pass variance does. A non-finite mean (NaN or inf among the valid
    values) makes every result NaN either way: then the sums of the first pass are used."""
    count, total, _ = sample_sums()
    shift = total / count if count > 0 and math.isfinite(total / count) else 0.0
    count, total, total_sq = sums_about(shift)
    if count == 0:
        raise ValueError(
            "whiten: no valid position (empty batch or all-zero mask): nothing to normalise"
        )
    mean = _mean(count, total, shift)
    if math.isfinite(mean) and not (
        math.isfinite(total_sq) and total * total / count <= total_sq - total * total / count
    ):
        shift = mean
        count, total, total_sq = sums_about(shift)
    return _mean(count, total, shift), _variance(count, total, total_sq, unbiased)


def _inverse_scale(variance: float, eps: float) -> float:
    """1 / sqrt(variance + eps), by which ``whiten`` multiplies (as verl's and TRL's
    ``masked_whiten`` multiply by ``rsqrt``): numba's pass with a float64 division per position
    took 1.1-1.3x its time with this multiplication (float32 1024 x 4096, one thread); the C pass
    was at the memory's speed either way."""
    scale = math.sqrt(variance + eps)
    if scale == 0.0:
        raise ValueError("whiten: the variance is 0 and eps=0: pass eps > 0")
    return 1.0 / scale


def masked_moments(
    x: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    shift: float = 0.0,
    backend: str | None = None,
) -> Moments:
    """Moments of ``x - shift`` over the valid positions; see the module docstring.

    Parameters
    ----------
    x
        (B, T) padded, or (N,) packed with ``cu_seqlens``; float32 or float64.
    mask, lengths, cu_seqlens
        At most one: a 0/1 (B, T) ``mask`` (holes and left padding allowed; nonzero is valid),
        ``lengths`` (B,) (positions 0 .. lengths[b]-1 of row b are valid), or ``cu_seqlens``
        (B+1,) for packed (N,) arrays (row b is positions cu_seqlens[b] .. cu_seqlens[b+1]-1).
        None of them: every position of a (B, T) array is valid.
    shift
        The value the moments are taken about (use the mean for an exact variance); finite.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    Moments(count, sum, sum_sq, shift), float64: all-reduce ``to_array()`` across ranks.
    """
    if type(shift) is not float:
        shift = _validate.fast_real(shift)
    if type(shift) is float and math.isfinite(shift):
        layout = _validate.common_layout((x,), mask, lengths, cu_seqlens)
        if layout is not False:
            moments, n_threads = _common_moments(x, layout, backend)
            return Moments._of_sums(*moments(x, layout, shift, n_threads), shift)
    (array,), rows = _validate.batch({"x": x}, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    about = _validate.scalar("shift", shift)
    return Moments(*_row_sums(array, rows, about, backend), about)


def _common_moments(x: np.ndarray, layout: np.ndarray | tuple | None, backend: str | None):
    """The moments' common-case entry for ``x`` in a fast path's ``layout`` (None, a bool
    mask, or packed rows' (starts, spans): ``_validate.common_layout``), and the threads the
    general way's call would take."""
    if type(layout) is tuple:
        return _backend.packed_common("moments", backend, x.dtype, layout, x.size)
    n_threads = _threads.threads_for(x.shape[0], x.size)
    return _backend.common("moments", backend, n_threads, x.dtype, layout is not None), n_threads


def _row_sums(
    array: np.ndarray,
    rows: _rows.Rows,
    shift: float,
    backend: str | None,
    first_rows: int | None = None,
) -> tuple[float, float, float]:
    """The count, sum and sum of squares of ``array - shift`` over the valid positions (of the
    first ``first_rows`` rows only, when given)."""
    layout = rows.arguments
    if first_rows is not None:
        for name in ("starts", "spans", "lengths"):
            layout[name] = layout[name][:first_rows]
    row_outputs = np.empty((3, len(layout["starts"])))
    counts, sums, sums_sq = row_outputs
    _backend.run(
        "moments",
        backend,
        x=array.ravel(),
        **layout,
        shift=shift,
        counts=counts,
        sums=sums,
        sums_sq=sums_sq,
    )
    # Rows reduce on their own and then in row order: the same bits on any number of threads.
    # One reduction over the (3, B) row outputs: each line summed as ``line.sum()`` would.
    count, total, total_sq = row_outputs.sum(axis=1).tolist()
    return count, total, total_sq


def whiten(
    x: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    shift_mean: bool = True,
    unbiased: bool = False,
    eps: float = 1e-8,
    moments: Moments | None = None,
    out: np.ndarray | None = None,
    backend: str | None = None,
) -> np.ndarray:
    """Whiten ``x`` over its valid positions, or by given (global) ``moments``.

    Parameters
    ----------
    x
        (B, T) padded, or (N,) packed with ``cu_seqlens``; float32 or float64.
    mask, lengths, cu_seqlens
        At most one: a 0/1 (B, T) ``mask`` (holes and left padding allowed; nonzero is valid),
        ``lengths`` (B,) (positions 0 .. lengths[b]-1 of row b are valid), or ``cu_seqlens``
        (B+1,) for packed (N,) arrays (row b is positions cu_seqlens[b] .. cu_seqlens[b+1]-1).
        None of them: every position of a (B, T) array is valid.
    shift_mean
        False adds the mean back: (x - mean) / sqrt(var + eps) + mean.
    unbiased
        Divide the variance by n - 1 instead of n (population, the default).
    eps
        Added to the variance under the square root (finite, >= 0).
    moments
        Global ``Moments`` (all-reduced across ranks) to whiten by, instead of this batch's.
    out
        Optional preallocated result: a C-contiguous, writeable NumPy array of the result's shape
        and dtype, sharing no memory with an input, or ``x`` itself: ``out=x`` whitens in place,
        replacing x's values by the result (the moments are taken first; then each position is
        read just before it is written). It is written and returned. In place moves less memory
        on large batches: the result's cache lines are those just read, where a separate array's
        must be fetched before they are written.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    An array shaped like ``x`` with its dtype (``out`` when given); positions that are not valid
    are 0.
    """
    if type(eps) is not float:
        eps = _validate.fast_real(eps)
    if (
        type(eps) is float
        and 0.0 <= eps < math.inf  # NaN fails the comparisons: it goes the general way
        and moments is None
    ):
        layout = _validate.common_layout((x,), mask, lengths, cu_seqlens)
        # out=x whitens in place: out need then lie apart from the layout's arrays only
        given = (mask, lengths, cu_seqlens) if out is x else (x, mask, lengths, cu_seqlens)
        if layout is not False and (out is None or _validate.common_outputs((out,), x, given)):
            return _whiten_common(x, layout, shift_mean, unbiased, eps, out, backend)
    (array,), rows = _validate.batch({"x": x}, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    if out is not None:
        (out,) = _validate.out_arrays(
            ("whitened",),
            out,
            array,
            {"x": x, "mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
            in_place="x",
        )
    epsilon = _validate.scalar("eps", eps, lo=0.0)
    if moments is None:
        mean, variance = _batch_mean_and_variance(
            lambda shift: _row_sums(array, rows, shift, backend),
            lambda: _row_sums(array, rows, 0.0, backend, first_rows=1),
            unbiased,
        )
    elif not isinstance(moments, Moments):
        raise TypeError(
            f"moments must be a ppo_fast.Moments, got {type(moments).__name__}: "
            "build it with Moments.from_array(all_reduced, shift)"
        )
    else:
        mean, variance = moments.mean, moments.var(unbiased)
    scale = _inverse_scale(variance, epsilon)
    if out is None:
        out = _result_arrays.empty(array.shape, array.dtype)
    _backend.run(
        "whiten",
        backend,
        x=array.ravel(),
        **rows.arguments,
        mean=mean,
        scale=scale,
        offset=0.0 if shift_mean else mean,
        whitened=out.ravel(),
    )
    return out


def _whiten_common(
    x: np.ndarray,
    mask: np.ndarray | None,
    shift_mean: bool,
    unbiased: bool,
    eps: float,
    out: np.ndarray | None,
    backend: str | None,
) -> np.ndarray:
    """The common case, checked by the caller (``_validate.common_case``: a C-contiguous (B, T)
    array of a float dtype, no mask or a bool one; or a 1-D one, ``mask`` its packed rows' (starts,
    spans) from ``_validate.common_packed``, for the packed entries; a float ``eps`` in range, the
    batch's own moments; ``out`` None or as ``_validate.common_outputs`` accepts it): what the
    general way computes, in the backends' common-case entries of the moments and whiten kernels
    (tests/test_fast_path.py compares the two)."""
    dtype = x.dtype
    moments, n_threads = _common_moments(x, mask, backend)
    if type(mask) is tuple:  # packed rows' (starts, spans); the sample is the first row
        whiten_entry = _backend.common("whiten", backend, n_threads, dtype, False, True)
        sample_moments = _backend.common("moments", backend, 1, dtype, False, True)
        sample = (x, (mask[0][:1], mask[1][:1]))
    else:
        masked = mask is not None
        whiten_entry = _backend.common("whiten", backend, n_threads, dtype, masked)
        sample_moments = (
            moments if n_threads == 1 else _backend.common("moments", backend, 1, dtype, masked)
        )
        sample = (x[:1], None if mask is None else mask[:1])
    mean, variance = _batch_mean_and_variance(
        lambda shift: moments(x, mask, shift, n_threads),
        lambda: sample_moments(*sample, 0.0, 1),
        unbiased,
    )
    scale = _inverse_scale(variance, eps)
    if out is None:
        # as gae's fast path
        empty = np.empty if x.nbytes < _result_arrays.POOLED_BYTES else _result_arrays.empty
        out = empty(x.shape, x.dtype)
    offset = 0.0 if shift_mean else mean
    whiten_entry(x, mask, mean, scale, offset, out, n_threads)
    return out
