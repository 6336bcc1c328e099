/* -- KL estimates and shaped rewards ----------------------------------------------------------- */
/* Twins of _kl_penalty_rows and _shape_rewards_rows (ppo_fast/_numba_kernels.py), over the lanes
 * of lanes.h: k3's exp is ppo_f64x8_exp, the twins' _exp64, which numba vectorizes and libm's exp
 * does not. Included by rows.h, once per dtype. */

#ifndef PPO_FAST_KL_VALUES
#define PPO_FAST_KL_VALUES
/* The estimator codes PPO_K1, PPO_K2, PPO_K3 and PPO_ABS are defined by the generated module,
 * from ppo_fast/_spec.py ESTIMATORS. */
#ifndef PPO_K1
#error "rows_kl.h: the estimator codes come from the module generated from src/_kernels.pyx.tp"
#endif

/* The twins' kl_value on 8 float64 log-ratios, for an estimator the caller makes a constant.
 * `bounded` is whether the clamp is finite (a constant too): with clamp = inf, the twins'
 * min(max(value, -inf), inf) is value, NaN included, and is skipped. */
PPO_INLINE ppo_f64x8 ppo_kl_values(
    int estimator, int bounded, ppo_f64x8 log_ratio, ppo_f64x8 clamp,
    ppo_f64x8 negative_clamp) {
    ppo_f64x8 value, one = ppo_f64x8_splat(1.0);
    if (estimator == PPO_K1) {
        value = log_ratio;
    } else if (estimator == PPO_K2) {
        value = ppo_f64x8_mul(ppo_f64x8_mul(ppo_f64x8_splat(0.5), log_ratio), log_ratio);
    } else if (estimator == PPO_K3) {
        /* exp(x) = e * exp(x - 1) past 708, as the twin: the polynomial saturates at exp(709),
         * and this overflows to inf where libm's exp does. Elsewhere the twin subtracts 0 and
         * multiplies by 1, which changes no bit, so a block with no lane past 708 skips both. */
        ppo_f64x8 x = ppo_f64x8_negative(log_ratio), exp_neg;
        ppo_m64x8 beyond = ppo_f64x8_gt(x, ppo_f64x8_splat(708.0));
        if (ppo_m64x8_any(beyond)) {
            ppo_f64x8 zero = ppo_f64x8_splat(0.0), e = ppo_f64x8_splat(2.718281828459045);
            exp_neg = ppo_f64x8_exp(ppo_f64x8_sub(x, ppo_f64x8_select(beyond, one, zero)));
            exp_neg = ppo_f64x8_mul(exp_neg, ppo_f64x8_select(beyond, e, one));
        } else {
            exp_neg = ppo_f64x8_exp(x);
        }
        value = ppo_f64x8_add(ppo_f64x8_sub(exp_neg, one), log_ratio);
    } else {
        value = ppo_f64x8_abs(log_ratio);
    }
    /* the twins' min(max(value, -clamp), clamp), comparison for comparison */
    return bounded ? ppo_f64x8_min(clamp, ppo_f64x8_max(negative_clamp, value)) : value;
}

/* One specialization per estimator (the twin compiles one kernel each: a switch in the token
 * loop would keep it from vectorizing), and per finite or infinite clamp. */
#define PPO_ESTIMATOR_CASES(function, ...)                     \
    if (clamp < INFINITY) {                                    \
        PPO_ESTIMATOR_CASE(function, 1, __VA_ARGS__)           \
    } else {                                                   \
        PPO_ESTIMATOR_CASE(function, 0, __VA_ARGS__)           \
    }
#define PPO_ESTIMATOR_CASE(function, bounded, ...)             \
    switch (estimator) {                                       \
        case PPO_K1:                                           \
            function(PPO_K1, bounded, __VA_ARGS__);            \
            break;                                             \
        case PPO_K2:                                           \
            function(PPO_K2, bounded, __VA_ARGS__);            \
            break;                                             \
        case PPO_K3:                                           \
            function(PPO_K3, bounded, __VA_ARGS__);            \
            break;                                             \
        default:                                               \
            function(PPO_ABS, bounded, __VA_ARGS__);           \
    }


#endif

/* 8 tokens from position i of two arrays, as float64 log-ratios. */
PPO_INLINE ppo_f64x8 PPO_ROW(ppo_log_ratios)(
    const ppo_real* logprobs, const ppo_real* ref_logprobs, ptrdiff_t i) {
    return ppo_f64x8_sub(
        PPO_V(to_f64)(PPO_V(load)(logprobs + i)), PPO_V(to_f64)(PPO_V(load)(ref_logprobs + i)));
}

PPO_INLINE void PPO_ROW(ppo_kl_penalty_cases)(
    int estimator, int bounded, const ppo_real* logprobs, const ppo_real* ref_logprobs,
    ptrdiff_t start, ptrdiff_t span, double clamp, ppo_real* out) {
    ppo_f64x8 clamps = ppo_f64x8_splat(clamp), negative_clamps = ppo_f64x8_splat(-clamp);
    ptrdiff_t end = start + span, whole_end = end - span % 8, i;
    /* Two blocks a step, so that their exp chains interleave (k3 is bound by their latency).
     * Each step prefetches the lines PPO_CHUNK positions ahead (into the next row past this
     * one's end: the rows lie end to end): with k3's exp between its loads, the hardware
     * prefetchers fall behind the stream (float32 (1024, 4096), one thread, AVX-512 build,
     * medians: 7.4-7.8 ms without, 4.7-5.0 with them; numba's twin 4.8-5.4; on a batch in L2
     * both took the same time without them). */
    for (i = start; i + 16 <= whole_end; i += 16) {
        PPO_ROW(ppo_prefetch_ahead)(
            logprobs, ref_logprobs, NULL, NULL, NULL, start, i, i + PPO_CHUNK);
        PPO_ROW(ppo_prefetch_ahead)(
            logprobs, ref_logprobs, NULL, NULL, NULL, start, i + 8, i + 8 + PPO_CHUNK);
        ppo_f64x8 first = ppo_kl_values(
            estimator, bounded, PPO_ROW(ppo_log_ratios)(logprobs, ref_logprobs, i), clamps,
            negative_clamps);
        ppo_f64x8 second = ppo_kl_values(
            estimator, bounded, PPO_ROW(ppo_log_ratios)(logprobs, ref_logprobs, i + 8), clamps,
            negative_clamps);
        PPO_V(store)(out + i, PPO_V(from_f64)(first));
        PPO_V(store)(out + i + 8, PPO_V(from_f64)(second));
    }
    for (; i < whole_end; i += 8) {
        ppo_f64x8 value = ppo_kl_values(
            estimator, bounded, PPO_ROW(ppo_log_ratios)(logprobs, ref_logprobs, i), clamps,
            negative_clamps);
        PPO_V(store)(out + i, PPO_V(from_f64)(value));
    }
    if (i < end) {
        ppo_real tail_logprobs[8] = {0}, tail_ref[8] = {0}, tail_out[8];
        memcpy(tail_logprobs, logprobs + i, (size_t)(end - i) * sizeof(ppo_real));
        memcpy(tail_ref, ref_logprobs + i, (size_t)(end - i) * sizeof(ppo_real));
        ppo_f64x8 value = ppo_kl_values(
            estimator, bounded, PPO_ROW(ppo_log_ratios)(tail_logprobs, tail_ref, 0), clamps,
            negative_clamps);
        PPO_V(store)(tail_out, PPO_V(from_f64)(value));
        memcpy(out + i, tail_out, (size_t)(end - i) * sizeof(ppo_real));
    }
}

static void PPO_ROW(ppo_kl_penalty_row)(
    const ppo_real* logprobs, const ppo_real* ref_logprobs, ptrdiff_t start, ptrdiff_t span,
    int estimator, double clamp, ppo_real* out) {
    PPO_ESTIMATOR_CASES(
        PPO_ROW(ppo_kl_penalty_cases), logprobs, ref_logprobs, start, span, clamp, out)
}

/* The twin's loop body for the 8 tokens from position i (token t of the row). */
PPO_INLINE void PPO_ROW(ppo_rewards_block)(
    int estimator, int bounded, ppo_m64x8 valid, const ppo_real* logprobs,
    const ppo_real* ref_logprobs, ptrdiff_t i, ptrdiff_t last, double score,
    ppo_f64x8 negative_coef, ppo_f64x8 clamps, ppo_f64x8 negative_clamps, ppo_real* out) {
    ppo_f64x8 log_ratio = PPO_ROW(ppo_log_ratios)(logprobs, ref_logprobs, i);
    ppo_f64x8 reward = ppo_f64x8_mul(
        negative_coef, ppo_kl_values(estimator, bounded, log_ratio, clamps, negative_clamps));
    /* Adding 0.0 off the last token, as the twin does, turns a -0.0 reward into +0.0. */
    double added[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    if (last >= i && last < i + 8) added[last - i] = score;
    reward = ppo_f64x8_add(reward, ppo_f64x8_load(added));
    reward = ppo_f64x8_select(valid, reward, ppo_f64x8_splat(0.0));
    PPO_V(store)(out + i, PPO_V(from_f64)(reward));
}

/* Blocks up to the row's length; past it, every position is 0, as in the twin. */
PPO_INLINE void PPO_ROW(ppo_shape_rewards_cases)(
    int estimator, int bounded, double score, const ppo_real* logprobs,
    const ppo_real* ref_logprobs,
    ptrdiff_t start, ptrdiff_t span, ptrdiff_t length, const uint8_t* mask, int has_mask,
    double kl_coef, double clamp, ppo_real* out) {
    ppo_f64x8 clamps = ppo_f64x8_splat(clamp), negative_clamps = ppo_f64x8_splat(-clamp);
    ppo_f64x8 negative_coef = ppo_f64x8_splat(-kl_coef);
    ptrdiff_t valid_span = length < span ? (length > 0 ? length : 0) : span;
    /* A mask's trailing words of 8 invalid bytes (a right-padded row's padding) are zeros, as
     * the twin's: not computed, and not searched byte by byte for the last valid position
     * (that search and the padding's blocks were a third of the kernel's time). */
    if (has_mask) valid_span = ppo_mask_stop(mask + start, 0, valid_span);
    ptrdiff_t last = start + span, t; /* one past the row when it has no valid position */
    for (t = valid_span - 1; t >= 0; t--) {
        if (!has_mask || mask[start + t] != 0) {
            last = start + t;
            break;
        }
    }
    ptrdiff_t whole = valid_span - valid_span % 8;
    for (t = 0; t < whole; t += 8) {
        /* kl_penalty's prefetches, across the padding into the next row (ppo_ahead) */
        PPO_ROW(ppo_prefetch_ahead)(
            logprobs, ref_logprobs, NULL, NULL, has_mask ? mask : NULL, start, start + t,
            ppo_ahead(start + t, start + valid_span, start + span));
        PPO_ROW(ppo_rewards_block)(
            estimator, bounded, ppo_valid_lanes(mask, has_mask, start + t, t, length),
            logprobs, ref_logprobs, start + t, last, score, negative_coef, clamps,
            negative_clamps, out);
    }
    if (t < valid_span) {
        ptrdiff_t count = valid_span - t;
        ppo_real tail_logprobs[8] = {0}, tail_ref[8] = {0}, tail_out[8];
        uint8_t tail_mask[8] = {0};
        memcpy(tail_logprobs, logprobs + start + t, (size_t)count * sizeof(ppo_real));
        memcpy(tail_ref, ref_logprobs + start + t, (size_t)count * sizeof(ppo_real));
        if (has_mask) memcpy(tail_mask, mask + start + t, (size_t)count);
        PPO_ROW(ppo_rewards_block)(
            estimator, bounded, ppo_valid_lanes(tail_mask, has_mask, 0, t, length),
            tail_logprobs, tail_ref, 0, last - (start + t), score, negative_coef, clamps,
            negative_clamps, tail_out);
        memcpy(out + start + t, tail_out, (size_t)count * sizeof(ppo_real));
    }
    for (t = valid_span; t < span; t++) out[start + t] = 0;
}

static void PPO_ROW(ppo_shape_rewards_row)(
    const ppo_real* logprobs, const ppo_real* ref_logprobs, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, int has_mask, double score, double kl_coef,
    int estimator, double clamp, ppo_real* out) {
    PPO_ESTIMATOR_CASES(
        PPO_ROW(ppo_shape_rewards_cases), score, logprobs, ref_logprobs, start, span, length,
        mask, has_mask, kl_coef, clamp, out)
}
