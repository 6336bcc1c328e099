"""KL penalties and KL-shaped per-token rewards.

With ``log_ratio_t = logprobs_t - ref_logprobs_t`` (the policy's log-probability of token t minus
the reference model's), the estimators of KL(policy || reference) per token are

    k1  = log_ratio                               (unbiased, can be negative)
    k2  = log_ratio**2 / 2                        (low variance, biased)
    k3  = exp(-log_ratio) - 1 + log_ratio         (unbiased, non-negative; "low_var_kl")
    abs = |log_ratio|

and ``clamp=c`` bounds the estimate to [-c, c] (verl's ``low_var_kl`` and OpenRLHF clamp k3 to
±10). The shaped reward of token t of a row is

    r_t = -kl_coef * KL_t + score * [t is the row's last valid token]

and 0 at positions that are not valid. A row with no valid token receives no score.
All arithmetic is float64; the result has the dtype of ``logprobs``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _result_arrays, _rows, _threads, _validate
from ._spec import ESTIMATORS

Estimator = Literal["k1", "k2", "k3", "abs"]


def _clamp(clamp: float | None) -> float:
    if clamp is None:
        return math.inf
    return _validate.scalar("clamp", clamp, lo=0.0, open_lo=True, allow_inf=True)


def kl_penalty(
    logprobs: ArrayLike,
    ref_logprobs: ArrayLike,
    estimator: Estimator = "k1",
    clamp: float | None = None,
    *,
    out: np.ndarray | None = None,
    backend: str | None = None,
) -> np.ndarray:
    """Per-token KL estimate between the policy and the reference, elementwise.

    Parameters
    ----------
    logprobs, ref_logprobs
        The policy's and the reference model's log-probabilities of the sampled tokens: float32
        or float64 arrays of one shape (any number of dimensions).
    estimator
        "k1", "k2", "k3" or "abs" (see the module docstring).
    clamp
        Bound the estimate to [-clamp, clamp] (clamp > 0; inf or None for no bound).
    out
        Optional preallocated result: a C-contiguous, writeable NumPy array of the result's shape
        and dtype, sharing no memory with an input. It is written and returned.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    An array of the shape and dtype of ``logprobs`` (``out`` when given); every position is
    computed (no mask).
    """
    bound = clamp if type(clamp) is float or clamp is None else _validate.fast_real(clamp)
    if (
        type(estimator) is str
        and estimator in _ESTIMATOR_CODES
        and (bound is None or (type(bound) is float and bound > 0.0))  # NaN fails: general way
        and _validate.common_case((logprobs, ref_logprobs), None)
        and (out is None or _validate.common_outputs((out,), logprobs, (logprobs, ref_logprobs)))
    ):
        return _kl_penalty_common(logprobs, ref_logprobs, estimator, bound, out, backend)
    code = ESTIMATORS.index(_validate.choice("estimator", estimator, ESTIMATORS))
    bound = _clamp(clamp)
    logp, ref = _validate.token_arrays(True, logprobs=logprobs, ref_logprobs=ref_logprobs)
    flat_logp = logp.reshape(-1)
    starts, spans = _elementwise_layout(flat_logp.shape[0])
    if out is None:
        result = _result_arrays.empty(logp.shape, logp.dtype)
    else:
        (result,) = _validate.out_arrays(
            ("kl",), out, logp, {"logprobs": logprobs, "ref_logprobs": ref_logprobs}
        )
    _backend.run(
        "kl_penalty",
        backend,
        logprobs=flat_logp,
        ref_logprobs=ref.reshape(-1),
        starts=starts,
        spans=spans,
        estimator=code,
        clamp=bound,
        kl=result.reshape(-1),
    )
    return result


def shape_rewards(
    scores: ArrayLike,
    logprobs: ArrayLike,
    ref_logprobs: ArrayLike,
    *,
    kl_coef: float,
    estimator: Estimator = "k1",
    clamp: float | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    out: np.ndarray | None = None,
    backend: str | None = None,
) -> np.ndarray:
    """KL-shaped per-token rewards; see the module docstring.

    Parameters
    ----------
    scores
        (B,): each row's sequence-level score (any real dtype), added on its last valid token.
        Scores are data: a NaN or inf score propagates into its row's last reward.
    logprobs, ref_logprobs
        (B, T) padded, or (N,) packed with ``cu_seqlens``; float32 or float64, one dtype.
    kl_coef
        The KL coefficient (finite, >= 0): r_t = -kl_coef * KL_t (+ the score on the last token).
    estimator, clamp
        As for ``kl_penalty``.
    mask, lengths, cu_seqlens
        At most one: a 0/1 (B, T) ``mask`` (holes and left padding allowed; nonzero is valid),
        ``lengths`` (B,) (positions 0 .. lengths[b]-1 of row b are valid), or ``cu_seqlens``
        (B+1,) for packed (N,) arrays (row b is positions cu_seqlens[b] .. cu_seqlens[b+1]-1).
        None of them: every position of a (B, T) array is valid.
    out
        Optional preallocated result: a C-contiguous, writeable NumPy array of the result's shape
        and dtype, sharing no memory with an input. It is written and returned.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    Rewards shaped like ``logprobs`` with its dtype (``out`` when given); 0 at positions that are
    not valid.
    """
    coef = kl_coef if type(kl_coef) is float else _validate.fast_real(kl_coef)
    bound = clamp if type(clamp) is float or clamp is None else _validate.fast_real(clamp)
    if (
        type(coef) is float
        and 0.0 <= coef < math.inf  # NaN fails the comparisons: it goes the general way
        and (bound is None or (type(bound) is float and bound > 0.0))
        and type(estimator) is str
        and estimator in _ESTIMATOR_CODES
    ):
        inputs = (logprobs, ref_logprobs)
        layout = _validate.common_layout(inputs, mask, lengths, cu_seqlens)
        if layout is not False:
            n_rows = len(layout[0]) if type(layout) is tuple else logprobs.shape[0]
            given = (*inputs, scores, mask, lengths, cu_seqlens)
            if (row_scores := _common_scores(scores, n_rows)) is not None and (
                out is None or _validate.common_outputs((out,), logprobs, given)
            ):
                return _shape_rewards_common(
                    *inputs, row_scores, layout, coef, estimator, bound, out, backend
                )
    code = ESTIMATORS.index(_validate.choice("estimator", estimator, ESTIMATORS))
    bound = _clamp(clamp)
    coef = _validate.scalar("kl_coef", kl_coef, lo=0.0)
    (logp, ref), rows = _validate.batch(
        {"logprobs": logprobs, "ref_logprobs": ref_logprobs},
        mask=mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
    )
    # Scores are data: a NaN or inf score propagates into the rewards (DESIGN.md section 3).
    row_scores = _validate.per_row(
        "scores", scores, rows.n_rows, allow_inf=True, allow_nan=True, rows_only=True
    )
    if out is None:
        rewards = _result_arrays.empty(logp.shape, logp.dtype)
    else:
        (rewards,) = _validate.out_arrays(
            ("rewards",),
            out,
            logp,
            {
                "scores": scores,
                "logprobs": logprobs,
                "ref_logprobs": ref_logprobs,
                "mask": mask,
                "lengths": lengths,
                "cu_seqlens": cu_seqlens,
            },
        )
    _backend.run(
        "shape_rewards",
        backend,
        logprobs=logp.ravel(),
        ref_logprobs=ref.ravel(),
        **rows.arguments,
        scores=row_scores,
        kl_coef=coef,
        estimator=code,
        clamp=bound,
        rewards=rewards.ravel(),
    )
    return rewards


_ESTIMATOR_CODES = {name: code for code, name in enumerate(ESTIMATORS)}
_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)


def _common_scores(scores: Any, n_rows: int) -> np.ndarray | None:
    """The (B,) float64 scores of the common case, as ``_validate.per_row`` makes them, from an
    exact NumPy array of float32 or float64 of shape (``n_rows``,): the array itself where it is
    float64, C-contiguous, aligned and writeable (the table kernel's exact entry takes one numba
    type: a read-only array is another), else its float64 copy; None otherwise (the general way:
    other dtypes, shapes, lists; what per_row refuses)."""
    if type(scores) is not np.ndarray or scores.shape != (n_rows,):
        return None
    if scores.dtype is _FLOAT64 and scores.flags.carray:
        return scores
    if scores.dtype is _FLOAT64 or scores.dtype is _FLOAT32:
        return scores.astype(_FLOAT64)
    return None


def _shape_rewards_common(
    logprobs: np.ndarray,
    ref_logprobs: np.ndarray,
    scores: np.ndarray,
    mask: np.ndarray | None,
    kl_coef: float,
    estimator: str,
    clamp: float | None,
    out: np.ndarray | None,
    backend: str | None,
) -> np.ndarray:
    """The common case, checked by the caller (``_validate.common_case``: two C-contiguous (B, T)
    arrays of one float dtype; no mask or a bool one, ``_validate.converted_mask``'s for a 0/1 one
    of numbers or for lengths; or two such 1-D arrays, ``mask`` their packed rows' (starts, spans)
    from ``_validate.common_packed``; ``scores`` from ``_common_scores``; ``kl_coef`` a float in [0,
    inf), ``clamp`` None or a float > 0, a known estimator; ``out`` None or as
    ``_validate.common_outputs`` accepts it): the general way's kernel call, its arguments made
    without the general way's checks and copies, on numba through the exact entry of the estimator's
    one-thread build (``_backend.table_kernel``: the table kernel would type its 12 arguments on
    each call). tests/test_fast_path.py compares the two."""
    if out is None:
        out = _result_arrays.empty(logprobs.shape, logprobs.dtype)
    if type(mask) is tuple:  # packed rows' (starts, spans)
        starts, spans = mask
        layout = (starts, spans, spans, _rows.EMPTY_MASK)
        n_threads = _threads.threads_for(len(starts), logprobs.size)
        mask = None
    else:
        n_rows, width = logprobs.shape
        layout = _rows.padded_arguments(n_rows, width, mask)
        n_threads = _threads.threads_for(n_rows, n_rows * width)
    code = _ESTIMATOR_CODES[estimator]
    kernel = _backend.table_kernel(
        "shape_rewards", backend, n_threads, logprobs.dtype, mask is not None, code
    )
    kernel(
        logprobs.reshape(-1),
        ref_logprobs.reshape(-1),
        *layout,
        scores,
        kl_coef,
        code,
        math.inf if clamp is None else clamp,
        out.reshape(-1),
        n_threads,
    )
    return out


# The rows an elementwise call of n positions is cut into, by n: only so that threads can share
# them (MIN_POSITIONS_PER_THREAD positions a row). Bounded as _rows' caches; the kernels only
# read them.
_elementwise_layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _elementwise_layout(n: int) -> tuple[np.ndarray, np.ndarray]:
    layout = _elementwise_layouts.get(n)
    if layout is None:
        starts = np.arange(0, n, _threads.MIN_POSITIONS_PER_THREAD, dtype=np.int64)
        layout = (starts, np.minimum(_threads.MIN_POSITIONS_PER_THREAD, n - starts))
        if len(_elementwise_layouts) >= 64:
            _elementwise_layouts.clear()
        _elementwise_layouts[n] = layout
    return layout


def _kl_penalty_common(
    logprobs: np.ndarray,
    ref_logprobs: np.ndarray,
    estimator: str,
    clamp: float | None,
    out: np.ndarray | None,
    backend: str | None,
) -> np.ndarray:
    """The common case, checked by the caller (``_validate.common_case``: two C-contiguous (B, T)
    arrays of one float dtype; a known estimator, ``clamp`` None or a float > 0; ``out`` None or
    as ``_validate.common_outputs`` accepts it): the general way's kernel call without its checks
    and copies, on numba through the exact entry of the estimator's one-thread build
    (``_backend.table_kernel``). tests/test_fast_path.py compares the two."""
    n = logprobs.size
    starts, spans = _elementwise_layout(n)
    if out is None:
        out = _result_arrays.empty(logprobs.shape, logprobs.dtype)
    n_threads = _threads.threads_for(starts.shape[0], n)
    code = _ESTIMATOR_CODES[estimator]
    kernel = _backend.table_kernel("kl_penalty", backend, n_threads, logprobs.dtype, False, code)
    kernel(
        logprobs.reshape(-1),
        ref_logprobs.reshape(-1),
        starts,
        spans,
        code,
        math.inf if clamp is None else clamp,
        out.reshape(-1),
        n_threads,
    )
    return out
