"""Fused PPO losses: the loss, its exact gradient and the statistics, in one pass.

Clipped surrogate (policy loss). Per valid token, with A the advantage, w the weight (1 without
``weights``) and ``log_ratio = logprobs - old_logprobs`` clamped to [-log_ratio_clamp,
log_ratio_clamp] when given:

    rho = exp(log_ratio)
    L   = min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)
    L   = max(L, dual_clip * A)   where A < 0, when dual_clip (> 1) is given
    l   = -w * L                  (the per-token loss)

Clipped value loss. Per valid token, with R the return and c = ``clip``:

    l = 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)

Aggregation (``agg``) of the per-token losses l over the valid tokens:

    "token-mean"               sum(l) / num_tokens      (default: the valid tokens here; pass the
                                                         global count so micro-batches sum to the
                                                         global mean)
    "seq-mean-token-mean"      sum over rows of mean(l in row) / num_seqs
    "seq-mean-token-sum"       sum over rows of sum(l in row) / num_seqs
    "seq-mean-token-sum-norm"  sum(l) / loss_scale     (default T, the padded width)

``num_seqs`` defaults to the rows with at least one valid token: fully masked rows do not count.
With no valid token the loss is 0 and the gradient 0.

The gradient is the exact derivative of that piecewise function with respect to ``logprobs`` (or
``values``): d rho / d logprobs = rho, so it is ``-w * A * rho * scale`` where the unclipped
branch is taken and 0 where the clipped or dual-clipped branch is (the flat parts), and 0 where the
log-ratio clamp is active. At a kink, where two branches are equal, the gradient is the unclipped
branch's: that is torch autograd's answer at the trust-region edge (clamp passes the gradient at
its bounds and min splits ties in halves that add up), while at an exact dual-clip tie autograd
gives half of it. ``scale`` is the token's aggregation weight (1/num_tokens, 1/(num_seqs * n_row),
1/num_seqs or 1/loss_scale). Positions that are not valid get gradient 0.

Statistics, over the valid tokens: ``clipfrac``, the fraction where the clipped branch is strictly
smaller (verl's pg_clipfrac); ``clipfrac_lower``, where the dual clip is taken; ``approx_kl``, the
mean of old_logprobs - logprobs (of the clamped log-ratio when a clamp is given, as verl does);
for the value loss, ``clipfrac``, where the clipped term is strictly larger. They are NaN when
there is no valid token.

Per-token arithmetic runs in the input dtype on every backend, the oracle included: a per-token
value that overflows float32 is inf in float32 (a value of 1e20 squared in the value loss, say),
whatever float64 would hold; sums and the loss are float64. Without a log-ratio clamp, exp
saturates for finite log-ratios past 88.3 in float32 and 709 in float64 (torch gives inf there):
pass ``log_ratio_clamp`` (verl uses 20) when log-ratios can be that large. Non-finite values at
valid positions propagate as IEEE arithmetic says, on every backend: a log-ratio of NaN, inf or
-inf has the ratio NaN, inf or 0, and a NaN or inf weight makes the gradient NaN even on a flat
branch (the weight times a zero slope). A NaN that reveals a bug upstream is never made finite.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _result_arrays, _rows, _threads, _validate
from ._policy_scalars import _surrogate_scalars
from ._spec import AGGREGATIONS

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]

# The aggregation modes each normaliser applies to.
_APPLIES_TO = {
    "num_tokens": ("token-mean",),
    "num_seqs": ("seq-mean-token-mean", "seq-mean-token-sum"),
    "loss_scale": ("seq-mean-token-sum-norm",),
}


class PolicyLossResult(NamedTuple):
    """The clipped-surrogate loss, d loss / d logprobs, and the statistics."""

    loss: float
    grad: np.ndarray
    clipfrac: float
    clipfrac_lower: float
    approx_kl: float


class ValueLossResult(NamedTuple):
    """The clipped value loss, d loss / d values, and the clip fraction."""

    loss: float
    grad: np.ndarray
    clipfrac: float


def _check_agg(
    agg: str, num_tokens: float | None, num_seqs: float | None, loss_scale: float | None
) -> None:
    """``agg`` is a mode, and each normaliser given is its mode's (``_row_scales``' checks on the
    arguments alone; ``ppo_fast.torch`` runs them before its torch path too)."""
    _validate.choice("agg", agg, AGGREGATIONS)
    if num_tokens is not None or num_seqs is not None or loss_scale is not None:
        for name, value in (
            ("num_tokens", num_tokens),
            ("num_seqs", num_seqs),
            ("loss_scale", loss_scale),
        ):
            if value is not None and agg not in _APPLIES_TO[name]:
                raise ValueError(
                    f"{name} applies to agg={' or '.join(map(repr, _APPLIES_TO[name]))}, "
                    f"not {agg!r}"
                )


def _row_scales(
    agg: str,
    rows: _rows.Rows,
    num_tokens: float | None,
    num_seqs: float | None,
    loss_scale: float | None,
    dtype: np.dtype,
) -> tuple[np.ndarray, float]:
    """Each row's aggregation weight (float64), and the number of valid tokens of the batch;
    ``dtype`` is the loss's, in which each weight must be finite (``_validate.normaliser``)."""
    _check_agg(agg, num_tokens, num_seqs, loss_scale)
    if agg == "token-mean" or agg == "seq-mean-token-sum-norm":
        # Only the batch's count: no count per row. Counted as the kernels test validity,
        # mask != 0 (a bool mask's bytes need not be 0/1).
        valid = float(np.count_nonzero(rows.mask) if rows.mask.shape[0] else rows.lengths.sum())
        if agg == "token-mean":
            total = (
                valid
                if num_tokens is None
                else _validate.normaliser("num_tokens", num_tokens, dtype)
            )
            return np.full(rows.n_rows, 1.0 / total if total else 0.0), valid
        if loss_scale is None:
            if rows.packed:
                raise ValueError(
                    "agg='seq-mean-token-sum-norm' on packed rows needs loss_scale: pass the fixed "
                    "maximum response length (the padded T it stands for)"
                )
            if rows.shape[1] == 0:  # no positions at all: the loss is 0
                return np.zeros(rows.n_rows), valid
            loss_scale = rows.shape[1]
        scale = _validate.normaliser("loss_scale", loss_scale, dtype)
        return np.full(rows.n_rows, 1.0 / scale), valid
    counts = rows.valid_counts
    valid = float(counts.sum())
    seqs = (
        float(np.count_nonzero(counts))
        if num_seqs is None
        else _validate.normaliser("num_seqs", num_seqs, dtype)
    )
    if not seqs:
        return np.zeros(rows.n_rows), valid
    if agg == "seq-mean-token-sum":
        return np.full(rows.n_rows, 1.0 / seqs), valid
    with np.errstate(divide="ignore"):
        per_token = np.where(counts > 0, 1.0 / (seqs * counts), 0.0)
    return per_token, valid


def _totals(row_outputs: np.ndarray, scales: np.ndarray) -> list[float]:
    """The loss (the first row output, weighted by the row scales) and the sums of the others.

    One reduction over the (k, B) row outputs: each line is summed as ``line.sum()`` would, in
    row order (the same bits as k separate sums).
    """
    row_outputs[0] *= scales
    return row_outputs.sum(axis=1).tolist()


# The empty weights of a call without them (read only by the kernels), by dtype.
_NO_WEIGHTS = {dtype: np.zeros(0, dtype) for dtype in _validate.FLOAT_DTYPES}


def _mean(total: float, count: float) -> float:
    return total / count if count else math.nan


def clipped_surrogate(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """PPO's clipped-surrogate policy loss with its gradient and statistics; see the module.

    Parameters
    ----------
    logprobs, old_logprobs, advantages
        The log-probabilities of the sampled tokens under the policy being trained and under the
        policy that sampled them, and the advantages: (B, T) padded or (N,) packed with
        ``cu_seqlens``; float32 or float64, one dtype.
    mask, lengths, cu_seqlens
        At most one: a 0/1 (B, T) ``mask`` (holes and left padding allowed; nonzero is valid),
        ``lengths`` (B,) (positions 0 .. lengths[b]-1 of row b are valid), or ``cu_seqlens``
        (B+1,) for packed (N,) arrays (row b is positions cu_seqlens[b] .. cu_seqlens[b+1]-1).
        None of them: every position of a (B, T) array is valid.
    clip_low, clip_high
        The trust region [1 - clip_low, 1 + clip_high] of the ratio; clip_low in [0, 1],
        clip_high >= 0 (inf: no upper clip); ``clip_high=None`` means ``clip_low``.
    dual_clip
        c > 1: bound the objective below by c * A where A < 0 (None or inf: no dual clip).
    log_ratio_clamp
        Clamp logprobs - old_logprobs to [-clamp, clamp] before exp (None or inf: no clamp).
    agg, num_tokens, num_seqs, loss_scale
        The aggregation mode and its normaliser (see the module docstring; finite, > 0); a
        normaliser only for its mode.
    weights
        Optional per-token weights, shaped like ``logprobs``, multiplying the per-token loss.
    grad_out
        Optional preallocated gradient: a C-contiguous, writeable NumPy array shaped like
        ``logprobs`` with its dtype, sharing no memory with an input. It is written and returned as
        the result's ``grad``.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    PolicyLossResult(loss, grad, clipfrac, clipfrac_lower, approx_kl): the loss (float), d loss
    / d logprobs shaped like ``logprobs`` (0 where not valid), and the statistics (floats, NaN
    with no valid token).
    """
    if type(clip_low) is not float:
        clip_low = _validate.fast_real(clip_low)
    if type(clip_high) is not float and clip_high is not None:
        clip_high = _validate.fast_real(clip_high)
    if type(dual_clip) is not float and dual_clip is not None:
        dual_clip = _validate.fast_real(dual_clip)
    if type(log_ratio_clamp) is not float and log_ratio_clamp is not None:
        log_ratio_clamp = _validate.fast_real(log_ratio_clamp)
    if (
        type(clip_low) is float
        and 0.0 <= clip_low <= 1.0  # NaN fails the comparisons: it goes the general way
        and (clip_high is None or (type(clip_high) is float and clip_high >= 0.0))
        and (dual_clip is None or (type(dual_clip) is float and dual_clip > 1.0))
        and (log_ratio_clamp is None or (type(log_ratio_clamp) is float and log_ratio_clamp > 0.0))
        and weights is None
        and (common := _common_agg(agg, cu_seqlens, num_tokens, num_seqs, loss_scale)) is not None
    ):
        inputs = (logprobs, old_logprobs, advantages)
        kernel_mask = _common_arrays(inputs, mask, grad_out, None, lengths, cu_seqlens)
        if kernel_mask is not False:
            bounds = (clip_low, clip_high, dual_clip, log_ratio_clamp)
            return _clipped_surrogate_common(
                *inputs, bounds, kernel_mask, common, grad_out, backend
            )
    arrays: dict[str, Any] = {
        "logprobs": logprobs,
        "old_logprobs": old_logprobs,
        "advantages": advantages,
    }
    if weights is not None:
        arrays["weights"] = weights
    checked, rows = _validate.batch(arrays, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    logp, old, adv = checked[:3]
    token_weights = checked[3].ravel() if weights is not None else _NO_WEIGHTS[logp.dtype]
    bounds = _surrogate_scalars(clip_low, clip_high, dual_clip, log_ratio_clamp)
    scales, valid = _row_scales(agg, rows, num_tokens, num_seqs, loss_scale, logp.dtype)

    token = logp.dtype.type  # the per-token arithmetic runs in the input dtype
    if grad_out is None:
        grad = _result_arrays.empty(logp.shape, logp.dtype)
    else:
        grad = _validate.out_array(
            "grad_out",
            grad_out,
            logp.shape,
            logp.dtype,
            {**arrays, "mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        )
    row_outputs = np.empty((4, rows.n_rows))
    row_loss, row_clipped, row_dual, row_kl = row_outputs
    _backend.run(
        "clipped_surrogate",
        backend,
        logprobs=logp.ravel(),
        old_logprobs=old.ravel(),
        advantages=adv.ravel(),
        weights=token_weights,
        **rows.arguments,
        scales=scales.astype(logp.dtype),
        **{name: token(value) for name, value in bounds.items()},
        grad=grad.ravel(),
        row_loss=row_loss,
        row_clipped=row_clipped,
        row_dual=row_dual,
        row_kl=row_kl,
    )
    loss, clipped, dual_clipped, kl = _totals(row_outputs, scales)
    return PolicyLossResult(
        loss=loss,
        grad=grad,
        clipfrac=_mean(clipped, valid),
        clipfrac_lower=_mean(dual_clipped, valid),
        approx_kl=_mean(kl, valid),
    )


# Each aggregation mode's code, as the common-case entries take it (``_spec.AGGREGATIONS``), and
# which of (num_tokens, num_seqs, loss_scale) applies to it.
_AGG_CODES = {name: code for code, name in enumerate(AGGREGATIONS)}
_AGG_NORMALISER = (0, 1, 1, 2)
# _common_agg's answer for each mode with no normaliser given: the batch's own counts.
_AGG_OWN_COUNTS = {name: (code, 0.0) for name, code in _AGG_CODES.items()}
# The common case's smallest normaliser: its reciprocal, the rows' scale, 2**127 at most, is finite
# in float32 too; a smaller one goes the general way, which refuses it where the scale overflows
# the loss's dtype (_validate.normaliser).
_COMMON_SMALLEST = 2.0**-127


def _common_agg(
    agg: Any,
    cu_seqlens: Any,
    num_tokens: Any,
    num_seqs: Any,
    loss_scale: Any,
) -> tuple[int, float] | None:
    """(the code of ``agg``, its normaliser) when a loss is asked for the common case's layout
    and normalisers: padded rows (a mask, lengths or none) or packed ones (``cu_seqlens``:
    ``_common_arrays`` decides), any aggregation mode, and at most the normaliser that applies to
    it, a plain float or int in [2**-127, 2**53] (the normaliser 0.0 when none is given: the
    batch's own count; packed rows have no T, so seq-mean-token-sum-norm needs its loss_scale
    there); None otherwise (the general way, which also names a bad mode or normaliser)."""
    if type(agg) is not str:
        return None
    if cu_seqlens is not None and agg == "seq-mean-token-sum-norm" and loss_scale is None:
        return None  # packed rows have no T to stand for loss_scale: the general way says so
    if num_tokens is None and num_seqs is None and loss_scale is None:  # the usual call
        return _AGG_OWN_COUNTS.get(agg)
    code = _AGG_CODES.get(agg)
    if code is None:
        return None
    normalisers = (num_tokens, num_seqs, loss_scale)
    applies = _AGG_NORMALISER[code]
    for k, other in enumerate(normalisers):
        if other is not None and k != applies:
            return None
    value = normalisers[applies]
    if value is None:
        return code, 0.0
    if (type(value) is float or type(value) is int) and _COMMON_SMALLEST <= value <= 2.0**53:
        return code, float(value)
    return None


def _common_arrays(
    inputs: tuple[Any, ...],
    mask: Any,
    grad_out: Any,
    selected: Any = None,
    lengths: Any = None,
    cu_seqlens: Any = None,
) -> Any:
    """The mask for the kernel's common-case entry (None, the bool ``mask``, or the bool mask of a
    0/1 mask of numbers or of ``lengths``: ``_validate.converted_mask``), or for its packed entry
    the rows' (starts, spans) of ``cu_seqlens`` (``_validate.common_packed``), where a loss's token
    ``inputs``, its layout, ``grad_out`` and KL-Cov's token selection ``selected`` (None for the
    other losses) are the common case (``_validate.common_case``; ``selected`` a C-contiguous bool
    NumPy array shaped like the inputs, not a subclass; ``_validate.common_outputs``: ``grad_out``
    apart from all of them, the mask or lengths given included); else False: the general way, which
    accepts them or says why not."""
    if (kernel_mask := _validate.common_layout(inputs, mask, lengths, cu_seqlens)) is False:
        return False
    if selected is not None and not (
        type(selected) is np.ndarray
        and selected.dtype == np.bool_
        and selected.shape == inputs[0].shape
        and selected.flags.c_contiguous
    ):
        return False
    if grad_out is not None and not _validate.common_outputs(
        (grad_out,), inputs[0], (*inputs, mask, selected, lengths, cu_seqlens)
    ):
        return False
    return kernel_mask


# The token scalars of the common case by (dtype, clip_low, clip_high, dual_clip,
# log_ratio_clamp), as the general way rounds them. Bounded as _validate's caches.
_common_bounds: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _clipped_surrogate_common(
    logprobs: np.ndarray,
    old_logprobs: np.ndarray,
    advantages: np.ndarray,
    bounds: tuple[float, float | None, float | None, float | None],
    mask: np.ndarray | None,
    agg: tuple[int, float],
    grad_out: np.ndarray | None,
    backend: str | None,
) -> PolicyLossResult:
    """The common case, checked by the caller (``_validate.common_case``: three C-contiguous (B, T)
    arrays of one float dtype, no mask or a bool one; or packed rows, ``mask`` their (starts, spans)
    from ``_validate.common_packed``, for the packed entry; float hyperparameters in range
    (``bounds``: clip_low, clip_high, dual_clip, log_ratio_clamp, ints and NumPy scalars made floats
    by ``_validate.fast_real``; None as the general way reads it), an aggregation mode's code and
    normaliser (``agg``, from ``_common_agg``); no weights; ``grad_out`` None or as
    ``_validate.common_outputs`` accepts it): what the general way computes, from the same arrays,
    in the backend's common-case entry, which counts the valid positions, scales the rows and totals
    the row outputs as the general way does (tests/test_fast_path.py compares the two)."""
    shape, dtype = logprobs.shape, logprobs.dtype
    key = (dtype, *bounds)
    scalars = _common_bounds.get(key)
    if scalars is None:
        token = dtype.type
        clip_low, clip_high, dual_clip, log_ratio_clamp = bounds
        high = clip_low if clip_high is None else clip_high
        scalars = (
            token(1.0 - clip_low),
            token(1.0 + high),
            token(math.inf if dual_clip is None else dual_clip),
            token(math.inf if log_ratio_clamp is None else log_ratio_clamp),
        )
        if len(_common_bounds) >= 64:
            _common_bounds.clear()
        _common_bounds[key] = scalars
    if grad_out is not None:
        grad = grad_out
    else:  # a small result is np.empty's, without a call around it (the fast path's cost)
        empty = np.empty if logprobs.nbytes < _result_arrays.POOLED_BYTES else _result_arrays.empty
        grad = empty(shape, dtype)
    if type(mask) is tuple:  # packed rows' (starts, spans)
        entry, n_threads = _backend.packed_common(
            "clipped_surrogate", backend, dtype, mask, shape[0]
        )
    else:
        n_threads = _threads.threads_for(shape[0], shape[0] * shape[1])
        entry = _backend.common("clipped_surrogate", backend, n_threads, dtype, mask is not None)
    valid, loss, clipped, dual_clipped, kl = entry(
        *(logprobs, old_logprobs, advantages, _NO_WEIGHTS[dtype], mask),
        *agg,
        *scalars,
        grad,
        n_threads,
    )
    if not valid:
        return _new_policy_result((loss, grad, math.nan, math.nan, math.nan))
    return _new_policy_result((loss, grad, clipped / valid, dual_clipped / valid, kl / valid))


# PolicyLossResult(...) from a tuple without NamedTuple's __new__ in Python (a third of a
# microsecond less on the fast path).
_new_policy_result = functools.partial(tuple.__new__, PolicyLossResult)


def value_loss(
    values: ArrayLike,
    old_values: ArrayLike,
    returns: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    clip: float | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> ValueLossResult:
    """PPO's clipped value loss with its gradient and clip fraction; see the module docstring.

    Parameters
    ----------
    values, old_values, returns
        The critic's predictions being trained, those at sampling time, and the targets: (B, T)
        padded or (N,) packed with ``cu_seqlens``; float32 or float64, one dtype.
    mask, lengths, cu_seqlens
        At most one: a 0/1 (B, T) ``mask`` (holes and left padding allowed; nonzero is valid),
        ``lengths`` (B,) (positions 0 .. lengths[b]-1 of row b are valid), or ``cu_seqlens``
        (B+1,) for packed (N,) arrays (row b is positions cu_seqlens[b] .. cu_seqlens[b+1]-1).
        None of them: every position of a (B, T) array is valid.
    clip
        Clip the prediction to [old - clip, old + clip] (>= 0); None or inf: no value clipping.
    agg, num_tokens, num_seqs, loss_scale
        As for ``clipped_surrogate``.
    grad_out
        Optional preallocated gradient: a C-contiguous, writeable NumPy array shaped like
        ``values`` with its dtype, sharing no memory with an input. It is written and returned as
        the result's ``grad``.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    ValueLossResult(loss, grad, clipfrac): the loss (float), d loss / d values shaped like
    ``values`` (0 where not valid), and the fraction of valid tokens where the clipped term is
    strictly larger (NaN with no valid token).
    """
    if type(clip) is not float and clip is not None:
        clip = _validate.fast_real(clip)
    if (
        (clip is None or (type(clip) is float and clip >= 0.0))  # NaN: the general way
        and (common := _common_agg(agg, cu_seqlens, num_tokens, num_seqs, loss_scale)) is not None
    ):
        inputs = (values, old_values, returns)
        kernel_mask = _common_arrays(inputs, mask, grad_out, None, lengths, cu_seqlens)
        if kernel_mask is not False:
            return _value_loss_common(*inputs, clip, kernel_mask, common, grad_out, backend)
    (new, old, target), rows = _validate.batch(
        {"values": values, "old_values": old_values, "returns": returns},
        mask=mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
    )
    bound = math.inf if clip is None else _validate.scalar("clip", clip, lo=0.0, allow_inf=True)
    scales, valid = _row_scales(agg, rows, num_tokens, num_seqs, loss_scale, new.dtype)
    if grad_out is None:
        grad = _result_arrays.empty(new.shape, new.dtype)
    else:
        grad = _validate.out_array(
            "grad_out",
            grad_out,
            new.shape,
            new.dtype,
            {
                "values": values,
                "old_values": old_values,
                "returns": returns,
                "mask": mask,
                "lengths": lengths,
                "cu_seqlens": cu_seqlens,
            },
        )
    row_outputs = np.empty((2, rows.n_rows))
    row_loss, row_clipped = row_outputs
    _backend.run(
        "value_loss",
        backend,
        values=new.ravel(),
        old_values=old.ravel(),
        returns=target.ravel(),
        **rows.arguments,
        scales=scales.astype(new.dtype),
        clip=new.dtype.type(bound),
        grad=grad.ravel(),
        row_loss=row_loss,
        row_clipped=row_clipped,
    )
    loss, clipped = _totals(row_outputs, scales)
    return ValueLossResult(loss=loss, grad=grad, clipfrac=_mean(clipped, valid))


def _value_loss_common(
    values: np.ndarray,
    old_values: np.ndarray,
    returns: np.ndarray,
    clip: float | None,
    mask: np.ndarray | None,
    agg: tuple[int, float],
    grad_out: np.ndarray | None,
    backend: str | None,
) -> ValueLossResult:
    """The common case, checked by the caller (``_validate.common_case``: three C-contiguous
    (B, T) arrays of one float dtype, no mask or a bool one; or packed rows, ``mask`` their
    (starts, spans), for the packed entry; ``clip`` None or a float >= 0,
    an aggregation mode's code and normaliser (``agg``); ``grad_out`` None or as
    ``_validate.common_outputs`` accepts it): what the general way computes, in the backend's
    common-case entry (tests/test_fast_path.py compares the two)."""
    shape, dtype = values.shape, values.dtype
    if grad_out is not None:
        grad = grad_out
    else:  # as _clipped_surrogate_common's
        empty = np.empty if values.nbytes < _result_arrays.POOLED_BYTES else _result_arrays.empty
        grad = empty(shape, dtype)
    if type(mask) is tuple:  # packed rows' (starts, spans)
        entry, n_threads = _backend.packed_common("value_loss", backend, dtype, mask, shape[0])
    else:
        n_threads = _threads.threads_for(shape[0], shape[0] * shape[1])
        entry = _backend.common("value_loss", backend, n_threads, dtype, mask is not None)
    bound = dtype.type(math.inf if clip is None else clip)
    valid, loss, clipped = entry(values, old_values, returns, mask, *agg, bound, grad, n_threads)
    return _new_value_result((loss, grad, clipped / valid if valid else math.nan))


_new_value_result = functools.partial(tuple.__new__, ValueLossResult)
