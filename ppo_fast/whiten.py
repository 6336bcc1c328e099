"""Masked whitening, and the moments that data-parallel ranks all-reduce to whiten globally.

Over the valid positions of the batch (count n),

    mean = sum(x) / n,    var = sum((x - mean)**2) / n        (population, the default)
                          var = sum((x - mean)**2) / (n - 1)  (unbiased=True)
    whiten(x) = (x - mean) / sqrt(var + eps)  [+ mean when shift_mean=False]

and 0 at positions that are not valid. With no valid position there is nothing to normalise and
``whiten`` raises ValueError (as does unbiased=True with a single valid position).

``masked_moments`` returns the sums a caller all-reduces across ranks: the count, and the sums of
``x - shift`` and ``(x - shift)**2`` in float64. For an exact global variance use two rounds:
all-reduce the moments with ``shift=0`` to get the global mean, then all-reduce
``masked_moments(x, shift=mean)`` and pass it as ``whiten(x, moments=...)``; one round with
shift 0 is accurate while |mean| / std is far below 1e8 (float64 cancellation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _validate


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
        if self.count <= 0:
            raise ValueError("no valid position: the mean of nothing is undefined")
        return self.shift + self.sum / self.count

    def var(self, unbiased: bool = False) -> float:
        """Population variance, or the unbiased (n - 1) one."""
        if self.count <= 0:
            raise ValueError("no valid position: there is nothing to normalise")
        if unbiased and self.count < 2:
            raise ValueError(
                "unbiased variance needs at least two valid positions, got one: pass unbiased=False"
            )
        centred_sq = max(self.sum_sq - self.sum * self.sum / self.count, 0.0)
        return centred_sq / (self.count - 1.0 if unbiased else self.count)


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
    (array,), rows = _validate.batch({"x": x}, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    about = _validate.scalar("shift", shift)
    return _row_moments(array, rows, about, backend)


def _row_moments(
    array: np.ndarray, rows: _validate.Rows, shift: float, backend: str | None
) -> Moments:
    row_outputs = np.empty((3, rows.n_rows))
    counts, sums, sums_sq = row_outputs
    _backend.run(
        "moments",
        backend,
        x=array.ravel(),
        **rows.arguments,
        shift=shift,
        counts=counts,
        sums=sums,
        sums_sq=sums_sq,
    )
    # Rows reduce on their own and then in row order: the same bits on any number of threads.
    # One reduction over the (3, B) row outputs: each line summed as ``line.sum()`` would.
    count, total, total_sq = row_outputs.sum(axis=1).tolist()
    return Moments(count, total, total_sq, shift)


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
        and dtype, sharing no memory with an input (so not ``x`` itself: whitening in place is
        refused). It is written and returned.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    An array shaped like ``x`` with its dtype (``out`` when given); positions that are not valid
    are 0.
    """
    (array,), rows = _validate.batch({"x": x}, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    if out is not None:
        (out,) = _validate.out_arrays(
            ("whitened",),
            out,
            array,
            {"x": x, "mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        )
    epsilon = _validate.scalar("eps", eps, lo=0.0)
    if moments is None:
        rough = _row_moments(array, rows, 0.0, backend)
        if rough.count == 0:
            raise ValueError(
                "whiten: no valid position (empty batch or all-zero mask): nothing to normalise"
            )
        # Second pass about the first mean: the variance without float64 cancellation. A
        # non-finite mean (NaN or inf among the valid values) makes every result NaN either way.
        if math.isfinite(rough.mean):
            moments = _row_moments(array, rows, rough.mean, backend)
        else:
            moments = rough
    elif not isinstance(moments, Moments):
        raise TypeError(
            f"moments must be a ppo_fast.Moments, got {type(moments).__name__}: "
            "build it with Moments.from_array(all_reduced, shift)"
        )
    mean = moments.mean
    scale = math.sqrt(moments.var(unbiased) + epsilon)
    if scale == 0.0:
        raise ValueError("whiten: the variance is 0 and eps=0: pass eps > 0")
    if out is None:
        out = np.empty_like(array)
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
