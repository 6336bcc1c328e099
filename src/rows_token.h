/* Twins of dppo and kl_cov (ppo_fast/_numba_losses.py), operation for operation. Included by
 * rows.h, once per dtype.
 *
 * One token at a time, in branch-free expressions over the row's valid prefix (the compiler may
 * vectorize them; the eight-lane form of rows_policy.h is not written for these two yet): per-token
 * arithmetic in the dtype, the weight in float64 as the twins' (numba's promotion), every sum in
 * float64 in token order (an order of its own, the same on any number of threads), every count an
 * integer. An invalid position gets a zero gradient and adds nothing to any sum. */

#if PPO_FAST_DTYPE == 32
#define ppo_exp_real ppo_exp32
#define ppo_log_real ppo_log32
#else
#define ppo_exp_real ppo_exp64
#define ppo_log_real ppo_log64
#endif

/* numba's (Python's) min and max, comparison for comparison: a NaN first argument stays. */
#define PPO_MIN(a, b) ((b) < (a) ? (b) : (a))
#define PPO_MAX(a, b) ((b) > (a) ? (b) : (a))

PPO_INLINE int PPO_ROW(ppo_token_valid)(
    const uint8_t* mask, int has_mask, ptrdiff_t i, ptrdiff_t t, ptrdiff_t length) {
    return t < length && (!has_mask || mask[i] != 0);
}

/* -- DPPO (binary TV or binary KL) ------------------------------------------------------------- */

static void PPO_ROW(ppo_dppo_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, int divergence, ppo_real divergence_low,
    ppo_real divergence_high, ppo_real ratio_cap, ppo_real log_ratio_clamp, ppo_real* grad,
    double* row_loss, double* row_outside, double* row_capped, double* row_kl) {
    const ppo_real zero = scale - scale, one = 1, eps = (ppo_real)1e-8; /* verl's 1e-8 */
    const ppo_real low = divergence_low, high = divergence_high, cap = ratio_cap;
    const ppo_real clamp = log_ratio_clamp;
    const int binary_kl = divergence == 1; /* _spec.DIVERGENCES */
    double total = 0, kl_total = 0;
    int64_t outside = 0, capped = 0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        if (!PPO_ROW(ppo_token_valid)(mask, has_mask, i, t, length)) {
            grad[i] = 0;
            continue;
        }
        ppo_real logprob = logprobs[i], old = old_logprobs[i], advantage = advantages[i];
        double weight = has_weights ? (double)weights[i] : 1.0;
        ppo_real log_ratio = PPO_MIN(PPO_MAX(logprob - old, -clamp), clamp);
        ppo_real ratio = ppo_exp_real(log_ratio);
        ppo_real prob = ppo_exp_real(logprob), old_prob = ppo_exp_real(old);
        int positive = advantage > zero, inside;
        if (binary_kl) {
            ppo_real complement = one - old_prob;
            ppo_real quotient = (complement + eps) / ((one - prob) + eps);
            ppo_real distance = old_prob * (old - logprob) + complement * ppo_log_real(quotient);
            inside = positive ? (distance <= high) | (prob <= old_prob)
                              : (distance <= low) | (prob >= old_prob);
        } else {
            ppo_real difference = prob - old_prob;
            inside = positive ? difference <= high : difference >= -low;
        }
        ppo_real keep = inside ? one : zero;
        ppo_real slope = advantage * PPO_MIN(ratio, cap);
        grad[i] = (ppo_real)(-weight * (double)(slope * keep) * (double)scale);
        total += -weight * (double)((slope * logprob) * keep);
        kl_total += -(double)log_ratio;
        outside += !inside;
        capped += inside && ratio > cap;
    }
    *row_loss = total;
    *row_outside = (double)outside;
    *row_capped = (double)capped;
    *row_kl = kl_total;
}

/* -- KL-Cov ------------------------------------------------------------------------------------ */

static void PPO_ROW(ppo_kl_cov_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, const ppo_real* penalties, ptrdiff_t start,
    ptrdiff_t span, ptrdiff_t length, const uint8_t* mask, int has_mask, ppo_real scale,
    ppo_real* grad, double* row_loss, double* row_penalised, double* row_abs_kl) {
    const ppo_real zero = scale - scale, one = 1;
    double total = 0, abs_total = 0;
    int64_t penalised_count = 0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        if (!PPO_ROW(ppo_token_valid)(mask, has_mask, i, t, length)) {
            grad[i] = 0;
            continue;
        }
        double weight = has_weights ? (double)weights[i] : 1.0;
        ppo_real log_ratio = logprobs[i] - old_logprobs[i], penalty = penalties[i];
        int penalised = penalty != zero;
        ppo_real distance = (ppo_real)fabs((double)log_ratio); /* numba's abs: |-0| = +0 */
        /* sign: 0 at 0, NaN at NaN (the log-ratio itself, where it is neither < nor > 0) */
        ppo_real sign = log_ratio > zero ? one : (log_ratio < zero ? -one : log_ratio);
        ppo_real base = advantages[i] * ppo_exp_real(log_ratio);
        ppo_real objective = penalised ? base - penalty * distance : base;
        ppo_real slope = penalised ? base - penalty * sign : base;
        grad[i] = (ppo_real)(-weight * (double)slope * (double)scale);
        total += -weight * (double)objective;
        abs_total += (double)distance;
        penalised_count += penalised;
    }
    *row_loss = total;
    *row_penalised = (double)penalised_count;
    *row_abs_kl = abs_total;
}

#undef PPO_MIN
#undef PPO_MAX
#undef ppo_exp_real
#undef ppo_log_real
