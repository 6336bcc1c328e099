"""DPPO's pre-passes over a chunk of a row (``_numba_losses``' rows call ``_dppo_chunk``): the
probabilities' exps, the binary KL's decisions and the trust region's 0/1, each a loop LLVM
vectorizes into L1 scratch rows. Twin: src/rows_token.h's ppo_dppo_cases."""

from __future__ import annotations

import numpy as np

from ._numba_core import (
    _is_float32,
    _jit,
    _one_like,
    _prefer_wide_vectors,
    _rounded_like,
    _select,
    _without_refcounts,
    exp_poly,
    log_poly,
)


@_without_refcounts
def _dppo_chunk(
    logprobs, old_logprobs, advantages, first, n, low, high, binary_kl, probs, old_probs, wide,
    kept,
):  # fmt: skip
    """kept[j] = 1 where the token at first + j is inside DPPO's trust region, else 0, for the
    chunk's n tokens (``_dppo_inside``). The TV reads the dtype's probabilities; the binary KL
    is decided in the dtype where that vouches for every decision of the chunk
    (``_binary_kls_narrow``), else in float64 (``_binary_kls``, its probabilities in the two
    rows of ``wide``). A bound of 0 goes to float64 at once: the binary KL is 0 at p = p_old,
    and its tokens crowd where the dtype cannot vouch."""
    screened = binary_kl and low > 0 and high > 0
    if screened or not binary_kl:
        _exps(logprobs, first, probs, n)
        _exps(old_logprobs, first, old_probs, n)
    if binary_kl and (
        not screened
        or _binary_kls_narrow(
            logprobs, old_logprobs, advantages, first, probs, old_probs, kept, n, low, high
        )
    ):
        _exps_wide(logprobs, first, wide[0], n)
        _exps_wide(old_logprobs, first, wide[1], n)
        _binary_kls(logprobs, old_logprobs, advantages, first, wide[0], wide[1], kept, n, low, high)
    _dppo_inside(
        logprobs, old_logprobs, advantages, first, probs, old_probs, kept, n, low, high, binary_kl
    )


@_without_refcounts
def _exps(values, first, out, n):
    """out[j] = exp(values[first + j]) for j < n: one inlined exp per function (numba's SSA pass
    loses track of a second, as _sapo_sigmoids says)."""
    _prefer_wide_vectors()
    for j in range(n):
        out[j] = exp_poly(values[first + j])


@_without_refcounts
def _exps_wide(values, first, out, n):
    """_exps in float64 (DPPO-KL's probabilities: _binary_kls says why)."""
    _prefer_wide_vectors()
    for j in range(n):
        out[j] = exp_poly(np.float64(values[first + j]))


@_without_refcounts
def _binary_kls_narrow(
    logprobs, old_logprobs, advantages, first, probs, old_probs, within, n, low, high
):  # fmt: skip
    """within[j] as ``_binary_kls`` writes it, for j < n, from the binary KL in the dtype and the
    dtype's probabilities; returns whether that may have decided any token otherwise than
    float64 would (never for float64, which is float64's evaluation).

    A float32 decision stands where |d - bound| > 2^-19 (|t1| + |t2| + |log q| + 1 + q), t1 and
    t2 d's terms and q the quotient whose log it takes, and both log-probabilities are in [-80,
    0] (no exp saturates, no probability is above 1). There d's rounding is below 7u (|t1| + |t2|
    + |log q| + 1 + q), u = 2^-24: the exps within 2u of p and p_old relative, so 1 - p_old and
    the quotient's numerator N and denominator D within 4u absolute; log q within 4u/N + 4u/D +
    u of log Q and 4u |log q| for the log's 2 ulp; (1 - p_old) 4u/N <= 4u and (1 - p_old) 4u/D
    about 4u q; t1 within 4u |t1|. (Where N or D is near 1e-8 the log is not linear: (1e-8 + 4u)
    log(1 + 4u / 1e-8) = 14u at the worst.) tests/test_policy_token.py decides float32
    log-probabilities a few ulp either side of each crossing of a bound as float64 does, a
    token a row, and fails with 2^-30 here."""
    _prefer_wide_vectors()
    one = _one_like(low)
    zero = one - one  # not low - low: a bound may be inf
    eps = _rounded_like(1e-8, zero)
    slack = _rounded_like(2.0**-19, zero)
    bottom = _rounded_like(-80.0, zero)
    unsure = 0
    for j in range(n):
        i = first + j
        logprob = logprobs[i]
        old = old_logprobs[i]
        old_prob = old_probs[j]
        complement = one - old_prob
        quotient = (complement + eps) / ((one - probs[j]) + eps)
        log_quotient = log_poly(quotient)
        first_term = old_prob * (old - logprob)
        second_term = complement * log_quotient
        distance = first_term + second_term
        bound = _select(advantages[i] > zero, high, low)
        error = slack * (abs(first_term) + abs(second_term) + abs(log_quotient) + one + quotient)
        sure = (
            (abs(distance - bound) > error)
            & (logprob <= zero)
            & (old <= zero)
            & (logprob >= bottom)
            & (old >= bottom)
        )
        within[j] = _select(distance <= bound, one, zero)
        unsure += np.int64(not sure)
    return unsure > 0 and _is_float32(zero)


@_without_refcounts
def _binary_kls(
    logprobs, old_logprobs, advantages, first, probs, old_probs, within, n, low, high
):  # fmt: skip
    """within[j] = 1 where the binary KL of the token at first + j, d = p_old * (old - logp) +
    (1 - p_old) * log((1 - p_old + 1e-8) / ((1 - p) + 1e-8)), is at most its bound (high where
    A > 0, else low), else 0, for j < n: in float64 from the float64 probabilities, for in
    float32 d's two terms (each about p * |logp - old|) cancel below their rounding (3e-8)."""
    _prefer_wide_vectors()
    one = _one_like(low)
    zero = one - one  # not low - low: a bound may be inf
    for j in range(n):
        i = first + j
        old_prob = old_probs[j]
        complement = 1.0 - old_prob
        quotient = (complement + 1e-8) / ((1.0 - probs[j]) + 1e-8)
        gap = np.float64(old_logprobs[i]) - np.float64(logprobs[i])
        distance = old_prob * gap + complement * log_poly(quotient)
        bound = _select(advantages[i] > zero, np.float64(high), np.float64(low))
        within[j] = _select(distance <= bound, one, zero)


@_without_refcounts
def _dppo_inside(
    logprobs, old_logprobs, advantages, first, probs, old_probs, kept, n, low, high, binary_kl
):
    """kept[j] = 1 where the token at first + j is within DPPO's trust region, else 0 (the
    oracle's v), for j < n, given the probabilities (TV), or in ``kept`` itself whether the
    binary KL is within its bound (KL; p <= p_old read as logp <= old, which is exact)."""
    _prefer_wide_vectors()
    one = _one_like(low)
    zero = one - one  # not low - low: a bound may be inf
    for j in range(n):
        i = first + j
        positive = advantages[i] > zero
        if binary_kl:
            within = kept[j] > zero
            inside_positive = within | (logprobs[i] <= old_logprobs[i])
            inside_negative = within | (logprobs[i] >= old_logprobs[i])
        else:
            difference = probs[j] - old_probs[j]
            inside_positive = difference <= high
            inside_negative = difference >= -low
        kept[j] = _select(_select_bool(positive, inside_positive, inside_negative), one, zero)


@_jit
def _select_bool(condition, a, b):
    return (condition & a) | ((not condition) & b)
