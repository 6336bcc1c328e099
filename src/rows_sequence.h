/* Twins of the per-sequence losses (ppo_fast/_numba_losses.py gspo, geo_mean), operation for
 * operation.
 * Included by rows.h, once per dtype.
 *
 * A row in two passes: the sums over its valid tokens (the pre-pass: GSPO's log-ratios, the
 * geometric mean's kept log-ratios, advantages and log-weights), then the token pass on the
 * row's values; GSPO's "sequence" form writes the row's one gradient in a third. Scalar C over
 * the token loop: per-token arithmetic in the dtype, the weight, the gradient's product, the
 * row's arithmetic and every sum in float64, an invalid position contributing a zero term as the
 * twin's selects; conditions on the data are combined with & and |, not && and ||, so that the
 * compiler need not branch on them (the advantages' signs are random: such a branch mispredicts,
 * and cost 3x). Each sum runs in token order (one order, the same on any
 * number of threads). */

#if PPO_FAST_DTYPE == 32
#define PPO_SCALAR_EXP ppo_exp32
#else
#define PPO_SCALAR_EXP ppo_exp64
#endif

/* -- GSPO -------------------------------------------------------------------------------------- */

static void PPO_ROW(ppo_gspo_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real ratio_low, ppo_real ratio_high,
    ppo_real dual_clip, ppo_real log_ratio_max, int form, ppo_real* grad, double* row_loss,
    double* row_clipped, double* row_lower, double* row_kl) {
    const ppo_real zero = scale - scale; /* 0 in the dtype, as the twin (the scale is finite) */
    const int detached = form == 0;
    double count = 0.0, log_ratio_total = 0.0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        int valid = (t < length) & (!has_mask || mask[i] != 0); /* no mask: not read */
        count += valid ? 1.0 : 0.0;
        log_ratio_total += valid ? (double)(ppo_real)(logprobs[i] - old_logprobs[i]) : 0.0;
    }
    ppo_real mean = (ppo_real)(log_ratio_total / (count > 1.0 ? count : 1.0));
    /* torch.clamp passes the gradient at its bound, and a NaN's NaN */
    int inside = !(mean > log_ratio_max);
    ppo_real ratio = PPO_SCALAR_EXP(mean > log_ratio_max ? log_ratio_max : mean);
    ppo_real clipped_ratio =
        ratio < ratio_low ? ratio_low : ratio > ratio_high ? ratio_high : ratio;
    ppo_real gradient_ratio = inside ? ratio : zero; /* d s / d mean: 0 beyond the clamp */
    double total = 0.0, clipped_count = 0.0, lower_count = 0.0, kl_total = 0.0;
    double slope_total = 0.0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        int valid = (t < length) & (!has_mask || mask[i] != 0); /* no mask: not read */
        ppo_real advantage = advantages[i];
        double weight = has_weights ? (double)weights[i] : 1.0;
        ppo_real unclipped = ratio * advantage;
        ppo_real clipped = clipped_ratio * advantage;
        int is_clipped = clipped < unclipped;
        ppo_real objective = is_clipped ? clipped : unclipped;
        ppo_real dual = dual_clip * advantage;
        int is_dual = (advantage < zero) & (dual > objective);
        objective = is_dual ? dual : objective;
        ppo_real slope = (is_clipped | is_dual) ? zero : advantage;
        if (detached) {
            /* beyond the clamp the slope is 0 (not inf * 0), times the weight: a NaN weight
             * still says so */
            ppo_real sloped = inside ? slope * ratio : zero;
            grad[i] = valid ? (ppo_real)(-weight * (double)sloped * (double)scale) : zero;
        } else {
            slope_total += valid ? -weight * (double)slope : 0.0;
        }
        total += valid ? -weight * (double)objective : 0.0;
        clipped_count += (valid & is_clipped) ? 1.0 : 0.0;
        lower_count += (valid & is_clipped & (advantage < zero)) ? 1.0 : 0.0;
        kl_total += valid ? -(double)(ppo_real)(logprobs[i] - old_logprobs[i]) : 0.0;
    }
    if (!detached) {
        double row_grad =
            slope_total * (double)gradient_ratio * (double)scale / (count > 1.0 ? count : 1.0);
        for (ptrdiff_t t = 0; t < span; t++) {
            ptrdiff_t i = start + t;
            int valid = (t < length) & (!has_mask || mask[i] != 0); /* no mask: not read */
            grad[i] = valid ? (ppo_real)row_grad : zero;
        }
    }
    *row_loss = total;
    *row_clipped = clipped_count;
    *row_lower = lower_count;
    *row_kl = kl_total;
}

/* -- verl's geometric-mean loss (GMPO) --------------------------------------------------------- */

static void PPO_ROW(ppo_geo_mean_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real log_ratio_low,
    ppo_real log_ratio_high, ppo_real* grad, double* row_loss, double* row_clipped,
    double* row_lower, double* row_kl) {
    const ppo_real zero = scale - scale, lo = log_ratio_low, hi = log_ratio_high;
    double count = 0.0, kept_total = 0.0, advantage_total = 0.0, log_weight_total = 0.0;
    double upper_count = 0.0, lower_count = 0.0, kl_total = 0.0, loss = 0.0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        int valid = (t < length) & (!has_mask || mask[i] != 0); /* no mask: not read */
        ppo_real advantage = advantages[i];
        ppo_real log_ratio = logprobs[i] - old_logprobs[i];
        int positive = advantage > zero, negative = advantage < zero;
        ppo_real kept = positive   ? (log_ratio > hi ? hi : log_ratio)
                        : negative ? (log_ratio < -lo ? -lo : log_ratio)
                                   : log_ratio * zero;
        int outside = !((log_ratio >= -lo) & (log_ratio <= hi)); /* NaN too */
        count += valid ? 1.0 : 0.0;
        kept_total += valid ? (double)kept : 0.0;
        advantage_total += valid ? (double)advantage : 0.0;
        if (has_weights) log_weight_total += valid ? log((double)weights[i]) : 0.0;
        upper_count += (valid & outside & positive) ? 1.0 : 0.0;
        lower_count += (valid & outside & negative) ? 1.0 : 0.0;
        kl_total += valid ? -(double)log_ratio : 0.0;
    }
    if (count > 0.0) {
        /* exp(mean(r')) * exp(mean(log w)) in one exp */
        double weighted_ratio = ppo_exp64(kept_total / count + log_weight_total / count);
        loss = -(advantage_total / count) * weighted_ratio;
    }
    double row_grad = loss * (double)scale;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        int valid = (t < length) & (!has_mask || mask[i] != 0); /* no mask: not read */
        ppo_real advantage = advantages[i];
        ppo_real log_ratio = logprobs[i] - old_logprobs[i];
        int moves =
            ((advantage > zero) & (log_ratio <= hi)) | ((advantage < zero) & (log_ratio >= -lo));
        grad[i] = (valid & moves) ? (ppo_real)row_grad : zero;
    }
    *row_loss = count * loss;
    *row_clipped = upper_count;
    *row_lower = lower_count;
    *row_kl = kl_total;
}

#undef PPO_SCALAR_EXP
