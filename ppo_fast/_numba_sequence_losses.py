"""The numba per-sequence policy losses, GSPO and verl's geometric mean (GMPO): a pre-pass per
row for its sequence-level quantity, then the token pass (twins of ``_reference_losses.py``'s;
the Cython twins are in ``src/rows_sequence.h``). Registered as the backend's kernels in
``_numba_kernels.py``; conventions in ``_numba_core.py``, the chunk of ``_numba_losses.py``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ._numba_core import (
    _CACHE,
    _PREFETCH_BLOCK,
    _STREAM_AHEAD_BYTES,
    _U1,
    _ahead_by,
    _jit,
    _mask_stop,
    _one_like,
    _prefer_wide_vectors,
    _prefetch_ahead,
    _select,
    exp_poly,
    log_poly,
)
from ._numba_lanes import _add_lanes, _lane_total, _lanes_splat
from ._numba_losses import _CHUNK, _UCHUNK


@_jit
def _gspo_token(advantage, weight, valid, p):
    """One token of GSPO's token pass on its row's ratio: (grad, loss term, slope term, clipped,
    clipped below), the terms 0 where not valid; as _numba_losses._policy_token, the arithmetic
    runs in the input dtype and a weight comes in float64 (a weight of 1 in the dtype gives the
    bits of 1.0 in float64). The slope term is the sequence form's, the grad the detached
    form's: beyond the clamp its slope is 0 (not inf * 0), times the weight, so that a NaN weight
    still says so."""
    ratio, clipped_ratio, dual, inside, scale, zero = p
    unclipped = ratio * advantage
    clipped = clipped_ratio * advantage
    is_clipped = clipped < unclipped
    objective = _select(is_clipped, clipped, unclipped)
    is_dual = (advantage < zero) & (dual * advantage > objective)
    objective = _select(is_dual, dual * advantage, objective)
    slope = _select(is_clipped | is_dual, zero, advantage)
    sloped = _select(inside, slope * ratio, zero)
    grad = _select(valid, -weight * sloped * scale, zero)
    loss = _select(valid, -weight * objective, zero)
    slope_term = _select(valid, -weight * slope, zero)
    counted = valid & is_clipped
    return grad, loss, slope_term, counted, counted & (advantage < zero)


def gspo(
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
    log_ratio_max,
    form,
    grad,
    row_loss,
    row_clipped,
    row_lower,
    row_kl,
):
    """Twin: src/rows_sequence.h ppo_gspo_row. Two passes over a row's valid prefix: the sum of
    its log-ratios (the sequence ratio s), then the token pass (_gspo_token: clipped_surrogate's
    body on s); the "sequence" form then writes the row's one gradient to its valid tokens in a
    third. The pre-pass sums in float64 in one loop per chunk of _CHUNK positions, whose lines
    are prefetched first (as a pass with scratch rows it measured twice as slow). The token pass
    runs in chunks of _CHUNK tokens as the token losses do: the chunk's lines prefetched at once,
    then the per-token terms in the dtype (in float64 with weights) into L1 scratch rows, one
    loop per case of mask and weights, and their float64 sums in short loops of their own;
    counts per chunk in the dtype (whole numbers below 2^24: exact). The row's KL is minus its
    log-ratios' sum (negation is exact). Positions past the length, and a mask's trailing words
    of 8 invalid bytes, get a zero gradient. The `reassoc` build vectorizes the float64 sums;
    their order is that of the compiled loop, never of the threads, so results stay identical on
    any number of threads."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    detached = form == 0
    distance = np.uint64(_STREAM_AHEAD_BYTES // logprobs.itemsize)
    lo, hi, dual, cap = ratio_low, ratio_high, dual_clip, log_ratio_max
    losses = np.empty(_CHUNK, logprobs.dtype)
    slopes = np.empty(_CHUNK, logprobs.dtype)
    weighted_losses = np.empty(_CHUNK, np.float64)
    weighted_slopes = np.empty(_CHUNK, np.float64)
    in_dtype = np.empty(1, logprobs.dtype)  # a float64 rounded to the dtype by a store
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        end = start + min(np.uint64(lengths[b]), span)
        if has_mask:  # as the token losses' (_numba_losses.clipped_surrogate)
            end = start + _mask_stop(mask, start, np.uint64(0), end - start)
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite)
        one = _one_like(zero)
        count = 0.0
        log_ratio_total = 0.0
        for i0 in range(start, end, _UCHUNK):
            # a fast pass: a chunk's lines prefetched _STREAM_AHEAD_BYTES ahead, then the token
            # pass's inputs; then its sums in one loop (a loop per _PREFETCH_BLOCK positions,
            # each with its vector loop's set-up and remainder, measured 1.15x the kernel's time)
            for j0 in range(np.uint64(0), _UCHUNK, _PREFETCH_BLOCK):
                ahead = i0 + j0 + distance
                if ahead < end:
                    _prefetch_ahead(
                        logprobs, old_logprobs, logprobs, logprobs, False, mask, has_mask, ahead
                    )
                else:  # the token pass's (its weights only where there are: an empty array's
                    # lines are addresses of nothing, and prefetching them cost 6-10%)
                    _prefetch_ahead(
                        advantages, advantages, advantages, weights, has_weights, mask, False,
                        ahead - end + start,
                    )  # fmt: skip
            # one loop per mask case: a test of has_mask in the loop keeps it from vectorizing
            if has_mask:
                for i in range(i0, min(i0 + _UCHUNK, end)):
                    valid = mask[i] != 0
                    count += _select(valid, 1.0, 0.0)
                    log_ratio_total += _select(
                        valid, np.float64(logprobs[i] - old_logprobs[i]), 0.0
                    )
            else:
                for i in range(i0, min(i0 + _UCHUNK, end)):
                    count += 1.0
                    log_ratio_total += np.float64(logprobs[i] - old_logprobs[i])
        in_dtype[0] = log_ratio_total / max(count, 1.0)
        mean = in_dtype[0]
        inside = not (mean > cap)  # torch.clamp passes the gradient at its bound, and NaN's
        ratio = exp_poly(_select(mean > cap, cap, mean))
        clipped_ratio = _select(ratio < lo, lo, _select(ratio > hi, hi, ratio))
        gradient_ratio = _select(inside, ratio, zero)  # d s / d mean: 0 beyond the clamp
        p = (ratio, clipped_ratio, dual, inside, scale, zero)
        total = 0.0
        clipped_count = 0.0
        lower_count = 0.0
        slope_total = 0.0
        for chunk in range((end - start + _UCHUNK - _U1) // _UCHUNK):
            first = start + chunk * _UCHUNK
            n = min(_UCHUNK, end - first)
            chunk_clipped = zero
            chunk_lower = zero
            for j0 in range(np.uint64(0), _UCHUNK, _PREFETCH_BLOCK):
                # ahead, the chunk's lines at once: this pass's inputs, then the next row's
                # pre-pass's (prefetching inside the loops below keeps them from vectorizing)
                ahead = first + j0 + distance
                if ahead < end:
                    _prefetch_ahead(
                        advantages, advantages, advantages, weights, has_weights, mask, has_mask,
                        ahead,
                    )  # fmt: skip
                else:
                    _prefetch_ahead(
                        logprobs, old_logprobs, logprobs, logprobs, False, mask, has_mask,
                        ahead - end + start + span,
                    )  # fmt: skip
            # One loop per case, so that nothing is loaded for an absent mask or weights.
            if has_mask and has_weights:
                for j in range(n):
                    i = first + j
                    g, loss, slope, c, low = _gspo_token(
                        advantages[i], np.float64(weights[i]), mask[i] != 0, p
                    )
                    grad[i] = g
                    weighted_losses[j] = loss
                    weighted_slopes[j] = slope
                    chunk_clipped += _select(c, one, zero)
                    chunk_lower += _select(low, one, zero)
            elif has_mask:
                for j in range(n):
                    i = first + j
                    g, loss, slope, c, low = _gspo_token(advantages[i], one, mask[i] != 0, p)
                    grad[i] = g
                    losses[j] = loss
                    slopes[j] = slope
                    chunk_clipped += _select(c, one, zero)
                    chunk_lower += _select(low, one, zero)
            elif has_weights:
                for j in range(n):
                    i = first + j
                    g, loss, slope, c, low = _gspo_token(
                        advantages[i], np.float64(weights[i]), True, p
                    )
                    grad[i] = g
                    weighted_losses[j] = loss
                    weighted_slopes[j] = slope
                    chunk_clipped += _select(c, one, zero)
                    chunk_lower += _select(low, one, zero)
            else:
                for j in range(n):
                    i = first + j
                    g, loss, slope, c, low = _gspo_token(advantages[i], one, True, p)
                    grad[i] = g
                    losses[j] = loss
                    slopes[j] = slope
                    chunk_clipped += _select(c, one, zero)
                    chunk_lower += _select(low, one, zero)
            if has_weights:
                for j in range(n):
                    total += weighted_losses[j]
                if not detached:
                    for j in range(n):
                        slope_total += weighted_slopes[j]
            else:
                for j in range(n):
                    total += np.float64(losses[j])
                if not detached:
                    for j in range(n):
                        slope_total += np.float64(slopes[j])
            clipped_count += np.float64(chunk_clipped)
            lower_count += np.float64(chunk_lower)
        if not detached:
            row_grad = slope_total * gradient_ratio * scale / max(count, 1.0)
            for i in range(start, end):
                valid = (not has_mask) or mask[i] != 0
                grad[i] = _select(valid, row_grad, 0.0)
        for i in range(end, start + span):
            grad[i] = zero
        row_loss[b] = total
        row_clipped[b] = clipped_count
        row_lower[b] = lower_count
        row_kl[b] = -log_ratio_total  # the sum of -log-ratio: negation is exact


@numba.njit(nogil=True, cache=_CACHE, error_model="numpy")
def _log_weights(weights, mask, has_mask, first, n, logs):
    """logs[j] = log(weights[first + j]) in float64 where valid, else 0, for j < n: the twin's
    ppo_f64x8_log (log.h's ppo_log64, lane for lane). A function of its own, with numpy's error
    model: under Python's, the log's division checks for a zero divisor, and that branch kept the
    loop scalar (slower than libm's log, which the kernels took until 0.8.14)."""
    _prefer_wide_vectors()
    for j in range(n):
        i = first + j
        valid = (not has_mask) or mask[i] != 0
        logs[j] = _select(valid, log_poly(np.float64(weights[i])), 0.0)


def geo_mean(
    logprobs,
    old_logprobs,
    advantages,
    weights,
    starts,
    spans,
    lengths,
    mask,
    scales,
    log_ratio_low,
    log_ratio_high,
    grad,
    row_loss,
    row_clipped,
    row_lower,
    row_kl,
):
    """Twin: src/rows_sequence.h ppo_geo_mean_row. Two passes over a row: the sums of its kept
    log-ratios, advantages and log-weights (the row's loss, in float64), then the gradient,
    that loss times the row's scale where the kept log-ratio moves with the token's. The row's
    gradient is a function of its sums, so they run in the C twin's order: over the row's valid
    prefix, token t in lane t % 8, the lanes added up in a fixed tree (identical on any number of
    threads). The terms go to scratch rows a chunk at a time (that loop vectorizes), then into
    the lanes. Built without `reassoc` (see its registration in _numba_kernels.py)."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    lo, hi = log_ratio_low, log_ratio_high
    kepts = np.empty(_CHUNK, np.float64)
    advantage_terms = np.empty(_CHUNK, np.float64)
    kls = np.empty(_CHUNK, np.float64)
    distance = np.uint64(_STREAM_AHEAD_BYTES // logprobs.itemsize)
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        valid_end = min(length, span)
        if has_mask:  # as the token losses' (_numba_losses.clipped_surrogate)
            valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite)
        kept_lanes = _lanes_splat(0.0)
        advantage_lanes = kept_lanes
        kl_lanes = kept_lanes
        log_weight_lanes = kept_lanes
        # whole numbers, as integers: a float sum would keep the loop from vectorizing
        count = 0
        upper_count = 0
        lower_count = 0
        for chunk in range((valid_end + _UCHUNK - _U1) // _UCHUNK):
            first = chunk * _UCHUNK
            n = min(_UCHUNK, valid_end - first)
            padded = (n + np.uint64(7)) // np.uint64(8) * np.uint64(8)
            for j0 in range(np.uint64(0), n, _PREFETCH_BLOCK):
                # the token pass rereads the row from the cache: ahead of it, the next row
                _prefetch_ahead(
                    logprobs, old_logprobs, advantages, weights, False, mask, has_mask,
                    _ahead_by(start + first + j0, start, span, valid_end, distance),
                )  # fmt: skip
                for j in range(j0, min(j0 + _PREFETCH_BLOCK, n)):
                    i = start + first + j
                    valid = (not has_mask) or mask[i] != 0
                    advantage = advantages[i]
                    log_ratio = logprobs[i] - old_logprobs[i]
                    positive = advantage > zero
                    negative = advantage < zero
                    kept = _select(
                        positive,
                        _select(log_ratio > hi, hi, log_ratio),
                        _select(
                            negative, _select(log_ratio < -lo, -lo, log_ratio), log_ratio * zero
                        ),
                    )
                    outside = not ((log_ratio >= -lo) & (log_ratio <= hi))  # NaN too
                    count += np.int64(valid)
                    kepts[j] = _select(valid, np.float64(kept), 0.0)
                    advantage_terms[j] = _select(valid, np.float64(advantage), 0.0)
                    upper_count += np.int64(valid & outside & positive)
                    lower_count += np.int64(valid & outside & negative)
                    kls[j] = _select(valid, -np.float64(log_ratio), 0.0)
            for j in range(n, padded):  # the C twin's zero-padded last block
                kepts[j] = 0.0
                advantage_terms[j] = 0.0
                kls[j] = 0.0
            kept_lanes = _add_lanes(kept_lanes, kepts, padded)
            advantage_lanes = _add_lanes(advantage_lanes, advantage_terms, padded)
            kl_lanes = _add_lanes(kl_lanes, kls, padded)
            if has_weights:
                _log_weights(weights, mask, has_mask, start + first, n, kepts)
                log_weight_lanes = _add_lanes(log_weight_lanes, kepts, padded)
        counted = np.float64(count)
        total = 0.0
        loss = 0.0
        if counted > 0.0:
            # exp(mean(r')) * exp(mean(log w)) in one exp
            log_weight_total = _lane_total(log_weight_lanes)
            weighted_ratio = exp_poly(
                _lane_total(kept_lanes) / counted + log_weight_total / counted
            )
            loss = -(_lane_total(advantage_lanes) / counted) * weighted_ratio
            total = counted * loss
        row_grad = loss * scale
        for i in range(start, start + valid_end):
            valid = (not has_mask) or mask[i] != 0
            advantage = advantages[i]
            log_ratio = logprobs[i] - old_logprobs[i]
            moves = ((advantage > zero) & (log_ratio <= hi)) | (
                (advantage < zero) & (log_ratio >= -lo)
            )
            grad[i] = _select(valid & moves, row_grad, 0.0)
        for i in range(start + valid_end, start + span):
            grad[i] = zero
        row_loss[b] = total
        row_clipped[b] = np.float64(upper_count)
        row_lower[b] = np.float64(lower_count)
        row_kl[b] = _lane_total(kl_lanes)
