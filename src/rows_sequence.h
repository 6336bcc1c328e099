/* Twins of the per-sequence losses (ppo_fast/_numba_losses.py gspo), operation for operation.
 * Included by rows.h, once per dtype.
 *
 * A row in two passes: the sum of its log-ratios over the valid tokens (the pre-pass, for the
 * sequence ratio), then the token pass on that ratio; the "sequence" form writes the row's one
 * gradient in a third. Scalar C over the token loop: per-token arithmetic in the dtype, the
 * weight, the gradient's product and every sum in float64, an invalid position contributing a
 * zero term as the twin's selects. Each sum runs in token order (one order, the same on any
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
        int valid = t < length && (!has_mask || mask[i] != 0);
        count += valid ? 1.0 : 0.0;
        log_ratio_total += valid ? (double)(ppo_real)(logprobs[i] - old_logprobs[i]) : 0.0;
    }
    ppo_real mean = (ppo_real)(log_ratio_total / (count > 1.0 ? count : 1.0));
    /* torch.clamp passes the gradient at its bound, and a NaN's NaN */
    int inside = !(mean > log_ratio_max);
    ppo_real ratio = PPO_SCALAR_EXP(mean > log_ratio_max ? log_ratio_max : mean);
    ppo_real clipped_ratio = ratio < ratio_low ? ratio_low : ratio > ratio_high ? ratio_high : ratio;
    ppo_real gradient_ratio = inside ? ratio : zero; /* d s / d mean: 0 beyond the clamp */
    double total = 0.0, clipped_count = 0.0, lower_count = 0.0, kl_total = 0.0;
    double slope_total = 0.0;
    for (ptrdiff_t t = 0; t < span; t++) {
        ptrdiff_t i = start + t;
        int valid = t < length && (!has_mask || mask[i] != 0);
        ppo_real advantage = advantages[i];
        double weight = has_weights ? (double)weights[i] : 1.0;
        ppo_real unclipped = ratio * advantage;
        ppo_real clipped = clipped_ratio * advantage;
        int is_clipped = clipped < unclipped;
        ppo_real objective = is_clipped ? clipped : unclipped;
        ppo_real dual = dual_clip * advantage;
        int is_dual = advantage < zero && dual > objective;
        objective = is_dual ? dual : objective;
        ppo_real slope = is_clipped || is_dual ? zero : advantage;
        if (detached) {
            /* beyond the clamp the slope is 0 (not inf * 0), times the weight: a NaN weight
             * still says so */
            ppo_real sloped = inside ? slope * ratio : zero;
            grad[i] = valid ? (ppo_real)(-weight * (double)sloped * (double)scale) : zero;
        } else {
            slope_total += valid ? -weight * (double)slope : 0.0;
        }
        total += valid ? -weight * (double)objective : 0.0;
        clipped_count += valid && is_clipped ? 1.0 : 0.0;
        lower_count += valid && is_clipped && advantage < zero ? 1.0 : 0.0;
        kl_total += valid ? -(double)(ppo_real)(logprobs[i] - old_logprobs[i]) : 0.0;
    }
    if (!detached) {
        double row_grad =
            slope_total * (double)gradient_ratio * (double)scale / (count > 1.0 ? count : 1.0);
        for (ptrdiff_t t = 0; t < span; t++) {
            ptrdiff_t i = start + t;
            int valid = t < length && (!has_mask || mask[i] != 0);
            grad[i] = valid ? (ppo_real)row_grad : zero;
        }
    }
    *row_loss = total;
    *row_clipped = clipped_count;
    *row_lower = lower_count;
    *row_kl = kl_total;
}

#undef PPO_SCALAR_EXP
