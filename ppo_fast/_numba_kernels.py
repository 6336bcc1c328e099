"""The numba backend: one @njit kernel per stage, written over rows, and the backend interface
(one callable per kernel of the table, at the bottom).

Signatures and semantics are those of the oracle, ``_reference.py``; each kernel names its
Cython twin in ``src/``. The conventions that keep them fast and exact, the intrinsics and the
serial/parallel builders in ``_numba_builds.py``; GAE in ``_numba_gae.py``; the losses in
``_numba_losses.py``, ``_numba_sequence_losses.py`` and ``_numba_value_loss.py``; KL-Cov's
selection in ``_numba_covariance.py``; exp and log in ``_numba_math.py``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba_builds import _Kernel, _Specialised
from ._numba_core import (
    _AVX512,
    _CACHE,
    _PREFETCH_BLOCK,
    _PREFETCH_DISTANCE,
    _STREAM_AHEAD_BYTES,
    _U1,
    _U3,
    _U8,
    _ahead_by,
    _all_valid,
    _as_int_bits,
    _blocks_per_line,
    _common_scales,
    _jit,
    _mask_stop,
    _positions_per_line,
    _prefer_wide_vectors,
    _prefetch,
    _prefetch_ahead,
    _prefetch_for_write,
    _row_totals,
    _select,
    _valid_count,
    _without_refcounts,
    fma,
)
from ._numba_covariance import _kl_cov_top_k_serial, _kl_cov_top_k_shared, kl_cov_top_k
from ._numba_gae import _ERROR_BOUND, _GAE, _RUNNING_BOUND, _gae_chunked, gae
from ._numba_lanes import (
    _count_valid_lanes,
    _lane,
    _lane_total,
    _lanes_add,
    _lanes_bounded,
    _lanes_down1_fill,
    _lanes_down2,
    _lanes_down4,
    _lanes_fma,
    _lanes_fma_by,
    _lanes_load,
    _lanes_mul,
    _lanes_splat,
    _lanes_store,
    _lanes_sub,
    _lanes_where,
    _lanes_where_valid,
    _valid_bytes,
    _with_lane,
    _zeros_backwards,
)
from ._numba_losses import (
    cispo,
    clipped_surrogate,
    dppo,
    kl_cov,
    reinforce,
    sapo,
)
from ._numba_math import (
    _exp64,
    _exp64_with,
    exp_constants,
    exp_registers,
    k3_blocks,
    k3_rewards_lanes,
)
from ._numba_sequence_losses import geo_mean, gspo
from ._numba_value_loss import value_loss
from ._rows import EMPTY_MASK as _EMPTY_MASK
from ._spec import ESTIMATORS, KERNELS

K1, K2, K3, ABS = (ESTIMATORS.index(name) for name in ("k1", "k2", "k3", "abs"))


@_jit
def _k3_within(log_ratio, clamp, constants):
    """kl_value's k3 where -log_ratio <= 708 (or NaN): exp(-log_ratio) with no correction for
    the range past 708, whose subtraction of 0 and product with 1 change no bit there.
    ``constants``: exp's, exp_constants(0.0) made before the loop (the same bits)."""
    value = _exp64_with(-log_ratio, constants) - 1.0 + log_ratio
    return min(max(value, -clamp), clamp)


# kl_value's k3 needs its correction for exp past 708 where -log_ratio > 708: where the bits
# of -log_ratio, as a signed integer, exceed 708.0's (positive floats are ordered as their bits,
# negative ones have the sign bit). A row's flag is the max of those bits, one integer max a
# position: the uint8 `|=` of the comparison took three vector instructions a block and 10%
# of k3's time. A NaN with a clear sign bit flags its row too, which is then redone with the
# same bits (the redone loop gives _k3_within's bits wherever the correction is not needed).
_BITS_708 = np.int64(np.float64(708.0).view(np.int64))
_NO_BITS = np.int64(np.iinfo(np.int64).min)


@_jit
def _k3_reach(log_ratio):
    """-log_ratio's bits as a signed integer, to be compared with _BITS_708 (twin of the
    comparison in src/rows_kl.h ppo_kl_values)."""
    return _as_int_bits(-log_ratio)


@_jit
def _kl_within(log_ratio, estimator, clamp, constants):
    """kl_value, k3 as _k3_within: the bits of kl_value wherever _k3_reach is at most
    _BITS_708."""
    if estimator == K3:
        return _k3_within(log_ratio, clamp, constants)
    return kl_value(log_ratio, estimator, clamp)


@_jit
def kl_value(log_ratio, estimator, clamp):
    """Twin of ``_reference.kl_value``; log_ratio is float64."""
    if estimator == K1:
        value = log_ratio
    elif estimator == K2:
        value = 0.5 * log_ratio * log_ratio
    elif estimator == K3:
        # exp(x) = e * exp(x - 1) past 708, so that it overflows to inf where math.exp does
        # (_exp64 saturates at exp(709) to stay vectorizable).
        beyond = -log_ratio > 708.0
        exp_neg = _exp64(-log_ratio - _select(beyond, 1.0, 0.0)) * _select(beyond, math.e, 1.0)
        value = exp_neg - 1.0 + log_ratio
    else:
        value = abs(log_ratio)
    return min(max(value, -clamp), clamp)


def _kl_penalty_rows(code):
    """Twin: src/rows_kl.h ppo_kl_penalty_row, built for the estimator `code` (the `estimator`
    argument is that code; see _Specialised)."""

    def kl_penalty(logprobs, ref_logprobs, starts, spans, estimator, clamp, kl):
        for b in prange(starts.shape[0]):
            _prefer_wide_vectors()
            start = np.uint64(starts[b])
            end = start + np.uint64(spans[b])
            if code == K3:
                # The row without k3's correction past exp(708) and with a flag of whether a
                # position needed it (an integer reduction: the loop still vectorizes); the rare
                # row that did is redone below, with the same bits. The correction, a select, a
                # subtraction and a product a position, took 27% of the row's time (float32
                # (1024, 4096): 2.2 -> 1.6 ms); the C twin skips it by a branch per block of 8
                # (this flag there measured no faster).
                # Where numba compiles for AVX-512, the twin's blocks (_numba_math.k3_blocks),
                # the row's last positions as above.
                reach = _NO_BITS
                constants = exp_constants(0.0)
                scalar_from = start
                if _AVX512:
                    scalar_from = k3_blocks(logprobs, ref_logprobs, start, end, clamp, kl)
                for i in range(scalar_from, end):
                    log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                    kl[i] = _k3_within(log_ratio, clamp, constants)
                    reach = max(reach, _k3_reach(log_ratio))
                if reach <= _BITS_708:
                    continue
            for i in range(start, end):
                log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                kl[i] = kl_value(log_ratio, code, clamp)

    return kl_penalty


def _shape_rewards_rows(code):
    """Twin: src/rows_kl.h ppo_shape_rewards_row, built for the estimator `code` (see
    _kl_penalty_rows)."""
    registers = code == K3 and _AVX512  # a constant of the kernel: its other forms skip them

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
    ):
        has_mask = mask.shape[0] > 0
        for b in prange(starts.shape[0]):
            _prefer_wide_vectors()
            start = np.uint64(starts[b])
            span = np.uint64(spans[b])
            length = np.uint64(lengths[b])
            end = start + min(length, span)
            if has_mask:  # the twin's: the padding's words are zeros, not computed or searched
                end = start + _mask_stop(mask, start, np.uint64(0), end - start)
            last = start + span  # one past the row when it has no valid position
            for k in range(end - start):
                t = end - start - _U1 - k
                if not has_mask or mask[start + t] != 0:
                    last = start + t
                    break
            score = np.float64(scores[b])
            # Every position of the valid prefix computed and the mask selecting, one loop per
            # mask case (a branch per token kept LLVM from vectorizing the loop: 2.1x slower than
            # the C twin); past the length, 0.
            # k3 without its correction past exp(708) and a flag of whether it was needed, the
            # rare row that needed it redone (as kl_penalty's).
            # In blocks of _PREFETCH_BLOCK positions, each after the prefetches of the lines
            # _PREFETCH_DISTANCE positions of work ahead, across the padding into the next row,
            # as the twin (ppo_prefetch_ahead): without them, float32 (1024, 4096) rows from
            # memory took 1.13x the twin's time (5.16 against 4.58 ms, one thread).
            # k3 where numba compiles for AVX-512: eight positions a step in one register
            # (_numba_math.k3_rewards_lanes, the twin's form), each block's last ones as above.
            reach = _NO_BITS
            constants = exp_constants(0.0)
            clamps = (_lanes_splat(clamp), _lanes_splat(-clamp))
            k3_registers = exp_registers(0.0)  # unused (and so not made) without `registers`
            for block in range(start, end, _PREFETCH_BLOCK):
                ahead = _ahead_by(block, start, span, end - start, _PREFETCH_DISTANCE)
                for k in range(np.uint64(0), _PREFETCH_BLOCK, _positions_per_line(logprobs)):
                    _prefetch(logprobs, ahead + k)
                    _prefetch(ref_logprobs, ahead + k)
                block_end = min(block + _PREFETCH_BLOCK, end)
                registers_end = block
                if registers:
                    while registers_end + _U8 <= block_end:
                        rewards8 = k3_rewards_lanes(
                            logprobs, ref_logprobs, registers_end, mask, has_mask, last, score,
                            kl_coef, clamps, k3_registers,
                        )  # fmt: skip
                        _lanes_store(rewards, registers_end, rewards8)
                        registers_end += _U8
                if has_mask:
                    _prefetch(mask, ahead)
                    for i in range(registers_end, block_end):
                        log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                        reward = -kl_coef * _kl_within(log_ratio, code, clamp, constants)
                        reward += _select(i == last, score, 0.0)
                        rewards[i] = _select(mask[i] != 0, reward, 0.0)
                        reach = max(reach, _k3_reach(log_ratio))
                else:
                    for i in range(registers_end, block_end):
                        log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                        reward = -kl_coef * _kl_within(log_ratio, code, clamp, constants)
                        rewards[i] = reward + _select(i == last, score, 0.0)
                        reach = max(reach, _k3_reach(log_ratio))
            if code == K3 and reach > _BITS_708:
                for i in range(start, end):
                    log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                    reward = -kl_coef * kl_value(log_ratio, code, clamp)
                    reward += _select(i == last, score, 0.0)
                    rewards[i] = _select((not has_mask) or mask[i] != 0, reward, 0.0)
            for i in range(end, start + span):
                rewards[i] = 0.0

    return shape_rewards


@_jit
def _returns_row(
    rewards, start, span, length, mask, has_mask, gamma, running, baseline, advantages, returns
):
    """Twin: src/rows_returns.h ppo_returns_row. One row of discounted returns (and, when
    ``advantages`` is not empty, returns - baseline), float64 state.

    The recursion G = fma(gamma, G_next, r) is a chain of dependent fma, 4 cycles each: alone it
    holds a row to about 2.5 times the memory floor. So the valid prefix runs backwards in blocks
    of 8 positions: a block whose 8 positions are valid gets its own suffix returns a_j (by the
    log-step scan of GAE's blocks, _gae_scan: three steps of lanes moved down, independent of
    the other blocks) and then G_j = fma(gamma^(8-j), G_8, a_j), which moves the row's chain 8
    positions per fma. Other blocks (a masked position among the 8, or a reward beyond 2^1000 or
    a running return beyond 2^1020, GAE's bounds: no inf or NaN goes into a scan, and no partial
    sum overflows in one order and not in the other) and the row's first positions (fewer than
    8) take the plain recursion. The float64 sums are thus reassociated per block: a few ulp from
    the oracle's recursion. Blocks are not used when gamma^8 underflows to 0 for a gamma > 0:
    gamma^8 * inf would then be NaN where the recursion gives inf.
    """
    valid_end = min(length, span)
    _zeros_backwards(returns, advantages, start + valid_end, start + span)
    # (gamma^8, ..., gamma^1) in lanes 0..7, each the product of the one before and gamma
    power = gamma
    powers = _with_lane(_lanes_splat(power), 7, power)
    for k in range(6, -1, -1):
        power = gamma * power
        powers = _with_lane(powers, k, power)
    baselines = _lanes_splat(baseline)
    gamma_2 = gamma * gamma
    gamma_4 = gamma_2 * gamma_2
    has_advantages = advantages.shape[0] > 0
    line = _blocks_per_line(rewards)
    t = valid_end
    if gamma == 0.0 or power != 0.0:
        while t >= _U8:
            i = start + t - _U8
            if (t >> _U3) & line == 0:  # src/rows.h ppo_prefetch_behind, the twin's
                behind = i - _PREFETCH_DISTANCE  # below 0: wraps to the same address
                _prefetch(rewards, behind)
                _prefetch_for_write(returns, behind)
                if has_advantages:
                    _prefetch_for_write(advantages, behind)
                if has_mask and (t >> _U3) & np.uint64(7) == 0:
                    _prefetch(mask, behind)
            scanned = False
            if not has_mask or _all_valid(mask, i):
                block_rewards = _lanes_load(rewards, i)
                if abs(running) <= _RUNNING_BOUND and _lanes_bounded(block_rewards, _ERROR_BOUND):
                    # the suffix returns a_j by the log-step scan, then G_j = fma(gamma^(8-j),
                    # G_8, a_j) lane by lane (the twin's ppo_returns_block)
                    sums = _lanes_fma(gamma, _lanes_down1_fill(block_rewards, 0.0), block_rewards)
                    sums = _lanes_fma(gamma_2, _lanes_down2(sums), sums)
                    sums = _lanes_fma(gamma_4, _lanes_down4(sums), sums)
                    block = _lanes_fma_by(powers, running, sums)
                    running = _lane(block, 0)
                    _lanes_store(returns, i, block)
                    if has_advantages:
                        _lanes_store(advantages, i, _lanes_sub(block, baselines))
                    scanned = True
            if not scanned:  # a hole among the 8, or outside the scan's bounds: the recursion
                for k in range(_U8):
                    j = i + _U8 - _U1 - k
                    if not has_mask or mask[j] != 0:
                        running = fma(gamma, running, np.float64(rewards[j]))
                        returns[j] = running
                        if advantages.shape[0] > 0:
                            advantages[j] = running - baseline
                    else:
                        returns[j] = 0.0
                        if advantages.shape[0] > 0:
                            advantages[j] = 0.0
            t -= _U8
    for k in range(t):
        i = start + t - _U1 - k
        if not has_mask or mask[i] != 0:
            running = fma(gamma, running, np.float64(rewards[i]))
            returns[i] = running
            if advantages.shape[0] > 0:
                advantages[i] = running - baseline
        else:
            returns[i] = 0.0
            if advantages.shape[0] > 0:
                advantages[i] = 0.0


def discounted_returns(rewards, starts, spans, lengths, mask, gammas, bootstrap, returns):
    """Twin: src/rows_returns.h ppo_discounted_returns_row (see _returns_row)."""
    has_mask = mask.shape[0] > 0
    no_advantages = returns[:0]
    n_rows = starts.shape[0]
    for k in prange(n_rows):
        b = n_rows - 1 - k  # the rows from the last (_spec.Kernel.backwards says why)
        _returns_row(
            rewards, np.uint64(starts[b]), np.uint64(spans[b]), np.uint64(lengths[b]), mask,
            has_mask, gammas[b], bootstrap[b], 0.0, no_advantages, returns,
        )  # fmt: skip


def remax(rewards, starts, spans, lengths, mask, gammas, bootstrap, baselines, advantages, returns):
    """Twin: src/rows_returns.h ppo_remax_row: discounted_returns' rows, and the advantages."""
    has_mask = mask.shape[0] > 0
    n_rows = starts.shape[0]
    for k in prange(n_rows):
        b = n_rows - 1 - k  # the rows from the last, as discounted_returns
        _returns_row(
            rewards, np.uint64(starts[b]), np.uint64(spans[b]), np.uint64(lengths[b]), mask,
            has_mask, gammas[b], bootstrap[b], baselines[b], advantages, returns,
        )  # fmt: skip


@_jit
def _valid_prefix(mask, has_mask, start, count):
    """Twin: src/rows_returns.h ppo_valid_prefix. Whether a row's valid tokens are its first
    ``count`` positions."""
    if not has_mask:
        return True
    valid = np.uint64(0)
    for i in range(start, start + count):
        valid += np.uint64(mask[i] != 0)
    return valid == count


@_without_refcounts
def _returns_in_place(r, n, gamma, running, mask):
    """Twin: src/rows_returns.h ppo_returns_in_place: _returns_row on n contiguous float64
    rewards without a mask (``mask``: an empty uint8 array), in place. Compiled once and left
    to LLVM to inline, not inlined into numba's IR as _jit's helpers: numba copied its block
    scan into the optimal token baseline at each of its three calls (the returns of the row
    and of the weights), and typed each copy, 2.8 s of that kernel's 7.1 s first call (now 4.3
    s; float32, 3 x 9, Intel Xeon); the same bits, and the same time per call (1024 x 1024 in
    groups of 8 rows: 0.91-0.92x Cython's time, 0.95-0.96 before, within this VM's noise)."""
    _returns_row(r, np.uint64(0), n, n, mask[:0], False, gamma, running, 0.0, r[:0], r)


@_jit
def _valid_returns(rewards, mask, prefix, start, valid_end, count, gamma, bootstrap, row_returns):
    """Twin: src/rows_returns.h ppo_valid_returns. The returns of a row's valid tokens back to
    back: gathered (a copy for a prefix), then _returns_in_place."""
    if prefix:
        for k in range(count):
            row_returns[k] = np.float64(rewards[start + k])
    else:
        k = np.uint64(0)
        for i in range(start, start + valid_end):
            if mask[i] != 0:
                row_returns[k] = np.float64(rewards[i])
                k += _U1
    _returns_in_place(row_returns, count, gamma, bootstrap, mask)


@_jit
def _baseline_sums(
    rewards, old_logprobs, sum_pi_squared, is_weights, has_is_weights, mask, prefix, start,
    valid_end, count, reached, gamma, bootstrap, row_returns, exps, cumulatives, numerators,
    denominators,
):  # fmt: skip
    """Twin: src/rows_returns.h ppo_baseline_sums (whose comment says how)."""
    _valid_returns(rewards, mask, prefix, start, valid_end, count, gamma, bootstrap, row_returns)
    reach = reached if prefix else valid_end  # the exps read below
    constants = exp_constants(0.0)
    for k in range(reach):
        exps[k] = _exp64_with(np.float64(old_logprobs[start + k]), constants)
    if prefix:
        for k in range(reached):
            weight = 1.0 - 2.0 * exps[k]
            exps[k] = weight + np.float64(sum_pi_squared[start + k])
        if has_is_weights:
            for k in range(reached):
                is_weight = np.float64(is_weights[start + k])
                exps[k] = exps[k] * (is_weight * is_weight)
    else:
        k = np.uint64(0)
        i = start
        while k < reached:
            if mask[i] != 0:
                weight = 1.0 - 2.0 * exps[i - start]
                weight = weight + np.float64(sum_pi_squared[i])
                if has_is_weights:
                    is_weight = np.float64(is_weights[i])
                    weight = weight * (is_weight * is_weight)
                exps[k] = weight
                k += _U1
            i += _U1
    for k in range(reached):
        cumulatives[reached - _U1 - k] = exps[k]
    _returns_in_place(cumulatives, reached, 1.0, 0.0, mask)
    for k in range(reached):
        exps[k] = cumulatives[reached - _U1 - k]
    for k in range(reached):
        numerators[k] = numerators[k] + row_returns[k] * exps[k]
        denominators[k] = denominators[k] + exps[k]


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
):
    """Twin: src/rows_returns.h ppo_optimal_token_baseline_group (whose comment says why the
    chains run as block scans on the gathered valid tokens). prange over groups; a group's sums
    run over its rows in order, in a float64 scratch of 4 x its longest row's valid tokens (the
    baseline's numerators and denominators by valid-token index, one row's returns and
    cumulative weights), and one row's exp(old_logprobs) by position, computed first in a loop
    LLVM vectorizes (the kernels' exp, _exp64: math.exp is a call per token). The scratch is
    one buffer for the call, of 5 x its longest span (a group's needs at most), and the groups
    run in ``_otb_groups``, compiled without refcounts: an allocation and the reference counts
    of its slices a group cost about 1 us of a group of 8 rows of 128 (1.4x the twin's time).
    """
    widest = 0
    for b in range(spans.shape[0]):
        widest = max(widest, spans[b])
    buffer = np.empty(5 * widest)
    _otb_groups(
        rewards, old_logprobs, sum_pi_squared, is_weights, starts, spans, lengths, mask,
        group_rows, group_starts, gammas, bootstrap, eps, zero_tail, advantages, returns, buffer,
    )  # fmt: skip


@_without_refcounts
def _otb_groups(
    rewards, old_logprobs, sum_pi_squared, is_weights, starts, spans, lengths, mask, group_rows,
    group_starts, gammas, bootstrap, eps, zero_tail, advantages, returns, buffer,
):  # fmt: skip
    """optimal_token_baseline's groups, its scratch in ``buffer``."""
    has_mask = mask.shape[0] > 0
    has_is_weights = is_weights.shape[0] > 0
    for g in range(group_starts.shape[0] - 1):
        first = group_starts[g]
        end = group_starts[g + 1]
        # The longest and second-longest rows (by valid tokens) and how many are that long.
        longest = np.uint64(0)
        second = np.uint64(0)
        n_longest = 0
        n_reaching = 0
        widest = np.uint64(0)  # the longest valid extent (positions before the length)
        for j in range(first, end):
            b = group_rows[j]
            widest = max(widest, min(np.uint64(lengths[b]), np.uint64(spans[b])))
            count = _valid_count(
                np.uint64(starts[b]), np.uint64(spans[b]), np.uint64(lengths[b]), mask, has_mask
            )
            if count == 0:
                continue
            n_reaching += 1
            if count > longest:
                second = longest
                longest = count
                n_longest = 1
            elif count == longest:
                n_longest += 1
            elif count > second:
                second = count
        if n_reaching < 2:
            baseline_end = np.uint64(0)
        elif zero_tail != 0 and n_longest == 1:
            baseline_end = second
        else:
            baseline_end = longest
        scratch = buffer[: np.uint64(4) * longest]
        exps = buffer[np.uint64(4) * longest : np.uint64(4) * longest + widest]
        numerators = scratch[:baseline_end]
        denominators = scratch[longest : longest + baseline_end]
        row_returns = scratch[np.uint64(2) * longest : np.uint64(3) * longest]
        cumulatives = scratch[np.uint64(3) * longest :]
        numerators[:] = 0.0
        denominators[:] = 0.0
        for j in range(first, end):
            b = group_rows[j]
            start = np.uint64(starts[b])
            valid_end = min(np.uint64(lengths[b]), np.uint64(spans[b]))
            count = _valid_count(start, np.uint64(spans[b]), np.uint64(lengths[b]), mask, has_mask)
            reached = min(count, baseline_end)  # the tokens summed
            if reached > 0:
                _baseline_sums(
                    rewards, old_logprobs, sum_pi_squared, is_weights, has_is_weights, mask,
                    _valid_prefix(mask, has_mask, start, count), start, valid_end, count,
                    reached, gammas[b], bootstrap[b], row_returns, exps, cumulatives,
                    numerators, denominators,
                )  # fmt: skip
        for k in range(baseline_end):
            numerators[k] = numerators[k] / (denominators[k] + eps)
        baselines = numerators
        for j in range(first, end):
            b = group_rows[j]
            start = np.uint64(starts[b])
            span = np.uint64(spans[b])
            length = np.uint64(lengths[b])
            valid_end = min(length, span)
            count = _valid_count(start, span, length, mask, has_mask)
            based = min(count, baseline_end)
            prefix = _valid_prefix(mask, has_mask, start, count)
            if count > 0:
                _valid_returns(
                    rewards, mask, prefix, start, valid_end, count, gammas[b], bootstrap[b],
                    row_returns,
                )  # fmt: skip
            if prefix:
                for k in range(based):
                    advantages[start + k] = row_returns[k] - baselines[k]
                    returns[start + k] = row_returns[k]
                for k in range(based, count):
                    advantages[start + k] = row_returns[k] - 0.0
                    returns[start + k] = row_returns[k]
                for i in range(start + count, start + span):
                    advantages[i] = 0.0
                    returns[i] = 0.0
                continue
            k = np.uint64(0)
            for i in range(start, start + valid_end):
                if mask[i] != 0:
                    baseline = baselines[k] if k < baseline_end else 0.0
                    advantages[i] = row_returns[k] - baseline
                    returns[i] = row_returns[k]
                    k += _U1
                else:
                    advantages[i] = 0.0
                    returns[i] = 0.0
            for i in range(start + valid_end, start + span):
                advantages[i] = 0.0
                returns[i] = 0.0


def moments(x, starts, spans, lengths, mask, shift, counts, sums, sums_sq):
    """Twin: src/rows_moments.h ppo_moments_row, its order: token t of a row to lane t % 8 of
    float64 lanes (explicit vectors: the order is written here, not left to LLVM's vectorizer),
    added up in the fixed tree; the count an integer. The row's valid prefix only, prefetching
    _STREAM_AHEAD_BYTES ahead and across the padding into the next row (the twin says why)."""
    has_mask = mask.shape[0] > 0
    distance = np.uint64(_STREAM_AHEAD_BYTES // x.itemsize)
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = min(np.uint64(max(lengths[b], 0)), span)
        end = start + length
        shifts = _lanes_splat(shift)
        count = 0
        total = _lanes_splat(0.0)
        total_sq = total
        whole = start + length // _U8 * _U8
        for i in range(start, whole, _U8):
            if (i - start) % _PREFETCH_BLOCK == 0:
                ahead = _ahead_by(i, start, span, length, distance)
                _prefetch_ahead(x, x, x, x, False, mask, has_mask, ahead)  # one array: x
            centred = _lanes_sub(_lanes_load(x, i), shifts)
            squares = _lanes_mul(centred, centred)
            if has_mask:  # a masked lane keeps its sums (the twin's ppo_f64x8_add_where)
                valid = _valid_bytes(mask, i)
                count += _count_valid_lanes(valid)
                total = _lanes_where(valid, _lanes_add(total, centred), total)
                total_sq = _lanes_where(valid, _lanes_add(total_sq, squares), total_sq)
            else:
                count += 8
                total = _lanes_add(total, centred)
                total_sq = _lanes_add(total_sq, squares)
        tail_total = _lanes_splat(0.0)
        tail_total_sq = tail_total
        for i in range(whole, end):  # the last positions, fewer than 8, lane by lane
            if not has_mask or mask[i] != 0:
                centred_x = np.float64(x[i]) - shift
                count += 1
                tail_total = _with_lane(tail_total, i - whole, centred_x)
                tail_total_sq = _with_lane(tail_total_sq, i - whole, centred_x * centred_x)
        counts[b] = np.float64(count)
        sums[b] = _lane_total(_lanes_add(total, tail_total))
        sums_sq[b] = _lane_total(_lanes_add(total_sq, tail_total_sq))


def whiten(x, starts, spans, lengths, mask, mean, scale, offset, whitened):
    """Twin: src/rows_moments.h ppo_whiten_row (which says why each row, and the rows, run from
    their ends): the padding's zeros, the last positions past a multiple of 8 one by one, then
    the valid prefix down to the row's start 8 tokens at a time in float64 lanes, ((double)x -
    mean) * scale + offset rounded to the dtype at the store, 0 where masked, prefetching as the
    backward rows do (ppo_prefetch_behind)."""
    has_mask = mask.shape[0] > 0
    line = _blocks_per_line(x)
    n_rows = starts.shape[0]
    for k in prange(n_rows):
        b = n_rows - 1 - k  # the rows from the last (_spec.Kernel.backwards says why)
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = min(np.uint64(max(lengths[b], 0)), span)
        means = _lanes_splat(mean)
        scales = _lanes_splat(scale)
        offsets = _lanes_splat(offset)
        _zeros_backwards(whitened, whitened[:0], start + length, start + span)
        whole = length // _U8 * _U8
        for j in range(length - whole):
            i = start + length - _U1 - j
            value = (np.float64(x[i]) - mean) * scale + offset
            whitened[i] = _select(not has_mask or mask[i] != 0, value, 0.0)
        t = whole
        while t >= _U8:
            t -= _U8
            i = start + t
            if (i >> _U3) & line == 0:  # src/rows.h ppo_prefetch_behind, the twin's
                behind = i - _PREFETCH_DISTANCE  # below 0: wraps to the same address
                _prefetch(x, behind)
                _prefetch_for_write(whitened, behind)
                if has_mask and (i >> _U3) & np.uint64(7) == 0:
                    _prefetch(mask, behind)
            centred = _lanes_sub(_lanes_load(x, i), means)
            value = _lanes_add(_lanes_mul(centred, scales), offsets)
            if has_mask:  # a masked position gets +0.0
                value = _lanes_where_valid(mask, i, value)
            _lanes_store(whitened, i, value)


# The backend interface: one callable per kernel of the table, with the table's arguments.
# No kernel is built with `fastmath`: the losses add their sums in the C twins' lanes
# (_numba_lanes), and every other kernel's sums are written in its twin's order.
kl_penalty = _Specialised(_kl_penalty_rows, KERNELS["kl_penalty"])
shape_rewards = _Specialised(_shape_rewards_rows, KERNELS["shape_rewards"])
gae = _GAE(gae, _gae_chunked, KERNELS["gae"])
discounted_returns = _Kernel(discounted_returns, KERNELS["discounted_returns"])
remax = _Kernel(remax, KERNELS["remax"])
optimal_token_baseline = _Kernel(
    optimal_token_baseline, KERNELS["optimal_token_baseline"], allocates=True
)
moments = _Kernel(moments, KERNELS["moments"])
whiten = _Kernel(whiten, KERNELS["whiten"])
clipped_surrogate = _Kernel(clipped_surrogate, KERNELS["clipped_surrogate"])
value_loss = _Kernel(value_loss, KERNELS["value_loss"])
reinforce = _Kernel(reinforce, KERNELS["reinforce"])
cispo = _Kernel(cispo, KERNELS["cispo"])
sapo = _Kernel(sapo, KERNELS["sapo"])
gspo = _Kernel(gspo, KERNELS["gspo"])
geo_mean = _Kernel(geo_mean, KERNELS["geo_mean"])
dppo = _Kernel(dppo, KERNELS["dppo"])
kl_cov = _Kernel(kl_cov, KERNELS["kl_cov"])
kl_cov_top_k = _Kernel(kl_cov_top_k, KERNELS["kl_cov_top_k"], shared=_kl_cov_top_k_shared)


def row_totals(row_outputs):
    """The totals of the (k, B) float64 row outputs of a common case (``_backend.common``), each
    summed as ``row_output.sum()`` sums (0.0 plus NumPy's pairwise sum), as Python floats: the
    general way's ``loss._totals`` bit for bit. Twin: src/totals.h ppo_numpy_sum."""
    return _row_totals(row_outputs).tolist()


def common_scales(agg, normaliser, flat_mask, n_rows, width):
    """``_backend.common_scales`` compiled (``_numba_core._common_scales``; the one-thread
    entries write theirs into their own rows, ``_common_scales_into``): the common case's row
    scales on more than one thread, counted in a loop numba compiles (a ``np.count_nonzero`` a
    row, ``_rows.count_by_row``, took 0.51 ms at 1024 x 4096: numba's
    GSPO with seq-mean-token-mean on two threads 1.29x Cython's time, which counts in C)."""
    has_mask = flat_mask is not None
    return _common_scales(
        agg, normaliser, flat_mask if has_mask else _EMPTY_MASK, has_mask, n_rows, width
    )


def serial_common(name):
    """The one-thread entry for the common case of kernel ``name`` (a kernel with ``common``):
    ``_backend.common`` calls it when the thread policy gives one thread. None with the on-disk
    cache on (``PPO_FAST_NUMBA_CACHE=1``): the entry calls the serial build by address, which
    numba cannot cache, so every process would compile it again (0.3-1 s a kernel on its first
    call, against a few ms from the cache), undoing what the cache is for; the common case then
    calls the table kernel from Python (1.5-6 us more a call at 8 x 128)."""
    if _CACHE:
        return None
    return globals()[name].serial_common()


def serial_packed(name):
    """``serial_common`` for packed rows (``_backend.common(..., packed=True)``), None likewise
    with the on-disk cache on."""
    if _CACHE:
        return None
    return globals()[name].serial_packed()


def parallel_common(name, packed=False):
    """The entry for the common case of kernel ``name`` on several threads, padded or
    ``packed``: ``_backend.common`` calls it when the thread policy gives more than one thread
    (``_numba_builds._Kernel.parallel_common``). None with the on-disk cache on, as
    ``serial_common``."""
    if _CACHE:
        return None
    return globals()[name].parallel_common(packed)


def serial_table_kernel(name, code=None):
    """The one-thread build of table kernel ``name`` as one compiled function of the table's
    arguments, n_threads (1) last, or None where there is none: ``_backend.table_kernel`` calls
    it for a fast path on one thread, through its exact entry. KL-Cov's selection has one: the
    serial build of its shared source, ``_kl_cov_top_k_serial``, whose last argument, the ranges
    of rows a group is cut into, is the table's n_threads (one thread, one range), where the
    table kernel is two Python functions around it (``_Kernel``'s call and ``kl_cov_top_k``).
    A kernel built per estimator has one per ``code`` (``_Specialised.serial_table``), but with
    the on-disk cache on (it calls by address, which numba cannot cache: see
    ``serial_common``). The other kernels' serial builds take the table's arguments without
    n_threads; their fast paths call ``_backend.common``."""
    if name == "kl_cov_top_k":
        return _kl_cov_top_k_serial
    kernel = globals().get(name)
    if isinstance(kernel, _Specialised) and code is not None and not _CACHE:
        return kernel.serial_table(code)
    return None


def exact_entry(dispatcher, arguments):
    """The compiled wrapper (numba's ``entry_point``) of the overload of ``dispatcher`` that
    ``arguments`` select by their numba types, or None where no overload has exactly those
    types. It unboxes each argument as the overload's type says, without typing it first, so
    it may only be called with arguments of those types: ``_backend.common`` calls it for the
    fast paths, whose checks fix every argument's type."""
    overload = dispatcher.overloads.get(tuple(map(dispatcher.typeof_pyval, arguments)))
    return None if overload is None else overload.entry_point
