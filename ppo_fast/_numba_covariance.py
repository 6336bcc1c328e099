"""The numba KL-Cov selection (``kl_cov_top_k``): each row's sums on its own, added in row
order, then the k strongest covariances kept in a buffer of candidates per range of rows, the
ranges merged (twin of ``src/rows_covariance.h``; the oracle is ``_reference_losses.py``'s).
Registered as the backend's kernel in ``_numba_kernels.py``; conventions in ``_numba_core.py``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ._numba_builds import _parts
from ._numba_core import (
    _CACHE,
    _PREFETCH_BLOCK,
    _STREAM_AHEAD_BYTES,
    _U8,
    _ahead_by,
    _called,
    _jit,
    _prefetch_ahead,
    _select,
)
from ._numba_lanes import (
    _lane_total,
    _lanes_add,
    _lanes_any_at_least,
    _lanes_load,
    _lanes_mul,
    _lanes_splat,
    _lanes_store,
    _lanes_sub,
    _lanes_where_valid,
    _with_lane,
)

_INT64_MAX = np.int64(2**63 - 1)


@_called
def _select_kth(a, n, kth):
    """Twin: src/rows_covariance.h ppo_select_f64 / ppo_select_i64. The kth smallest (from 0) of
    a[:n], which it reorders: Hoare's selection, the median of three as the pivot (numba's
    np.partition took 10 times as long). Never NaN here: < is a total order."""
    lo = 0
    hi = n - 1
    while hi > lo:
        x = a[lo]
        y = a[lo + (hi - lo) // 2]
        z = a[hi]
        if x < y:
            pivot = y if y < z else (z if x < z else x)
        else:
            pivot = x if x < z else (z if y < z else y)
        i = lo
        j = hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while pivot < a[j]:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if kth <= j:
            hi = j
        elif kth >= i:
            lo = i
        else:
            return a[kth]
    return a[kth]


@_called  # not inlined: called once in many candidates
def _top_k_keep(keys, positions, size, k, threshold):
    """Twin: src/rows_covariance.h ppo_top_k_keep. Keeps the k strongest of the candidates
    keys[:size], positions[:size] (when there are more) in their first k slots: those above the
    k-th strongest key, and of those equal to it the lowest positions (exactly k: positions are
    distinct); returns (k, that key: the new threshold)."""
    if size <= k:
        return size, threshold
    kth = _select_kth(keys[:size].copy(), size, size - k)
    # Branch-free loops: each item is written to the next slot, which a kept one keeps (half of
    # them are kept: a branch on it was mispredicted as often, 5 times the time).
    above = 0
    tied = 0
    tied_positions = np.empty(size, dtype=np.int64)
    for m in range(size):
        above += keys[m] > kth
        tied_positions[tied] = positions[m]
        tied += keys[m] == kth
    need = k - above  # 1 .. tied
    last = _INT64_MAX
    if need < tied:
        last = _select_kth(tied_positions, tied, need - 1)
    kept = 0
    for m in range(size):
        key = keys[m]
        position = positions[m]
        keys[kept] = key
        positions[kept] = position
        kept += (key > kth) | ((key == kth) & (position <= last))
    return kept, kth


@_jit
def _top_k_take(keys, positions, size, threshold, key, position):
    """Twin: src/rows_covariance.h ppo_top_k_take. Takes the token at ``position`` with
    covariance ``key`` (a NaN counts as -inf) into the candidates of KL-Cov's top-k when it is at
    least as strong as ``threshold``; the caller has made room (_top_k_room). Returns the size."""
    if key != key:
        key = -math.inf
    if key < threshold:
        return size
    keys[size] = key
    positions[size] = position
    return size + 1


@_jit
def _top_k_room(keys, positions, size, k, threshold):
    """Twin: src/rows_covariance.h ppo_top_k_room: room for 8 more candidates (the buffer has
    at least k + 8 slots); returns (size, threshold)."""
    if size > keys.shape[0] - 8:
        return _top_k_keep(keys, positions, size, k, threshold)
    return size, threshold


@_jit
def _kl_cov_row_sums(logprobs, advantages, starts, spans, lengths, mask, has_mask, b, selected):
    """Twin: src/rows_covariance.h ppo_kl_cov_row_sums. Row b's valid tokens' (count, sum of
    advantages, sum of log-probs), each in 8 float64 lanes from +0.0 (token t of the row in lane
    t % 8) added up in the fixed tree; zeroes the row's flags."""
    distance = np.uint64(_STREAM_AHEAD_BYTES // logprobs.itemsize)
    zeros = _lanes_splat(0.0)
    ones = _lanes_splat(1.0)
    count_lanes = zeros
    adv_lanes = zeros
    logp_lanes = zeros
    start = np.uint64(starts[b])
    span = np.uint64(spans[b])
    length = min(np.uint64(max(lengths[b], 0)), span)
    whole = start + length // _U8 * _U8
    for i in range(start, start + span):
        selected[i] = 0
    for i in range(start, whole, _U8):
        if (i - start) % _PREFETCH_BLOCK == 0:
            # two arrays to prefetch: the third given is the second again
            _prefetch_ahead(
                logprobs, advantages, advantages, advantages, False, mask, has_mask,
                _ahead_by(i, start, span, length, distance),
            )  # fmt: skip
        adv = _lanes_load(advantages, i)
        logp = _lanes_load(logprobs, i)
        if has_mask:
            count_lanes = _lanes_add(count_lanes, _lanes_where_valid(mask, i, ones))
            adv_lanes = _lanes_add(adv_lanes, _lanes_where_valid(mask, i, adv))
            logp_lanes = _lanes_add(logp_lanes, _lanes_where_valid(mask, i, logp))
        else:
            count_lanes = _lanes_add(count_lanes, ones)
            adv_lanes = _lanes_add(adv_lanes, adv)
            logp_lanes = _lanes_add(logp_lanes, logp)
    counts = zeros
    adv_tail = zeros
    logp_tail = zeros
    for i in range(whole, start + length):
        if not has_mask or mask[i] != 0:
            lane = i - whole
            counts = _with_lane(counts, lane, 1.0)
            adv_tail = _with_lane(adv_tail, lane, np.float64(advantages[i]))
            logp_tail = _with_lane(logp_tail, lane, np.float64(logprobs[i]))
    count_lanes = _lanes_add(count_lanes, counts)
    adv_lanes = _lanes_add(adv_lanes, adv_tail)
    logp_lanes = _lanes_add(logp_lanes, logp_tail)
    return _lane_total(count_lanes), _lane_total(adv_lanes), _lane_total(logp_lanes)


@_jit
def _kl_cov_offer_rows(
    logprobs, advantages, starts, spans, lengths, mask, has_mask, rows, mean_adv, mean_logp,
    keys, positions, k,
):  # fmt: skip
    """Twin: src/rows_covariance.h ppo_kl_cov_offer_rows. Offers the valid tokens of ``rows``
    to an empty buffer of candidates (keys, positions: _top_k_take), 8 at a time: none of a
    block when the threshold is above -inf and none of its covariances reaches it (not when it
    is -inf: a NaN key counts as -inf but compares false); returns its size and threshold."""
    distance = np.uint64(_STREAM_AHEAD_BYTES // logprobs.itemsize)
    mean_advs = _lanes_splat(mean_adv)
    mean_logps = _lanes_splat(mean_logp)
    size = np.int64(0)  # not the literal 0: numba would compile _top_k_keep for it too
    threshold = -math.inf
    block = np.empty(8)
    for j in range(rows.shape[0]):
        b = rows[j]
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = min(np.uint64(max(lengths[b], 0)), span)
        whole = start + length // _U8 * _U8
        for i in range(start, whole, _U8):
            if (i - start) % _PREFETCH_BLOCK == 0:
                _prefetch_ahead(
                    logprobs, advantages, advantages, advantages, False, mask, has_mask,
                    _ahead_by(i, start, span, length, distance),
                )  # fmt: skip
            covariances = _lanes_mul(
                _lanes_sub(_lanes_load(advantages, i), mean_advs),
                _lanes_sub(_lanes_load(logprobs, i), mean_logps),
            )
            if threshold > -math.inf and not _lanes_any_at_least(covariances, threshold):
                continue
            size, threshold = _top_k_room(keys, positions, size, k, threshold)
            # branch-free: each lane is written to the next slot, which a taken one keeps
            _lanes_store(block, 0, covariances)
            for lane in range(8):
                key = block[lane]
                key = _select(key != key, -math.inf, key)
                keys[size] = key
                positions[size] = np.int64(i + lane)
                size += (not has_mask or mask[i + lane] != 0) & (key >= threshold)
        size, threshold = _top_k_room(keys, positions, size, k, threshold)
        for i in range(whole, start + length):  # fewer than 8
            if not has_mask or mask[i] != 0:
                covariance = (np.float64(advantages[i]) - mean_adv) * (
                    np.float64(logprobs[i]) - mean_logp
                )
                size = _top_k_take(keys, positions, size, threshold, covariance, np.int64(i))
    return size, threshold


def _kl_cov_top_k_shared(
    logprobs, advantages, starts, spans, lengths, mask, group_rows, group_starts, ratio, selected,
    n_parts,
):  # fmt: skip
    """Twin: src/rows_covariance.h ppo_kl_cov_top_k_group. The groups in turn, each shared among
    the threads (the table's ``splits_groups``: the parallel build is this source with
    parallel=True, whose prange loops share a group's work; the serial build, kl_cov_top_k,
    runs it with n_parts 1). Eight positions at a time, as float64 lanes: a first pass sums each
    row's valid tokens (_kl_cov_row_sums: token t of the row in lane t % 8, the lanes added up
    in a fixed tree), and the group's sums are its rows' added in row order (the oracle's order,
    whatever the threads); a second computes 8 covariances and offers the block's valid tokens
    to a buffer of candidates, none when none of the 8 reaches its threshold
    (_kl_cov_offer_rows, _top_k_take: the threshold only rises, so a token below it stays out of
    the top k). Each of up to n_parts ranges of rows (about equal positions: _parts; the
    parallel build's threads, one a range) has a buffer of its own, and the others' k strongest
    are offered to the first's: the k strongest of the group are the k strongest of the ranges'
    k strongest, and strength is a total order (the position breaks ties), so the selection does
    not depend on the ranges. O(n + k log(n / k)) time with at most 2k + 8 slots a range."""
    has_mask = mask.shape[0] > 0
    for g in range(group_starts.shape[0] - 1):
        rows = group_rows[group_starts[g] : group_starts[g + 1]]
        n_rows = rows.shape[0]
        row_sums = np.empty((n_rows, 3))
        for j in prange(n_rows):
            count, adv_total, logp_total = _kl_cov_row_sums(
                logprobs, advantages, starts, spans, lengths, mask, has_mask, rows[j], selected
            )
            row_sums[j, 0] = count
            row_sums[j, 1] = adv_total
            row_sums[j, 2] = logp_total
        count = 0.0
        adv_total = 0.0
        logp_total = 0.0
        for j in range(n_rows):  # in row order, from +0.0
            count += row_sums[j, 0]
            adv_total += row_sums[j, 1]
            logp_total += row_sums[j, 2]
        if count == 0.0:
            continue
        mean_adv = adv_total / count
        mean_logp = logp_total / count
        wanted = ratio * count
        k = np.int64(count) if wanted >= count else max(np.int64(wanted), 1)
        spans_of_rows = np.empty(n_rows, dtype=np.int64)
        for j in range(n_rows):
            spans_of_rows[j] = spans[rows[j]]
        bounds = _parts(spans_of_rows, min(n_parts, 64))
        n_parts = bounds.shape[0] - 1
        capacity = k
        for p in range(n_parts):
            tokens = 0.0
            for j in range(bounds[p], bounds[p + 1]):
                tokens += row_sums[j, 0]
            capacity = max(capacity, min(max(np.int64(tokens), k), 2 * k))
        keys = np.empty((n_parts, capacity + 8))
        positions = np.empty((n_parts, capacity + 8), dtype=np.int64)
        # empty, not zeros: every range writes its size, and under parallel=True np.zeros is a
        # parallel loop of its own, a third start of the threads (about 30 us where they sleep
        # between calls: OMP_WAIT_POLICY=PASSIVE, as `ppo-fast bench` sets it)
        sizes = np.empty(n_parts, dtype=np.int64)
        for p in prange(n_parts):
            size, threshold = _kl_cov_offer_rows(
                logprobs, advantages, starts, spans, lengths, mask, has_mask,
                rows[bounds[p] : bounds[p + 1]], mean_adv, mean_logp, keys[p], positions[p], k,
            )  # fmt: skip
            sizes[p], threshold = _top_k_keep(keys[p], positions[p], size, k, threshold)
        size = sizes[0]
        threshold = -math.inf
        for p in range(1, n_parts):
            for m in range(sizes[p]):
                size, threshold = _top_k_room(keys[0], positions[0], size, k, threshold)
                size = _top_k_take(
                    keys[0], positions[0], size, threshold, keys[p, m], positions[p, m]
                )
        size, threshold = _top_k_keep(keys[0], positions[0], size, k, threshold)
        for m in range(size):
            selected[positions[0, m]] = 1


_kl_cov_top_k_serial = numba.njit(nogil=True, cache=_CACHE)(_kl_cov_top_k_shared)


def kl_cov_top_k(
    logprobs, advantages, starts, spans, lengths, mask, group_rows, group_starts, ratio, selected
):
    """The serial build (the table's arguments), in Python: _kl_cov_top_k_shared's serial
    build with one range of rows; the parallel build is that function with parallel=True and a
    range a thread (``_Kernel``)."""
    _kl_cov_top_k_serial(
        logprobs, advantages, starts, spans, lengths, mask, group_rows, group_starts, ratio,
        selected, 1,
    )  # fmt: skip
