/* -- discounted returns and ReMax ------------------------------------------------------------- */
/* Twins of discounted_returns and remax (ppo_fast/_numba_kernels.py). The
 * running return is float64 whatever the dtype, and each multiply-add on it is one fma, as the
 * twins' llvm.fma (the same bits as numba). Included by rows.h, once per dtype. */

#ifndef PPO_FAST_ROWS_RETURNS_ONCE
#define PPO_FAST_ROWS_RETURNS_ONCE

/* The end of a row's positions that may be valid: min(length, span), from 0. */
PPO_INLINE ptrdiff_t ppo_valid_end(ptrdiff_t span, ptrdiff_t length) {
    return length < span ? (length > 0 ? length : 0) : span;
}
#endif

/* The padding past the length is written first, then the valid prefix backwards, its mask test
 * hoisted out of the loop: the loop that remains is the recursion's chain of fma. */
static void PPO_ROW(ppo_discounted_returns_row)(
    const ppo_real* rewards, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, double gamma, double running, ppo_real* returns) {
    ptrdiff_t valid_end = ppo_valid_end(span, length), t;
    for (t = valid_end; t < span; t++) returns[start + t] = 0;
    if (has_mask) {
        for (t = valid_end - 1; t >= 0; t--) {
            ptrdiff_t i = start + t;
            if (mask[i] != 0) {
                running = fma(gamma, running, (double)rewards[i]);
                returns[i] = (ppo_real)running;
            } else {
                returns[i] = 0;
            }
        }
    } else {
        for (t = valid_end - 1; t >= 0; t--) {
            running = fma(gamma, running, (double)rewards[start + t]);
            returns[start + t] = (ppo_real)running;
        }
    }
}

static void PPO_ROW(ppo_remax_row)(
    const ppo_real* rewards, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, double gamma, double running, double baseline,
    ppo_real* advantages, ppo_real* returns) {
    ptrdiff_t valid_end = ppo_valid_end(span, length), t;
    for (t = valid_end; t < span; t++) advantages[start + t] = returns[start + t] = 0;
    for (t = valid_end - 1; t >= 0; t--) {
        ptrdiff_t i = start + t;
        if (!has_mask || mask[i] != 0) {
            running = fma(gamma, running, (double)rewards[i]);
            advantages[i] = (ppo_real)(running - baseline);
            returns[i] = (ppo_real)running;
        } else {
            advantages[i] = 0;
            returns[i] = 0;
        }
    }
}
