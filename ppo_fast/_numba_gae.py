"""The numba backend's GAE: a row's recursion by blocks of 8 valid positions (_gae_span), and
the long rows cut into chunks that threads share (_gae_chunked). Twin: src/rows_gae.h. The
backend's callable (``_numba_kernels.gae``) is built from ``gae`` and ``_gae_chunked`` by
``_GAE``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba_builds import _Kernel
from ._numba_core import (
    _PREFETCH_DISTANCE,
    _U1,
    _U3,
    _U8,
    _all_valid,
    _blocks_per_line,
    _called,
    _jit,
    _mask_stop,
    _mask_word,
    _prefer_wide_vectors,
    _prefetch,
    _prefetch_for_write,
    fma,
)
from ._numba_lanes import (
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
    _td_errors,
    _with_lane,
    _zeros_backwards,
)
from ._spec import KERNELS

_U7 = np.uint64(7)
# GAE's long rows (_spec.GAE_CHUNKS), as constants.
_GAE_LONG_ROW = np.uint64(KERNELS["gae"].chunks.long_row)
_GAE_CHUNK = np.uint64(KERNELS["gae"].chunks.size)


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
    if has_mask:
        end = _mask_stop(mask, start, low, end)
    # The positions past the valid extent, and a mask's trailing words of 8 invalid bytes (a
    # right-padded row's padding): zeros, by blocks (the twin's comment says why)
    _zeros_backwards(advantages, returns, start + end, start + high)
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
    line = _blocks_per_line(rewards)
    t = end
    while t > low:
        if blocks and t - low >= _U8 and (not has_mask or _all_valid(mask, start + t - _U8)):
            i = start + t - _U8
            if (t >> _U3) & line == 0:  # src/rows.h ppo_prefetch_behind, the twin's
                behind = i - _PREFETCH_DISTANCE  # below 0: wraps to the same address
                _prefetch(rewards, behind)
                _prefetch(values, behind)
                _prefetch_for_write(advantages, behind)
                _prefetch_for_write(returns, behind)
                if has_mask and (t >> _U3) & _U7 == 0:
                    _prefetch(mask, behind)
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
    if has_mask:
        end = _mask_stop(mask, start, low, end)
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
    for k in prange(n_rows):
        _prefer_wide_vectors()
        b = n_rows - 1 - k  # the rows from the last (_spec.Kernel.backwards says why)
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
    # zeroed by a loop: under parallel=True np.zeros is a parallel loop, one more start of
    # the threads (_numba_covariance says what that costs)
    summaries = np.empty((n_units, 4))
    for u in range(n_units):
        for c in range(4):
            summaries[u, c] = 0.0
    # both parallel passes from the last unit, as gae's rows
    n_summarised = summarised.shape[0]
    for s in prange(n_summarised):
        u = summarised[n_summarised - 1 - s]
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
    for k in prange(n_units):
        _prefer_wide_vectors()
        u = n_units - 1 - k
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
        self.chunked = _Kernel(chunked, allocates=True)
        self.kernels = [self.whole_rows, self.chunked]
        # The common case has no long row (gae.py's fast path): the whole rows' entries.
        self.serial_common = self.whole_rows.serial_common
        self.serial_packed = self.whole_rows.serial_packed
        self.parallel_common = self.whole_rows.parallel_common

    def __call__(self, *args):
        if self.whole_rows(*args):
            self.chunked(*args)
