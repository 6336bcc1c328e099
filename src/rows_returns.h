/* -- discounted returns, ReMax and the optimal token baseline ---------------------------------- */
/* Twins of discounted_returns, remax and optimal_token_baseline (ppo_fast/_numba_kernels.py). The
 * running return is float64 whatever the dtype, and each multiply-add on it is one fma, as the
 * twins' llvm.fma (the same bits as numba). Included by rows.h, once per dtype. */

#ifndef PPO_FAST_ROWS_RETURNS_ONCE
#define PPO_FAST_ROWS_RETURNS_ONCE
#include <stdlib.h>

/* The end of a row's positions that may be valid: min(length, span), from 0. */
PPO_INLINE ptrdiff_t ppo_valid_end(ptrdiff_t span, ptrdiff_t length) {
    return length < span ? (length > 0 ? length : 0) : span;
}

/* The number of valid positions of the row at start. */
PPO_INLINE ptrdiff_t ppo_valid_count(
    ptrdiff_t start, ptrdiff_t span, ptrdiff_t length, const uint8_t* mask, int has_mask) {
    ptrdiff_t valid_end = ppo_valid_end(span, length), count = 0;
    if (!has_mask) return valid_end;
    for (ptrdiff_t i = start; i < start + valid_end; i++) count += mask[i] != 0;
    return count;
}

/* The returns of a block of 8 valid positions (lane 7 the last) from their rewards and the
 * running return after the block, by the log-step scan of ppo_gae_block (rows_gae.h, whose
 * comment has the algebra): the suffix returns a_j = sum_{k=0}^{7-j} gamma^k r_{j+k} in three
 * steps of lanes moved down (1, 2 and 4 lanes), then G_j = fma(gamma^(8-j), G_8, a_j). A chain of
 * 7 fma per block took the returns to 0.46 ns a position in the cache (2.7x the memory floor at
 * 1024x4096); the steps are independent of the other blocks, and the row's chain is one fma a
 * block. The sums are reassociated, within a few ulp of the recursion's (the oracle's
 * tolerances), and the same on every backend and thread count. Taken only where it cannot differ
 * from the recursion in anything but rounding, as ppo_gae_block: every reward within 2^1000 and
 * the running return within 2^1020; 0, with nothing changed, elsewhere. gammas, gamma_2s and
 * gamma_4s: gamma, gamma^2 and gamma^4 in every lane, made once a row by the caller (as
 * ppo_gae_scan's, which says why); powers: lane j gamma^(8 - j). */
PPO_INLINE int ppo_returns_block(
    ppo_f64x8 rewards, ppo_f64x8 gammas, ppo_f64x8 gamma_2s, ppo_f64x8 gamma_4s, ppo_f64x8 powers,
    double* running, ppo_f64x8* returns) {
    ppo_m64x8 bounded = ppo_f64x8_le(ppo_f64x8_abs(rewards), ppo_f64x8_splat(0x1p1000));
    if (!(fabs(*running) <= 0x1p1020) ||
        ppo_m64x8_any(ppo_m64x8_and_not(ppo_m64x8_all(), bounded)))
        return 0;
    ppo_f64x8 sums = ppo_f64x8_fma(gammas, ppo_f64x8_down1_fill(rewards, 0.0), rewards);
    sums = ppo_f64x8_fma(gamma_2s, ppo_f64x8_down2(sums), sums);
    sums = ppo_f64x8_fma(gamma_4s, ppo_f64x8_down4(sums), sums);
    *returns = ppo_f64x8_fma(powers, ppo_f64x8_splat(*running), sums);
    *running = ppo_f64x8_lane0(*returns);
    return 1;
}

/* The returns of n contiguous float64 rewards r[0 .. n), in place, from the running return after
 * them: ppo_returns_cases on a row without a mask, operation for operation (blocks of 8 from the
 * end by ppo_returns_block, a block outside its bounds and the first n % 8 by the recursion). */
PPO_INLINE void ppo_returns_in_place(double* r, ptrdiff_t n, double gamma, double running) {
    double powers[9], lanes[8];
    ptrdiff_t t = n, j;
    powers[0] = 1.0;
    for (j = 1; j <= 8; j++) powers[j] = gamma * powers[j - 1];
    for (j = 0; j < 8; j++) lanes[j] = powers[8 - j];
    ppo_f64x8 block_powers = ppo_f64x8_load(lanes), block;
    double gamma_2 = gamma * gamma, gamma_4 = gamma_2 * gamma_2;
    ppo_f64x8 gammas = ppo_f64x8_splat(gamma), gamma_2s = ppo_f64x8_splat(gamma_2);
    ppo_f64x8 gamma_4s = ppo_f64x8_splat(gamma_4);
    if (gamma == 0.0 || powers[8] != 0.0) {
        for (; t >= 8; t -= 8) {
            double* at = r + t - 8;
            if (ppo_returns_block(
                    ppo_f64x8_load(at), gammas, gamma_2s, gamma_4s, block_powers, &running,
                    &block)) {
                ppo_f64x8_store(at, block);
            } else {
                for (j = 7; j >= 0; j--) at[j] = running = fma(gamma, running, at[j]);
            }
        }
    }
    for (t = t - 1; t >= 0; t--) r[t] = running = fma(gamma, running, r[t]);
}

/* Whether a row's valid tokens are its first `count` positions (no hole among them): its
 * valid-token index is then its position. */
PPO_INLINE int ppo_valid_prefix(
    const uint8_t* mask, int has_mask, ptrdiff_t start, ptrdiff_t count) {
    ptrdiff_t valid = 0;
    if (!has_mask) return 1;
    for (ptrdiff_t i = start; i < start + count; i++) valid += mask[i] != 0;
    return valid == count;
}
#endif

/* One position of the plain recursion (advantages: NULL for none); the running return after it. */
PPO_INLINE double PPO_ROW(ppo_returns_step)(
    const ppo_real* rewards, int has_mask, const uint8_t* mask, ptrdiff_t i, double gamma,
    double running, double baseline, ppo_real* advantages, ppo_real* returns) {
    if (!has_mask || mask[i] != 0) {
        running = fma(gamma, running, (double)rewards[i]);
        returns[i] = (ppo_real)running;
        if (advantages) advantages[i] = (ppo_real)(running - baseline);
    } else {
        returns[i] = 0;
        if (advantages) advantages[i] = 0;
    }
    return running;
}

/* Twin of _returns_row (its docstring says why): the padding past the length first, then the
 * valid prefix backwards in blocks of 8 positions, a block whose 8 positions are valid (and
 * within ppo_returns_block's bounds) as G_j = fma(gamma^(8-j), G_8, a_j) with a_j its own suffix
 * returns by the log-step scan, the others and the row's first positions by the plain recursion.
 * Operation for operation the twin's (the same bits).
 * has_mask is a constant in each of the two calls below, so that each gets its own loop. */
PPO_INLINE void PPO_ROW(ppo_returns_cases)(
    int has_mask, const ppo_real* rewards, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, double gamma, double running, double baseline, ppo_real* advantages,
    ppo_real* returns) {
    ptrdiff_t valid_end = ppo_valid_end(span, length), t, j;
    PPO_ROW(ppo_zeros_backwards)(returns, advantages, start + valid_end, start + span);
    double powers[9], lanes[8];
    powers[0] = 1.0;
    for (j = 1; j <= 8; j++) powers[j] = gamma * powers[j - 1];
    for (j = 0; j < 8; j++) lanes[j] = powers[8 - j];
    ppo_f64x8 block_powers = ppo_f64x8_load(lanes), baselines = ppo_f64x8_splat(baseline), block;
    double gamma_2 = gamma * gamma, gamma_4 = gamma_2 * gamma_2;
    ppo_f64x8 gammas = ppo_f64x8_splat(gamma), gamma_2s = ppo_f64x8_splat(gamma_2);
    ppo_f64x8 gamma_4s = ppo_f64x8_splat(gamma_4);
    t = valid_end;
    if (gamma == 0.0 || powers[8] != 0.0) {
        for (; t >= 8; t -= 8) {
            ptrdiff_t i = start + t - 8;
            PPO_ROW(ppo_prefetch_behind)(
                rewards, NULL, returns, advantages, has_mask ? mask : NULL, t, i);
            if ((!has_mask || ppo_all_valid8(mask + i)) &&
                ppo_returns_block(
                    PPO_V(to_f64)(PPO_V(load)(rewards + i)), gammas, gamma_2s, gamma_4s,
                    block_powers, &running, &block)) {
                PPO_V(store)(returns + i, PPO_V(from_f64)(block));
                if (advantages)
                    PPO_V(store)(advantages + i, PPO_V(from_f64)(ppo_f64x8_sub(block, baselines)));
            } else { /* a hole among the 8, or outside the scan's bounds: the recursion */
                for (j = 7; j >= 0; j--)
                    running = PPO_ROW(ppo_returns_step)(
                        rewards, has_mask, mask, i + j, gamma, running, baseline, advantages,
                        returns);
            }
        }
    }
    for (t = t - 1; t >= 0; t--)
        running = PPO_ROW(ppo_returns_step)(
            rewards, has_mask, mask, start + t, gamma, running, baseline, advantages, returns);
}

PPO_INLINE void PPO_ROW(ppo_returns_row)(
    const ppo_real* rewards, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, double gamma, double running, double baseline,
    ppo_real* advantages, ppo_real* returns) {
    if (has_mask)
        PPO_ROW(ppo_returns_cases)(
            1, rewards, start, span, length, mask, gamma, running, baseline, advantages, returns);
    else
        PPO_ROW(ppo_returns_cases)(
            0, rewards, start, span, length, mask, gamma, running, baseline, advantages, returns);
}

static void PPO_ROW(ppo_discounted_returns_row)(
    const ppo_real* rewards, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, double gamma, double running, ppo_real* returns) {
    PPO_ROW(ppo_returns_row)(
        rewards, start, span, length, mask, has_mask, gamma, running, 0.0, NULL, returns);
}

static void PPO_ROW(ppo_remax_row)(
    const ppo_real* rewards, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, double gamma, double running, double baseline,
    ppo_real* advantages, ppo_real* returns) {
    PPO_ROW(ppo_returns_row)(
        rewards, start, span, length, mask, has_mask, gamma, running, baseline, advantages,
        returns);
}

/* The returns of a row's `count` valid tokens, back to back in row_returns (valid-token index k):
 * the rewards gathered (a copy where they are its first positions, `prefix`), then
 * ppo_returns_in_place from the row's bootstrap (the recursion's chain, 4 cycles a token,
 * becomes one fma per 8 tokens). The bits depend only on the row's valid tokens, not on its
 * layout (padded with holes, right-padded or packed). */
PPO_INLINE void PPO_ROW(ppo_valid_returns)(
    const ppo_real* rewards, const uint8_t* mask, int prefix, ptrdiff_t start,
    ptrdiff_t valid_end, ptrdiff_t count, double gamma, double bootstrap, double* row_returns) {
    if (prefix) {
        for (ptrdiff_t k = 0; k < count; k++) row_returns[k] = (double)rewards[start + k];
    } else {
        ptrdiff_t k = 0;
        for (ptrdiff_t i = start; i < start + valid_end; i++)
            if (mask[i] != 0) row_returns[k++] = (double)rewards[i];
    }
    ppo_returns_in_place(row_returns, count, gamma, bootstrap);
}

/* to[n-1-k] = from[k] for k < n. */
PPO_INLINE void PPO_ROW(ppo_reversed)(
    const double* restrict from, ptrdiff_t n, double* restrict to) {
    for (ptrdiff_t k = 0; k < n; k++) to[n - 1 - k] = from[k];
}

/* A row into the baseline's sums: its first `reached` valid tokens' returns times their
 * cumulative weights, and those weights. The weights go by valid-token index into the exps'
 * scratch (by position: token k is at a position >= k, so the loop never overwrites an exp it
 * has still to read), then reversed into `cumulative`: the cumulative weights are their
 * returns with gamma 1 (ppo_returns_in_place), reversed back. Each loop is its own, so that the
 * compiler runs them 8 at a time where the row is a prefix. */
PPO_INLINE void PPO_ROW(ppo_baseline_sums)(
    const ppo_real* rewards, const ppo_real* old_logprobs, const ppo_real* sum_pi_squared,
    const ppo_real* is_weights, int has_is_weights, const uint8_t* mask, int prefix,
    ptrdiff_t start, ptrdiff_t valid_end, ptrdiff_t count, ptrdiff_t reached, double gamma,
    double bootstrap, double* row_returns, double* exps, double* cumulative, double* numerators,
    double* denominators) {
    ptrdiff_t k, i, reach = prefix ? reached : valid_end; /* the exps read below */
    PPO_ROW(ppo_valid_returns)(
        rewards, mask, prefix, start, valid_end, count, gamma, bootstrap, row_returns);
    for (k = 0; k + 8 <= reach; k += 8) {
        ppo_f64x8 x = PPO_V(to_f64)(PPO_V(load)(old_logprobs + start + k));
        ppo_f64x8_store(exps + k, ppo_f64x8_exp(x));
    }
    for (; k < reach; k++) exps[k] = ppo_exp64((double)old_logprobs[start + k]);
    if (prefix) {
        for (k = 0; k < reached; k++) {
            double weight = 1.0 - 2.0 * exps[k];
            exps[k] = weight + (double)sum_pi_squared[start + k];
        }
        if (has_is_weights) {
            for (k = 0; k < reached; k++) {
                double is_weight = is_weights[start + k];
                exps[k] = exps[k] * (is_weight * is_weight);
            }
        }
    } else {
        for (i = start, k = 0; k < reached; i++) {
            if (mask[i] != 0) {
                double weight = 1.0 - 2.0 * exps[i - start];
                weight = weight + (double)sum_pi_squared[i];
                if (has_is_weights) {
                    double is_weight = is_weights[i];
                    weight = weight * (is_weight * is_weight);
                }
                exps[k++] = weight;
            }
        }
    }
    PPO_ROW(ppo_reversed)(exps, reached, cumulative);
    ppo_returns_in_place(cumulative, reached, 1.0, 0.0);
    PPO_ROW(ppo_reversed)(cumulative, reached, exps); /* token k's cumulative weight at k */
    for (k = 0; k < reached; k++) {
        numerators[k] = numerators[k] + row_returns[k] * exps[k];
        denominators[k] = denominators[k] + exps[k];
    }
}

/* One group: its rows are rows[0 .. n_rows-1] (in row order). The scratch holds, by valid-token
 * index, the baseline's numerators and denominators (summed over the group's rows in order),
 * one row's returns and cumulative weights at a time; and by position, one row's
 * exp(old_logprobs), computed 8 at a time first (the kernels' exp, ppo_f64x8_exp: libm's one
 * call a token was a quarter of the kernel's time). A row's two chains, its returns and its
 * cumulative weights, run as block scans on its valid tokens gathered back to back
 * (ppo_baseline_sums: reassociated sums, within a few ulp of the recursions', the same for any
 * layout of the same tokens), and a row whose valid tokens are its first positions
 * (right-padded, lengths, packed: the common case) gathers and scatters by copies: as
 * recursions a token at a time, with a branch a position in every loop, the kernel took 16.7
 * ms at float32 (1024, 4096), 6.5x the memory floor. Returns 1 when the scratch cannot be
 * allocated, else 0. */
static int PPO_ROW(ppo_optimal_token_baseline_group)(
    const ppo_real* rewards, const ppo_real* old_logprobs, const ppo_real* sum_pi_squared,
    const ppo_real* is_weights, int has_is_weights, const int64_t* starts, const int64_t* spans,
    const int64_t* lengths, const uint8_t* mask, int has_mask, const int64_t* rows,
    ptrdiff_t n_rows, const double* gammas, const double* bootstrap, double eps, int zero_tail,
    ppo_real* advantages, ppo_real* returns) {
    /* The longest and second-longest rows (by valid tokens), and how many are that long. */
    ptrdiff_t longest = 0, second = 0, n_longest = 0, n_reaching = 0, baseline_end, j, k;
    ptrdiff_t widest = 0; /* the longest valid extent (positions before the length) */
    for (j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
        ptrdiff_t extent = ppo_valid_end(spans[b], lengths[b]);
        if (extent > widest) widest = extent;
        ptrdiff_t count = ppo_valid_count(starts[b], spans[b], lengths[b], mask, has_mask);
        if (count == 0) continue;
        n_reaching++;
        if (count > longest) {
            second = longest;
            longest = count;
            n_longest = 1;
        } else if (count == longest) {
            n_longest++;
        } else if (count > second) {
            second = count;
        }
    }
    if (n_reaching < 2)
        baseline_end = 0;
    else if (zero_tail != 0 && n_longest == 1)
        baseline_end = second;
    else
        baseline_end = longest;
    double *scratch = NULL, *numerators = NULL, *denominators = NULL, *row_returns = NULL;
    double *cumulatives = NULL, *exps = NULL;
    if (longest > 0) {
        scratch = (double*)malloc((4 * (size_t)longest + (size_t)widest) * sizeof(double));
        if (scratch == NULL) return 1;
        numerators = scratch;
        denominators = scratch + longest;
        row_returns = scratch + 2 * longest;
        cumulatives = scratch + 3 * longest;
        exps = scratch + 4 * longest;
        for (k = 0; k < baseline_end; k++) numerators[k] = denominators[k] = 0.0;
    }
    for (j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
        ptrdiff_t start = starts[b], valid_end = ppo_valid_end(spans[b], lengths[b]);
        ptrdiff_t count = ppo_valid_count(start, spans[b], lengths[b], mask, has_mask);
        ptrdiff_t reached = count < baseline_end ? count : baseline_end; /* tokens summed */
        if (reached > 0)
            PPO_ROW(ppo_baseline_sums)(
                rewards, old_logprobs, sum_pi_squared, is_weights, has_is_weights, mask,
                ppo_valid_prefix(mask, has_mask, start, count), start, valid_end, count, reached,
                gammas[b], bootstrap[b], row_returns, exps, cumulatives, numerators,
                denominators);
    }
    for (k = 0; k < baseline_end; k++) numerators[k] = numerators[k] / (denominators[k] + eps);
    const double* baselines = numerators;
    for (j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
        ptrdiff_t start = starts[b], span = spans[b], valid_end = ppo_valid_end(span, lengths[b]);
        ptrdiff_t count = ppo_valid_count(start, span, lengths[b], mask, has_mask), i;
        ptrdiff_t based = count < baseline_end ? count : baseline_end;
        int prefix = ppo_valid_prefix(mask, has_mask, start, count);
        if (count > 0)
            PPO_ROW(ppo_valid_returns)(
                rewards, mask, prefix, start, valid_end, count, gammas[b], bootstrap[b],
                row_returns);
        if (prefix) {
            for (k = 0; k < based; k++) {
                advantages[start + k] = (ppo_real)(row_returns[k] - baselines[k]);
                returns[start + k] = (ppo_real)row_returns[k];
            }
            for (; k < count; k++) {
                advantages[start + k] = (ppo_real)(row_returns[k] - 0.0);
                returns[start + k] = (ppo_real)row_returns[k];
            }
            for (i = start + count; i < start + span; i++) advantages[i] = returns[i] = 0;
            continue;
        }
        for (i = start, k = 0; i < start + valid_end; i++) {
            if (mask[i] != 0) {
                double baseline = k < baseline_end ? baselines[k] : 0.0;
                advantages[i] = (ppo_real)(row_returns[k] - baseline);
                returns[i] = (ppo_real)row_returns[k];
                k++;
            } else {
                advantages[i] = 0;
                returns[i] = 0;
            }
        }
        for (i = start + valid_end; i < start + span; i++) advantages[i] = returns[i] = 0;
    }
    free(scratch);
    return 0;
}
