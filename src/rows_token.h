/* Twins of dppo and kl_cov (ppo_fast/_numba_losses.py), operation for operation. Included by
 * rows.h, once per dtype.
 *
 * Scalar C over the row's valid prefix, in loops the compiler may vectorize (not the explicit
 * eight-lane form of rows_policy.h): per-token
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

/* out[j] = exp(x[j]) (y NULL), or exp(x[j] - y[j]) clamped to [-clamp, clamp] when `clamped`,
 * for j < n: eight lanes at a time with lanes.h's exp, the last partial block one at a time with
 * exp.h's (the same function, lane for lane). */
PPO_INLINE void PPO_ROW(ppo_exps_of)(
    const ppo_real* x, const ppo_real* y, ptrdiff_t n, ppo_real clamp, int clamped,
    ppo_real* out) {
    ptrdiff_t j = 0;
    ppo_vec high = PPO_V(splat)(clamp), low = PPO_V(splat)(-clamp);
    for (; j + 8 <= n; j += 8) {
        ppo_vec v = PPO_V(load)(x + j);
        if (y) v = PPO_V(sub)(v, PPO_V(load)(y + j));
        if (clamped) v = PPO_ROW(ppo_clip)(v, low, high);
        PPO_V(store)(out + j, PPO_V(exp)(v));
    }
    for (; j < n; j++) {
        ppo_real v = y ? x[j] - y[j] : x[j];
        out[j] = ppo_exp_real(clamped ? PPO_MIN(PPO_MAX(v, -clamp), clamp) : v);
    }
}

/* -- DPPO (binary TV or binary KL) ------------------------------------------------------------- */

/* A row's valid prefix in chunks of PPO_CHUNK tokens, as the twin: the chunk's exps (the ratios,
 * the probabilities) and, for the binary KL, its quotients and their logs, each in a loop of its
 * own into a scratch row (short loops over plain arithmetic, which the compiler vectorizes), then
 * the rest. */
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
    ppo_real ratios[PPO_CHUNK], probs[PPO_CHUNK], old_probs[PPO_CHUNK], logs[PPO_CHUNK];
    double total = 0, kl_total = 0;
    int64_t outside = 0, capped = 0;
    ptrdiff_t valid_end = start + (length < span ? (length > 0 ? length : 0) : span);
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t n = valid_end - first < PPO_CHUNK ? valid_end - first : PPO_CHUNK, j;
        const ppo_real *lp = logprobs + first, *op = old_logprobs + first;
        PPO_ROW(ppo_exps_of)(lp, op, n, clamp, 1, ratios);
        PPO_ROW(ppo_exps_of)(lp, NULL, n, 0, 0, probs);
        PPO_ROW(ppo_exps_of)(op, NULL, n, 0, 0, old_probs);
        if (binary_kl) {
            for (j = 0; j < n; j++)
                logs[j] = (one - old_probs[j] + eps) / ((one - probs[j]) + eps);
            for (j = 0; j < n; j++) logs[j] = ppo_log_real(logs[j]);
        }
        for (j = 0; j < n; j++) {
            ptrdiff_t i = first + j;
            int valid = !has_mask || mask[i] != 0;
            ppo_real logprob = lp[j], old = op[j], advantage = advantages[i];
            ppo_real prob = probs[j], old_prob = old_probs[j], ratio = ratios[j];
            double weight = has_weights ? (double)weights[i] : 1.0;
            ppo_real log_ratio = PPO_MIN(PPO_MAX(logprob - old, -clamp), clamp);
            int positive = advantage > zero, inside;
            if (binary_kl) {
                ppo_real distance = old_prob * (old - logprob) + (one - old_prob) * logs[j];
                inside = positive ? (distance <= high) | (prob <= old_prob)
                                  : (distance <= low) | (prob >= old_prob);
            } else {
                ppo_real difference = prob - old_prob;
                inside = positive ? difference <= high : difference >= -low;
            }
            ppo_real keep = inside ? one : zero;
            ppo_real slope = advantage * PPO_MIN(ratio, cap);
            double gradient = -weight * (double)(slope * keep) * (double)scale;
            double term = -weight * (double)((slope * logprob) * keep);
            grad[i] = valid ? (ppo_real)gradient : zero;
            total += valid ? term : 0.0;
            kl_total += valid ? -(double)log_ratio : 0.0;
            outside += valid & !inside;
            capped += valid & inside & (ratio > cap);
        }
    }
    for (ptrdiff_t i = valid_end; i < start + span; i++) grad[i] = 0;
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
    ppo_real ratios[PPO_CHUNK];
    double total = 0, abs_total = 0;
    int64_t penalised_count = 0;
    ptrdiff_t valid_end = start + (length < span ? (length > 0 ? length : 0) : span);
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t n = valid_end - first < PPO_CHUNK ? valid_end - first : PPO_CHUNK, j;
        const ppo_real *lp = logprobs + first, *op = old_logprobs + first;
        PPO_ROW(ppo_exps_of)(lp, op, n, 0, 0, ratios);
        for (j = 0; j < n; j++) {
            ptrdiff_t i = first + j;
            int valid = !has_mask || mask[i] != 0;
            double weight = has_weights ? (double)weights[i] : 1.0;
            ppo_real log_ratio = lp[j] - op[j], penalty = penalties[i];
            int penalised = penalty != zero;
            ppo_real distance = (ppo_real)fabs((double)log_ratio); /* numba's abs: |-0| = +0 */
            /* sign: 0 at 0, NaN at NaN (the log-ratio itself, where it is neither < nor > 0) */
            ppo_real sign = log_ratio > zero ? one : (log_ratio < zero ? -one : log_ratio);
            ppo_real base = advantages[i] * ratios[j];
            ppo_real objective = penalised ? base - penalty * distance : base;
            ppo_real slope = penalised ? base - penalty * sign : base;
            double gradient = -weight * (double)slope * (double)scale;
            grad[i] = valid ? (ppo_real)gradient : zero;
            total += valid ? -weight * (double)objective : 0.0;
            abs_total += valid ? (double)distance : 0.0;
            penalised_count += valid & penalised;
        }
    }
    for (ptrdiff_t i = valid_end; i < start + span; i++) grad[i] = 0;
    *row_loss = total;
    *row_penalised = (double)penalised_count;
    *row_abs_kl = abs_total;
}

#undef PPO_MIN
#undef PPO_MAX
#undef ppo_exp_real
#undef ppo_log_real
