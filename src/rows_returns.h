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
 * valid prefix backwards in blocks of 8 positions, a block whose 8 positions are valid as
 * G_j = fma(gamma^(8-j), G_8, a_j) with a_j its own suffix returns, the others and the row's
 * first positions by the plain recursion. Operation for operation the twin's (the same bits).
 * has_mask is a constant in each of the two calls below, so that each gets its own loop. */
PPO_INLINE void PPO_ROW(ppo_returns_cases)(
    int has_mask, const ppo_real* rewards, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, double gamma, double running, double baseline, ppo_real* advantages,
    ppo_real* returns) {
    ptrdiff_t valid_end = ppo_valid_end(span, length), t, j;
    for (t = start + valid_end; t < start + span; t++) {
        returns[t] = 0;
        if (advantages) advantages[t] = 0;
    }
    double powers[9];
    powers[0] = 1.0;
    for (j = 1; j <= 8; j++) powers[j] = gamma * powers[j - 1];
    t = valid_end;
    if (gamma == 0.0 || powers[8] != 0.0) {
        for (; t >= 8; t -= 8) {
            ptrdiff_t i = start + t - 8;
            PPO_ROW(ppo_prefetch_behind)(
                rewards, NULL, returns, advantages, has_mask ? mask : NULL, t, i);
            if (!has_mask || ppo_all_valid8(mask + i)) {
                double suffix[8], block[8];
                suffix[7] = (double)rewards[i + 7];
                for (j = 6; j >= 0; j--) suffix[j] = fma(gamma, suffix[j + 1], (double)rewards[i + j]);
                for (j = 0; j < 8; j++) block[j] = fma(powers[8 - j], running, suffix[j]);
                for (j = 0; j < 8; j++) returns[i + j] = (ppo_real)block[j];
                if (advantages)
                    for (j = 0; j < 8; j++) advantages[i + j] = (ppo_real)(block[j] - baseline);
                running = block[0];
            } else {
                for (j = 7; j >= 0; j--)
                    running = PPO_ROW(ppo_returns_step)(
                        rewards, 1, mask, i + j, gamma, running, baseline, advantages, returns);
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

/* One group: its rows are rows[0 .. n_rows-1] (in row order). The scratch holds, by valid-token
 * index, the baseline's numerators and denominators (summed over the group's rows in order),
 * and one row's returns at a time. Returns 1 when the scratch cannot be allocated, else 0. */
static int PPO_ROW(ppo_optimal_token_baseline_group)(
    const ppo_real* rewards, const ppo_real* old_logprobs, const ppo_real* sum_pi_squared,
    const ppo_real* is_weights, int has_is_weights, const int64_t* starts, const int64_t* spans,
    const int64_t* lengths, const uint8_t* mask, int has_mask, const int64_t* rows,
    ptrdiff_t n_rows, const double* gammas, const double* bootstrap, double eps, int zero_tail,
    ppo_real* advantages, ppo_real* returns) {
    /* The longest and second-longest rows (by valid tokens), and how many are that long. */
    ptrdiff_t longest = 0, second = 0, n_longest = 0, n_reaching = 0, baseline_end, j, k;
    for (j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
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
    if (longest > 0) {
        scratch = (double*)malloc(3 * (size_t)longest * sizeof(double));
        if (scratch == NULL) return 1;
        numerators = scratch;
        denominators = scratch + longest;
        row_returns = scratch + 2 * longest;
        for (k = 0; k < baseline_end; k++) numerators[k] = denominators[k] = 0.0;
    }
    for (j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
        ptrdiff_t start = starts[b], valid_end = ppo_valid_end(spans[b], lengths[b]);
        ptrdiff_t slot = longest, index = 0, i;
        double gamma = gammas[b], running = bootstrap[b], cumulative = 0.0;
        /* The row's returns by valid-token index, from the end of the scratch row back. */
        for (i = start + valid_end - 1; i >= start; i--) {
            if (!has_mask || mask[i] != 0) {
                running = fma(gamma, running, (double)rewards[i]);
                row_returns[--slot] = running;
            }
        }
        for (i = start; i < start + valid_end && index < baseline_end; i++) {
            if (!has_mask || mask[i] != 0) {
                double weight = 1.0 - 2.0 * exp((double)old_logprobs[i]);
                weight = weight + (double)sum_pi_squared[i];
                if (has_is_weights) {
                    double is_weight = is_weights[i];
                    weight = weight * (is_weight * is_weight);
                }
                cumulative = cumulative + weight;
                numerators[index] = numerators[index] + row_returns[slot + index] * cumulative;
                denominators[index] = denominators[index] + cumulative;
                index++;
            }
        }
    }
    for (k = 0; k < baseline_end; k++) numerators[k] = numerators[k] / (denominators[k] + eps);
    const double* baselines = numerators;
    for (j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
        ptrdiff_t start = starts[b], span = spans[b], valid_end = ppo_valid_end(span, lengths[b]);
        ptrdiff_t index = ppo_valid_count(start, span, lengths[b], mask, has_mask), i;
        double gamma = gammas[b], running = bootstrap[b];
        for (i = start + valid_end; i < start + span; i++) advantages[i] = returns[i] = 0;
        for (i = start + valid_end - 1; i >= start; i--) {
            if (!has_mask || mask[i] != 0) {
                running = fma(gamma, running, (double)rewards[i]);
                index--;
                double baseline = index < baseline_end ? baselines[index] : 0.0;
                advantages[i] = (ppo_real)(running - baseline);
                returns[i] = (ppo_real)running;
            } else {
                advantages[i] = 0;
                returns[i] = 0;
            }
        }
    }
    free(scratch);
    return 0;
}
