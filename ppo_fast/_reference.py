"""The oracle: every kernel as plain Python loops in float64. It is the specification.

It imports no compiled code and checks every other backend. Each function is a kernel of the
table, ``_spec.KERNELS``, with its arguments in the table's order, as its compiled twins in
``_numba_kernels.py`` and the Cython module generated from ``src/_kernels.pyx.tp``: flat
C-contiguous token arrays, per-row ``starts``, ``spans`` and ``lengths`` (int64), a flat uint8
``mask`` that is empty when every position within ``lengths`` is valid, per-row values, scalars,
and preallocated outputs that every position of every row is written to. Position
``i = starts[b] + t`` of row ``b`` is valid when ``t < lengths[b]`` and (no mask or
``mask[i] != 0``). A kernel of the "groups" layout also takes ``group_rows`` and
``group_starts`` (``_spec``) and reduces over the rows of each group in row order. ``n_threads``
is accepted and ignored: the oracle is serial.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from ._spec import DIVERGENCES, ESTIMATORS, EXP32, EXP64, GSPO_FORMS

K1, K2, K3, ABS = (ESTIMATORS.index(name) for name in ("k1", "k2", "k3", "abs"))
DETACHED = GSPO_FORMS.index("detached")
BINARY_KL = DIVERGENCES.index("kl")


def in_dtype(dtype: np.dtype):
    """Rounding of a per-token value to the token dtype (the identity for float64).

    The losses' per-token arithmetic runs in the input dtype on every backend: a value that
    overflows float32 is inf there, and the oracle rounds each per-token product to the dtype so
    that it says the same (its sums stay float64, as every backend's).
    """
    if np.dtype(dtype) == np.float64:
        return float

    # struct's native "f" is C's (float) cast, as numpy's: inf past float32's range, subnormals
    # below it; a third of float(np.float32(x))'s time, which needed numpy's error state set
    # against its overflow warning (6 us a call: half of a float32 fast-path test's profile)
    single = struct.Struct("f")

    def rounded(x: float) -> float:
        return single.unpack(single.pack(x))[0]

    return rounded


def _valid(mask: np.ndarray, i: int, t: int, length: int) -> bool:
    return t < length and (mask.shape[0] == 0 or mask[i] != 0)


def safe_exp(x: float) -> float:
    """exp that overflows to inf, as IEEE arithmetic does, instead of raising OverflowError."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def saturated_exp(x: float, dtype: np.dtype) -> float:
    """exp as the compiled kernels compute it (``_spec.EXP64`` / ``EXP32``): a finite argument
    beyond the dtype's bounds saturates (exp(709) or exp(88.3) instead of overflowing, exp(-708)
    or exp(-87.3) instead of a subnormal or 0); NaN, inf and -inf give NaN, inf and 0."""
    if math.isfinite(x):
        bounds = EXP64 if np.dtype(dtype) == np.float64 else EXP32
        x = min(max(x, bounds.low), bounds.high)
    return safe_exp(x)


def safe_log(x: float) -> float:
    """log as IEEE arithmetic (and numpy) has it, where math.log raises: log(0) = -inf and the
    log of a negative number NaN."""
    if x > 0.0:
        return math.log(x)
    return -math.inf if x == 0.0 else math.nan


def safe_divide(a: float, b: float) -> float:
    """a / b as IEEE arithmetic has it, where Python raises ZeroDivisionError."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(a) / np.float64(b))


def kl_value(log_ratio: float, estimator: int, clamp: float) -> float:
    """One token's KL estimate on log_ratio = logp - ref_logp, clamped to [-clamp, clamp]."""
    if estimator == K1:
        value = log_ratio
    elif estimator == K2:
        value = 0.5 * log_ratio * log_ratio
    elif estimator == K3:
        # exp(-log_ratio) overflows to inf for log_ratio below about -709.78; a clamp bounds it.
        value = safe_exp(-log_ratio) - 1.0 + log_ratio
    else:
        value = abs(log_ratio)
    return min(max(value, -clamp), clamp)


def kl_penalty(logprobs, ref_logprobs, starts, spans, estimator, clamp, kl, n_threads):
    for b in range(starts.shape[0]):
        for t in range(spans[b]):
            i = starts[b] + t
            kl[i] = kl_value(float(logprobs[i]) - float(ref_logprobs[i]), estimator, clamp)


def shape_rewards(
    logprobs,
    ref_logprobs,
    starts,
    spans,
    lengths,
    mask,
    scores,
    kl_coef,
    estimator,
    clamp,
    rewards,
    n_threads,
):
    for b in range(starts.shape[0]):
        last = -1  # the row's last valid position, which receives the score
        for t in range(spans[b] - 1, -1, -1):
            if _valid(mask, starts[b] + t, t, lengths[b]):
                last = starts[b] + t
                break
        for t in range(spans[b]):
            i = starts[b] + t
            if _valid(mask, i, t, lengths[b]):
                kl = kl_value(float(logprobs[i]) - float(ref_logprobs[i]), estimator, clamp)
                rewards[i] = -kl_coef * kl + (float(scores[b]) if i == last else 0.0)
            else:
                rewards[i] = 0.0


def gae(
    rewards,
    values,
    starts,
    spans,
    lengths,
    mask,
    gammas,
    lams,
    bootstrap,
    advantages,
    returns,
    n_threads,
):
    for b in range(starts.shape[0]):
        gamma = float(gammas[b])
        gamma_lam = gamma * float(lams[b])
        next_value = float(bootstrap[b])
        running = 0.0
        for t in range(spans[b] - 1, -1, -1):
            i = starts[b] + t
            if _valid(mask, i, t, lengths[b]):
                value = float(values[i])
                delta = float(rewards[i]) + gamma * next_value - value
                running = delta + gamma_lam * running
                advantages[i] = running
                returns[i] = running + value
                next_value = value
            else:
                advantages[i] = 0.0
                returns[i] = 0.0


def discounted_returns(
    rewards, starts, spans, lengths, mask, gammas, bootstrap, returns, n_threads
):
    """G_k = r_k + gamma * G_{k+1} over a row's valid positions, G_{n+1} = bootstrap[b]."""
    for b in range(starts.shape[0]):
        gamma = float(gammas[b])
        running = float(bootstrap[b])
        for t in range(spans[b] - 1, -1, -1):
            i = starts[b] + t
            if _valid(mask, i, t, lengths[b]):
                running = float(rewards[i]) + gamma * running
                returns[i] = running
            else:
                returns[i] = 0.0


def remax(
    rewards,
    starts,
    spans,
    lengths,
    mask,
    gammas,
    bootstrap,
    baselines,
    advantages,
    returns,
    n_threads,
):
    """The returns of ``discounted_returns``, and advantages = returns - baselines[b]."""
    for b in range(starts.shape[0]):
        gamma = float(gammas[b])
        baseline = float(baselines[b])
        running = float(bootstrap[b])
        for t in range(spans[b] - 1, -1, -1):
            i = starts[b] + t
            if _valid(mask, i, t, lengths[b]):
                running = float(rewards[i]) + gamma * running
                advantages[i] = running - baseline
                returns[i] = running
            else:
                advantages[i] = 0.0
                returns[i] = 0.0


def _row_positions(starts, spans, lengths, mask, b) -> list[int]:
    """The valid positions of row b, in order."""
    return [starts[b] + t for t in range(spans[b]) if _valid(mask, starts[b] + t, t, lengths[b])]


def optimal_token_baseline(
    rewards,
    old_logprobs,
    sum_pi_squared,
    is_weights,
    starts,
    spans,
    lengths,
    mask,
    group_rows,
    group_starts,
    gammas,
    bootstrap,
    eps,
    zero_tail,
    advantages,
    returns,
    n_threads,
):
    """Per group, at each index k of the rows' valid tokens (k = 0, 1, ...):

        w_k = (1 - 2 exp(old_logprobs_k) + sum_pi_squared_k) * is_weights_k^2

    (exp in float64 as the kernels compute it, ``saturated_exp``)
        W_k = w_0 + ... + w_k,    G_k = the return of ``discounted_returns``
        B_k = sum(G_k W_k) / (sum(W_k) + eps)

    summed in row order over the group's rows that have a k-th valid token. B = 0 when fewer
    than two of the group's rows have a valid token, and, with ``zero_tail`` (code 1), at
    k >= the second-longest row's length when the longest row is the only one that long.
    Writes advantages = G_k - B_k and returns = G_k at the valid positions, 0 elsewhere.
    """
    for g in range(group_starts.shape[0] - 1):
        rows = [int(b) for b in group_rows[group_starts[g] : group_starts[g + 1]]]
        positions = {b: _row_positions(starts, spans, lengths, mask, b) for b in rows}
        row_returns = {}
        for b in rows:
            gamma, running = float(gammas[b]), float(bootstrap[b])
            backwards = []
            for i in reversed(positions[b]):
                running = float(rewards[i]) + gamma * running
                backwards.append(running)
            row_returns[b] = backwards[::-1]
        counts = sorted((len(positions[b]) for b in rows if positions[b]), reverse=True)
        if len(counts) < 2:
            baseline_end = 0
        elif zero_tail and counts[0] > counts[1]:
            baseline_end = counts[1]
        else:
            baseline_end = counts[0]
        numerators = [0.0] * baseline_end
        denominators = [0.0] * baseline_end
        for b in rows:
            cumulative = 0.0
            for k, i in enumerate(positions[b][:baseline_end]):
                exp_old = saturated_exp(float(old_logprobs[i]), np.float64)
                weight = 1.0 - 2.0 * exp_old + float(sum_pi_squared[i])
                if is_weights.shape[0]:
                    weight *= float(is_weights[i]) * float(is_weights[i])
                cumulative += weight
                numerators[k] += row_returns[b][k] * cumulative
                denominators[k] += cumulative
        baselines = [n / (d + eps) for n, d in zip(numerators, denominators, strict=True)]
        for b in rows:
            for t in range(spans[b]):
                advantages[starts[b] + t] = returns[starts[b] + t] = 0.0
            for k, i in enumerate(positions[b]):
                baseline = baselines[k] if k < baseline_end else 0.0
                advantages[i] = row_returns[b][k] - baseline
                returns[i] = row_returns[b][k]


def moments(x, starts, spans, lengths, mask, shift, counts, sums, sums_sq, n_threads):
    for b in range(starts.shape[0]):
        count = total = total_sq = 0.0
        for t in range(spans[b]):
            i = starts[b] + t
            if _valid(mask, i, t, lengths[b]):
                centred = float(x[i]) - shift
                count += 1.0
                total += centred
                total_sq += centred * centred
        counts[b] = count
        sums[b] = total
        sums_sq[b] = total_sq


def whiten(x, starts, spans, lengths, mask, mean, scale, offset, whitened, n_threads):
    for b in range(starts.shape[0]):
        for t in range(spans[b]):
            i = starts[b] + t
            if _valid(mask, i, t, lengths[b]):
                whitened[i] = (float(x[i]) - mean) * scale + offset
            else:
                whitened[i] = 0.0


# The losses, last: they import the helpers above.
from ._reference_losses import (  # noqa: E402, F401
    cispo,
    clipped_surrogate,
    dppo,
    geo_mean,
    gspo,
    kl_cov,
    kl_cov_top_k,
    reinforce,
    sapo,
    value_loss,
)
