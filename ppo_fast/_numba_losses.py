"""The numba per-token policy losses and the value loss: the loss, its exact gradient and the
statistics in one pass over rows (twins of ``_reference.py``'s; the Cython twins are in
``src/rows_loss.h``, ``src/rows_policy.h`` and ``src/rows_token.h``; the per-sequence losses are
in ``_numba_sequence_losses.py``). Registered as the backend's kernels in ``_numba_kernels.py``;
conventions in ``_numba_core.py``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange
from numba.core import types
from numba.extending import intrinsic

from ._numba_core import (
    _CACHE,
    _PREFETCH_BLOCK,
    _U1,
    _ahead,
    _half_like,
    _jit,
    _mask_stop,
    _one_like,
    _prefer_wide_vectors,
    _prefetch,
    _prefetch_ahead,
    _select,
    exp_poly,
    log_poly,
)

_CHUNK = 256  # tokens per chunk of the loss kernels: their scratch rows stay in L1
_UCHUNK = np.uint64(_CHUNK)


@_jit
def _policy_token(logprob, old_logprob, advantage, weight, ratio, valid, p):
    """One token of the policy loss: (grad, loss term, KL term, clipped, dual), the terms 0
    where not valid; ratio is exp of the clamped log-ratio. The arithmetic runs in the input
    dtype, except that a weight comes in float64 (the Cython twin does the same): -weight *
    slope * scale and -weight * objective then run in float64. A weight of 1 in the input dtype
    gives the same bits as 1.0 in float64 (a float32 product is exact in float64)."""
    lo, hi, dual, clamp, scale, zero = p
    log_ratio = logprob - old_logprob
    inside = (log_ratio >= -clamp) & (log_ratio <= clamp)
    log_ratio = min(max(log_ratio, -clamp), clamp)
    unclipped = ratio * advantage
    clipped = min(max(ratio, lo), hi) * advantage
    is_clipped = clipped < unclipped
    objective = _select(is_clipped, clipped, unclipped)
    is_dual = (advantage < zero) & (dual * advantage > objective)
    objective = _select(is_dual, dual * advantage, objective)
    sloped = inside & (not is_clipped) & (not is_dual)
    # A flat branch has slope 0, times the weight: a NaN or inf weight still says so.
    slope = _select(sloped, advantage * ratio, zero)
    grad = _select(valid, -weight * slope * scale, zero)
    loss = _select(valid, -weight * objective, zero)
    kl = _select(valid, -log_ratio, zero)
    return grad, loss, kl, valid & is_clipped, valid & is_dual


@_jit
def _chunk_ratios(
    logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask, start, span,
    valid_end, first, n, clamp, ratios,
):  # fmt: skip
    """Twin: src/rows.h ppo_chunk_ratios. A chunk's ratios exp(clip(logprobs - old_logprobs,
    -clamp, clamp)) at positions first .. first + n - 1 into ratios[0 .. n): the losses' exp
    pre-pass, _PREFETCH_BLOCK positions at a time, each block prefetching ahead the inputs the
    chunk's main pass reads (_ahead, _prefetch_ahead: past the row's valid_end, the next row's)."""
    for j0 in range(np.uint64(0), n, _PREFETCH_BLOCK):
        _prefetch_ahead(
            logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
            _ahead(first + j0, start, span, valid_end),
        )  # fmt: skip
        for j in range(j0, min(j0 + _PREFETCH_BLOCK, n)):
            i = first + j
            ratios[j] = exp_poly(min(max(logprobs[i] - old_logprobs[i], -clamp), clamp))


def clipped_surrogate(
    logprobs,
    old_logprobs,
    advantages,
    weights,
    starts,
    spans,
    lengths,
    mask,
    scales,
    ratio_low,
    ratio_high,
    dual_clip,
    log_ratio_clamp,
    grad,
    row_loss,
    row_clipped,
    row_dual,
    row_kl,
):
    """Twin: src/rows_loss.h ppo_clipped_surrogate_row. Loss, gradient and statistics.

    Per-token arithmetic runs in the input dtype (the scalars and scales come in it), sums in
    float64. A row runs in chunks of ``_CHUNK`` tokens, as the twin does: exp in a pre-pass into
    an L1 scratch row, then the branch-free body (selects) with one loop per case of mask and
    weights, writing the loss and KL terms in the input dtype to scratch rows, then their float64
    sums in a short loop of their own: float64 stays out of the main loop, which LLVM vectorizes
    at full width. The counts are summed per chunk in the input dtype (whole numbers below 2^24:
    exact in any order). The `reassoc` build vectorizes the sums; their order of addition is
    fixed by the compiled loop, not by threads, so results stay identical on any number of
    threads. Positions past the length, and a mask's trailing words of 8 invalid bytes, are not
    computed: their gradient is 0.
    """
    has_mask = mask.shape[0] > 0
    lo, hi, dual, clamp = ratio_low, ratio_high, dual_clip, log_ratio_clamp
    has_weights = weights.shape[0] > 0
    ratios = np.empty(_CHUNK, logprobs.dtype)
    losses = np.empty(_CHUNK, logprobs.dtype)
    weighted_losses = np.empty(_CHUNK, np.float64)
    kls = np.empty(_CHUNK, logprobs.dtype)
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        valid_end = min(np.uint64(lengths[b]), span)
        if has_mask:  # a mask's trailing invalid words too (the twin's comment says why)
            valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite; params may be inf)
        one = _one_like(zero)
        p = (lo, hi, dual, clamp, scale, zero)
        total = 0.0
        clipped_count = 0.0
        dual_count = 0.0
        kl_total = 0.0
        for chunk in range((valid_end + _UCHUNK - _U1) // _UCHUNK):
            first = start + chunk * _UCHUNK
            n = min(_UCHUNK, start + valid_end - first)
            _chunk_ratios(
                logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
                start, span, valid_end, first, n, clamp, ratios,
            )  # fmt: skip
            chunk_clipped = zero
            chunk_dual = zero
            # One loop per case, so that nothing is loaded for an absent mask or weights.
            if has_mask and has_weights:
                for j in range(n):
                    i = first + j
                    g, loss, kl, c, d = _policy_token(
                        logprobs[i], old_logprobs[i], advantages[i], np.float64(weights[i]),
                        ratios[j], mask[i] != 0, p,
                    )  # fmt: skip
                    grad[i] = g
                    weighted_losses[j] = loss
                    kls[j] = kl
                    chunk_clipped += _select(c, one, zero)
                    chunk_dual += _select(d, one, zero)
            elif has_mask:
                for j in range(n):
                    i = first + j
                    g, loss, kl, c, d = _policy_token(
                        logprobs[i], old_logprobs[i], advantages[i], one, ratios[j],
                        mask[i] != 0, p,
                    )  # fmt: skip
                    grad[i] = g
                    losses[j] = loss
                    kls[j] = kl
                    chunk_clipped += _select(c, one, zero)
                    chunk_dual += _select(d, one, zero)
            elif has_weights:
                for j in range(n):
                    i = first + j
                    g, loss, kl, c, d = _policy_token(
                        logprobs[i], old_logprobs[i], advantages[i], np.float64(weights[i]),
                        ratios[j], True, p,
                    )  # fmt: skip
                    grad[i] = g
                    weighted_losses[j] = loss
                    kls[j] = kl
                    chunk_clipped += _select(c, one, zero)
                    chunk_dual += _select(d, one, zero)
            else:
                for j in range(n):
                    i = first + j
                    g, loss, kl, c, d = _policy_token(
                        logprobs[i], old_logprobs[i], advantages[i], one, ratios[j], True, p
                    )
                    grad[i] = g
                    losses[j] = loss
                    kls[j] = kl
                    chunk_clipped += _select(c, one, zero)
                    chunk_dual += _select(d, one, zero)
            if has_weights:
                for j in range(n):
                    total += weighted_losses[j]
            else:
                for j in range(n):
                    total += np.float64(losses[j])
            for j in range(n):
                kl_total += np.float64(kls[j])
            clipped_count += np.float64(chunk_clipped)
            dual_count += np.float64(chunk_dual)
        for i in range(start + valid_end, start + span):
            grad[i] = zero
        row_loss[b] = total
        row_clipped[b] = clipped_count
        row_dual[b] = dual_count
        row_kl[b] = kl_total


@_jit
def _reinforce_token(logprob, old_logprob, advantage, weight, valid, p):
    """One token of REINFORCE: (grad, loss term, KL term), the terms 0 where not valid. As in
    _policy_token, the arithmetic runs in the input dtype and a weight comes in float64. The KL
    penalty's terms are selected, not branched on, so that the loop has no branch."""
    beta, half_beta, penalised, scale, zero = p
    log_ratio = logprob - old_logprob
    objective = advantage * logprob
    objective = _select(penalised, objective - half_beta * (log_ratio * log_ratio), objective)
    slope = _select(penalised, advantage - beta * log_ratio, advantage)
    grad = _select(valid, -weight * slope * scale, zero)
    loss = _select(valid, -weight * objective, zero)
    kl = _select(valid, -log_ratio, zero)
    return grad, loss, kl


def reinforce(
    logprobs,
    old_logprobs,
    advantages,
    weights,
    starts,
    spans,
    lengths,
    mask,
    scales,
    beta,
    grad,
    row_loss,
    row_kl,
):
    """Twin: src/rows_policy.h ppo_reinforce_row. One pass over a row's valid prefix with
    selects, a block of _PREFETCH_BLOCK positions at a time, a loop per case of mask and
    weights, writing the gradient and the block's float64 loss and KL terms to L1 scratch rows;
    then the terms' sums, in loops of their own. The `reassoc` build vectorizes the sums; their
    order is that of the compiled loop, never of the threads, so results stay identical on any
    number of threads. Why not the sums in the loop that stores the gradient (as until
    0.8.13): LLVM vectorizes that loop behind a run-time check that the gradient does not
    overlap the inputs, which also fails for an input that merely starts less than the vector
    loop's step (32 float64) before it (short rows, small arrays side by side in memory), and
    then runs its scalar copy, whose sums add in another order: the loss and KL changed in their
    last bit with where the arrays lay (a row of 18 tokens, an input ending 0-13 positions before
    the gradient; tests/test_fast_path.py caught it as the fast path and the general way
    disagreeing). A loop that only loads has no such check. This costs numba about a tenth of
    its time here (numba/Cython 1.07 -> 1.17 on float32 1024x4096, one thread). Positions past
    the length, and a mask's trailing words of 8 invalid bytes, are not computed: their gradient
    is 0."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    penalised = beta != 0.0
    losses = np.empty(_PREFETCH_BLOCK, np.float64)
    kls = np.empty(_PREFETCH_BLOCK, np.float64)
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        end = start + min(np.uint64(lengths[b]), span)
        if has_mask:  # as clipped_surrogate's
            end = start + _mask_stop(mask, start, np.uint64(0), end - start)
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite)
        one = _one_like(zero)
        p = (beta, beta * _half_like(zero), penalised, scale, zero)
        total = 0.0
        kl_total = 0.0
        # A block of _PREFETCH_BLOCK positions at a time, prefetching ahead (_prefetch_ahead).
        for first in range(start, end, _PREFETCH_BLOCK):
            _prefetch_ahead(
                logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
                _ahead(first, start, span, end - start),
            )  # fmt: skip
            n = min(_PREFETCH_BLOCK, end - first)
            # One loop per case, so that nothing is loaded for an absent mask or weights.
            if has_mask and has_weights:
                for j in range(n):
                    i = first + j
                    g, loss, kl = _reinforce_token(
                        logprobs[i], old_logprobs[i], advantages[i], np.float64(weights[i]),
                        mask[i] != 0, p,
                    )  # fmt: skip
                    grad[i] = g
                    losses[j] = loss
                    kls[j] = kl
            elif has_mask:
                for j in range(n):
                    i = first + j
                    g, loss, kl = _reinforce_token(
                        logprobs[i], old_logprobs[i], advantages[i], one, mask[i] != 0, p
                    )
                    grad[i] = g
                    losses[j] = loss
                    kls[j] = kl
            elif has_weights:
                for j in range(n):
                    i = first + j
                    g, loss, kl = _reinforce_token(
                        logprobs[i], old_logprobs[i], advantages[i], np.float64(weights[i]), True, p
                    )
                    grad[i] = g
                    losses[j] = loss
                    kls[j] = kl
            else:
                for j in range(n):
                    i = first + j
                    g, loss, kl = _reinforce_token(
                        logprobs[i], old_logprobs[i], advantages[i], one, True, p
                    )
                    grad[i] = g
                    losses[j] = loss
                    kls[j] = kl
            for j in range(n):
                total += losses[j]
            for j in range(n):
                kl_total += kls[j]
        for i in range(end, start + span):
            grad[i] = zero
        row_loss[b] = total
        row_kl[b] = kl_total


def cispo(
    logprobs,
    old_logprobs,
    advantages,
    weights,
    starts,
    spans,
    lengths,
    mask,
    scales,
    ratio_low,
    ratio_high,
    log_ratio_clamp,
    grad,
    row_loss,
    row_clipped,
    row_lower,
    row_kl,
):
    """Twin: src/rows_policy.h ppo_cispo_row. A row's valid prefix in chunks of ``_CHUNK``
    tokens, as clipped_surrogate: exp in a pre-pass per chunk into an L1 scratch row (so that
    the main loop vectorizes), then one pass with selects; the float64 loss and KL terms go to
    scratch rows that short loops of their own sum (the `reassoc` build vectorizes them, in an
    order fixed by the compiled loop). Positions past the length, and a mask's trailing words of
    8 invalid bytes, get a zero gradient."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    lo, hi, clamp = ratio_low, ratio_high, log_ratio_clamp
    ratios = np.empty(_CHUNK, logprobs.dtype)
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        valid_end = min(np.uint64(lengths[b]), span)
        if has_mask:  # as clipped_surrogate's
            valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
        scale = scales[b]
        zero = scale - scale
        total = 0.0
        clipped_count = 0.0
        lower_count = 0.0
        kl_total = 0.0
        for chunk in range((valid_end + _UCHUNK - _U1) // _UCHUNK):
            first = start + chunk * _UCHUNK
            n = min(_UCHUNK, start + valid_end - first)
            _chunk_ratios(
                logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
                start, span, valid_end, first, n, clamp, ratios,
            )  # fmt: skip
            for j in range(n):
                i = first + j
                valid = (not has_mask) or mask[i] != 0
                logprob = logprobs[i]
                weight = np.float64(weights[i]) if has_weights else 1.0
                log_ratio = min(max(logprob - old_logprobs[i], -clamp), clamp)
                ratio = ratios[j]
                coefficient = min(max(ratio, lo), hi)
                slope = coefficient * advantages[i]
                grad[i] = _select(valid, -weight * slope * scale, zero)
                total += _select(valid, -weight * (slope * logprob), 0.0)
                kl_total += _select(valid, -np.float64(log_ratio), 0.0)
                # whole numbers: exact in any order of addition
                clipped_count += _select(valid & (coefficient != ratio), 1.0, 0.0)
                lower_count += _select(valid & (ratio < lo), 1.0, 0.0)
        for i in range(start + valid_end, start + span):
            grad[i] = zero
        row_loss[b] = total
        row_clipped[b] = clipped_count
        row_lower[b] = lower_count
        row_kl[b] = kl_total


@numba.njit(nogil=True, cache=_CACHE, error_model="numpy")
def _sapo_sigmoids(advantages, first, ratios, sigmoids, n, tau_pos, tau_neg):
    """sigmoids[j] = sigmoid(tau * (ratios[j] - 1)) for the n tokens from position first, tau by
    the sign of the advantage. A function of its own, not inlined: numba's SSA pass loses track
    of a second inlined exp_poly in one function. Its error model is numpy's: under the default
    (Python's), each division checks for a zero divisor and may raise ZeroDivisionError, a branch
    that kept LLVM from vectorizing the loop (SAPO ran 4 times slower than CISPO)."""
    _prefer_wide_vectors()
    zero = tau_pos - tau_pos
    one = _one_like(zero)
    for j in range(n):
        tau = _select(advantages[first + j] > zero, tau_pos, tau_neg)
        sigmoids[j] = one / (one + exp_poly(-(tau * (ratios[j] - one))))  # 1 / (1 + exp(-z))


def sapo(
    logprobs,
    old_logprobs,
    advantages,
    weights,
    starts,
    spans,
    lengths,
    mask,
    scales,
    tau_pos,
    tau_neg,
    log_ratio_clamp,
    grad,
    row_loss,
    row_kl,
):
    """Twin: src/rows_policy.h ppo_sapo_row. As cispo, with the ratio's exp and then the
    sigmoid's in pre-passes per chunk into L1 scratch rows."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    clamp = log_ratio_clamp
    ratios = np.empty(_CHUNK, logprobs.dtype)
    sigmoids = np.empty(_CHUNK, logprobs.dtype)
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        valid_end = min(np.uint64(lengths[b]), span)
        if has_mask:  # as clipped_surrogate's
            valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
        scale = scales[b]
        zero = scale - scale
        one = _one_like(zero)
        four = one + one + one + one
        # 4 / tau per sign of the advantage, divided once: a division in the token loop checks
        # its divisor for zero (numba's Python error model), which keeps the loop from vectorizing
        gate_pos = four / tau_pos
        gate_neg = four / tau_neg
        total = 0.0
        kl_total = 0.0
        for chunk in range((valid_end + _UCHUNK - _U1) // _UCHUNK):
            first = start + chunk * _UCHUNK
            n = min(_UCHUNK, start + valid_end - first)
            _chunk_ratios(
                logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
                start, span, valid_end, first, n, clamp, ratios,
            )  # fmt: skip
            _sapo_sigmoids(advantages, first, ratios, sigmoids, n, tau_pos, tau_neg)
            for j in range(n):
                i = first + j
                valid = (not has_mask) or mask[i] != 0
                advantage = advantages[i]
                weight = np.float64(weights[i]) if has_weights else 1.0
                raw = logprobs[i] - old_logprobs[i]
                # torch.clamp passes the gradient at its bounds, and a NaN log-ratio's NaN
                inside = not ((raw < -clamp) | (raw > clamp))
                log_ratio = min(max(raw, -clamp), clamp)
                sigmoid = sigmoids[j]
                gate = sigmoid * _select(advantage > zero, gate_pos, gate_neg)
                slope = advantage * ((four * sigmoid) * (one - sigmoid))
                sloped = _select(inside, slope * ratios[j], zero)
                grad[i] = _select(valid, -weight * sloped * scale, zero)
                total += _select(valid, -weight * (gate * advantage), 0.0)
                kl_total += _select(valid, -np.float64(log_ratio), 0.0)
        for i in range(start + valid_end, start + span):
            grad[i] = zero
        row_loss[b] = total
        row_kl[b] = kl_total


@numba.njit(nogil=True, cache=_CACHE, error_model="numpy")
def _exps(values, first, out, n):
    """out[j] = exp(values[first + j]) for j < n: one inlined exp per function (numba's SSA pass
    loses track of a second, as _sapo_sigmoids says)."""
    _prefer_wide_vectors()
    for j in range(n):
        out[j] = exp_poly(values[first + j])


@numba.njit(nogil=True, cache=_CACHE, error_model="numpy")
def _dppo_inside(
    logprobs, old_logprobs, advantages, first, probs, old_probs, kept, n, low, high, binary_kl
):
    """kept[j] = 1 where the token at position first + j is within DPPO's trust region, else 0
    (the oracle's v), for the n tokens from first, given their probabilities. A function of its
    own, compiled without fastmath: the binary KL is compared with a threshold, and its rounding
    is the oracle's order of operations."""
    _prefer_wide_vectors()
    zero = low - low
    one = _one_like(zero)
    eps = _eps_like(zero)
    for j in range(n):
        i = first + j
        prob = probs[j]
        old_prob = old_probs[j]
        positive = advantages[i] > zero
        if binary_kl:
            complement = one - old_prob
            quotient = (complement + eps) / ((one - prob) + eps)
            distance = old_prob * (old_logprobs[i] - logprobs[i]) + complement * log_poly(quotient)
            inside_positive = (distance <= high) | (prob <= old_prob)
            inside_negative = (distance <= low) | (prob >= old_prob)
        else:
            difference = prob - old_prob
            inside_positive = difference <= high
            inside_negative = difference >= -low
        kept[j] = _select(_select_bool(positive, inside_positive, inside_negative), one, zero)


@_jit
def _select_bool(condition, a, b):
    return (condition & a) | ((not condition) & b)


@intrinsic
def _eps_like(typingctx, x):
    """verl's 1e-8 of the binary KL, rounded to the type of the float x (``x * 1e-8`` would be
    float64: numba's literal is)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return context.get_constant(sig.return_type, 1e-8)

    return x(x), codegen


def dppo(
    logprobs,
    old_logprobs,
    advantages,
    weights,
    starts,
    spans,
    lengths,
    mask,
    scales,
    divergence,
    divergence_low,
    divergence_high,
    ratio_cap,
    log_ratio_clamp,
    grad,
    row_loss,
    row_outside,
    row_capped,
    row_kl,
):
    """Twin: src/rows_token.h ppo_dppo_row. As cispo, with the probabilities' exps and then the
    trust region's 0/1 (``_dppo_inside``) in pre-passes per chunk into L1 scratch rows."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    binary_kl = divergence == 1  # _spec.DIVERGENCES
    cap, clamp = ratio_cap, log_ratio_clamp
    ratios = np.empty(_CHUNK, logprobs.dtype)
    kept = np.empty(_CHUNK, logprobs.dtype)
    probs = np.empty(_CHUNK, logprobs.dtype)
    old_probs = np.empty(_CHUNK, logprobs.dtype)
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        valid_end = min(np.uint64(lengths[b]), span)
        if has_mask:  # as clipped_surrogate's
            valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
        scale = scales[b]
        zero = scale - scale
        total = 0.0
        outside_count = 0.0
        capped_count = 0.0
        kl_total = 0.0
        for chunk in range((valid_end + _UCHUNK - _U1) // _UCHUNK):
            first = start + chunk * _UCHUNK
            n = min(_UCHUNK, start + valid_end - first)
            _chunk_ratios(
                logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
                start, span, valid_end, first, n, clamp, ratios,
            )  # fmt: skip
            _exps(logprobs, first, probs, n)
            _exps(old_logprobs, first, old_probs, n)
            _dppo_inside(
                logprobs, old_logprobs, advantages, first, probs, old_probs, kept, n,
                divergence_low, divergence_high, binary_kl,
            )  # fmt: skip
            for j in range(n):
                i = first + j
                valid = (not has_mask) or mask[i] != 0
                logprob = logprobs[i]
                weight = np.float64(weights[i]) if has_weights else 1.0
                log_ratio = min(max(logprob - old_logprobs[i], -clamp), clamp)
                ratio = ratios[j]
                keep = kept[j]
                slope = advantages[i] * min(ratio, cap)
                grad[i] = _select(valid, -weight * (slope * keep) * scale, zero)
                total += _select(valid, -weight * ((slope * logprob) * keep), 0.0)
                kl_total += _select(valid, -np.float64(log_ratio), 0.0)
                inside = keep != zero
                # whole numbers: exact in any order of addition
                outside_count += _select(valid & (not inside), 1.0, 0.0)
                capped_count += _select(valid & inside & (ratio > cap), 1.0, 0.0)
        for i in range(start + valid_end, start + span):
            grad[i] = zero
        row_loss[b] = total
        row_outside[b] = outside_count
        row_capped[b] = capped_count
        row_kl[b] = kl_total


def kl_cov(
    logprobs,
    old_logprobs,
    advantages,
    weights,
    selected,
    starts,
    spans,
    lengths,
    mask,
    scales,
    coef,
    grad,
    row_loss,
    row_penalised,
    row_abs_kl,
):
    """Twin: src/rows_token.h ppo_kl_cov_row. As cispo: the ratios' exp in a pre-pass per chunk,
    then one pass with selects. A token is penalised where it is selected and coef != 0."""
    has_mask = mask.shape[0] > 0
    penalise = coef != 0
    has_weights = weights.shape[0] > 0
    ratios = np.empty(_CHUNK, logprobs.dtype)
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        valid_end = min(np.uint64(lengths[b]), span)
        if has_mask:  # as clipped_surrogate's
            valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
        scale = scales[b]
        zero = scale - scale
        one = _one_like(zero)
        total = 0.0
        penalised_count = 0.0
        abs_total = 0.0
        for chunk in range((valid_end + _UCHUNK - _U1) // _UCHUNK):
            first = start + chunk * _UCHUNK
            n = min(_UCHUNK, start + valid_end - first)
            for j0 in range(np.uint64(0), n, _PREFETCH_BLOCK):
                ahead = _ahead(first + j0, start, span, valid_end)
                _prefetch_ahead(
                    logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
                    ahead,
                )  # fmt: skip
                _prefetch(selected, ahead)  # a byte a token: one line for the block
                for j in range(j0, min(j0 + _PREFETCH_BLOCK, n)):
                    i = first + j
                    ratios[j] = exp_poly(logprobs[i] - old_logprobs[i])
            for j in range(n):
                i = first + j
                valid = (not has_mask) or mask[i] != 0
                weight = np.float64(weights[i]) if has_weights else 1.0
                log_ratio = logprobs[i] - old_logprobs[i]
                penalised = penalise & (selected[i] != 0)
                distance = abs(log_ratio)
                # sign(log_ratio): 0 at 0, NaN at NaN (log_ratio itself, where it is not < or >)
                sign = _select(log_ratio > zero, one, _select(log_ratio < zero, -one, log_ratio))
                base = advantages[i] * ratios[j]
                objective = _select(penalised, base - coef * distance, base)
                slope = _select(penalised, base - coef * sign, base)
                grad[i] = _select(valid, -weight * slope * scale, zero)
                total += _select(valid, -weight * objective, 0.0)
                abs_total += _select(valid, np.float64(distance), 0.0)
                penalised_count += _select(valid & penalised, 1.0, 0.0)
        for i in range(start + valid_end, start + span):
            grad[i] = zero
        row_loss[b] = total
        row_penalised[b] = penalised_count
        row_abs_kl[b] = abs_total


def value_loss(
    values,
    old_values,
    returns,
    starts,
    spans,
    lengths,
    mask,
    scales,
    clip,
    grad,
    row_loss,
    row_clipped,
):
    """Twin: src/rows_loss.h ppo_value_loss_row. One pass, vectorized like the policy loss, a
    chunk of _CHUNK positions at a time: the gradient and the chunk's float64 loss terms (to an
    L1 scratch row), then their sum in a loop of its own, as reinforce's (whose docstring says
    why: summed in the loop that stores the gradient, the loss changed in its last bit with
    where the arrays lay). That costs numba about a fifth of its time here (numba/Cython
    1.0 -> 1.2 on float32 1024x4096, one thread; blocks of 64 positions: 1.4, of 1024: 1.3).
    The counts are whole numbers: exact in any order."""
    has_mask = mask.shape[0] > 0
    halves = np.empty(_CHUNK, np.float64)
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        length = np.uint64(lengths[b])
        span = np.uint64(spans[b])
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite; params may be inf)
        total = 0.0
        clipped_count = 0.0
        for first in range(np.uint64(0), span, _UCHUNK):
            n = min(_UCHUNK, span - first)
            for j in range(n):
                t = first + j
                i = start + t
                valid = t < length and (not has_mask or mask[i] != 0)
                value = values[i]
                old = old_values[i]
                error = value - returns[i]
                unclipped = error * error
                clipped_error = min(max(value, old - clip), old + clip) - returns[i]
                clipped = clipped_error * clipped_error
                is_clipped = clipped > unclipped
                grad[i] = error * scale if valid & (not is_clipped) else zero
                half = np.float64(clipped if is_clipped else unclipped) * 0.5
                halves[j] = _select(valid, half, 0.0)  # a select: no predicated store
                clipped_count += 1.0 if valid & is_clipped else 0.0
            for j in range(n):
                total += halves[j]
        row_loss[b] = total
        row_clipped[b] = clipped_count
