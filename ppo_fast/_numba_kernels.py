"""The numba backend: one @njit kernel per stage, written over rows, and the backend interface
(one callable per kernel of the table, at the bottom).

Signatures and semantics are those of the oracle, ``_reference.py``; each kernel names its
Cython twin in ``src/``. The conventions that keep them fast and exact, the intrinsics and the
serial/parallel builders in ``_numba_builds.py``; the losses in ``_numba_losses.py``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba_builds import _Kernel, _Specialised
from ._numba_core import (
    _U1,
    _all_valid,
    _called,
    _exp64,
    _jit,
    _lane,
    _lanes_add,
    _lanes_bounded,
    _lanes_down1_fill,
    _lanes_down2,
    _lanes_down4,
    _lanes_fma,
    _lanes_fma_by,
    _lanes_load,
    _lanes_splat,
    _lanes_store,
    _lanes_sub,
    _mask_word,
    _prefer_wide_vectors,
    _row_totals,
    _select,
    _td_errors,
    _valid_count,
    _with_lane,
    fma,
)
from ._numba_losses import (
    cispo,
    clipped_surrogate,
    dppo,
    geo_mean,
    gspo,
    kl_cov,
    reinforce,
    sapo,
    value_loss,
)
from ._spec import ESTIMATORS, KERNELS

K1, K2, K3, ABS = (ESTIMATORS.index(name) for name in ("k1", "k2", "k3", "abs"))
_U7, _U8 = np.uint64(7), np.uint64(8)
# GAE's long rows (_spec.GAE_CHUNKS), as constants.
_GAE_LONG_ROW = np.uint64(KERNELS["gae"].chunks.long_row)
_GAE_CHUNK = np.uint64(KERNELS["gae"].chunks.size)


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
            for t in range(np.uint64(spans[b])):
                i = start + t
                log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                kl[i] = kl_value(log_ratio, code, clamp)

    return kl_penalty


def _shape_rewards_rows(code):
    """Twin: src/rows_kl.h ppo_shape_rewards_row, built for the estimator `code` (see
    _kl_penalty_rows)."""

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
            last = start + span  # one past the row when it has no valid position
            for k in range(span):
                t = span - _U1 - k
                if t < length and (not has_mask or mask[start + t] != 0):
                    last = start + t
                    break
            score = np.float64(scores[b])
            # Every position computed and validity selecting, one loop per mask case (a branch
            # per token kept LLVM from vectorizing the loop: 2.1x slower than the C twin).
            if has_mask:
                for t in range(span):
                    i = start + t
                    log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                    reward = -kl_coef * kl_value(log_ratio, code, clamp)
                    reward += _select(i == last, score, 0.0)
                    rewards[i] = _select((t < length) & (mask[i] != 0), reward, 0.0)
            else:
                for t in range(span):
                    i = start + t
                    log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                    reward = -kl_coef * kl_value(log_ratio, code, clamp)
                    reward += _select(i == last, score, 0.0)
                    rewards[i] = _select(t < length, reward, 0.0)

    return shape_rewards


@_jit
def _gae_run(rewards, values, i, gamma, gamma_lam, next_value, running, advantages, returns):
    """One valid position by the plain recursion: (the value there, the running advantage)."""
    value = np.float64(values[i])
    delta = fma(gamma, next_value, np.float64(rewards[i])) - value
    running = fma(gamma_lam, running, delta)
    advantages[i] = running
    returns[i] = running + value
    return value, running


_RUNNING_BOUND = 2.0**1020
_ERROR_BOUND = 2.0**1000


@_jit
def _gae_scan(block_rewards, block_values, next_value, running, gamma, scan):
    """Twin: src/rows_gae.h ppo_gae_block, whose comment has the algebra and the bounds. The
    advantages of a block of 8 valid positions (lane 7 the last) by the log-step scan: (whether
    the block is within the bounds, the advantages, the running advantage at lane 0)."""
    gamma_lam, gl_2, gl_4, gl_8, powers = scan
    errors = _lanes_sub(
        _lanes_fma(gamma, _lanes_down1_fill(block_values, next_value), block_rewards),
        block_values,
    )
    if not abs(running) <= _RUNNING_BOUND or not _lanes_bounded(errors, _ERROR_BOUND):
        return False, errors, running
    sums = _lanes_fma(gamma_lam, _lanes_down1_fill(errors, 0.0), errors)
    sums = _lanes_fma(gl_2, _lanes_down2(sums), sums)
    sums = _lanes_fma(gl_4, _lanes_down4(sums), sums)
    block = _lanes_fma_by(powers, running, sums)
    return True, block, fma(gl_8, running, _lane(sums, 0))


@_jit
def _gae_span(
    rewards, values, start, low, high, length, mask, has_mask, gamma, gamma_lam, next_value,
    running, advantages, returns,
):  # fmt: skip
    """Twin: src/rows_gae.h ppo_gae_span. Positions low .. high-1 of the row at start, backwards,
    from the value after them and the running advantage there: each run of adjacent valid
    positions in blocks of 8 by the scan (_gae_scan), counted from the run's last position; the
    run's first positions that fill no block, and a block outside the scan's bounds, by the
    plain recursion."""
    end = max(min(high, length), low)
    for k in range(high - end):
        i = start + high - _U1 - k
        advantages[i] = 0.0
        returns[i] = 0.0
    c = gamma_lam
    c2 = c * c
    c3 = c2 * c
    c4 = c2 * c2
    c8 = c4 * c4
    powers = _with_lane(_lanes_splat(c), 0, c8)
    powers = _with_lane(powers, 1, c4 * c3)
    powers = _with_lane(powers, 2, c4 * c2)
    powers = _with_lane(powers, 3, c4 * c)
    powers = _with_lane(powers, 4, c4)
    powers = _with_lane(powers, 5, c3)
    powers = _with_lane(powers, 6, c2)
    scan = (c, c2, c4, c8, powers)
    blocks = c == 0.0 or c8 != 0.0
    t = end
    while t > low:
        if blocks and t - low >= _U8 and (not has_mask or _all_valid(mask, start + t - _U8)):
            i = start + t - _U8
            block_values = _lanes_load(values, i)
            scanned, block, block_running = _gae_scan(
                _lanes_load(rewards, i), block_values, next_value, running, gamma, scan
            )
            if scanned:
                _lanes_store(advantages, i, block)
                _lanes_store(returns, i, _lanes_add(block, block_values))
                next_value = _lane(block_values, 0)
                running = block_running
            else:
                for j in range(_U8):
                    next_value, running = _gae_run(
                        rewards, values, i + _U7 - j, gamma, gamma_lam, next_value, running,
                        advantages, returns,
                    )  # fmt: skip
            t -= _U8
        elif has_mask:
            # A hole among the 8 positions below t, or fewer than 8 left: the valid positions
            # down to the highest hole by the recursion, then the hole (ppo_gae_span's comment).
            while t > low:
                t -= _U1
                i = start + t
                if mask[i] == 0:
                    advantages[i] = 0.0
                    returns[i] = 0.0
                    break
                next_value, running = _gae_run(
                    rewards, values, i, gamma, gamma_lam, next_value, running, advantages,
                    returns,
                )  # fmt: skip
        else:
            t -= _U1
            next_value, running = _gae_run(
                rewards, values, start + t, gamma, gamma_lam, next_value, running, advantages,
                returns,
            )  # fmt: skip


@_jit
def _power(base, exponent):
    """base ** exponent for an unsigned integer exponent, by squaring (the same operations as the
    twin's, src/rows_gae.h ppo_power, where pow() would round as its libm does)."""
    result = 1.0
    while exponent != 0:
        if exponent & _U1:
            result = result * base
        base = base * base
        exponent = exponent >> _U1
    return result


@_jit
def _gae_chunks(span, length):
    """The chunks of a row: 0 when it runs whole (GAE_LONG_ROW positions of valid extent or
    fewer), else its valid extent min(length, span) cut every GAE_CHUNK positions."""
    valid_end = min(length, span)
    if valid_end <= _GAE_LONG_ROW:
        return np.uint64(0)
    return (valid_end + _GAE_CHUNK - _U1) // _GAE_CHUNK


@_called
def _gae_summary(rewards, values, start, low, high, mask, has_mask, gamma, gamma_lam):
    """Twin: src/rows_gae.h ppo_gae_summary. Pass 1 of a chunk, positions low .. high-1 (all
    within the row's valid extent), reading only: (its valid count m, the index of its last valid
    position, the value at its first one, and L, the advantage at its first valid position by
    the recursion over all but its last valid position, seeded with 0 there). Then for any
    advantage A_m at the last valid position, the one at the first is L + (gamma lam)^(m-1) A_m.

    The recursion is linear and nothing is written, so a run of blocks of 8 valid positions
    goes without its chain: lane j holds the sum over the run's blocks of (gamma lam)^(8k) times
    the TD error at position j of the k-th block from the run's start (Horner in (gamma lam)^8,
    eight independent lanes in one vector), and the run is then folded into the running value
    (_gae_carry). Not when (gamma lam)^8 underflows to 0 for a gamma lam > 0: a product by it
    would make an inf NaN where the recursion keeps it. Blocks with a masked position take the
    plain recursion, and blocks with no valid position are skipped."""
    end = high  # the search for the last valid position skips masked words
    while has_mask and end - low >= _U8 and _mask_word(mask, start + end - _U8) == 0:
        end -= _U8
    last = high
    for k in range(end - low):
        if not has_mask or mask[start + end - _U1 - k] != 0:
            last = end - _U1 - k
            break
    if last == high:
        return np.uint64(0), start, 0.0, 0.0
    gl_2 = gamma_lam * gamma_lam
    gl_4 = gl_2 * gl_2
    gl_8 = gl_4 * gl_4
    next_value = np.float64(values[start + last])
    running = 0.0
    count = _U1
    t = last
    blocks = gamma_lam == 0.0 or gl_8 != 0.0
    while t - low >= _U8:
        i = start + t - _U8
        if has_mask and not _all_valid(mask, i):
            if _mask_word(mask, i) != 0:
                for j in range(_U8):
                    position = i + _U8 - _U1 - j
                    if mask[position] != 0:
                        value = np.float64(values[position])
                        delta = fma(gamma, next_value, np.float64(rewards[position])) - value
                        running = fma(gamma_lam, running, delta)
                        next_value = value
                        count += _U1
            t -= _U8
            continue
        if not blocks:
            break
        # A run of valid blocks from the one at i down. The lanes' TD errors take the value at
        # the next position, values[i + 8] for the run's first block too (t <= last: in the row),
        # but that block's position 7 takes the value after it, which may lie past a hole.
        last_error = fma(gamma, next_value, np.float64(rewards[i + _U7])) - np.float64(
            values[i + _U7]
        )
        lanes = _with_lane(_td_errors(rewards, values, i, gamma), 7, last_error)
        n_blocks = _U1
        t -= _U8
        while t - low >= _U8 and (not has_mask or _all_valid(mask, start + t - _U8)):
            i = start + t - _U8
            lanes = _lanes_fma(gl_8, lanes, _td_errors(rewards, values, i, gamma))
            n_blocks += _U1
            t -= _U8
        pair_3 = fma(gamma_lam, _lane(lanes, 7), _lane(lanes, 6))
        pair_2 = fma(gamma_lam, _lane(lanes, 5), _lane(lanes, 4))
        pair_1 = fma(gamma_lam, _lane(lanes, 3), _lane(lanes, 2))
        pair_0 = fma(gamma_lam, _lane(lanes, 1), _lane(lanes, 0))
        folded = fma(gl_4, fma(gl_2, pair_3, pair_2), fma(gl_2, pair_1, pair_0))
        running = _gae_carry(running, _power(gl_8, n_blocks), gamma_lam, folded)
        next_value = np.float64(values[i])
        count += _U8 * n_blocks
    for k in range(t - low):
        i = start + t - _U1 - k
        if not has_mask or mask[i] != 0:
            value = np.float64(values[i])
            delta = fma(gamma, next_value, np.float64(rewards[i])) - value
            running = fma(gamma_lam, running, delta)
            next_value = value
            count += _U1
    return count, start + last, next_value, running


@_jit
def _gae_carry(carry, factor, gamma_lam, local):
    """fma(factor, carry, local): the advantage before a stretch of the row from the one after
    it (carry), where factor = (gamma lam)^(the stretch's valid positions) and local is the
    stretch's own sum. The factor may underflow to 0 for a gamma lam > 0, where the recursion
    would carry an inf on (inf times a positive number is inf): an inf or NaN carry then goes
    with the factor 1, which gives what the recursion gives (with local finite, the inf; with
    the opposite inf or NaN, NaN)."""
    if factor == 0.0 and gamma_lam > 0.0 and not math.isfinite(carry):
        factor = 1.0
    return fma(factor, carry, local)


@_called
def _gae_seed(
    rewards, values, count, last, first_value, local, gamma, gamma_lam, next_value, carry
):
    """Twin: src/rows_gae.h ppo_gae_seed. The combine step, right to left: from a chunk's summary
    (_gae_summary) and the (next value, running advantage) after the chunk, those before it.
    The advantage at the chunk's last valid position is the recursion's own step there, the one
    at its first L + (gamma lam)^(count-1) times it (_gae_carry)."""
    if count == 0:
        return next_value, carry
    value = np.float64(values[last])
    at_last = fma(gamma_lam, carry, fma(gamma, next_value, np.float64(rewards[last])) - value)
    return first_value, _gae_carry(at_last, _power(gamma_lam, count - _U1), gamma_lam, local)


@_called
def _gae_units(starts, spans, lengths, n_chunks):
    """The units of a batch with long rows, in row order: for each, its row and its chunk (-1
    for a row that runs whole), and the units pass 1 summarises (every chunk but a row's first)."""
    n_rows = starts.shape[0]
    n_units = n_chunks
    for b in range(n_rows):
        if _gae_chunks(np.uint64(spans[b]), np.uint64(lengths[b])) == 0:
            n_units += _U1
    unit_rows = np.empty(n_units, np.int64)
    unit_chunks = np.empty(n_units, np.int64)
    summarised = np.empty(n_chunks, np.int64)
    unit = 0
    n_summarised = 0
    for b in range(n_rows):
        chunks = _gae_chunks(np.uint64(spans[b]), np.uint64(lengths[b]))
        for c in range(max(chunks, _U1)):
            unit_rows[unit] = b
            unit_chunks[unit] = np.int64(c) if chunks != 0 else np.int64(-1)
            if c > 0:
                summarised[n_summarised] = unit
                n_summarised += 1
            unit += 1
    return unit_rows, unit_chunks, summarised[:n_summarised]


@_called
def _gae_seeds(rewards, values, gammas, lams, bootstrap, unit_rows, summaries, seeds):
    """The serial pass: each row's units right to left, a unit's seed (the value after it and
    the running advantage there) from the unit after it (_gae_seed); a row's last unit gets the
    row's bootstrap and 0."""
    for k in range(unit_rows.shape[0]):
        u = unit_rows.shape[0] - 1 - k
        b = unit_rows[u]
        if u + 1 == unit_rows.shape[0] or unit_rows[u + 1] != b:
            seeds[u, 0] = bootstrap[b]
            seeds[u, 1] = 0.0
        else:
            gamma = gammas[b]
            seeds[u, 0], seeds[u, 1] = _gae_seed(
                rewards, values, np.uint64(summaries[u + 1, 0]), np.uint64(summaries[u + 1, 1]),
                summaries[u + 1, 2], summaries[u + 1, 3], gamma, gamma * lams[b],
                seeds[u + 1, 0], seeds[u + 1, 1],
            )  # fmt: skip


def gae(
    rewards, values, starts, spans, lengths, mask, gammas, lams, bootstrap, advantages, returns
):
    """Twin: src/rows_gae.h ppo_gae_rows. The running state is float64 whatever the input dtype.

    A row runs whole (_gae_span), unless its valid extent is longer than
    GAE_LONG_ROW positions. A batch without such a row runs here; one with them is left to
    _gae_chunked (this returns its number of chunks, 0 when it has run): compiled apart, on
    first use, so that the common kernel compiles as fast as before."""
    n_rows = starts.shape[0]
    n_chunks = np.uint64(0)
    for b in range(n_rows):
        n_chunks += _gae_chunks(np.uint64(spans[b]), np.uint64(lengths[b]))
    if n_chunks != 0:
        return n_chunks
    has_mask = mask.shape[0] > 0
    for b in prange(n_rows):
        _prefer_wide_vectors()
        gamma = gammas[b]
        _gae_span(
            rewards, values, np.uint64(starts[b]), np.uint64(0), np.uint64(spans[b]),
            np.uint64(lengths[b]), mask, has_mask, gamma, gamma * lams[b], bootstrap[b], 0.0,
            advantages, returns,
        )  # fmt: skip
    return n_chunks


def _gae_chunked(
    rewards, values, starts, spans, lengths, mask, gammas, lams, bootstrap, advantages, returns
):
    """gae for a batch with long rows: they are cut into chunks of GAE_CHUNK positions (fixed
    by the row, never by the threads), and the work units are the other rows and these chunks,
    in row order. Pass 1 summarises every chunk but each row's first (_gae_summary), a serial
    pass combines the summaries of each row right to left into each chunk's seed (_gae_seeds),
    and pass 2 runs the recursion over each unit from its seed (_gae_span). A row that runs
    whole, and a row's last chunk, are seeded with the row's bootstrap and 0, as the recursion
    is; the seeds of the other chunks are the combined summaries, within a few ulp of the
    recursion's own values. The helpers outside the prange bodies are compiled on their own
    (_called), once for both builds."""
    has_mask = mask.shape[0] > 0
    n_chunks = np.uint64(0)
    for b in range(starts.shape[0]):
        n_chunks += _gae_chunks(np.uint64(spans[b]), np.uint64(lengths[b]))
    unit_rows, unit_chunks, summarised = _gae_units(starts, spans, lengths, n_chunks)
    n_units = unit_rows.shape[0]
    # Per unit: its valid count, the index of its last valid position, the value at its first
    # and its local advantage (the count and the index are exact in float64).
    summaries = np.zeros((n_units, 4))
    for s in prange(summarised.shape[0]):
        u = summarised[s]
        b = unit_rows[u]
        low = np.uint64(unit_chunks[u]) * _GAE_CHUNK
        high = min(low + _GAE_CHUNK, min(np.uint64(lengths[b]), np.uint64(spans[b])))
        count, last, first_value, local = _gae_summary(
            rewards, values, np.uint64(starts[b]), low, high, mask, has_mask, gammas[b],
            gammas[b] * lams[b],
        )  # fmt: skip
        summaries[u, 0] = np.float64(count)
        summaries[u, 1] = np.float64(last)
        summaries[u, 2] = first_value
        summaries[u, 3] = local
    seeds = np.empty((n_units, 2))
    _gae_seeds(rewards, values, gammas, lams, bootstrap, unit_rows, summaries, seeds)
    for u in prange(n_units):
        _prefer_wide_vectors()
        b = unit_rows[u]
        chunk = unit_chunks[u]
        low = np.uint64(0) if chunk < 0 else np.uint64(chunk) * _GAE_CHUNK
        row_ends = u + 1 == n_units or unit_rows[u + 1] != b
        high = np.uint64(spans[b]) if row_ends else low + _GAE_CHUNK
        gamma = gammas[b]
        _gae_span(
            rewards, values, np.uint64(starts[b]), low, high, np.uint64(lengths[b]), mask,
            has_mask, gamma, gamma * lams[b], seeds[u, 0], seeds[u, 1], advantages, returns,
        )  # fmt: skip


class _GAE:
    """The backend's gae: the kernel of batches without long rows, and the one of batches with
    them (compiled on the first such batch). ``kernels`` lists both, whose builds the tests
    check."""

    def __init__(self, whole_rows, chunked, kernel):
        self.function = whole_rows  # the Python source, for the interface test
        self.whole_rows = _Kernel(whole_rows, kernel, row_chunks=_gae_chunks)
        self.chunked = _Kernel(chunked)
        self.kernels = [self.whole_rows, self.chunked]

    def __call__(self, *args):
        if self.whole_rows(*args):
            self.chunked(*args)


@_jit
def _returns_row(
    rewards, start, span, length, mask, has_mask, gamma, running, baseline, advantages, returns
):
    """Twin: src/rows_returns.h ppo_returns_row. One row of discounted returns (and, when
    ``advantages`` is not empty, returns - baseline), float64 state.

    The recursion G = fma(gamma, G_next, r) is a chain of dependent fma, 4 cycles each: alone it
    holds a row to about 2.5 times the memory floor. So the valid prefix runs backwards in blocks
    of 8 positions: a block whose 8 positions are valid gets its own suffix returns a_j (a chain
    within the block, independent of the other blocks) and then G_j = fma(gamma^(8-j), G_8,
    a_j), which moves the row's chain 8 positions per fma. Other blocks (a masked position
    among the 8) and the row's first positions (fewer than 8) take the plain recursion. The
    float64 sums are thus associated per block: a few ulp from the oracle's recursion (a sum
    beyond float64's range may overflow in one order and not in the other). Blocks are not used
    when gamma^8 underflows to 0 for a gamma > 0: gamma^8 * inf would then be NaN where the
    recursion gives inf.
    """
    valid_end = min(length, span)
    for i in range(start + valid_end, start + span):
        returns[i] = 0.0
        if advantages.shape[0] > 0:
            advantages[i] = 0.0
    power_1 = gamma
    power_2 = gamma * power_1
    power_3 = gamma * power_2
    power_4 = gamma * power_3
    power_5 = gamma * power_4
    power_6 = gamma * power_5
    power_7 = gamma * power_6
    power_8 = gamma * power_7
    t = valid_end
    if gamma == 0.0 or power_8 != 0.0:
        while t >= _U8:
            i = start + t - _U8
            if not has_mask or _all_valid(mask, i):
                a_7 = np.float64(rewards[i + np.uint64(7)])
                a_6 = fma(gamma, a_7, np.float64(rewards[i + np.uint64(6)]))
                a_5 = fma(gamma, a_6, np.float64(rewards[i + np.uint64(5)]))
                a_4 = fma(gamma, a_5, np.float64(rewards[i + np.uint64(4)]))
                a_3 = fma(gamma, a_4, np.float64(rewards[i + np.uint64(3)]))
                a_2 = fma(gamma, a_3, np.float64(rewards[i + np.uint64(2)]))
                a_1 = fma(gamma, a_2, np.float64(rewards[i + _U1]))
                a_0 = fma(gamma, a_1, np.float64(rewards[i]))
                g_7 = fma(power_1, running, a_7)
                g_6 = fma(power_2, running, a_6)
                g_5 = fma(power_3, running, a_5)
                g_4 = fma(power_4, running, a_4)
                g_3 = fma(power_5, running, a_3)
                g_2 = fma(power_6, running, a_2)
                g_1 = fma(power_7, running, a_1)
                running = fma(power_8, running, a_0)
                returns[i + np.uint64(7)] = g_7
                returns[i + np.uint64(6)] = g_6
                returns[i + np.uint64(5)] = g_5
                returns[i + np.uint64(4)] = g_4
                returns[i + np.uint64(3)] = g_3
                returns[i + np.uint64(2)] = g_2
                returns[i + _U1] = g_1
                returns[i] = running
                if advantages.shape[0] > 0:
                    advantages[i + np.uint64(7)] = g_7 - baseline
                    advantages[i + np.uint64(6)] = g_6 - baseline
                    advantages[i + np.uint64(5)] = g_5 - baseline
                    advantages[i + np.uint64(4)] = g_4 - baseline
                    advantages[i + np.uint64(3)] = g_3 - baseline
                    advantages[i + np.uint64(2)] = g_2 - baseline
                    advantages[i + _U1] = g_1 - baseline
                    advantages[i] = running - baseline
            else:
                for k in range(_U8):
                    j = i + _U8 - _U1 - k
                    if mask[j] != 0:
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
    for b in prange(starts.shape[0]):
        _returns_row(
            rewards, np.uint64(starts[b]), np.uint64(spans[b]), np.uint64(lengths[b]), mask,
            has_mask, gammas[b], bootstrap[b], 0.0, no_advantages, returns,
        )  # fmt: skip


def remax(rewards, starts, spans, lengths, mask, gammas, bootstrap, baselines, advantages, returns):
    """Twin: src/rows_returns.h ppo_remax_row: discounted_returns' rows, and the advantages."""
    has_mask = mask.shape[0] > 0
    for b in prange(starts.shape[0]):
        _returns_row(
            rewards, np.uint64(starts[b]), np.uint64(spans[b]), np.uint64(lengths[b]), mask,
            has_mask, gammas[b], bootstrap[b], baselines[b], advantages, returns,
        )  # fmt: skip


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
    """Twin: src/rows_returns.h ppo_optimal_token_baseline_group. prange over groups; a group's
    sums run over its rows in order, in a float64 scratch of 3 x its longest row's valid tokens
    (the baseline's numerators and denominators by valid-token index, and one row's returns)."""
    has_mask = mask.shape[0] > 0
    has_is_weights = is_weights.shape[0] > 0
    for g in prange(group_starts.shape[0] - 1):
        first = group_starts[g]
        end = group_starts[g + 1]
        # The longest and second-longest rows (by valid tokens) and how many are that long.
        longest = np.uint64(0)
        second = np.uint64(0)
        n_longest = 0
        n_reaching = 0
        for j in range(first, end):
            b = group_rows[j]
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
        scratch = np.empty(np.uint64(3) * longest)
        numerators = scratch[:baseline_end]
        denominators = scratch[longest : longest + baseline_end]
        row_returns = scratch[np.uint64(2) * longest :]
        numerators[:] = 0.0
        denominators[:] = 0.0
        for j in range(first, end):
            b = group_rows[j]
            start = np.uint64(starts[b])
            valid_end = min(np.uint64(lengths[b]), np.uint64(spans[b]))
            gamma = gammas[b]
            running = bootstrap[b]
            # The row's returns by valid-token index, from the end of the scratch row back.
            slot = longest
            for k in range(valid_end):
                i = start + valid_end - _U1 - k
                if not has_mask or mask[i] != 0:
                    running = fma(gamma, running, np.float64(rewards[i]))
                    slot -= _U1
                    row_returns[slot] = running
            cumulative = 0.0
            index = np.uint64(0)
            for i in range(start, start + valid_end):
                if index == baseline_end:
                    break
                if not has_mask or mask[i] != 0:
                    weight = 1.0 - 2.0 * math.exp(np.float64(old_logprobs[i]))
                    weight = weight + np.float64(sum_pi_squared[i])
                    if has_is_weights:
                        is_weight = np.float64(is_weights[i])
                        weight = weight * (is_weight * is_weight)
                    cumulative = cumulative + weight
                    numerators[index] = numerators[index] + row_returns[slot + index] * cumulative
                    denominators[index] = denominators[index] + cumulative
                    index += _U1
        for k in range(baseline_end):
            numerators[k] = numerators[k] / (denominators[k] + eps)
        baselines = numerators
        for j in range(first, end):
            b = group_rows[j]
            start = np.uint64(starts[b])
            span = np.uint64(spans[b])
            length = np.uint64(lengths[b])
            valid_end = min(length, span)
            gamma = gammas[b]
            running = bootstrap[b]
            index = _valid_count(start, span, length, mask, has_mask)
            for i in range(start + valid_end, start + span):
                advantages[i] = 0.0
                returns[i] = 0.0
            for k in range(valid_end):
                i = start + valid_end - _U1 - k
                if not has_mask or mask[i] != 0:
                    running = fma(gamma, running, np.float64(rewards[i]))
                    index -= _U1
                    baseline = baselines[index] if index < baseline_end else 0.0
                    advantages[i] = running - baseline
                    returns[i] = running
                else:
                    advantages[i] = 0.0
                    returns[i] = 0.0


@_jit
def _weaker(key, position, other_key, other_position):
    """Whether (key, position) ranks below (other_key, other_position) in KL-Cov's top-k: a
    smaller key, or the same key at a later position."""
    return key < other_key or (key == other_key and position > other_position)


@_jit
def _sift_up(keys, positions, node):
    """Moves the token at ``node`` up the heap of KL-Cov's kept tokens to its place."""
    while node > 0:
        parent = (node - 1) // 2
        if not _weaker(keys[node], positions[node], keys[parent], positions[parent]):
            return
        keys[node], keys[parent] = keys[parent], keys[node]
        positions[node], positions[parent] = positions[parent], positions[node]
        node = parent


@_jit
def _sift_down(keys, positions, size, node):
    """Moves the token at ``node`` down the heap to its place (the weakest at the root)."""
    while True:
        weakest = node
        for child in (2 * node + 1, 2 * node + 2):
            if child < size and _weaker(
                keys[child], positions[child], keys[weakest], positions[weakest]
            ):
                weakest = child
        if weakest == node:
            return
        keys[node], keys[weakest] = keys[weakest], keys[node]
        positions[node], positions[weakest] = positions[weakest], positions[node]
        node = weakest


def kl_cov_top_k(
    logprobs, advantages, starts, spans, lengths, mask, group_rows, group_starts, ratio, selected
):
    """Twin: src/rows_covariance.h ppo_kl_cov_top_k_group. prange over groups. A first pass sums
    the group's valid tokens in order (float64, not reassociated: the means are the oracle's
    bits), a second keeps the k strongest tokens so far in a heap whose root is the weakest, so
    that almost every token costs one comparison; O(n log k), k scratch slots."""
    has_mask = mask.shape[0] > 0
    for g in prange(group_starts.shape[0] - 1):
        first = group_starts[g]
        end = group_starts[g + 1]
        count = 0
        total_adv = 0.0
        total_logp = 0.0
        for j in range(first, end):
            b = group_rows[j]
            start = np.uint64(starts[b])
            span = np.uint64(spans[b])
            valid_end = start + min(np.uint64(lengths[b]), span)
            for i in range(start, start + span):
                selected[i] = 0.0
            for i in range(start, valid_end):
                if not has_mask or mask[i] != 0:
                    count += 1
                    total_adv += np.float64(advantages[i])
                    total_logp += np.float64(logprobs[i])
        if count == 0:
            continue
        mean_adv = total_adv / count
        mean_logp = total_logp / count
        wanted = ratio * count
        k = count if wanted >= count else max(int(wanted), 1)
        keys = np.empty(k)
        positions = np.empty(k, dtype=np.int64)
        size = 0
        for j in range(first, end):
            b = group_rows[j]
            start = np.uint64(starts[b])
            valid_end = start + min(np.uint64(lengths[b]), np.uint64(spans[b]))
            for i in range(start, valid_end):
                if has_mask and mask[i] == 0:
                    continue
                key = (np.float64(advantages[i]) - mean_adv) * (np.float64(logprobs[i]) - mean_logp)
                if key != key:
                    key = -math.inf
                position = np.int64(i)
                if size < k:  # not full: the new token goes in, up to its place
                    keys[size] = key
                    positions[size] = position
                    _sift_up(keys, positions, size)
                    size += 1
                elif key >= keys[0] and _weaker(keys[0], positions[0], key, position):
                    keys[0] = key  # it displaces the weakest
                    positions[0] = position
                    _sift_down(keys, positions, size, 0)
        for m in range(size):
            selected[positions[m]] = 1.0


def moments(x, starts, spans, lengths, mask, shift, counts, sums, sums_sq):
    """Twin: src/rows_moments.h ppo_moments_row. Branch-free, with one loop per mask case and
    validity by ``&`` and ``_select`` (a short-circuit test or a conditional expression in the
    loop kept LLVM from vectorizing it: 2.4x slower), so that the `reassoc` build vectorizes the
    sums (a serial float64 sum is bound by the latency of its additions)."""
    has_mask = mask.shape[0] > 0
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        length = np.uint64(lengths[b])
        count = 0.0
        total = 0.0
        total_sq = 0.0
        if has_mask:
            for t in range(np.uint64(spans[b])):
                i = start + t
                valid = (t < length) & (mask[i] != 0)
                centred = np.float64(x[i]) - shift
                count += _select(valid, 1.0, 0.0)
                total += _select(valid, centred, 0.0)
                total_sq += _select(valid, centred * centred, 0.0)
        else:
            for t in range(np.uint64(spans[b])):
                valid = t < length
                centred = np.float64(x[start + t]) - shift
                count += _select(valid, 1.0, 0.0)
                total += _select(valid, centred, 0.0)
                total_sq += _select(valid, centred * centred, 0.0)
        counts[b] = count
        sums[b] = total
        sums_sq[b] = total_sq


def whiten(x, starts, spans, lengths, mask, mean, scale, offset, whitened):
    """Twin: src/rows_moments.h ppo_whiten_row, split as it is so that LLVM vectorizes it: the
    valid prefix with or without a mask (every position computed, the mask selecting), then the
    padding."""
    has_mask = mask.shape[0] > 0
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        valid_end = start + min(np.uint64(lengths[b]), span)
        if has_mask:
            for i in range(start, valid_end):
                value = (np.float64(x[i]) - mean) / scale + offset
                whitened[i] = _select(mask[i] != 0, value, 0.0)
        else:
            for i in range(start, valid_end):
                whitened[i] = (np.float64(x[i]) - mean) / scale + offset
        for i in range(valid_end, start + span):
            whitened[i] = 0.0


# The backend interface: one callable per kernel of the table, with the table's arguments.
# reassoc lets LLVM vectorize the row sums of the moments and loss kernels; nothing else in them
# reassociates.
kl_penalty = _Specialised(_kl_penalty_rows, KERNELS["kl_penalty"])
shape_rewards = _Specialised(_shape_rewards_rows, KERNELS["shape_rewards"])
gae = _GAE(gae, _gae_chunked, KERNELS["gae"])
discounted_returns = _Kernel(discounted_returns, KERNELS["discounted_returns"])
remax = _Kernel(remax, KERNELS["remax"])
optimal_token_baseline = _Kernel(optimal_token_baseline, KERNELS["optimal_token_baseline"])
moments = _Kernel(moments, KERNELS["moments"], fastmath={"reassoc"})
whiten = _Kernel(whiten, KERNELS["whiten"])
clipped_surrogate = _Kernel(clipped_surrogate, KERNELS["clipped_surrogate"], fastmath={"reassoc"})
value_loss = _Kernel(value_loss, KERNELS["value_loss"], fastmath={"reassoc"})
reinforce = _Kernel(reinforce, KERNELS["reinforce"], fastmath={"reassoc"})
cispo = _Kernel(cispo, KERNELS["cispo"], fastmath={"reassoc"})
sapo = _Kernel(sapo, KERNELS["sapo"], fastmath={"reassoc"})
gspo = _Kernel(gspo, KERNELS["gspo"], fastmath={"reassoc"})
# Not `reassoc`: with it LLVM regroups the row's -(sum A / n) * exp(...) * scale so that it
# overflows to inf where the oracle's gradient is finite (the hostile-input test's 1e200
# log-prob), and numba passes the flag on to any function the kernel calls.
geo_mean = _Kernel(geo_mean, KERNELS["geo_mean"])
dppo = _Kernel(dppo, KERNELS["dppo"], fastmath={"reassoc"})
kl_cov = _Kernel(kl_cov, KERNELS["kl_cov"], fastmath={"reassoc"})
kl_cov_top_k = _Kernel(kl_cov_top_k, KERNELS["kl_cov_top_k"])


def row_totals(row_outputs, weight):
    """The totals of the (k, B) float64 row outputs of a common case (``_backend.common``), the
    first weighted row by row by ``weight``, each summed as ``row_output.sum()`` sums (0.0 plus
    NumPy's pairwise sum), as Python floats: the general way's ``loss._totals`` bit for bit.
    Twin: src/totals.h ppo_numpy_sum."""
    return _row_totals(row_outputs, weight).tolist()
