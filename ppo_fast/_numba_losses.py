"""The numba per-token policy losses: the loss, its exact gradient and the statistics in one pass
over rows (twins of ``_reference.py``'s; the Cython twins are in ``src/rows_loss.h``,
``src/rows_policy.h`` and ``src/rows_token.h``; the per-sequence losses are in
``_numba_sequence_losses.py``, the value loss in ``_numba_value_loss.py``). Registered as the
backend's kernels in ``_numba_kernels.py``; conventions in ``_numba_core.py``.

Every kernel here runs in lanes (``_numba_lanes``), operation for operation its C twin's, and
gives its bits; a chunk's exps (and DPPO's trust region) come first, as scalar loops that LLVM
vectorizes into L1 scratch rows.
"""

from __future__ import annotations

import numpy as np

from ._numba_core import (
    _AVX512,
    _PREFETCH_BLOCK,
    _U8,
    _ahead,
    _half_like,
    _jit,
    _mask_stop,
    _one_like,
    _positions_per_line,
    _prefer_wide_vectors,
    _prefetch,
    _prefetch_ahead,
    _select,
    _without_refcounts,
)
from ._numba_lanes import (
    _count_valid_lanes,
    _lane_total,
    _lanes_abs,
    _lanes_add,
    _lanes_clip,
    _lanes_eq,
    _lanes_f64,
    _lanes_f64_where,
    _lanes_gt,
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
    _valid_bytes_first,
    _valid_first,
    _valid_put,
)
from ._numba_math import (
    EXP_FIXUP_CLAMPED,
    EXP_FIXUP_UNCLAMPED,
    clipped_exps,
    exp_bounds,
    exp_constants,
    exp_registers,
    exp_with,
    log_poly,
)
from ._numba_memory import _stack_array

_CHUNK = 256  # tokens per chunk of the loss kernels: their scratch rows stay in L1
_UCHUNK = np.uint64(_CHUNK)
_U64 = np.uint64(64)


@_jit
def _chunk_ratios(
    logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask, start, span,
    valid_end, first, n, clamp, ratios,
):  # fmt: skip
    """Twin: src/rows.h ppo_chunk_ratios. A chunk's ratios exp(clip(logprobs - old_logprobs,
    -clamp, clamp)) at positions first .. first + n - 1 into ratios[0 .. n): the losses' exp
    pre-pass, _PREFETCH_BLOCK positions at a time, each block prefetching ahead the inputs the
    chunk's main pass reads (_ahead, _prefetch_ahead: past the row's valid_end, the next row's).
    Where numba compiles for AVX-512 (and the clamp is >= 0, as the public functions check), a
    64-byte register of exps at a time (_numba_math.clipped_exps, the same bits), the block's
    last positions one by one."""
    constants = exp_constants(clamp)
    # AVX-512: a register of exps at a time (clipped_exps), its bounds and table made here
    registers = _AVX512 and clamp >= 0.0  # inf (no clamp) included, NaN and < 0 not
    low, high = exp_bounds(clamp, constants)
    table = EXP_FIXUP_CLAMPED if clamp < np.inf else EXP_FIXUP_UNCLAMPED
    exp_register_constants = exp_registers(ratios)  # unused (and so not made) without AVX-512
    width = np.uint64(64 // ratios.itemsize)
    for j0 in range(np.uint64(0), n, _PREFETCH_BLOCK):
        _prefetch_ahead(
            logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
            _ahead(first + j0, start, span, valid_end),
        )  # fmt: skip
        end = min(j0 + _PREFETCH_BLOCK, n)
        scalar_from = j0
        if registers:
            while scalar_from + width <= end:
                clipped_exps(
                    logprobs, old_logprobs, first + scalar_from, low, high, table, ratios,
                    scalar_from, exp_register_constants,
                )  # fmt: skip
                scalar_from += width
        for j in range(scalar_from, end):
            i = first + j
            ratios[j] = exp_with(min(max(logprobs[i] - old_logprobs[i], -clamp), clamp), constants)


@_jit
def _kl_cov_ratios(
    logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask, selected, start,
    span, valid_end, first, n, ratios,
):  # fmt: skip
    """KL-Cov's pre-pass (twin: src/rows_token.h ppo_kl_cov_cases' first loop): as
    _chunk_ratios, without a clamp (exp of the log-ratio itself), its selection's line
    prefetched too (a byte a token: one line a block)."""
    constants = exp_constants(logprobs)
    for j0 in range(np.uint64(0), n, _PREFETCH_BLOCK):
        ahead = _ahead(first + j0, start, span, valid_end)
        _prefetch_ahead(
            logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask, ahead
        )
        _prefetch(selected, ahead)
        for j in range(j0, min(j0 + _PREFETCH_BLOCK, n)):
            i = first + j
            ratios[j] = exp_with(logprobs[i] - old_logprobs[i], constants)


@_without_refcounts
def _sapo_sigmoids(advantages, first, ratios, sigmoids, n, tau_pos, tau_neg):
    """sigmoids[j] = sigmoid(tau * (ratios[j] - 1)) for the n tokens from position first, tau by
    the sign of the advantage. A function of its own, not inlined: numba's SSA pass loses track
    of a second inlined exp_poly in one function. Its error model is numpy's: under the default
    (Python's), each division checks for a zero divisor and may raise ZeroDivisionError, a branch
    that kept LLVM from vectorizing the loop (SAPO ran 4 times slower than CISPO)."""
    _prefer_wide_vectors()
    one = _one_like(tau_pos)
    zero = one - one  # not tau_pos - tau_pos: a float32 tau may be inf (1e39 rounded), as the twin
    constants = exp_constants(zero)
    for j in range(n):
        tau = _select(advantages[first + j] > zero, tau_pos, tau_neg)
        sigmoids[j] = one / (one + exp_with(-(tau * (ratios[j] - one)), constants))  # sigmoid


# The per-token policy losses in lanes: the family's kernels (twin: src/rows_policy.h's
# PPO_REINFORCE, PPO_CISPO, PPO_SAPO) and PPO's clipped surrogate (src/rows_loss.h), which goes
# through its rows as they do.
_REINFORCE, _CISPO, _SAPO, _CLIPPED, _DPPO, _KL_COV = 0, 1, 2, 3, 4, 5


@_jit
def _policy_gradient(
    has_weights, weights, i, valid, slope, objective, zero, token_scale, scale, grad, loss
):  # fmt: skip
    """Twin: src/rows.h ppo_policy_gradient (its comment says why each case is so): stores the
    gradient -weight * slope * scale of the 8 tokens from position i where valid (0 elsewhere)
    and returns the float64 loss lanes plus -weight * objective where valid (_lanes_f64_where:
    0 elsewhere); the weight in float64, the products in float64 rounded to the dtype at the
    store."""
    if not has_weights:
        gradient = _lanes_mul(_lanes_negative(slope), token_scale)
        _lanes_put(grad, i, _lanes_where(valid, gradient, zero))
        return _lanes_sub(loss, _lanes_f64_where(valid, objective))
    negative_weight = _lanes_negative(_lanes_f64_where(valid, _lanes_of(weights, i)))
    gradient = _lanes_mul(_lanes_mul(negative_weight, _lanes_f64(slope)), scale)
    _lanes_put(grad, i, _lanes_where(valid, _lanes_rounded(gradient, zero), zero))
    return _lanes_add(loss, _lanes_mul(negative_weight, _lanes_f64_where(valid, objective)))


@_jit
def _policy_params(
    scale, beta, dual_clip, ratio_low, ratio_high, log_ratio_clamp, tau_pos, tau_neg
):  # fmt: skip
    """A row's lanes of the scalars, for every kernel (twins: src/rows_policy.h
    ppo_family_params and ppo_family_init, src/rows_loss.h ppo_policy_params): 0 in the dtype as
    the twins (the scale is finite). What a kernel does not use is 1 (so that 4 / tau is too)."""
    zero = scale - scale
    one = _one_like(zero)
    four = one + one + one + one
    return (
        _lanes_splat(zero), _lanes_splat(one), _lanes_splat(four), _lanes_splat(beta),
        _lanes_splat(beta * _half_like(zero)), beta != zero, _lanes_splat(scale),
        _lanes_splat(np.float64(scale)), _lanes_splat(dual_clip), _lanes_splat(ratio_low),
        _lanes_splat(ratio_high), _lanes_splat(log_ratio_clamp), _lanes_splat(-log_ratio_clamp),
        _lanes_splat(four / tau_pos), _lanes_splat(four / tau_neg),
    )  # fmt: skip


def _policy_rows_build(kind):
    """The rows of the per-token policy loss ``kind``: its block of 8 tokens (twins:
    src/rows_policy.h ppo_family_block, src/rows_loss.h ppo_policy_block, src/rows_token.h
    ppo_dppo_block), its row (twins: ppo_family_cases, ppo_clipped_surrogate_cases,
    ppo_dppo_cases) and its loop over rows, each compiled for that kernel alone (``kind`` is a
    constant of theirs), not inlined into one another by numba: a kernel built of inlined
    helpers, with its four cases of mask and weights as literal arguments, took numba 20 s to
    compile (its type inference runs on every inlined copy); built so, 2-3 s. Mask and weights
    (and REINFORCE's penalty) are tested in the block, a branch that every step of the loop
    takes the same way, and LLVM copies the loop for each case (``_numba_core._LLVMOptions``):
    with the test in every block, REINFORCE took 1.27x its twin's time."""

    @_without_refcounts
    def block(
        has_mask, has_weights, logprobs, old_logprobs, advantages, weights, mask, selected, i,
        ratio, second, p, grad, loss, kl,
    ):  # fmt: skip
        """The 8 tokens from position i, their ratios and ``second`` lanes given (for the
        kernels that have them: SAPO's sigmoids, DPPO's 1 inside its trust region and 0
        outside): stores their gradient, returns the loss and KL lanes with their terms added
        (KL-Cov's: |log-ratio|), and the kernel's two counts (the clipped surrogate's clipped
        and dual, CISPO's clipped and lower, DPPO's outside and capped, KL-Cov's penalised)."""
        zero, one, four, beta, half_beta, penalised, token_scale, scale, dual = p[:9]
        low, high, clamp, negative_clamp, gate_pos, gate_neg = p[9:]
        if has_mask:
            valid = _valid_bytes(mask, i)
        else:
            valid = _valid_all()
        logprob = _lanes_of(logprobs, i)
        advantage = _lanes_of(advantages, i)
        raw_log_ratio = _lanes_sub(logprob, _lanes_of(old_logprobs, i))
        first_count = 0
        second_count = 0
        if kind == _CLIPPED:
            log_ratio = _lanes_clip(raw_log_ratio, negative_clamp, clamp)
            # (log_ratio >= -clamp) & (log_ratio <= clamp), false on NaN as well
            inside = _lanes_eq(log_ratio, raw_log_ratio)
            unclipped = _lanes_mul(ratio, advantage)
            clipped = _lanes_mul(_lanes_clip(ratio, low, high), advantage)
            is_clipped = _lanes_lt(clipped, unclipped)
            objective = _lanes_where(is_clipped, clipped, unclipped)
            dual_objective = _lanes_mul(dual, advantage)
            is_dual = _valid_and(_lanes_lt(advantage, zero), _lanes_gt(dual_objective, objective))
            objective = _lanes_where(is_dual, dual_objective, objective)
            sloped = _valid_and_not(_valid_and_not(inside, is_clipped), is_dual)
            # the slope `unclipped` (advantage * ratio) where sloped and 0 on a flat branch:
            # times the weight, so that a NaN or inf weight still says so
            slope = _lanes_where(sloped, unclipped, zero)
            first_count = _count_valid_lanes(_valid_and(valid, is_clipped))
            second_count = _count_valid_lanes(_valid_and(valid, is_dual))
        elif kind == _REINFORCE:
            log_ratio = raw_log_ratio
            objective = _lanes_mul(advantage, logprob)
            slope = advantage
            if penalised:
                squared = _lanes_mul(log_ratio, log_ratio)
                objective = _lanes_sub(objective, _lanes_mul(half_beta, squared))
                slope = _lanes_sub(advantage, _lanes_mul(beta, log_ratio))
        elif kind == _CISPO:
            log_ratio = _lanes_clip(raw_log_ratio, negative_clamp, clamp)
            coefficient = _lanes_clip(ratio, low, high)
            slope = _lanes_mul(coefficient, advantage)
            objective = _lanes_mul(slope, logprob)
            # coefficient != ratio: NaN ratios too
            first_count = _count_valid_lanes(_valid_and_not(valid, _lanes_eq(coefficient, ratio)))
            second_count = _count_valid_lanes(_valid_and(valid, _lanes_lt(ratio, low)))
        elif kind == _KL_COV:  # twin: src/rows_token.h ppo_kl_cov_block, its coef in `beta`
            log_ratio = raw_log_ratio
            if penalised:  # coef != 0: with coef 0 no token is penalised, whatever is selected
                penalising = _valid_bytes(selected, i)
            else:
                penalising = _valid_first(0)
            distance = _lanes_abs(log_ratio)
            # sign: 0 at 0, NaN at NaN (the log-ratio itself, where it is neither < nor > 0)
            sign = _lanes_where(
                _lanes_gt(log_ratio, zero),
                one,
                _lanes_where(_lanes_lt(log_ratio, zero), _lanes_negative(one), log_ratio),
            )
            base = _lanes_mul(advantage, ratio)
            objective = _lanes_where(penalising, _lanes_sub(base, _lanes_mul(beta, distance)), base)
            slope = _lanes_where(penalising, _lanes_sub(base, _lanes_mul(beta, sign)), base)
            first_count = _count_valid_lanes(_valid_and(valid, penalising))
        elif kind == _DPPO:  # its ratio cap in `dual`
            log_ratio = _lanes_clip(raw_log_ratio, negative_clamp, clamp)
            keep = second
            # the twin's min(cap, ratio): cap < ratio ? cap : ratio
            capped_ratio = _lanes_where(_lanes_lt(dual, ratio), dual, ratio)
            capped_slope = _lanes_mul(advantage, capped_ratio)
            objective = _lanes_mul(_lanes_mul(capped_slope, logprob), keep)
            slope = _lanes_mul(capped_slope, keep)
            outside = _lanes_eq(keep, zero)
            first_count = _count_valid_lanes(_valid_and(valid, outside))
            capped = _valid_and(_valid_and_not(valid, outside), _lanes_gt(ratio, dual))
            second_count = _count_valid_lanes(capped)
        else:  # SAPO
            sigmoid = second
            # torch.clamp passes the gradient at its bounds, and a NaN log-ratio's NaN
            inside = _valid_and_not(
                _valid_and_not(_valid_all(), _lanes_lt(raw_log_ratio, negative_clamp)),
                _lanes_gt(raw_log_ratio, clamp),
            )
            log_ratio = _lanes_clip(raw_log_ratio, negative_clamp, clamp)
            gate = _lanes_mul(sigmoid, _lanes_where(_lanes_gt(advantage, zero), gate_pos, gate_neg))
            gradient_gate = _lanes_mul(_lanes_mul(four, sigmoid), _lanes_sub(one, sigmoid))
            slope = _lanes_where(
                inside, _lanes_mul(_lanes_mul(advantage, gradient_gate), ratio), zero
            )
            objective = _lanes_mul(gate, advantage)
        loss = _policy_gradient(
            has_weights, weights, i, valid, slope, objective, zero, token_scale, scale, grad, loss
        )
        if kind == _KL_COV:
            kl = _lanes_add(kl, _lanes_f64_where(valid, distance))
        else:
            kl = _lanes_sub(kl, _lanes_f64_where(valid, log_ratio))
        return loss, kl, first_count, second_count

    @_without_refcounts
    def rows_of(
        logprobs, old_logprobs, advantages, weights, selected, starts, spans, lengths, mask,
        scales, beta, dual_clip, ratio_low, ratio_high, log_ratio_clamp, tau_pos, tau_neg,
        divergence_low, divergence_high, binary_kl, grad, row_loss, row_first, row_second,
        row_kl, scratch, wide, tail, tail_mask, tail_selected,
    ):  # fmt: skip
        """Each row's valid prefix, a chunk of _CHUNK tokens at a time: the chunk's exps first
        into L1 scratch rows (the ratios, then SAPO's sigmoids, or DPPO's probabilities and its
        0/1 of the trust region), prefetching the next chunk's inputs meanwhile; then 8 tokens
        a step (REINFORCE, which has no exp, prefetching in it), a row's last partial block in
        zero-padded lanes (``_tail_fill``). Writes the row's loss and KL (the sums' float64
        lanes added up in the C twin's tree) and counts (whole numbers) where the kernel has
        them. Positions past the length, and a mask's trailing words of 8 invalid bytes, get a
        zero gradient and nothing else. The loop over the rows is here, not in the caller: a
        call a row passed its arrays field by field and cost short rows 30-45 ns each (the
        clipped surrogate at 1024 x 8: 2.4x the twin's time)."""
        _prefer_wide_vectors()
        has_mask = mask.shape[0] > 0
        has_weights = weights.shape[0] > 0
        ratios, seconds, probs, old_probs = scratch[0], scratch[1], scratch[2], scratch[3]
        clamp = log_ratio_clamp
        for b in range(starts.shape[0]):
            start = np.uint64(starts[b])
            span = np.uint64(spans[b])
            length = np.uint64(lengths[b])
            p = _policy_params(
                scales[b], beta, dual_clip, ratio_low, ratio_high, log_ratio_clamp, tau_pos,
                tau_neg,
            )  # fmt: skip
            zero_lanes = p[0]
            loss = _lanes_splat(0.0)
            kl = _lanes_splat(0.0)
            first_count = 0
            second_count = 0
            valid_end = min(length, span)
            if has_mask:  # a mask's trailing invalid words too (src/rows_loss.h says why)
                valid_end = _mask_stop(mask, start, np.uint64(0), valid_end)
            stop = start + valid_end
            ratio = zero_lanes
            second = zero_lanes
            for first in range(start, stop, _UCHUNK):
                end = min(first + _UCHUNK, stop)
                n = end - first
                whole_end = end - n % _U8
                if kind == _KL_COV:
                    _kl_cov_ratios(
                        logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
                        selected, start, span, valid_end, first, n, ratios,
                    )  # fmt: skip
                elif kind != _REINFORCE:
                    _chunk_ratios(
                        logprobs, old_logprobs, advantages, weights, has_weights, mask, has_mask,
                        start, span, valid_end, first, n, clamp, ratios,
                    )  # fmt: skip
                if kind == _SAPO:
                    _sapo_sigmoids(advantages, first, ratios, seconds, n, tau_pos, tau_neg)
                if kind == _DPPO:
                    if binary_kl:  # in float64 (_binary_kls says why), into the probs row
                        _exps_wide(logprobs, first, wide[0], n)
                        _exps_wide(old_logprobs, first, wide[1], n)
                        _binary_kls(
                            logprobs, old_logprobs, advantages, first, wide[0], wide[1], probs, n,
                            divergence_low, divergence_high,
                        )  # fmt: skip
                    else:
                        _exps(logprobs, first, probs, n)
                        _exps(old_logprobs, first, old_probs, n)
                    _dppo_inside(
                        logprobs, old_logprobs, advantages, first, probs, old_probs, seconds, n,
                        divergence_low, divergence_high, binary_kl,
                    )  # fmt: skip
                for i in range(first, whole_end, _U8):
                    if kind == _REINFORCE and (i - first) % _positions_per_line(logprobs) == 0:
                        # a line of each input at a time, as the twin (ppo_prefetch_ahead): a
                        # block's lines at once measured 1.15x its time on rows in memory
                        ahead = _ahead(i, start, span, valid_end)
                        _prefetch(logprobs, ahead)
                        _prefetch(old_logprobs, ahead)
                        _prefetch(advantages, ahead)
                        if has_weights:
                            _prefetch(weights, ahead)
                        if has_mask and (i - first) % _U64 == 0:
                            _prefetch(mask, ahead)
                    if kind != _REINFORCE:
                        ratio = _lanes_of(ratios, i - first)
                    if kind == _SAPO or kind == _DPPO:
                        second = _lanes_of(seconds, i - first)
                    loss, kl, block_first, block_second = block(
                        has_mask, has_weights, logprobs, old_logprobs, advantages, weights, mask,
                        selected, i, ratio, second, p, grad, loss, kl,
                    )  # fmt: skip
                    first_count += block_first
                    second_count += block_second
                if whole_end < end:
                    count = end - whole_end
                    _tail_fill(
                        tail, tail_mask, logprobs, old_logprobs, advantages, weights, has_weights,
                        mask, has_mask, whole_end, count,
                    )  # fmt: skip
                    # the scratch rows hold the tail's ratios and second lanes; those past the
                    # row's end are not valid, and nothing of theirs reaches the outputs
                    if kind != _REINFORCE:
                        ratio = _lanes_of(ratios, whole_end - first)
                    if kind == _SAPO or kind == _DPPO:
                        second = _lanes_of(seconds, whole_end - first)
                    if kind == _KL_COV:  # its selection, zero-padded as the mask
                        _valid_put(tail_selected, 0, _valid_bytes_first(selected, whole_end, count))
                    tail_grad = tail[4]
                    # the tail's mask is always there (tail_mask: True, but as a value, not a
                    # constant: numba would compile the block a second time for the constant)
                    loss, kl, block_first, block_second = block(
                        tail_mask.shape[0] > 0, has_weights, tail[0], tail[1], tail[2],
                        tail[3], tail_mask, tail_selected, np.uint64(0), ratio, second, p,
                        tail_grad, loss, kl,
                    )  # fmt: skip
                    first_count += block_first
                    second_count += block_second
                    _lanes_put_first(grad, whole_end, _lanes_of(tail_grad, 0), count)
            row_loss[b] = _lane_total(loss)
            row_kl[b] = _lane_total(kl)
            if kind != _REINFORCE and kind != _SAPO:  # they count nothing
                row_first[b] = first_count
            if kind != _REINFORCE and kind != _SAPO and kind != _KL_COV:  # one count
                row_second[b] = second_count
            # after the totals: LLVM makes this loop a call of memset, and lanes live across a
            # call are spilled and reloaded (2-5 ns a row with padding)
            for i in range(stop, start + span):
                grad[i] = 0

    @_jit
    def rows(
        logprobs, old_logprobs, advantages, weights, selected, starts, spans, lengths, mask,
        scales, beta, dual_clip, ratio_low, ratio_high, log_ratio_clamp, tau_pos, tau_neg,
        divergence_low, divergence_high, binary_kl, grad, row_loss, row_first, row_second,
        row_kl,
    ):  # fmt: skip
        """The rows (``rows_of``), with the call's scratch rows (_numba_core's docstring says
        why). Counts go to row_first and row_second where the kernel has them."""
        # uninitialised, as the twin's: a tail block reads the lanes past the row's end too,
        # which are not valid, and nothing of theirs reaches the outputs
        scratch = _stack_array((4, _CHUNK), logprobs.dtype)
        wide = _stack_array((2, _CHUNK), np.float64)  # DPPO-KL's probabilities
        tail = _stack_array((5, 8), logprobs.dtype)
        tail[:] = 0
        tail_mask = _stack_array((8,), np.uint8)
        tail_mask[:] = 0
        tail_selected = _stack_array((8,), np.uint8)
        tail_selected[:] = 0
        rows_of(
            logprobs, old_logprobs, advantages, weights, selected, starts, spans, lengths, mask,
            scales, beta, dual_clip, ratio_low, ratio_high, log_ratio_clamp, tau_pos, tau_neg,
            divergence_low, divergence_high, binary_kl, grad, row_loss, row_first, row_second,
            row_kl, scratch, wide, tail, tail_mask, tail_selected,
        )  # fmt: skip

    return rows


_clipped_surrogate_rows = _policy_rows_build(_CLIPPED)
_reinforce_rows = _policy_rows_build(_REINFORCE)
_cispo_rows = _policy_rows_build(_CISPO)
_sapo_rows = _policy_rows_build(_SAPO)
_dppo_rows = _policy_rows_build(_DPPO)
_kl_cov_rows = _policy_rows_build(_KL_COV)


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
    """Twin: src/rows_loss.h ppo_clipped_surrogate_row, in lanes (``_policy_rows_build``): loss,
    gradient and statistics."""
    one = _one_like(ratio_low)
    _clipped_surrogate_rows(
        logprobs, old_logprobs, advantages, weights, mask[:0], starts, spans, lengths, mask, scales,
        one - one, dual_clip, ratio_low, ratio_high, log_ratio_clamp, one, one, one, one, False,
        grad, row_loss, row_clipped, row_dual, row_kl,
    )  # fmt: skip


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
    """Twin: src/rows_policy.h ppo_reinforce_row, in lanes (``_policy_rows_build``)."""
    one = _one_like(beta)
    _reinforce_rows(
        logprobs, old_logprobs, advantages, weights, mask[:0], starts, spans, lengths, mask, scales,
        beta, one, one, one, one, one, one, one, one, False, grad, row_loss, row_loss, row_loss,
        row_kl,
    )  # fmt: skip


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
    """Twin: src/rows_policy.h ppo_cispo_row, in lanes (``_policy_rows_build``)."""
    one = _one_like(ratio_low)
    _cispo_rows(
        logprobs, old_logprobs, advantages, weights, mask[:0], starts, spans, lengths, mask, scales,
        one - one, one, ratio_low, ratio_high, log_ratio_clamp, one, one, one, one, False, grad,
        row_loss, row_clipped, row_lower, row_kl,
    )  # fmt: skip


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
    """Twin: src/rows_policy.h ppo_sapo_row, in lanes (``_policy_rows_build``)."""
    one = _one_like(tau_pos)
    _sapo_rows(
        logprobs, old_logprobs, advantages, weights, mask[:0], starts, spans, lengths, mask, scales,
        one - one, one, one, one, log_ratio_clamp, tau_pos, tau_neg, one, one, False, grad,
        row_loss, row_loss, row_loss, row_kl,
    )  # fmt: skip


@_without_refcounts
def _exps(values, first, out, n):
    """out[j] = exp(values[first + j]) for j < n: one inlined exp per function (numba's SSA pass
    loses track of a second, as _sapo_sigmoids says)."""
    _prefer_wide_vectors()
    constants = exp_constants(out)
    for j in range(n):
        out[j] = exp_with(values[first + j], constants)


@_without_refcounts
def _exps_wide(values, first, out, n):
    """_exps in float64 (DPPO-KL's probabilities: _binary_kls says why)."""
    _prefer_wide_vectors()
    constants = exp_constants(out)
    for j in range(n):
        out[j] = exp_with(np.float64(values[first + j]), constants)


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
    oracle's v), for j < n, given the probabilities (TV), or in ``probs`` whether the binary KL
    is within its bound (KL: ``_binary_kls``; p <= p_old read as logp <= old, exact)."""
    _prefer_wide_vectors()
    one = _one_like(low)
    zero = one - one  # not low - low: a bound may be inf
    for j in range(n):
        i = first + j
        positive = advantages[i] > zero
        if binary_kl:
            within = probs[j] > zero
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
    """Twin: src/rows_token.h ppo_dppo_row, in lanes (``_policy_rows_build``): the ratios' and
    the probabilities' exps and the trust region's 0/1 (``_dppo_inside``) in pre-passes per
    chunk into L1 scratch rows, then the blocks of 8."""
    one = _one_like(ratio_cap)
    binary_kl = divergence == 1  # _spec.DIVERGENCES
    _dppo_rows(
        logprobs, old_logprobs, advantages, weights, mask[:0], starts, spans, lengths, mask, scales,
        one - one, ratio_cap, one, one, log_ratio_clamp, one, one, divergence_low, divergence_high,
        binary_kl, grad, row_loss, row_outside, row_capped, row_kl,
    )  # fmt: skip


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
    """Twin: src/rows_token.h ppo_kl_cov_row, in lanes (``_policy_rows_build``): the ratios'
    exps (of the log-ratio itself, unclamped) in a pre-pass per chunk, then the blocks of 8. A
    token is penalised where it is selected and coef != 0."""
    one = _one_like(coef)
    _kl_cov_rows(
        logprobs, old_logprobs, advantages, weights, selected, starts, spans, lengths, mask, scales,
        coef, one, one, one, one, one, one, one, one, False, grad, row_loss, row_penalised,
        row_penalised, row_abs_kl,
    )  # fmt: skip
