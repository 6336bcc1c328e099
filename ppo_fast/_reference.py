"""The oracle: every kernel as plain Python loops in float64. It is the specification.

It imports no compiled code and checks every other backend. Each function has the exact
signature of its compiled twins in ``_numba_kernels.py`` and ``src/*.pyx``: flat C-contiguous
token arrays, per-row ``starts``, ``spans`` and ``lengths`` (int64), a flat uint8 ``mask`` that is
empty when every position within ``lengths`` is valid, per-row parameters as float64 arrays, and
preallocated outputs that every position of every row is written to. Position ``i = starts[b] + t``
of row ``b`` is valid when ``t < lengths[b]`` and (no mask or ``mask[i] == 1``). ``n_threads``
is accepted and ignored: the oracle is serial.

Estimator codes: 0 = k1, 1 = k2, 2 = k3, 3 = abs (see ``rewards.py``).
"""

from __future__ import annotations

import math

import numpy as np

K1, K2, K3, ABS = 0, 1, 2, 3


def _valid(mask: np.ndarray, i: int, t: int, length: int) -> bool:
    return t < length and (mask.shape[0] == 0 or mask[i] != 0)


def kl_value(log_ratio: float, estimator: int, clamp: float) -> float:
    """One token's KL estimate on log_ratio = logp - ref_logp, clamped to [-clamp, clamp]."""
    if estimator == K1:
        value = log_ratio
    elif estimator == K2:
        value = 0.5 * log_ratio * log_ratio
    elif estimator == K3:
        # exp(-log_ratio) overflows to inf for log_ratio < -709; the clamp then bounds it.
        value = (math.exp(-log_ratio) if -log_ratio < 709.0 else math.inf) - 1.0 + log_ratio
    else:
        value = abs(log_ratio)
    return min(max(value, -clamp), clamp)


def kl_penalty(logprobs, ref_logprobs, starts, spans, estimator, clamp, out, n_threads):
    for b in range(starts.shape[0]):
        for t in range(spans[b]):
            i = starts[b] + t
            out[i] = kl_value(float(logprobs[i]) - float(ref_logprobs[i]), estimator, clamp)


def shape_rewards(
    scores,
    logprobs,
    ref_logprobs,
    starts,
    spans,
    lengths,
    mask,
    kl_coef,
    estimator,
    clamp,
    out,
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
                out[i] = -kl_coef * kl + (float(scores[b]) if i == last else 0.0)
            else:
                out[i] = 0.0


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


def whiten(x, starts, spans, lengths, mask, mean, scale, offset, out, n_threads):
    for b in range(starts.shape[0]):
        for t in range(spans[b]):
            i = starts[b] + t
            if _valid(mask, i, t, lengths[b]):
                out[i] = (float(x[i]) - mean) / scale + offset
            else:
                out[i] = 0.0
