/* Twins of reinforce, cispo and sapo (ppo_fast/_numba_kernels.py), operation for operation.
 * Included by rows.h, once per dtype.
 *
 * Scalar twins: one token at a time, in token order, as the numba kernels loop (no explicit lanes
 * yet). Per-token arithmetic runs in the dtype; the weight is float64 (numba's is, either way), so
 * the gradient's -weight * slope * scale is a float64 product, rounded to the dtype at the store.
 * Every sum is float64, in token order, and every count a float64. An invalid position (past the
 * length, or masked) gets a zero gradient and adds a zero term to each sum, as the twins' selects:
 * whatever is stored there (NaN, inf) reaches nothing. */

#if PPO_FAST_DTYPE == 32
#define ppo_real_exp ppo_exp32 /* numba's exp_poly for float32: _exp32 */
#else
#define ppo_real_exp ppo_exp64
#endif

/* The twins' min(max(x, low), high), comparison for comparison: max(x, low) is x unless low > x,
 * min(m, high) is m unless high < m, so that a NaN x stays NaN. */
PPO_INLINE ppo_real PPO_ROW(ppo_clip_scalar)(ppo_real x, ppo_real low, ppo_real high) {
    ppo_real m = low > x ? low : x;
    return high < m ? high : m;
}

/* Whether token t of the row (at position i) is valid. */
PPO_INLINE int PPO_ROW(ppo_policy_valid)(
    ptrdiff_t t, ptrdiff_t length, const uint8_t* mask, int has_mask, ptrdiff_t i) {
    return t < length && (!has_mask || mask[i] != 0);
}

/* -- REINFORCE / GPG / DRO --------------------------------------------------------------------- */

static void PPO_ROW(ppo_reinforce_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real beta, ppo_real* grad,
    double* row_loss, double* row_kl) {
    ppo_real zero = scale - scale; /* as the twin: 0 in the dtype (the scale is finite) */
    ppo_real half_beta = beta * (ppo_real)0.5;
    int penalised = beta != 0;
    double total = 0.0, kl_total = 0.0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        int valid = PPO_ROW(ppo_policy_valid)(t, length, mask, has_mask, i);
        ppo_real logprob = logprobs[i], advantage = advantages[i];
        double weight = has_weights ? (double)weights[i] : 1.0;
        ppo_real log_ratio = logprob - old_logprobs[i];
        ppo_real objective = advantage * logprob;
        ppo_real slope = advantage;
        if (penalised) {
            objective = objective - half_beta * (log_ratio * log_ratio);
            slope = advantage - beta * log_ratio;
        }
        grad[i] = valid ? (ppo_real)(-weight * (double)slope * (double)scale) : zero;
        total += valid ? -weight * (double)objective : 0.0;
        kl_total += valid ? -(double)log_ratio : 0.0;
    }
    *row_loss = total;
    *row_kl = kl_total;
}

/* -- CISPO ------------------------------------------------------------------------------------- */

static void PPO_ROW(ppo_cispo_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real ratio_low, ppo_real ratio_high,
    ppo_real log_ratio_clamp, ppo_real* grad, double* row_loss, double* row_clipped,
    double* row_lower, double* row_kl) {
    ppo_real zero = scale - scale;
    ppo_real lo = ratio_low, hi = ratio_high, clamp = log_ratio_clamp;
    double total = 0.0, clipped_count = 0.0, lower_count = 0.0, kl_total = 0.0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        int valid = PPO_ROW(ppo_policy_valid)(t, length, mask, has_mask, i);
        ppo_real logprob = logprobs[i];
        double weight = has_weights ? (double)weights[i] : 1.0;
        ppo_real log_ratio = PPO_ROW(ppo_clip_scalar)(logprob - old_logprobs[i], -clamp, clamp);
        ppo_real ratio = ppo_real_exp(log_ratio);
        ppo_real coefficient = PPO_ROW(ppo_clip_scalar)(ratio, lo, hi);
        ppo_real slope = coefficient * advantages[i];
        grad[i] = valid ? (ppo_real)(-weight * (double)slope * (double)scale) : zero;
        total += valid ? -weight * (double)(slope * logprob) : 0.0;
        clipped_count += valid && coefficient != ratio ? 1.0 : 0.0; /* NaN ratios too */
        lower_count += valid && ratio < lo ? 1.0 : 0.0;
        kl_total += valid ? -(double)log_ratio : 0.0;
    }
    *row_loss = total;
    *row_clipped = clipped_count;
    *row_lower = lower_count;
    *row_kl = kl_total;
}

/* -- SAPO -------------------------------------------------------------------------------------- */

static void PPO_ROW(ppo_sapo_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real tau_pos, ppo_real tau_neg,
    ppo_real log_ratio_clamp, ppo_real* grad, double* row_loss, double* row_kl) {
    ppo_real zero = scale - scale;
    ppo_real one = 1, four = one + one + one + one;
    ppo_real clamp = log_ratio_clamp;
    double total = 0.0, kl_total = 0.0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        int valid = PPO_ROW(ppo_policy_valid)(t, length, mask, has_mask, i);
        ppo_real advantage = advantages[i];
        double weight = has_weights ? (double)weights[i] : 1.0;
        ppo_real raw = logprobs[i] - old_logprobs[i];
        /* torch.clamp passes the gradient at its bounds, and a NaN log-ratio's NaN */
        int inside = !((raw < -clamp) || (raw > clamp));
        ppo_real log_ratio = PPO_ROW(ppo_clip_scalar)(raw, -clamp, clamp);
        ppo_real ratio = ppo_real_exp(log_ratio);
        ppo_real tau = advantage > zero ? tau_pos : tau_neg;
        ppo_real sigmoid = one / (one + ppo_real_exp(-(tau * (ratio - one))));
        ppo_real gate = sigmoid * (four / tau);
        ppo_real slope = advantage * ((four * sigmoid) * (one - sigmoid));
        ppo_real sloped = inside ? slope * ratio : zero;
        grad[i] = valid ? (ppo_real)(-weight * (double)sloped * (double)scale) : zero;
        total += valid ? -weight * (double)(gate * advantage) : 0.0;
        kl_total += valid ? -(double)log_ratio : 0.0;
    }
    *row_loss = total;
    *row_kl = kl_total;
}

#undef ppo_real_exp
