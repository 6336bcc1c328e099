"""The oracle's policy and value losses (``_reference`` re-exports them: the oracle is that module),
and KL-Cov's token selection: plain Python loops in float64, the specification, with the
conventions of ``_reference``'s docstring."""

from __future__ import annotations

import math

import numpy as np

from ._reference import (
    BINARY_KL,
    DETACHED,
    _row_positions,
    _valid,
    in_dtype,
    safe_divide,
    safe_log,
    saturated_exp,
)


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
    n_threads,
):
    """Per token: L = min(rho*A, clip(rho, lo, hi)*A), bounded below by c*A where A < 0.

    lo, hi = ratio_low, ratio_high; c = dual_clip (inf without dual clip); clamp =
    log_ratio_clamp (inf without one). Writes grad = scales[b] * d(-w*L)/d logprobs, and per row
    the unscaled sum of -w*L, the number of clipped and dual-clipped tokens and the sum of
    -log_ratio.
    """
    lo, hi = float(ratio_low), float(ratio_high)
    dual, clamp = float(dual_clip), float(log_ratio_clamp)
    rnd = in_dtype(logprobs.dtype)
    for b in range(starts.shape[0]):
        total = clipped_count = dual_count = kl_total = 0.0
        for t in range(spans[b]):
            i = starts[b] + t
            if not _valid(mask, i, t, lengths[b]):
                grad[i] = 0.0
                continue
            advantage = float(advantages[i])
            weight = float(weights[i]) if weights.shape[0] else 1.0
            log_ratio = rnd(float(logprobs[i]) - float(old_logprobs[i]))
            inside = -clamp <= log_ratio <= clamp  # torch.clamp passes the gradient inclusively
            log_ratio = min(max(log_ratio, -clamp), clamp)
            ratio = rnd(saturated_exp(log_ratio, logprobs.dtype))
            unclipped = rnd(ratio * advantage)
            clipped = rnd(min(max(ratio, lo), hi) * advantage)
            # The clipped branch is taken only where it is strictly smaller: at a tie the
            # gradient is the unclipped one (torch's min splits ties in half, which sums to it).
            is_clipped = clipped < unclipped
            objective = clipped if is_clipped else unclipped
            is_dual = advantage < 0.0 and rnd(dual * advantage) > objective
            if is_dual:
                objective = rnd(dual * advantage)
            # A flat branch has slope 0, times the weight: a NaN or inf weight still says so.
            slope = 0.0 if (is_clipped or is_dual or not inside) else unclipped
            grad[i] = -weight * slope * float(scales[b])
            total += -weight * objective
            clipped_count += is_clipped
            dual_count += is_dual
            kl_total += -log_ratio
        row_loss[b] = total
        row_clipped[b] = clipped_count
        row_dual[b] = dual_count
        row_kl[b] = kl_total


def _clip(x: float, low: float, high: float) -> float:
    """min(max(x, low), high): NaN stays NaN (Python's max and min return their first argument
    when a comparison with NaN is false), as in every backend."""
    return min(max(x, low), high)


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
    n_threads,
):
    """Per token: l = -w * (A * logp - beta / 2 * (logp - old)^2), the penalty only when beta > 0.

    REINFORCE and GPG (beta = 0: -w * A * logp) and DRO (beta > 0). Writes grad = scales[b] *
    -w * (A - beta * (logp - old)), and per row the unscaled sum of l and the sum of -(logp -
    old). With beta = 0 the log-ratio enters nothing but the KL sum: an inf one leaves the loss
    and gradient finite.
    """
    half_beta, beta = float(beta) * 0.5, float(beta)
    rnd = in_dtype(logprobs.dtype)
    for b in range(starts.shape[0]):
        total = kl_total = 0.0
        for t in range(spans[b]):
            i = starts[b] + t
            if not _valid(mask, i, t, lengths[b]):
                grad[i] = 0.0
                continue
            logprob, advantage = float(logprobs[i]), float(advantages[i])
            weight = float(weights[i]) if weights.shape[0] else 1.0
            log_ratio = rnd(logprob - float(old_logprobs[i]))
            objective = rnd(advantage * logprob)
            slope = advantage
            if beta != 0.0:
                objective = rnd(objective - rnd(half_beta * rnd(log_ratio * log_ratio)))
                slope = rnd(advantage - rnd(beta * log_ratio))
            grad[i] = -weight * slope * float(scales[b])
            total += -weight * objective
            kl_total += -log_ratio
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
    n_threads,
):
    """Per token: l = -w * c * A * logp, c = clip(rho, lo, hi) held constant (no gradient).

    rho = exp(clamp(logp - old, -clamp, clamp)), exp saturating as the compiled kernels' does
    (``saturated_exp``). Writes grad = scales[b] * -w * c * A, and per
    row the unscaled sum of l, the number of tokens where c != rho (clipped on either side, and
    NaN ratios, as verl counts them), where rho < lo, and the sum of -log_ratio (clamped).
    """
    lo, hi, clamp = float(ratio_low), float(ratio_high), float(log_ratio_clamp)
    rnd = in_dtype(logprobs.dtype)
    for b in range(starts.shape[0]):
        total = clipped_count = lower_count = kl_total = 0.0
        for t in range(spans[b]):
            i = starts[b] + t
            if not _valid(mask, i, t, lengths[b]):
                grad[i] = 0.0
                continue
            logprob, advantage = float(logprobs[i]), float(advantages[i])
            weight = float(weights[i]) if weights.shape[0] else 1.0
            log_ratio = _clip(rnd(logprob - float(old_logprobs[i])), -clamp, clamp)
            ratio = rnd(saturated_exp(log_ratio, logprobs.dtype))
            coefficient = _clip(ratio, lo, hi)
            slope = rnd(coefficient * advantage)
            grad[i] = -weight * slope * float(scales[b])
            total += -weight * rnd(slope * logprob)
            clipped_count += coefficient != ratio
            lower_count += ratio < lo
            kl_total += -log_ratio
        row_loss[b] = total
        row_clipped[b] = clipped_count
        row_lower[b] = lower_count
        row_kl[b] = kl_total


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
    n_threads,
):
    """Per token: l = -w * g * A with the gate g = sigmoid(tau * (rho - 1)) * 4 / tau.

    tau = tau_pos where A > 0, tau_neg elsewhere; rho = exp(clamp(logp - old, -clamp, clamp));
    sigmoid(z) = 1 / (1 + exp(-z)), exp saturating as the compiled kernels' does (so that a
    ratio past exp(709) has the gradient's limit 0, not 0 * inf). Writes grad = scales[b] * -w
    * A * 4 s (1 - s) rho, with s the sigmoid (d g / d rho = 4 s (1 - s), d rho / d logp = rho),
    0 where the clamp is active; per row the unscaled sum of l and the sum of -log_ratio
    (clamped).
    """
    positive, negative = float(tau_pos), float(tau_neg)
    clamp = float(log_ratio_clamp)
    rnd = in_dtype(logprobs.dtype)
    for b in range(starts.shape[0]):
        total = kl_total = 0.0
        for t in range(spans[b]):
            i = starts[b] + t
            if not _valid(mask, i, t, lengths[b]):
                grad[i] = 0.0
                continue
            advantage = float(advantages[i])
            weight = float(weights[i]) if weights.shape[0] else 1.0
            raw = rnd(float(logprobs[i]) - float(old_logprobs[i]))
            # torch.clamp passes the gradient at its bounds, and a NaN log-ratio's NaN
            inside = not (raw < -clamp or raw > clamp)
            log_ratio = _clip(raw, -clamp, clamp)
            ratio = rnd(saturated_exp(log_ratio, logprobs.dtype))
            tau = positive if advantage > 0.0 else negative
            sigmoid = rnd(
                1.0 / rnd(1.0 + rnd(saturated_exp(-rnd(tau * rnd(ratio - 1.0)), logprobs.dtype)))
            )
            gate = rnd(sigmoid * rnd(4.0 / tau))
            slope = rnd(advantage * rnd(rnd(4.0 * sigmoid) * rnd(1.0 - sigmoid)))
            # A flat (clamped) token has slope 0, times the weight: a NaN weight still says so.
            grad[i] = -weight * (rnd(slope * ratio) if inside else 0.0) * float(scales[b])
            total += -weight * rnd(gate * advantage)
            kl_total += -log_ratio
        row_loss[b] = total
        row_kl[b] = kl_total


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
    n_threads,
):
    """Per token of row b: L = min(s*A, clip(s, lo, hi)*A), bounded below by c*A where A < 0,
    with the row's sequence ratio s in place of the token's ratio.

    Pre-pass per row: n = its valid tokens, m = (sum of logp - old over them) / max(n, 1)
    (float64 sum, rounded to the dtype), log s = min(m, log_ratio_max), s = exp(log s) (exp
    saturating as the compiled kernels'). Token pass: the clipped surrogate's branches on s (the
    clipped branch where strictly smaller, dual clip c = dual_clip where A < 0 and c*A is strictly
    larger); slope = d L / d s = A on the unclipped branch, 0 on a flat one. The gradient, 0
    where m > log_ratio_max (the clamp is active strictly beyond its bound):

        form "detached" (verl): grad = scales[b] * -w * slope * s, each token its own;
        form "sequence" (TRL, OpenRLHF): grad = (sum over the row's valid tokens of -w * slope)
            * s * scales[b] / n at every valid token of the row.

    Writes per row the unscaled sum of -w*L, the number of clipped tokens, of those with A < 0
    (clipped at the lower bound), and the sum of -(logp - old) (not clamped). A row with no
    valid token has nothing to sum: 0 everywhere.
    """
    lo, hi, dual, cap = float(ratio_low), float(ratio_high), float(dual_clip), float(log_ratio_max)
    rnd = in_dtype(logprobs.dtype)
    for b in range(starts.shape[0]):
        positions = [
            starts[b] + t for t in range(spans[b]) if _valid(mask, starts[b] + t, t, lengths[b])
        ]
        log_ratio_total = 0.0
        for i in positions:
            log_ratio_total += rnd(float(logprobs[i]) - float(old_logprobs[i]))
        count = len(positions)
        mean = rnd(log_ratio_total / max(count, 1))
        inside = not mean > cap  # torch.clamp passes the gradient at its bound, and a NaN's NaN
        ratio = rnd(saturated_exp(cap if mean > cap else mean, logprobs.dtype))
        scale = float(scales[b])
        total = clipped_count = lower_count = kl_total = slope_total = 0.0
        for t in range(spans[b]):
            grad[starts[b] + t] = 0.0
        for i in positions:
            advantage = float(advantages[i])
            weight = float(weights[i]) if weights.shape[0] else 1.0
            unclipped = rnd(ratio * advantage)
            clipped = rnd(_clip(ratio, lo, hi) * advantage)
            is_clipped = clipped < unclipped
            objective = clipped if is_clipped else unclipped
            is_dual = advantage < 0.0 and rnd(dual * advantage) > objective
            if is_dual:
                objective = rnd(dual * advantage)
            slope = 0.0 if (is_clipped or is_dual) else advantage
            if form == DETACHED:
                # A flat branch has slope 0, times the weight: a NaN or inf weight still says so.
                grad[i] = -weight * (rnd(slope * ratio) if inside else 0.0) * scale
            else:
                slope_total += -weight * slope
            total += -weight * objective
            clipped_count += is_clipped
            lower_count += is_clipped and advantage < 0.0
            kl_total += -rnd(float(logprobs[i]) - float(old_logprobs[i]))
        if form != DETACHED:
            row_grad = slope_total * (ratio if inside else 0.0) * scale / max(count, 1)
            for i in positions:
                grad[i] = row_grad
        row_loss[b] = total
        row_clipped[b] = clipped_count
        row_lower[b] = lower_count
        row_kl[b] = kl_total


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
    n_threads,
):
    """Per row b with n valid tokens: L = -mean(A) * exp(mean(r') + mean(log w)), the per-token
    loss of each of its valid tokens (so the row sums n * L).

    r = logp - old; r' = min(r, hi) where A > 0, max(r, -lo) where A < 0, r * 0 where A = 0
    (verl's sign(A) * min(sign(A) * r, sign(A) * clamp(r, -lo, hi))); lo, hi = log_ratio_low,
    log_ratio_high. Row arithmetic in float64 (exp saturating as the compiled kernels' float64
    exp). Writes grad = scales[b] * L at the valid tokens where r' moves with r (A > 0 and r <=
    hi, or A < 0 and r >= -lo: torch.clamp and torch.min pass the gradient at a bound), 0
    elsewhere (d (n L) / d logp_t = n * L / n); per row n * L, the number of tokens with r
    outside [-lo, hi] (or NaN) and A > 0, those with A < 0, and the sum of -r. A row with no
    valid token contributes nothing: 0 everywhere.
    """
    lo, hi = float(log_ratio_low), float(log_ratio_high)
    rnd = in_dtype(logprobs.dtype)
    for b in range(starts.shape[0]):
        positions = [
            starts[b] + t for t in range(spans[b]) if _valid(mask, starts[b] + t, t, lengths[b])
        ]
        kept_total = advantage_total = log_weight_total = 0.0
        upper_count = lower_count = kl_total = 0.0
        sloped = []
        for i in positions:
            advantage = float(advantages[i])
            log_ratio = rnd(float(logprobs[i]) - float(old_logprobs[i]))
            if advantage > 0.0:
                kept = hi if log_ratio > hi else log_ratio
                sloped.append(log_ratio <= hi)
            elif advantage < 0.0:
                kept = -lo if log_ratio < -lo else log_ratio
                sloped.append(log_ratio >= -lo)
            else:
                kept = rnd(log_ratio * 0.0)
                sloped.append(False)
            kept_total += kept
            advantage_total += advantage
            if weights.shape[0]:
                log_weight_total += safe_log(float(weights[i]))
            outside = not (-lo <= log_ratio <= hi)  # NaN too, as verl's ne(r, clamp(r))
            upper_count += outside and advantage > 0.0
            lower_count += outside and advantage < 0.0
            kl_total += -log_ratio
        for t in range(spans[b]):
            grad[starts[b] + t] = 0.0
        total = 0.0
        count = len(positions)
        if count:
            # exp(mean(r')) * exp(mean(log w)) in one exp
            weighted_ratio = saturated_exp(
                kept_total / count + log_weight_total / count, np.float64
            )
            loss = -(advantage_total / count) * weighted_ratio
            total = count * loss
            for i, moves in zip(positions, sloped, strict=True):
                grad[i] = loss * float(scales[b]) if moves else 0.0
        row_loss[b] = total
        row_clipped[b] = upper_count
        row_lower[b] = lower_count
        row_kl[b] = kl_total


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
    n_threads,
):
    """Per token: l = -w * A * sg(min(rho, cap)) * logp * v, v = 1 where the token is within
    the trust region and 0 outside (verl's DPPO-Binary-TV and -KL; v held constant).

    rho = exp(clamp(logp - old, -clamp, clamp)); p = exp(logp), p_old = exp(old), exp
    saturating as the compiled kernels'; lo, hi = divergence_low, divergence_high. "tv": v = (p -
    p_old <= hi) where A > 0, (p - p_old >= -lo) elsewhere. "kl": with the binary KL d = p_old *
    (old - logp) + (1 - p_old) * log((1 - p_old + 1e-8) / (1 - p + 1e-8)), evaluated in float64
    (p and p_old too), v = (d <= hi or logp <= old) where A > 0, (d <= lo or logp >= old)
    elsewhere (p <= p_old read on the log-probabilities, where nothing rounds). In
    float32 the two terms of d cancel below their rounding (about 3e-8) wherever |p - p_old| <
    3e-4, so that the dtype's arithmetic decided a bound of 0 by rounding. v multiplies (a NaN
    stays NaN). Writes grad = scales[b] * -w * A * min(rho, cap) * v, and per row the
    unscaled sum of l, the number of tokens outside (v = 0), of those inside whose ratio is
    above the cap, and the sum of -log_ratio (clamped).
    """
    low, high = float(divergence_low), float(divergence_high)
    cap, clamp = float(ratio_cap), float(log_ratio_clamp)
    binary_kl = int(divergence) == BINARY_KL
    dtype = logprobs.dtype
    rnd = in_dtype(dtype)
    for b in range(starts.shape[0]):
        total = outside_count = capped_count = kl_total = 0.0
        for t in range(spans[b]):
            i = starts[b] + t
            if not _valid(mask, i, t, lengths[b]):
                grad[i] = 0.0
                continue
            logprob, old, advantage = (float(a[i]) for a in (logprobs, old_logprobs, advantages))
            weight = float(weights[i]) if weights.shape[0] else 1.0
            log_ratio = _clip(rnd(logprob - old), -clamp, clamp)
            ratio = rnd(saturated_exp(log_ratio, dtype))
            prob, old_prob = rnd(saturated_exp(logprob, dtype)), rnd(saturated_exp(old, dtype))
            if binary_kl:  # in float64
                prob, old_prob = saturated_exp(logprob, np.float64), saturated_exp(old, np.float64)
                complement = 1.0 - old_prob
                quotient = safe_divide(complement + 1e-8, (1.0 - prob) + 1e-8)
                distance = old_prob * (old - logprob) + complement * safe_log(quotient)
                if advantage > 0.0:
                    inside = distance <= high or logprob <= old
                else:
                    inside = distance <= low or logprob >= old
            else:
                difference = rnd(prob - old_prob)
                inside = difference <= high if advantage > 0.0 else difference >= -low
            kept = 1.0 if inside else 0.0
            slope = rnd(advantage * min(ratio, cap))
            grad[i] = -weight * rnd(slope * kept) * float(scales[b])
            total += -weight * rnd(rnd(slope * logprob) * kept)
            outside_count += not inside
            capped_count += inside and ratio > cap
            kl_total += -log_ratio
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
    n_threads,
):
    """Per token: l = -w * (A * rho - p * |logp - old|), the penalty only where p != 0.

    rho = exp(logp - old) (not clamped, as verl's KL-Cov), exp saturating as the compiled
    kernels'; p = coef where selected[i] != 0, else 0 (verl: ppo_kl_coef at the tokens its
    covariance selection picked). Writes grad = scales[b] * -w * (A * rho - p * sign(logp -
    old)), with sign(0) = 0 (torch's abs has gradient 0 at 0), and per row the unscaled sum of
    l, the number of penalised tokens (p != 0) and the sum of |logp - old|.
    """
    rnd = in_dtype(logprobs.dtype)
    for b in range(starts.shape[0]):
        total = penalised_count = abs_total = 0.0
        for t in range(spans[b]):
            i = starts[b] + t
            if not _valid(mask, i, t, lengths[b]):
                grad[i] = 0.0
                continue
            advantage = float(advantages[i])
            penalty = float(coef) if selected[i] != 0 else 0.0
            weight = float(weights[i]) if weights.shape[0] else 1.0
            log_ratio = rnd(float(logprobs[i]) - float(old_logprobs[i]))
            distance = abs(log_ratio)
            objective = slope = rnd(advantage * rnd(saturated_exp(log_ratio, logprobs.dtype)))
            if penalty != 0.0:
                sign = math.copysign(1.0, log_ratio) if log_ratio != 0.0 else 0.0
                sign = log_ratio if log_ratio != log_ratio else sign  # NaN stays NaN
                objective = rnd(objective - rnd(penalty * distance))
                slope = rnd(slope - rnd(penalty * sign))
            grad[i] = -weight * slope * float(scales[b])
            total += -weight * objective
            penalised_count += penalty != 0.0
            abs_total += distance
        row_loss[b] = total
        row_penalised[b] = penalised_count
        row_abs_kl[b] = abs_total


def _lane_total(lanes):
    """Eight lanes of a sum added up in the kernels' fixed tree (src/lanes.h ppo_f64x8_total)."""
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
        (lanes[4] + lanes[5]) + (lanes[6] + lanes[7])
    )


def kl_cov_top_k(
    logprobs,
    advantages,
    starts,
    spans,
    lengths,
    mask,
    group_rows,
    group_starts,
    ratio,
    selected,
    n_threads,
):
    """Per group, over its n valid tokens (its rows in row order, each row's in order):

        cov_i = (A_i - mean A) * (logp_i - mean logp)

    in float64, each mean's sum taken row by row: a row's valid tokens in 8 lanes (token t of the
    row to lane t % 8, in order, each lane from 0.0) added up in the tree ((l0 + l1) + (l2 + l3))
    + ((l4 + l5) + (l6 + l7)), then the rows' sums added in row order, from 0.0 (so that the
    rows' sums can be taken on any number of threads). Writes the flag selected = 1 at the
    k = min(n, max(1, floor(ratio * n))) tokens of largest cov (a NaN counts as -inf; ties at the
    k-th value to the lowest positions), 0 at every other position; nothing is selected when
    n = 0. The public ``kl_cov_selection`` passes the whole batch as one group.
    """
    for g in range(group_starts.shape[0] - 1):
        rows = [int(b) for b in group_rows[group_starts[g] : group_starts[g + 1]]]
        positions = [i for b in rows for i in _row_positions(starts, spans, lengths, mask, b)]
        for b in rows:
            for t in range(spans[b]):
                selected[starts[b] + t] = 0
        n = len(positions)
        if n == 0:
            continue
        total_adv = total_logp = 0.0
        for b in rows:
            adv_lanes, logp_lanes = [0.0] * 8, [0.0] * 8
            for i in _row_positions(starts, spans, lengths, mask, b):
                adv_lanes[(i - starts[b]) % 8] += float(advantages[i])
                logp_lanes[(i - starts[b]) % 8] += float(logprobs[i])
            total_adv += _lane_total(adv_lanes)
            total_logp += _lane_total(logp_lanes)
        mean_adv, mean_logp = total_adv / n, total_logp / n
        keys = {}
        for i in positions:
            cov = (float(advantages[i]) - mean_adv) * (float(logprobs[i]) - mean_logp)
            keys[i] = cov if cov == cov else -math.inf
        wanted = ratio * n
        k = n if wanted >= n else max(int(wanted), 1)
        for i in sorted(positions, key=lambda i: (-keys[i], i))[:k]:
            selected[i] = 1


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
    n_threads,
):
    """Per token: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).

    c = clip (inf without clipping). Writes grad = scales[b] * d loss / d v, and per row the
    unscaled loss sum and the number of tokens where the clipped term is strictly larger.
    """
    clip = float(clip)
    rnd = in_dtype(values.dtype)
    for b in range(starts.shape[0]):
        total = clipped_count = 0.0
        for t in range(spans[b]):
            i = starts[b] + t
            if not _valid(mask, i, t, lengths[b]):
                grad[i] = 0.0
                continue
            value, old, target = float(values[i]), float(old_values[i]), float(returns[i])
            error = rnd(value - target)
            unclipped = rnd(error * error)  # not error ** 2, which raises OverflowError
            clipped_error = rnd(min(max(value, rnd(old - clip)), rnd(old + clip)) - target)
            clipped = rnd(clipped_error * clipped_error)
            is_clipped = clipped > unclipped
            grad[i] = 0.0 if is_clipped else error * float(scales[b])
            total += 0.5 * (clipped if is_clipped else unclipped)
            clipped_count += is_clipped
        row_loss[b] = total
        row_clipped[b] = clipped_count
