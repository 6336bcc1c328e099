"""The numba backend: one @njit kernel per stage, written over rows.

Signatures and semantics are those of the oracle, ``_reference.py``; each kernel names its
Cython twin in ``src/``. Conventions that keep them fast and exact:

- Compiled lazily at first call (no eager signatures), ``nogil``. Each kernel is built twice from
  the same source: serial, and ``parallel=True`` with ``prange`` over rows. Both do the same
  arithmetic per row and reduce per row, so results are identical bit for bit on any number of
  threads. Numba's default threading layer must not be entered from two Python threads at once
  (it aborts the process), so the parallel build runs under a lock and a call that finds the
  lock taken runs the serial build on its own thread instead. A kernel of the "groups" layout
  runs its prange over groups, each reduced on its own in row order: the same guarantee.
- Validity is tested inline with `has_mask` hoisted: through a helper function the
  short-circuit control flow stops LLVM from vectorizing the loss kernels (9x slower).
- Positions are indexed with unsigned integers, which removes numba's negative-index
  wrap-around check from the inner loops (worth about 1.3x on GAE).
- Multiply-adds on a dependency chain use an explicit ``llvm.fma``: one rounding, half the
  latency of a multiply then an add, and the same result whatever LLVM decides elsewhere
  (implicit contraction via fastmath could differ between the serial and parallel builds).
- The on-disk cache is off by default: numba issues #4807 and #7518 (cache races between
  processes). ``PPO_FAST_NUMBA_CACHE=1`` turns it on, with a warning naming them.
"""

from __future__ import annotations

import math
import os
import threading
import warnings

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic, overload

from ._spec import ESTIMATORS, EXP32, EXP64, KERNELS

_CACHE = os.environ.get("PPO_FAST_NUMBA_CACHE", "") == "1"
if _CACHE:
    warnings.warn(
        "PPO_FAST_NUMBA_CACHE=1: numba's on-disk cache can race when several processes compile "
        "at once (numba issues #4807 and #7518); unset it if you see corrupted-cache errors",
        RuntimeWarning,
        stacklevel=2,
    )

K1, K2, K3, ABS = (ESTIMATORS.index(name) for name in ("k1", "k2", "k3", "abs"))
_U1 = np.uint64(1)


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c with a single rounding (llvm.fma), in float32 or float64."""
    if not (a == b == c and a in (types.float32, types.float64)):
        return None
    signature = a(a, b, c)
    ir_type = ir.FloatType() if a == types.float32 else ir.DoubleType()

    def codegen(context, builder, sig, args):
        function = builder.module.declare_intrinsic(
            "llvm.fma", [ir_type], ir.FunctionType(ir_type, [ir_type] * 3)
        )
        return builder.call(function, args)

    return signature, codegen


@intrinsic
def _as_int_bits(typingctx, x):
    """The bits of a float as a signed integer of the same width."""
    if x not in (types.float32, types.float64):
        return None
    integer = types.int32 if x == types.float32 else types.int64

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(integer.bitwidth))

    return integer(x), codegen


@intrinsic
def _as_float_bits(typingctx, n):
    """The float whose bits are the integer n (int32 -> float32, int64 -> float64)."""
    if n not in (types.int32, types.int64):
        return None
    real = types.float32 if n == types.int32 else types.float64

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType() if n == types.int32 else ir.DoubleType())

    return real(n), codegen


def _jit(function):
    return numba.njit(nogil=True, cache=_CACHE, inline="always")(function)


# exp by range reduction and a polynomial, with the constants of the kernel table (_spec.EXP64 and
# _spec.EXP32, which the Cython build reads too): x = n ln2 + r, |r| <= ln2/2, exp(x) = 2^n p(r),
# with n rounded by the 1.5 * 2^(mantissa bits) shift trick and 2^n built from its exponent bits.
# All of it is plain arithmetic LLVM vectorizes (math.exp is a libm call that it cannot: PyPI's
# llvmlite has no SVML). Finite inputs are saturated so that 2^n stays a normal number: the result
# is finite for every finite input, within 2 ulp of exp in float64 and 1 ulp in float32
# (tests/test_loss.py); below exp(-708) (float64) or exp(-87.3) (float32) it returns that bound
# instead of a subnormal, above exp(709) or exp(88.3) that bound instead of overflowing. NaN, inf
# and -inf give NaN, inf and 0, as math.exp: a non-finite input is never made finite.
_F32 = np.float32
# numba reads globals as constants: plain numbers and tuples, not the table's records.
_E64_LOW, _E64_HIGH, _E64_SHIFT = EXP64.low, EXP64.high, EXP64.shift
_E64_LOG2E, _E64_LN2_HIGH, _E64_LN2_LOW = EXP64.log2e, EXP64.ln2_high, EXP64.ln2_low
_P64 = EXP64.polynomial
_F64_SHIFT_BITS = np.int64(np.float64(_E64_SHIFT).view(np.int64))
_E32_LOW, _E32_HIGH, _E32_SHIFT = _F32(EXP32.low), _F32(EXP32.high), _F32(EXP32.shift)
_E32_LOG2E, _E32_LN2_HIGH = _F32(EXP32.log2e), _F32(EXP32.ln2_high)
_E32_LN2_LOW = _F32(EXP32.ln2_low)
_P32 = tuple(_F32(c) for c in EXP32.polynomial)
_F32_SHIFT_BITS = np.int32(_E32_SHIFT.view(np.int32))


@_jit
def _exact_where_nonfinite(x, y):
    """y = exp(x) as computed, except where x is not finite: the saturation is for finite
    arguments only, and NaN, inf and -inf come out as math.exp's (NaN, inf, 0)."""
    y = y - y if x == -np.inf else y
    y = x if x == np.inf else y
    return y if x == x else x


@_jit
def _exp64(argument):
    x = min(max(argument, _E64_LOW), _E64_HIGH)
    shifted = fma(x, _E64_LOG2E, _E64_SHIFT)  # x / ln2 + shift
    n = shifted - _E64_SHIFT
    r = fma(-n, _E64_LN2_HIGH, x)  # ln2 in two parts: exact n * ln2_high
    r = fma(-n, _E64_LN2_LOW, r)
    p = fma(_P64[0], r, _P64[1])
    p = fma(p, r, _P64[2])
    p = fma(p, r, _P64[3])
    p = fma(p, r, _P64[4])
    p = fma(p, r, _P64[5])
    p = fma(p, r, _P64[6])
    p = fma(p, r, _P64[7])
    p = fma(p, r, _P64[8])
    p = fma(p, r, _P64[9])
    p = fma(p, r, _P64[10])
    p = fma(p, r, _P64[11])
    p = fma(p, r, _P64[12])
    exponent = _as_int_bits(shifted) - _F64_SHIFT_BITS
    power = _as_float_bits((exponent + np.int64(1023)) << np.int64(52))
    return _exact_where_nonfinite(argument, p * power)


@_jit
def _exp32(argument):
    x = min(max(argument, _E32_LOW), _E32_HIGH)
    shifted = fma(x, _E32_LOG2E, _E32_SHIFT)
    n = shifted - _E32_SHIFT
    r = fma(-n, _E32_LN2_HIGH, x)
    r = fma(-n, _E32_LN2_LOW, r)
    p = fma(_P32[0], r, _P32[1])
    p = fma(p, r, _P32[2])
    p = fma(p, r, _P32[3])
    p = fma(p, r, _P32[4])
    p = fma(p, r, _P32[5])
    p = fma(p * r, r, r) + _F32(1.0)
    exponent = _as_int_bits(shifted) - _F32_SHIFT_BITS
    # numba widens int32 arithmetic to int64: narrow back so the bits are a float32's.
    power = _as_float_bits(np.int32((exponent + 127) << 23))
    return _exact_where_nonfinite(argument, p * power)


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
        exp_neg = _exp64(-log_ratio - (1.0 if beyond else 0.0)) * (math.e if beyond else 1.0)
        value = exp_neg - 1.0 + log_ratio
    else:
        value = abs(log_ratio)
    return min(max(value, -clamp), clamp)


def exp_poly(x):
    """exp in the dtype of x (float32 or float64), vectorizable; see _exp64 and _exp32."""


@overload(exp_poly, inline="always")
def _exp_poly_overload(x):
    if x == types.float32:
        return lambda x: _exp32(x)
    if x == types.float64:
        return lambda x: _exp64(x)
    return None


def _kl_penalty_rows(code):
    """Twin: src/rows_kl.h ppo_kl_penalty_row, built for the estimator `code` (the `estimator`
    argument is that code; see _Specialised)."""

    def kl_penalty(logprobs, ref_logprobs, starts, spans, estimator, clamp, kl):
        for b in prange(starts.shape[0]):
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
            for t in range(span):
                i = start + t
                if t < length and (not has_mask or mask[i] != 0):
                    log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                    reward = -kl_coef * kl_value(log_ratio, code, clamp)
                    rewards[i] = reward + (score if i == last else 0.0)
                else:
                    rewards[i] = 0.0

    return shape_rewards


def gae(
    rewards, values, starts, spans, lengths, mask, gammas, lams, bootstrap, advantages, returns
):
    """Twin: src/rows_gae.h ppo_gae_row. The running state is float64 whatever the input dtype."""
    has_mask = mask.shape[0] > 0
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        gamma = gammas[b]
        gamma_lam = gamma * lams[b]
        next_value = bootstrap[b]
        running = 0.0
        for k in range(span):
            t = span - _U1 - k
            i = start + t
            if t < length and (not has_mask or mask[i] != 0):
                value = np.float64(values[i])
                delta = fma(gamma, next_value, np.float64(rewards[i])) - value
                running = fma(gamma_lam, running, delta)
                advantages[i] = running
                returns[i] = running + value
                next_value = value
            else:
                advantages[i] = 0.0
                returns[i] = 0.0


@intrinsic
def _mask_word(typingctx, mask, index):
    """The 8 bytes of a uint8 array from ``index`` on, as one uint64 (an unaligned load)."""
    if not (isinstance(mask, types.Array) and mask.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        address = builder.gep(array.data, [args[1]])
        return builder.load(builder.bitcast(address, ir.IntType(64).as_pointer()), align=1)

    return types.uint64(mask, index), codegen


_U8 = np.uint64(8)
_BYTE_ONES = np.uint64(0x0101010101010101)
_BYTE_HIGHS = np.uint64(0x8080808080808080)


@_jit
def _all_valid(mask, i):
    """Whether the 8 mask bytes from position i on are all nonzero: a word has a zero byte
    exactly when (word - 0x01..01) & ~word & 0x80..80 is nonzero (Hacker's Delight 6-1)."""
    word = _mask_word(mask, i)
    return ((word - _BYTE_ONES) & ~word & _BYTE_HIGHS) == 0


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


@_jit
def _valid_count(start, span, length, mask, has_mask):
    """The number of valid positions of a row."""
    valid_end = min(length, span)
    if not has_mask:
        return valid_end
    count = np.uint64(0)
    for i in range(start, start + valid_end):
        count += np.uint64(mask[i] != 0)
    return count


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


def moments(x, starts, spans, lengths, mask, shift, counts, sums, sums_sq):
    """Twin: src/rows_moments.h ppo_moments_row. Branch-free, so that the `reassoc` build
    vectorizes the sums (a serial float64 sum is bound by the latency of its additions)."""
    has_mask = mask.shape[0] > 0
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        length = np.uint64(lengths[b])
        count = 0.0
        total = 0.0
        total_sq = 0.0
        for t in range(np.uint64(spans[b])):
            i = start + t
            valid = t < length and (not has_mask or mask[i] != 0)
            centred = np.float64(x[i]) - shift
            count += 1.0 if valid else 0.0
            total += centred if valid else 0.0
            total_sq += centred * centred if valid else 0.0
        counts[b] = count
        sums[b] = total
        sums_sq[b] = total_sq


def whiten(x, starts, spans, lengths, mask, mean, scale, offset, whitened):
    """Twin: src/rows_moments.h ppo_whiten_row."""
    has_mask = mask.shape[0] > 0
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        length = np.uint64(lengths[b])
        for t in range(np.uint64(spans[b])):
            i = start + t
            if t < length and (not has_mask or mask[i] != 0):
                whitened[i] = (np.float64(x[i]) - mean) / scale + offset
            else:
                whitened[i] = 0.0


_CHUNK = 256  # tokens per chunk of the loss kernels: their scratch rows stay in L1
_UCHUNK = np.uint64(_CHUNK)


@intrinsic
def _select(typingctx, condition, a, b):
    """a if condition else b, as one LLVM select, in a's type (b is converted, as numba's
    conditional expression unifies float32 and float64 to float64): a conditional expression at
    a store becomes two predicated stores, and blocks the vectorizer."""
    if not (
        isinstance(condition, types.Boolean)
        and isinstance(a, types.Float)
        and isinstance(b, types.Float)
        and a.bitwidth >= b.bitwidth
    ):
        return None

    def codegen(context, builder, sig, args):
        other = context.cast(builder, args[2], sig.args[2], sig.args[1])
        return builder.select(args[0], args[1], other)

    return a(condition, a, b), codegen


@intrinsic
def _one_like(typingctx, x):
    """1 in the type of the float x (numba's `x - x + 1` is float64: its 1 is an integer)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return context.get_constant(sig.return_type, 1.0)

    return x(x), codegen


@intrinsic
def _half_like(typingctx, x):
    """0.5 in the type of the float x."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return context.get_constant(sig.return_type, 0.5)

    return x(x), codegen


@intrinsic
def _prefer_wide_vectors(typingctx):
    """Lets LLVM vectorize the calling function at 512 bits where the CPU has them: the
    function attribute "prefer-vector-width"="512" (LLVM prefers 256 bits on AVX-512 CPUs,
    for the clock; these kernels are bound by memory). numba has no option for a function
    attribute and llvmlite accepts only a list of known ones: this adds it to the set directly.
    Called inside the prange body, so that it lands on the function that runs the rows in both
    builds (the parallel build outlines the body)."""

    def codegen(context, builder, sig, args):
        try:
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        except TypeError:  # llvmlite's attributes are no longer a set: a hint only, so skip it
            pass
        return context.get_dummy_value()

    return types.none(), codegen


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
    threads. Positions past the length are not computed: their gradient is 0.
    """
    has_mask = mask.shape[0] > 0
    lo, hi, dual, clamp = ratio_low, ratio_high, dual_clip, log_ratio_clamp
    has_weights = weights.shape[0] > 0
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        valid_end = min(np.uint64(lengths[b]), span)
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite; params may be inf)
        one = _one_like(zero)
        p = (lo, hi, dual, clamp, scale, zero)
        ratios = np.empty(_CHUNK, logprobs.dtype)
        losses = np.empty(_CHUNK, logprobs.dtype)
        weighted_losses = np.empty(_CHUNK, np.float64)
        kls = np.empty(_CHUNK, logprobs.dtype)
        total = 0.0
        clipped_count = 0.0
        dual_count = 0.0
        kl_total = 0.0
        for chunk in range((valid_end + _UCHUNK - _U1) // _UCHUNK):
            first = start + chunk * _UCHUNK
            n = min(_UCHUNK, start + valid_end - first)
            for j in range(n):
                i = first + j
                log_ratio = min(max(logprobs[i] - old_logprobs[i], -clamp), clamp)
                ratios[j] = exp_poly(log_ratio)
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
    """Twin: src/rows_policy.h ppo_reinforce_row. A row in chunks of ``_CHUNK`` tokens: one pass
    with selects writes the gradient and the float64 loss and KL terms to L1 scratch rows, which
    short loops of their own then sum. As in clipped_surrogate, the `reassoc` build vectorizes
    those sums, and their order is that of the one compiled loop (never of the threads or of how
    LLVM vectorized the main loop), so results stay identical on any number of threads."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    penalised = beta != 0.0
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite)
        half_beta = beta * _half_like(zero)
        losses = np.empty(_CHUNK, np.float64)
        kls = np.empty(_CHUNK, np.float64)
        total = 0.0
        kl_total = 0.0
        for chunk in range((span + _UCHUNK - _U1) // _UCHUNK):
            first = chunk * _UCHUNK
            n = min(_UCHUNK, span - first)
            for j in range(n):
                t = first + j
                i = start + t
                valid = (t < length) & ((not has_mask) or mask[i] != 0)
                logprob = logprobs[i]
                advantage = advantages[i]
                weight = np.float64(weights[i]) if has_weights else 1.0
                log_ratio = logprob - old_logprobs[i]
                objective = advantage * logprob
                slope = advantage
                if penalised:
                    objective = objective - half_beta * (log_ratio * log_ratio)
                    slope = advantage - beta * log_ratio
                grad[i] = _select(valid, -weight * slope * scale, zero)
                losses[j] = _select(valid, -weight * objective, 0.0)
                kls[j] = _select(valid, -np.float64(log_ratio), 0.0)
            for j in range(n):
                total += losses[j]
            for j in range(n):
                kl_total += kls[j]
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
    """Twin: src/rows_policy.h ppo_cispo_row. As reinforce, with exp in a pre-pass per chunk
    into an L1 scratch row (so that the main loop vectorizes, as in clipped_surrogate)."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    lo, hi, clamp = ratio_low, ratio_high, log_ratio_clamp
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        scale = scales[b]
        zero = scale - scale
        ratios = np.empty(_CHUNK, logprobs.dtype)
        losses = np.empty(_CHUNK, np.float64)
        kls = np.empty(_CHUNK, np.float64)
        total = 0.0
        clipped_count = 0.0
        lower_count = 0.0
        kl_total = 0.0
        for chunk in range((span + _UCHUNK - _U1) // _UCHUNK):
            first = chunk * _UCHUNK
            n = min(_UCHUNK, span - first)
            for j in range(n):
                i = start + first + j
                ratios[j] = exp_poly(min(max(logprobs[i] - old_logprobs[i], -clamp), clamp))
            for j in range(n):
                t = first + j
                i = start + t
                valid = (t < length) & ((not has_mask) or mask[i] != 0)
                logprob = logprobs[i]
                weight = np.float64(weights[i]) if has_weights else 1.0
                log_ratio = min(max(logprob - old_logprobs[i], -clamp), clamp)
                ratio = ratios[j]
                coefficient = min(max(ratio, lo), hi)
                slope = coefficient * advantages[i]
                grad[i] = _select(valid, -weight * slope * scale, zero)
                losses[j] = _select(valid, -weight * (slope * logprob), 0.0)
                kls[j] = _select(valid, -np.float64(log_ratio), 0.0)
                # whole numbers: exact in any order of addition
                clipped_count += _select(valid & (coefficient != ratio), 1.0, 0.0)
                lower_count += _select(valid & (ratio < lo), 1.0, 0.0)
            for j in range(n):
                total += losses[j]
            for j in range(n):
                kl_total += kls[j]
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
    """Twin: src/rows_policy.h ppo_sapo_row. As reinforce, with the ratio's exp and then the
    sigmoid's in pre-passes per chunk into L1 scratch rows."""
    has_mask = mask.shape[0] > 0
    has_weights = weights.shape[0] > 0
    clamp = log_ratio_clamp
    for b in prange(starts.shape[0]):
        _prefer_wide_vectors()
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        scale = scales[b]
        zero = scale - scale
        one = _one_like(zero)
        four = one + one + one + one
        # 4 / tau per sign of the advantage, divided once: a division in the token loop checks
        # its divisor for zero (numba's Python error model), which keeps the loop from vectorizing
        gate_pos = four / tau_pos
        gate_neg = four / tau_neg
        ratios = np.empty(_CHUNK, logprobs.dtype)
        sigmoids = np.empty(_CHUNK, logprobs.dtype)
        losses = np.empty(_CHUNK, np.float64)
        kls = np.empty(_CHUNK, np.float64)
        total = 0.0
        kl_total = 0.0
        for chunk in range((span + _UCHUNK - _U1) // _UCHUNK):
            first = chunk * _UCHUNK
            n = min(_UCHUNK, span - first)
            for j in range(n):
                i = start + first + j
                ratios[j] = exp_poly(min(max(logprobs[i] - old_logprobs[i], -clamp), clamp))
            _sapo_sigmoids(advantages, start + first, ratios, sigmoids, n, tau_pos, tau_neg)
            for j in range(n):
                t = first + j
                i = start + t
                valid = (t < length) & ((not has_mask) or mask[i] != 0)
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
                losses[j] = _select(valid, -weight * (gate * advantage), 0.0)
                kls[j] = _select(valid, -np.float64(log_ratio), 0.0)
            for j in range(n):
                total += losses[j]
            for j in range(n):
                kl_total += kls[j]
        row_loss[b] = total
        row_kl[b] = kl_total


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
    """Twin: src/rows_loss.h ppo_value_loss_row. One pass, vectorized like the policy loss."""
    has_mask = mask.shape[0] > 0
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        length = np.uint64(lengths[b])
        scale = scales[b]
        zero = scale - scale  # 0 in the input dtype (the scale is finite; params may be inf)
        total = 0.0
        clipped_count = 0.0
        for t in range(np.uint64(spans[b])):
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
            total += half if valid else 0.0
            clipped_count += 1.0 if valid & is_clipped else 0.0
        row_loss[b] = total
        row_clipped[b] = clipped_count


_parallel_lock = threading.Lock()


class _Kernel:
    """A row kernel built serial and parallel from one source, compiled on first use."""

    def __init__(self, function, fastmath=False):
        self.function = function  # the Python source, for the interface test
        self.serial = numba.njit(nogil=True, cache=_CACHE, fastmath=fastmath)(function)
        self.parallel = numba.njit(nogil=True, cache=_CACHE, fastmath=fastmath, parallel=True)(
            function
        )

    def __call__(self, *args):
        *args, n_threads = args  # the backend signature ends with n_threads
        n_threads = min(n_threads, numba.config.NUMBA_NUM_THREADS)
        if n_threads > 1 and _parallel_lock.acquire(blocking=False):
            try:
                numba.set_num_threads(n_threads)
                self.parallel(*args)
            finally:
                _parallel_lock.release()
        else:
            self.serial(*args)


class _Specialised:
    """A row kernel built once per value of a code argument, which the kernel sees as a constant
    (the table's ``specialise``: the KL estimator).

    A switch on a run-time estimator inside the token loop keeps LLVM from vectorizing it (k1
    ran 12 times slower). The argument stays in the signature, common to all backends.
    """

    def __init__(self, make_rows, kernel, fastmath=False):
        self.position = kernel.arguments.index(kernel.specialise)
        codes = range(len(kernel.scalar(kernel.specialise).choices))
        self.kernels = [_Kernel(make_rows(code), fastmath) for code in codes]
        self.function = self.kernels[0].function

    def __call__(self, *args):
        self.kernels[args[self.position]](*args)


# The backend interface: one callable per kernel of the table, with the table's arguments.
# reassoc lets LLVM vectorize the row sums of the moments and loss kernels; nothing else in them
# reassociates.
kl_penalty = _Specialised(_kl_penalty_rows, KERNELS["kl_penalty"])
shape_rewards = _Specialised(_shape_rewards_rows, KERNELS["shape_rewards"])
gae = _Kernel(gae)
discounted_returns = _Kernel(discounted_returns)
remax = _Kernel(remax)
optimal_token_baseline = _Kernel(optimal_token_baseline)
moments = _Kernel(moments, fastmath={"reassoc"})
whiten = _Kernel(whiten)
clipped_surrogate = _Kernel(clipped_surrogate, fastmath={"reassoc"})
value_loss = _Kernel(value_loss, fastmath={"reassoc"})
reinforce = _Kernel(reinforce, fastmath={"reassoc"})
cispo = _Kernel(cispo, fastmath={"reassoc"})
sapo = _Kernel(sapo, fastmath={"reassoc"})
