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
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _validate

Estimator = Literal["k1", "k2", "k3", "abs"]
ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")


def _clamp(clamp: float | None) -> float:
    if clamp is None:
        return math.inf
    return _validate.scalar("clamp", clamp, lo=0.0, open_lo=True)


def kl_penalty(
    logprobs: ArrayLike,
    ref_logprobs: ArrayLike,
    estimator: Estimator = "k1",
    clamp: float | None = None,
    *,
    backend: str | None = None,
) -> np.ndarray:
    """Per-token KL estimate between the policy and the reference, elementwise.

    ``logprobs`` and ``ref_logprobs`` are float32 or float64 arrays of one shape (any number of
    dimensions). Returns an array of that shape and dtype. See the module docstring.
    """
    code = ESTIMATORS.index(_validate.choice("estimator", estimator, ESTIMATORS))
    bound = _clamp(clamp)
    logp, ref = _validate.token_arrays(True, logprobs=logprobs, ref_logprobs=ref_logprobs)
    flat_logp, flat_ref = logp.reshape(-1), ref.reshape(-1)
    # Elementwise: cut the positions into rows only so that threads can share them.
    n = flat_logp.shape[0]
    chunk = _backend.MIN_POSITIONS_PER_THREAD
    starts = np.arange(0, n, chunk, dtype=np.int64)
    spans = np.minimum(chunk, n - starts)
    out = np.empty_like(flat_logp)
    _backend.resolve(backend).kl_penalty(
        flat_logp,
        flat_ref,
        starts,
        spans,
        code,
        bound,
        out,
        _backend.threads_for(starts.shape[0], n),
    )
    return out.reshape(logp.shape)


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
    backend: str | None = None,
) -> np.ndarray:
    """KL-shaped per-token rewards, shaped like ``logprobs``; see the module docstring.

    ``scores`` (B,) is each row's sequence-level score (any real dtype); ``logprobs`` and
    ``ref_logprobs`` are (B, T) with ``mask`` or ``lengths``, or packed (N,) with ``cu_seqlens``.
    """
    code = ESTIMATORS.index(_validate.choice("estimator", estimator, ESTIMATORS))
    bound = _clamp(clamp)
    coef = _validate.scalar("kl_coef", kl_coef, lo=0.0)
    logp, ref = _validate.token_arrays(logprobs=logprobs, ref_logprobs=ref_logprobs)
    rows = _validate.rows(logp.shape, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    if np.ndim(scores) == 0:
        raise ValueError(f"scores must have shape ({rows.n_rows},), one score per row")
    row_scores = _validate.per_row("scores", scores, rows.n_rows)
    out = np.empty_like(logp)
    _backend.resolve(backend).shape_rewards(
        row_scores,
        logp.reshape(-1),
        ref.reshape(-1),
        rows.starts,
        rows.spans,
        rows.lengths,
        rows.mask,
        coef,
        code,
        bound,
        out.reshape(-1),
        _backend.threads_for(rows.n_rows, rows.n_positions),
    )
    return out
