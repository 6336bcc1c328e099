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

from . import _backend, _result_arrays, _threads, _validate
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
    code = ESTIMATORS.index(_validate.choice("estimator", estimator, ESTIMATORS))
    bound = _clamp(clamp)
    logp, ref = _validate.token_arrays(True, logprobs=logprobs, ref_logprobs=ref_logprobs)
    flat_logp = logp.reshape(-1)
    # Elementwise: cut the positions into rows only so that threads can share them.
    n = flat_logp.shape[0]
    starts = np.arange(0, n, _threads.MIN_POSITIONS_PER_THREAD, dtype=np.int64)
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
        spans=np.minimum(_threads.MIN_POSITIONS_PER_THREAD, n - starts),
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
