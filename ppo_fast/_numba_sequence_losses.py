"""The numba per-sequence policy losses, GSPO and verl's geometric mean (GMPO): a pre-pass per
row for its sequence-level quantity, then the token pass (twins of ``_reference_losses.py``'s;
the Cython twins are in ``src/rows_sequence.h``). Registered as the backend's kernels in
``_numba_kernels.py``; conventions in ``_numba_core.py``, the chunk of ``_numba_losses.py``.
"""

from __future__ import annotations

import numpy as np

from ._numba_core import (
    _STREAM_AHEAD_BYTES,
    _U8,
    _ahead_by,
    _jit,
    _mask_stop,
    _positions_per_line,
    _prefer_wide_vectors,
    _prefetch,
    _rounded_like,
    _select,
    _without_refcounts,
)
from ._numba_lanes import (
    _add_lanes,
    _count_valid_lanes,
    _lane_total,
    _lanes_add,
    _lanes_f64,
    _lanes_gt,
    _lanes_le,
    _lanes_lt,
    _lanes_mul,
    _lanes_negative,
    _lanes_of,
    _lanes_put,
    _lanes_put_first,
    _lanes_rounded,
    _lanes_splat,
    _lanes_sub,
    _lanes_where,
    _tail_fill,
    _valid_all,
    _valid_and,
    _valid_and_not,
    _valid_bytes,
    _valid_or,
)
from ._numba_losses import _CHUNK, _U64, _UCHUNK
from ._numba_math import exp_poly, log_poly
from ._numba_memory import _stack_array

_U7 = np.uint64(7)


@_jit
def _gspo_sum_block(has_mask, logprobs, old_logprobs, mask, i, zero, sums):
    """Twin: src/rows_sequence.h ppo_gspo_sum_block. The pre-pass's 8 tokens from position i:
    their log-ratios (in the dtype) added to the lanes of the sum and of the KL's, and the count
    of valid tokens."""
    log_ratio_lanes, kl_lanes, count = sums
    if has_mask:
        valid = _valid_bytes(mask, i)
    else:
        valid = _valid_all()
    log_ratio = _lanes_sub(_lanes_of(logprobs, i), _lanes_of(old_logprobs, i))
    wide = _lanes_f64(_lanes_where(valid, log_ratio, zero))
    return (
        _lanes_add(log_ratio_lanes, wide), _lanes_add(kl_lanes, _lanes_negative(wide)),
        count + _count_valid_lanes(valid),
    )  # fmt: skip


@_jit
def _gspo_block(has_mask, has_weights, detached, advantages, weights, mask, i, p, grad, sums):
    """Twin: src/rows_sequence.h ppo_gspo_block. The token pass's 8 tokens from position i on
    the row's ratio s (the clipped surrogate's body): the detached form stores their gradient,
    the sequence form sums their slope; returns the loss and slope lanes with their terms added
    and the clipped counts (all, and those below). Beyond the clamp the slope is 0 (not
    inf * 0), times the weight, so that a NaN weight still says so."""
    zero, ratio, clipped_ratio, dual, scale, inside = p
    loss_lanes, slope_lanes, clipped_count, lower_count = sums
    if has_mask:
        valid = _valid_bytes(mask, i)
    else:
        valid = _valid_all()
    advantage = _lanes_of(advantages, i)
    unclipped = _lanes_mul(ratio, advantage)
    clipped = _lanes_mul(clipped_ratio, advantage)
    is_clipped = _lanes_lt(clipped, unclipped)
    objective = _lanes_where(is_clipped, clipped, unclipped)
    dual_objective = _lanes_mul(dual, advantage)
    negative = _lanes_lt(advantage, zero)
    is_dual = _valid_and(negative, _lanes_gt(dual_objective, objective))
    objective = _lanes_where(is_dual, dual_objective, objective)
    slope = _lanes_where(_valid_or(is_clipped, is_dual), zero, advantage)
    negative_weight = _lanes_splat(-1.0)  # the weight is float64 either way, as the twin's
    if has_weights:
        weight = _lanes_where(valid, _lanes_of(weights, i), zero)
        negative_weight = _lanes_negative(_lanes_f64(weight))
    if detached:
        sloped = zero
        if inside:
            sloped = _lanes_mul(slope, ratio)
        gradient = _lanes_mul(_lanes_mul(negative_weight, _lanes_f64(sloped)), scale)
        _lanes_put(grad, i, _lanes_where(valid, _lanes_rounded(gradient, zero), zero))
    else:
        slope = _lanes_where(valid, slope, zero)
        slope_lanes = _lanes_add(slope_lanes, _lanes_mul(negative_weight, _lanes_f64(slope)))
    objective = _lanes_where(valid, objective, zero)
    loss_lanes = _lanes_add(loss_lanes, _lanes_mul(negative_weight, _lanes_f64(objective)))
    counted = _valid_and(valid, is_clipped)
    return (
        loss_lanes, slope_lanes, clipped_count + _count_valid_lanes(counted),
        lower_count + _count_valid_lanes(_valid_and(counted, negative)),
    )  # fmt: skip


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
    """Twin: src/rows_sequence.h ppo_gspo_row, in lanes (``_gspo_rows``)."""
    detached = form == 0
    tail = _stack_array((5, 8), logprobs.dtype)
    tail[:] = 0
    tail_mask = _stack_array((8,), np.uint8)
    tail_mask[:] = 0
    _gspo_rows(
        logprobs, old_logprobs, advantages, weights, starts, spans, lengths, mask, scales,
        ratio_low, ratio_high, dual_clip, log_ratio_max, detached, grad, row_loss, row_clipped,
        row_lower, row_kl, tail, tail_mask,
    )  # fmt: skip


@_without_refcounts
def _gspo_rows(
    logprobs, old_logprobs, advantages, weights, starts, spans, lengths, mask, scales,
    ratio_low, ratio_high, dual_clip, log_ratio_max, detached, grad, row_loss, row_clipped,
    row_lower, row_kl, tail, tail_mask,
):  # fmt: skip
    """Twin: src/rows_sequence.h ppo_gspo_cases. Two passes over each row's valid prefix in
    lanes, each prefetching _STREAM_AHEAD_BYTES ahead (past its end, the next pass's inputs):
    the sum of its log-ratios (the sequence ratio s), then the token pass on s; the "sequence"
    form then writes the row's one gradient to its valid tokens in a third. A row's last
    partial block goes through zero-padded lanes. Writes the row's loss, clipped and lower
    counts and KL. The loop over the rows is here, as in _numba_losses' rows_of (which says
    why)."""
    _prefer_wide_vectors()
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    for b in range(starts.shape[0]):
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite)
        zeros = _lanes_splat(zero)
        nothing = _lanes_splat(0.0)
        valid_end = min(length, span)
        if has_mask:  # as the token losses' (_numba_losses)
            valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
        stop = start + valid_end
        distance = np.uint64(_STREAM_AHEAD_BYTES // logprobs.itemsize)
        per_line = _positions_per_line(logprobs)
        sums = (nothing, nothing, 0)
        for first in range(start, stop, _UCHUNK):
            end = min(first + _UCHUNK, stop)
            whole_end = end - (end - first) % _U8
            for i in range(first, whole_end, _U8):
                if (i - first) % per_line == 0:
                    ahead = i + distance
                    if ahead < stop:  # this pass's inputs
                        _prefetch(logprobs, ahead)
                        _prefetch(old_logprobs, ahead)
                        if has_mask and (i - first) % _U64 == 0:
                            _prefetch(mask, ahead)
                    else:  # then the token pass's, from the row's start
                        ahead = ahead - stop + start
                        _prefetch(advantages, ahead)
                        if has_weights:
                            _prefetch(weights, ahead)
                sums = _gspo_sum_block(has_mask, logprobs, old_logprobs, mask, i, zeros, sums)
            if whole_end < end:
                _tail_fill(
                    tail, tail_mask, logprobs, old_logprobs, logprobs, weights, False, mask,
                    has_mask, whole_end, end - whole_end,
                )  # fmt: skip
                sums = _gspo_sum_block(
                    tail_mask.shape[0] > 0, tail[0], tail[1], tail_mask, 0, zeros, sums
                )
        log_ratio_lanes, kl_lanes, count = sums
        divisor = max(np.float64(count), 1.0)
        mean = _rounded_like(_lane_total(log_ratio_lanes) / divisor, zero)
        # torch.clamp passes the gradient at its bound, and NaN's
        inside = not (mean > log_ratio_max)
        ratio = exp_poly(_select(mean > log_ratio_max, log_ratio_max, mean))
        clipped_ratio = _select(
            ratio < ratio_low, ratio_low, _select(ratio > ratio_high, ratio_high, ratio)
        )
        gradient_ratio = _select(inside, ratio, zero)  # d s / d mean: 0 beyond the clamp
        p = (
            zeros, _lanes_splat(ratio), _lanes_splat(clipped_ratio), _lanes_splat(dual_clip),
            _lanes_splat(np.float64(scale)), inside,
        )  # fmt: skip
        sums = (nothing, nothing, 0, 0)
        for first in range(start, stop, _UCHUNK):
            end = min(first + _UCHUNK, stop)
            whole_end = end - (end - first) % _U8
            for i in range(first, whole_end, _U8):
                if (i - first) % per_line == 0:
                    ahead = i + distance
                    if ahead < stop:  # this pass's inputs
                        _prefetch(advantages, ahead)
                        if has_weights:
                            _prefetch(weights, ahead)
                        if has_mask and (i - first) % _U64 == 0:
                            _prefetch(mask, ahead)
                    else:  # then the next row's pre-pass's
                        ahead = ahead - stop + start + span
                        _prefetch(logprobs, ahead)
                        _prefetch(old_logprobs, ahead)
                        if has_mask and (i - first) % _U64 == 0:
                            _prefetch(mask, ahead)
                sums = _gspo_block(
                    has_mask, has_weights, detached, advantages, weights, mask, i, p, grad, sums
                )
            if whole_end < end:
                count_left = end - whole_end
                _tail_fill(
                    tail, tail_mask, advantages, advantages, advantages, weights, has_weights, mask,
                    has_mask, whole_end, count_left,
                )  # fmt: skip
                tail_grad = tail[4]
                sums = _gspo_block(
                    tail_mask.shape[0] > 0, has_weights, detached, tail[0], tail[3], tail_mask,
                    0, p, tail_grad, sums,
                )  # fmt: skip
                if detached:
                    _lanes_put_first(grad, whole_end, _lanes_of(tail_grad, 0), count_left)
        loss_lanes, slope_lanes, clipped_count, lower_count = sums
        if not detached:
            row_grad = _lane_total(slope_lanes) * np.float64(gradient_ratio) * np.float64(scale)
            row_grad = row_grad / divisor
            gradient = _lanes_rounded(_lanes_splat(row_grad), zeros)
            whole_end = stop - valid_end % _U8
            for i in range(start, whole_end, _U8):
                if has_mask:
                    valid = _valid_bytes(mask, i)
                else:
                    valid = _valid_all()
                _lanes_put(grad, i, _lanes_where(valid, gradient, zeros))
            for i in range(whole_end, stop):
                grad[i] = _select((not has_mask) or mask[i] != 0, row_grad, 0.0)
        for i in range(stop, start + span):
            grad[i] = 0
        row_loss[b] = _lane_total(loss_lanes)
        row_clipped[b] = np.float64(clipped_count)
        row_lower[b] = np.float64(lower_count)
        row_kl[b] = _lane_total(kl_lanes)


@_without_refcounts
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


@_jit
def _geo_mean_sum_block(
    has_mask, logprobs, old_logprobs, advantages, mask, i, zero, high, negative_low, sums
):  # fmt: skip
    """Twin: src/rows_sequence.h ppo_geo_mean_sum_block. The pre-pass's 8 tokens from position
    i: their kept log-ratios, advantages and -log-ratios added to the sums' lanes, and the
    counts of valid tokens and of those outside the clip above and below."""
    kept_lanes, advantage_lanes, kl_lanes, count, upper, lower = sums
    if has_mask:
        valid = _valid_bytes(mask, i)
    else:
        valid = _valid_all()
    advantage = _lanes_of(advantages, i)
    log_ratio = _lanes_sub(_lanes_of(logprobs, i), _lanes_of(old_logprobs, i))
    positive = _lanes_gt(advantage, zero)
    negative = _lanes_lt(advantage, zero)
    # the twin's min(high, log_ratio) and max(-low, log_ratio): NaN stays NaN
    kept = _lanes_where(
        positive,
        _lanes_where(_lanes_lt(high, log_ratio), high, log_ratio),
        _lanes_where(
            negative,
            _lanes_where(_lanes_gt(negative_low, log_ratio), negative_low, log_ratio),
            _lanes_mul(log_ratio, zero),
        ),
    )
    # (log_ratio >= -lo) & (log_ratio <= hi): false on NaN, which is outside
    within = _valid_and(_lanes_le(negative_low, log_ratio), _lanes_le(log_ratio, high))
    outside = _valid_and_not(valid, within)
    kept_lanes = _lanes_add(kept_lanes, _lanes_f64(_lanes_where(valid, kept, zero)))
    advantage_lanes = _lanes_add(advantage_lanes, _lanes_f64(_lanes_where(valid, advantage, zero)))
    kl = _lanes_f64(_lanes_where(valid, log_ratio, zero))
    kl_lanes = _lanes_add(kl_lanes, _lanes_negative(kl))
    return (
        kept_lanes, advantage_lanes, kl_lanes, count + _count_valid_lanes(valid),
        upper + _count_valid_lanes(_valid_and(outside, positive)),
        lower + _count_valid_lanes(_valid_and(outside, negative)),
    )  # fmt: skip


@_jit
def _geo_mean_block(
    has_mask, logprobs, old_logprobs, advantages, mask, i, zero, high, negative_low, row_grad,
    grad,
):  # fmt: skip
    """Twin: src/rows_sequence.h ppo_geo_mean_block: the row's gradient at the 8 tokens from
    position i where the kept log-ratio moves with the token's, else 0."""
    if has_mask:
        valid = _valid_bytes(mask, i)
    else:
        valid = _valid_all()
    advantage = _lanes_of(advantages, i)
    log_ratio = _lanes_sub(_lanes_of(logprobs, i), _lanes_of(old_logprobs, i))
    moves = _valid_or(
        _valid_and(_lanes_gt(advantage, zero), _lanes_le(log_ratio, high)),
        _valid_and(_lanes_lt(advantage, zero), _lanes_le(negative_low, log_ratio)),
    )
    _lanes_put(grad, i, _lanes_where(_valid_and(valid, moves), row_grad, zero))


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
    """Twin: src/rows_sequence.h ppo_geo_mean_row, in lanes (``_geo_mean_rows``): the row's
    gradient is a function of its sums, which run in the C twin's lanes and order, so that the
    two backends give the same bits (and so do any number of threads)."""
    logs = _stack_array((_CHUNK,), np.float64)
    tail = _stack_array((5, 8), logprobs.dtype)
    tail[:] = 0
    tail_mask = _stack_array((8,), np.uint8)
    tail_mask[:] = 0
    _geo_mean_rows(
        logprobs, old_logprobs, advantages, weights, starts, spans, lengths, mask, scales,
        log_ratio_low, log_ratio_high, grad, row_loss, row_clipped, row_lower, row_kl, logs,
        tail, tail_mask,
    )  # fmt: skip


@_without_refcounts
def _geo_mean_rows(
    logprobs, old_logprobs, advantages, weights, starts, spans, lengths, mask, scales,
    log_ratio_low, log_ratio_high, grad, row_loss, row_clipped, row_lower, row_kl, logs, tail,
    tail_mask,
):  # fmt: skip
    """Twin: src/rows_sequence.h ppo_geo_mean_cases. Two passes over each row's valid prefix in
    lanes: the sums of its kept log-ratios, advantages and (with weights) log-weights, a chunk
    at a time, prefetching _STREAM_AHEAD_BYTES ahead (past the row, the next row: the token pass
    rereads this one from the cache); then the gradient, the row's loss times its scale where
    the kept log-ratio moves with the token's. A row's last partial block goes through
    zero-padded lanes. Writes the row's loss, upper and lower counts and KL. The loop over the
    rows is here, as in _numba_losses' rows_of (which says why)."""
    _prefer_wide_vectors()
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    for b in range(starts.shape[0]):
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        scale = scales[b]
        valid_end = min(length, span)
        if has_mask:  # as the token losses' (_numba_losses)
            valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
        stop = start + valid_end
        zero = _lanes_splat(scale - scale)  # 0 in the input dtype (the scale is finite)
        high = _lanes_splat(log_ratio_high)
        negative_low = _lanes_splat(-log_ratio_low)
        nothing = _lanes_splat(0.0)
        sums = (nothing, nothing, nothing, 0, 0, 0)
        distance = np.uint64(_STREAM_AHEAD_BYTES // logprobs.itemsize)
        per_line = _positions_per_line(logprobs)
        for first in range(start, stop, _UCHUNK):
            end = min(first + _UCHUNK, stop)
            whole_end = end - (end - first) % _U8
            for i in range(first, whole_end, _U8):
                if (i - first) % per_line == 0:
                    ahead = _ahead_by(i, start, span, valid_end, distance)
                    _prefetch(logprobs, ahead)
                    _prefetch(old_logprobs, ahead)
                    _prefetch(advantages, ahead)
                    if has_mask and (i - first) % _U64 == 0:
                        _prefetch(mask, ahead)
                sums = _geo_mean_sum_block(
                    has_mask, logprobs, old_logprobs, advantages, mask, i, zero, high,
                    negative_low, sums,
                )  # fmt: skip
            if whole_end < end:
                _tail_fill(
                    tail, tail_mask, logprobs, old_logprobs, advantages, weights, False, mask,
                    has_mask, whole_end, end - whole_end,
                )  # fmt: skip
                sums = _geo_mean_sum_block(
                    tail_mask.shape[0] > 0, tail[0], tail[1], tail[2], tail_mask, 0, zero, high,
                    negative_low, sums,
                )  # fmt: skip
        kept_lanes, advantage_lanes, kl_lanes, count, upper, lower = sums
        log_weight_total = 0.0
        if has_weights:  # log_poly on each weight in float64, in the sums' lanes
            log_weight_lanes = nothing
            for first in range(start, stop, _UCHUNK):
                n = min(_UCHUNK, stop - first)
                padded = (n + _U7) // _U8 * _U8
                _log_weights(weights, mask, has_mask, first, n, logs)
                for j in range(n, padded):  # the twin's zero-padded last block
                    logs[j] = 0.0
                log_weight_lanes = _add_lanes(log_weight_lanes, logs, padded)
            log_weight_total = _lane_total(log_weight_lanes)
        counted = np.float64(count)
        loss = 0.0
        if counted > 0.0:
            # exp(mean(r')) * exp(mean(log w)) in one exp
            weighted_ratio = exp_poly(
                _lane_total(kept_lanes) / counted + log_weight_total / counted
            )
            loss = -(_lane_total(advantage_lanes) / counted) * weighted_ratio
        row_grad = _lanes_rounded(_lanes_splat(loss * np.float64(scale)), zero)
        whole_end = stop - valid_end % _U8
        for i in range(start, whole_end, _U8):
            _geo_mean_block(
                has_mask, logprobs, old_logprobs, advantages, mask, i, zero, high, negative_low,
                row_grad, grad,
            )  # fmt: skip
        if whole_end < stop:
            count_left = stop - whole_end
            _tail_fill(
                tail, tail_mask, logprobs, old_logprobs, advantages, weights, False, mask, has_mask,
                whole_end, count_left,
            )  # fmt: skip
            tail_grad = tail[4]
            _geo_mean_block(
                tail_mask.shape[0] > 0, tail[0], tail[1], tail[2], tail_mask, 0, zero, high,
                negative_low, row_grad, tail_grad,
            )  # fmt: skip
            _lanes_put_first(grad, whole_end, _lanes_of(tail_grad, 0), count_left)
        for i in range(stop, start + span):
            grad[i] = 0
        row_loss[b] = counted * loss
        row_clipped[b] = np.float64(upper)
        row_lower[b] = np.float64(lower)
        row_kl[b] = _lane_total(kl_lanes)
