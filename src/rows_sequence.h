/* Twins of the per-sequence losses (ppo_fast/_numba_losses.py gspo, geo_mean), operation for
 * operation. Included by rows.h, once per dtype.
 *
 * A row in two passes over its valid prefix (the positions before its length), eight lanes at a
 * time as rows_policy.h: the sums over its valid tokens (the pre-pass: GSPO's log-ratios, the
 * geometric mean's kept log-ratios, advantages and log-weights), then the token pass on the row's
 * values; GSPO's "sequence" form writes the row's one gradient in a third. Neither has an exp per
 * token, so there are no chunks of exps first: each pass streams its inputs. Per-token arithmetic
 * runs in the dtype, the weight, the gradient's product, the row's arithmetic and every sum in
 * float64, in 8 lanes added up in a fixed tree (an order of its own, the same on any number of
 * threads; the geometric mean's numba twin adds in the same lanes, since its gradient is a
 * function of its sums); counts are integers. An invalid lane is zeroed before it reaches a sum,
 * so that whatever is stored at a masked position (NaN, inf) reaches nothing; positions past the
 * length get a zero gradient and nothing else. A row's last partial block goes through the
 * zero-padded lanes of PPO_ROW(ppo_tail) (rows.h), which are invalid. */

#if PPO_FAST_DTYPE == 32
#define PPO_SCALAR_EXP ppo_exp32
#else
#define PPO_SCALAR_EXP ppo_exp64
#endif

/* -- GSPO -------------------------------------------------------------------------------------- */

typedef struct {
    ppo_vec zero, ratio, clipped_ratio, dual;
    ppo_f64x8 scale;
    int inside; /* the row's mean log-ratio is within its clamp (or NaN) */
} PPO_ROW(ppo_gspo_params);

typedef struct {
    ppo_f64x8 log_ratio, kl, loss, slope;
    ppo_count valid, clipped, lower;
} PPO_ROW(ppo_gspo_sums);

/* The pre-pass's block: the 8 tokens from position i, their log-ratios in the dtype. */
PPO_INLINE void PPO_ROW(ppo_gspo_sum_block)(
    int has_mask, const ppo_real* logprobs, const ppo_real* old_logprobs, const uint8_t* mask,
    ptrdiff_t i, ppo_vec zero, PPO_ROW(ppo_gspo_sums) * sums) {
    ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
    ppo_vec log_ratio = PPO_V(sub)(PPO_V(load)(logprobs + i), PPO_V(load)(old_logprobs + i));
    ppo_f64x8 wide = PPO_V(to_f64)(PPO_V(select)(valid, log_ratio, zero));
    sums->log_ratio = ppo_f64x8_add(sums->log_ratio, wide);
    sums->kl = ppo_f64x8_add(sums->kl, ppo_f64x8_negative(wide));
    sums->valid = PPO_C(add)(sums->valid, valid);
}

/* The token pass's block: the twin's loop body for the 8 tokens from position i on the row's
 * ratio; the detached form stores the gradient, the sequence form sums the slope. */
PPO_INLINE void PPO_ROW(ppo_gspo_block)(
    int has_mask, int has_weights, int detached, const ppo_real* advantages,
    const ppo_real* weights, const uint8_t* mask, ptrdiff_t i, const PPO_ROW(ppo_gspo_params) * p,
    ppo_real* grad, PPO_ROW(ppo_gspo_sums) * sums) {
    ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
    ppo_vec advantage = PPO_V(load)(advantages + i);
    ppo_vec unclipped = PPO_V(mul)(p->ratio, advantage);
    ppo_vec clipped = PPO_V(mul)(p->clipped_ratio, advantage);
    ppo_mask is_clipped = PPO_V(lt)(clipped, unclipped);
    ppo_vec objective = PPO_V(select)(is_clipped, clipped, unclipped);
    ppo_vec dual = PPO_V(mul)(p->dual, advantage);
    ppo_mask negative = PPO_V(lt)(advantage, p->zero);
    ppo_mask is_dual = PPO_M(and)(negative, PPO_V(gt)(dual, objective));
    objective = PPO_V(select)(is_dual, dual, objective);
    ppo_vec slope = PPO_V(select)(PPO_M(or)(is_clipped, is_dual), p->zero, advantage);
    /* numba's weight is float64 either way (its 1 is an integer) */
    ppo_f64x8 negative_weight = ppo_f64x8_splat(-1.0);
    if (has_weights) {
        ppo_vec weight = PPO_V(select)(valid, PPO_V(load)(weights + i), p->zero);
        negative_weight = ppo_f64x8_negative(PPO_V(to_f64)(weight));
    }
    if (detached) {
        /* beyond the clamp the slope is 0 (not inf * 0), times the weight: a NaN weight still
         * says so */
        ppo_vec sloped = p->inside ? PPO_V(mul)(slope, p->ratio) : p->zero;
        ppo_f64x8 gradient =
            ppo_f64x8_mul(ppo_f64x8_mul(negative_weight, PPO_V(to_f64)(sloped)), p->scale);
        PPO_V(store)(grad + i, PPO_V(select)(valid, PPO_V(from_f64)(gradient), p->zero));
    } else {
        slope = PPO_V(select)(valid, slope, p->zero);
        sums->slope =
            ppo_f64x8_add(sums->slope, ppo_f64x8_mul(negative_weight, PPO_V(to_f64)(slope)));
    }
    objective = PPO_V(select)(valid, objective, p->zero);
    sums->loss =
        ppo_f64x8_add(sums->loss, ppo_f64x8_mul(negative_weight, PPO_V(to_f64)(objective)));
    ppo_mask counted = PPO_M(and)(valid, is_clipped);
    sums->clipped = PPO_C(add)(sums->clipped, counted);
    sums->lower = PPO_C(add)(sums->lower, PPO_M(and)(counted, negative));
}

PPO_INLINE void PPO_ROW(ppo_gspo_cases)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, ppo_real scale, ppo_real ratio_low,
    ppo_real ratio_high, ppo_real dual_clip, ppo_real log_ratio_max, int detached, ppo_real* grad,
    double* row_loss, double* row_clipped, double* row_lower, double* row_kl) {
    const ppo_real zero = scale - scale; /* 0 in the dtype, as the twin (the scale is finite) */
    const ppo_vec zeros = PPO_V(splat)(zero);
    ptrdiff_t valid_end = ppo_valid_stop(start, span, length);
    if (has_mask) valid_end = ppo_mask_stop(mask, start, valid_end); /* as rows_loss.h's */
    ppo_f64x8 f64_zero = ppo_f64x8_splat(0.0);
    PPO_ROW(ppo_gspo_sums) sums = {f64_zero, f64_zero, f64_zero, f64_zero,
                                   PPO_C(zero)(), PPO_C(zero)(), PPO_C(zero)()};
    int64_t count = 0, clipped_count = 0, lower_count = 0;
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t end = valid_end - first < PPO_CHUNK ? valid_end : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, i;
        sums.valid = PPO_C(zero)(); /* int32 lanes: totalled every chunk */
        for (i = first; i < whole_end; i += 8) {
            /* ahead: this pass's inputs, then the token pass's from the row's start */
            ptrdiff_t ahead = i + PPO_STREAM_AHEAD_BYTES / (ptrdiff_t)sizeof(ppo_real);
            if (ahead < valid_end)
                PPO_ROW(ppo_prefetch_ahead)(
                    logprobs, old_logprobs, NULL, NULL, has_mask ? mask : NULL, first, i, ahead);
            else
                PPO_ROW(ppo_prefetch_ahead)(
                    advantages, has_weights ? weights : NULL, NULL, NULL, NULL, first, i,
                    ahead - valid_end + start);
            PPO_ROW(ppo_gspo_sum_block)(has_mask, logprobs, old_logprobs, mask, i, zeros, &sums);
        }
        if (i < end) {
            const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {logprobs, old_logprobs};
            PPO_ROW(ppo_tail) tail;
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, end - i);
            PPO_ROW(ppo_gspo_sum_block)(
                1, tail.tokens[0], tail.tokens[1], tail.mask, 0, zeros, &sums);
        }
        count += PPO_C(total)(sums.valid);
    }
    const double counted = (double)count, divisor = counted > 1.0 ? counted : 1.0;
    ppo_real mean = (ppo_real)(ppo_f64x8_total(sums.log_ratio) / divisor);
    /* torch.clamp passes the gradient at its bound, and a NaN's NaN */
    int inside = !(mean > log_ratio_max);
    ppo_real ratio = PPO_SCALAR_EXP(mean > log_ratio_max ? log_ratio_max : mean);
    ppo_real clipped_ratio =
        ratio < ratio_low ? ratio_low : ratio > ratio_high ? ratio_high : ratio;
    ppo_real gradient_ratio = inside ? ratio : zero; /* d s / d mean: 0 beyond the clamp */
    PPO_ROW(ppo_gspo_params) p;
    p.zero = zeros;
    p.ratio = PPO_V(splat)(ratio);
    p.clipped_ratio = PPO_V(splat)(clipped_ratio);
    p.inside = inside;
    p.dual = PPO_V(splat)(dual_clip);
    p.scale = ppo_f64x8_splat((double)scale);
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t end = valid_end - first < PPO_CHUNK ? valid_end : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, i;
        sums.clipped = PPO_C(zero)();
        sums.lower = PPO_C(zero)();
        for (i = first; i < whole_end; i += 8) {
            /* ahead: this pass's inputs, then the next row's pre-pass's */
            ptrdiff_t ahead = i + PPO_STREAM_AHEAD_BYTES / (ptrdiff_t)sizeof(ppo_real);
            if (ahead < valid_end)
                PPO_ROW(ppo_prefetch_ahead)(
                    advantages, has_weights ? weights : NULL, NULL, NULL, has_mask ? mask : NULL,
                    first, i, ahead);
            else
                PPO_ROW(ppo_prefetch_ahead)(
                    logprobs, old_logprobs, NULL, NULL, has_mask ? mask : NULL, first, i,
                    ahead - valid_end + start + span);
            PPO_ROW(ppo_gspo_block)(
                has_mask, has_weights, detached, advantages, weights, mask, i, &p, grad, &sums);
        }
        if (i < end) {
            const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {
                advantages, has_weights ? weights : NULL};
            PPO_ROW(ppo_tail) tail;
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, end - i);
            PPO_ROW(ppo_gspo_block)(
                1, has_weights, detached, tail.tokens[0], tail.tokens[1], tail.mask, 0, &p,
                tail.grad, &sums);
            if (detached) memcpy(grad + i, tail.grad, (size_t)(end - i) * sizeof(ppo_real));
        }
        clipped_count += PPO_C(total)(sums.clipped);
        lower_count += PPO_C(total)(sums.lower);
    }
    if (!detached) {
        double row_grad = ppo_f64x8_total(sums.slope) * (double)gradient_ratio * (double)scale /
                          divisor;
        ppo_vec gradient = PPO_V(splat)((ppo_real)row_grad);
        ptrdiff_t i = start, whole_end = valid_end - (valid_end - start) % 8;
        for (; i < whole_end; i += 8) {
            ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
            PPO_V(store)(grad + i, PPO_V(select)(valid, gradient, zeros));
        }
        for (; i < valid_end; i++) grad[i] = !has_mask || mask[i] != 0 ? (ppo_real)row_grad : zero;
    }
    for (ptrdiff_t i = valid_end; i < start + span; i++) grad[i] = 0;
    *row_loss = ppo_f64x8_total(sums.loss);
    *row_clipped = (double)clipped_count;
    *row_lower = (double)lower_count;
    *row_kl = ppo_f64x8_total(sums.kl);
}

/* One specialization per case: without a mask or weights, nothing is loaded for them. */
#define PPO_SEQUENCE_CASES(cases, ...)                                                         \
    do {                                                                                       \
        if (has_mask && has_weights)                                                           \
            cases(1, 1, __VA_ARGS__);                                                          \
        else if (has_mask)                                                                     \
            cases(1, 0, __VA_ARGS__);                                                          \
        else if (has_weights)                                                                  \
            cases(0, 1, __VA_ARGS__);                                                          \
        else                                                                                   \
            cases(0, 0, __VA_ARGS__);                                                          \
    } while (0)

static void PPO_ROW(ppo_gspo_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real ratio_low, ppo_real ratio_high,
    ppo_real dual_clip, ppo_real log_ratio_max, int form, ppo_real* grad, double* row_loss,
    double* row_clipped, double* row_lower, double* row_kl) {
    PPO_SEQUENCE_CASES(
        PPO_ROW(ppo_gspo_cases), logprobs, old_logprobs, advantages, weights, start, span, length,
        mask, scale, ratio_low, ratio_high, dual_clip, log_ratio_max, form == 0, grad, row_loss,
        row_clipped, row_lower, row_kl);
}

/* -- verl's geometric-mean loss (GMPO) --------------------------------------------------------- */

typedef struct {
    ppo_vec zero, high, negative_low;
} PPO_ROW(ppo_geo_mean_params);

typedef struct {
    ppo_f64x8 kept, advantage, kl;
    ppo_count valid, upper, lower;
} PPO_ROW(ppo_geo_mean_sums);

/* The pre-pass's block: the 8 tokens from position i. */
PPO_INLINE void PPO_ROW(ppo_geo_mean_sum_block)(
    int has_mask, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const uint8_t* mask, ptrdiff_t i,
    const PPO_ROW(ppo_geo_mean_params) * p, PPO_ROW(ppo_geo_mean_sums) * sums) {
    ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
    ppo_vec advantage = PPO_V(load)(advantages + i);
    ppo_vec log_ratio = PPO_V(sub)(PPO_V(load)(logprobs + i), PPO_V(load)(old_logprobs + i));
    ppo_mask positive = PPO_V(gt)(advantage, p->zero), negative = PPO_V(lt)(advantage, p->zero);
    /* the twin's log_ratio > hi ? hi : log_ratio and log_ratio < -lo ? -lo : log_ratio */
    ppo_vec kept = PPO_V(select)(
        positive, PPO_V(min)(p->high, log_ratio),
        PPO_V(select)(negative, PPO_V(max)(p->negative_low, log_ratio),
                      PPO_V(mul)(log_ratio, p->zero)));
    /* (log_ratio >= -lo) & (log_ratio <= hi): false on NaN, which is outside */
    ppo_mask within = PPO_M(and)(PPO_V(le)(p->negative_low, log_ratio),
                                 PPO_V(le)(log_ratio, p->high));
    ppo_mask outside = PPO_M(and_not)(valid, within);
    sums->valid = PPO_C(add)(sums->valid, valid);
    sums->kept = ppo_f64x8_add(sums->kept, PPO_V(to_f64)(PPO_V(select)(valid, kept, p->zero)));
    sums->advantage =
        ppo_f64x8_add(sums->advantage, PPO_V(to_f64)(PPO_V(select)(valid, advantage, p->zero)));
    sums->upper = PPO_C(add)(sums->upper, PPO_M(and)(outside, positive));
    sums->lower = PPO_C(add)(sums->lower, PPO_M(and)(outside, negative));
    ppo_f64x8 kl = PPO_V(to_f64)(PPO_V(select)(valid, log_ratio, p->zero));
    sums->kl = ppo_f64x8_add(sums->kl, ppo_f64x8_negative(kl));
}

/* The gradient's block: the row's gradient where the kept log-ratio moves with the token's. */
PPO_INLINE void PPO_ROW(ppo_geo_mean_block)(
    int has_mask, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const uint8_t* mask, ptrdiff_t i,
    const PPO_ROW(ppo_geo_mean_params) * p, ppo_vec row_grad, ppo_real* grad) {
    ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
    ppo_vec advantage = PPO_V(load)(advantages + i);
    ppo_vec log_ratio = PPO_V(sub)(PPO_V(load)(logprobs + i), PPO_V(load)(old_logprobs + i));
    ppo_mask moves = PPO_M(or)(
        PPO_M(and)(PPO_V(gt)(advantage, p->zero), PPO_V(le)(log_ratio, p->high)),
        PPO_M(and)(PPO_V(lt)(advantage, p->zero), PPO_V(le)(p->negative_low, log_ratio)));
    PPO_V(store)(grad + i, PPO_V(select)(PPO_M(and)(valid, moves), row_grad, p->zero));
}

/* The sum of log(weight) over the valid tokens, in the lanes of the other sums: log.h's ppo_log64
 * on eight lanes (the twin's log_poly, lane for lane). libm's log here, one call a token, took
 * four times the rest of the loss (float32 (1024, 4096) rows, one thread: 23.5 ms against 4.6
 * without weights); the polynomial is within 1 ulp of it. */
PPO_INLINE double PPO_ROW(ppo_log_weight_total)(
    int has_mask, const ppo_real* weights, ptrdiff_t start, ptrdiff_t valid_end,
    const uint8_t* mask) {
    const ppo_f64x8 zero = ppo_f64x8_splat(0.0);
    ppo_f64x8 total = zero;
    ptrdiff_t i = start, whole_end = valid_end - (valid_end - start) % 8;
    for (; i < whole_end; i += 8) {
        ppo_m64x8 valid = has_mask ? ppo_m64x8_from_bytes(mask + i) : ppo_m64x8_all();
        ppo_f64x8 log_weight = ppo_f64x8_log(PPO_V(to_f64)(PPO_V(load)(weights + i)));
        total = ppo_f64x8_add(total, ppo_f64x8_select(valid, log_weight, zero));
    }
    if (i < valid_end) {
        const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {weights};
        PPO_ROW(ppo_tail) tail;
        PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, valid_end - i);
        ppo_f64x8 log_weight = ppo_f64x8_log(PPO_V(to_f64)(PPO_V(load)(tail.tokens[0])));
        total = ppo_f64x8_add(
            total, ppo_f64x8_select(ppo_m64x8_from_bytes(tail.mask), log_weight, zero));
    }
    return ppo_f64x8_total(total);
}

PPO_INLINE void PPO_ROW(ppo_geo_mean_cases)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, ppo_real scale, ppo_real log_ratio_low,
    ppo_real log_ratio_high, ppo_real* grad, double* row_loss, double* row_clipped,
    double* row_lower, double* row_kl) {
    const ppo_real zero = scale - scale;
    ptrdiff_t valid_end = ppo_valid_stop(start, span, length);
    if (has_mask) valid_end = ppo_mask_stop(mask, start, valid_end); /* as rows_loss.h's */
    PPO_ROW(ppo_geo_mean_params) p;
    p.zero = PPO_V(splat)(zero);
    p.high = PPO_V(splat)(log_ratio_high);
    p.negative_low = PPO_V(splat)(-log_ratio_low);
    ppo_f64x8 f64_zero = ppo_f64x8_splat(0.0);
    PPO_ROW(ppo_geo_mean_sums) sums = {f64_zero, f64_zero, f64_zero,
                                       PPO_C(zero)(), PPO_C(zero)(), PPO_C(zero)()};
    int64_t count = 0, upper_count = 0, lower_count = 0;
    const ptrdiff_t distance = PPO_STREAM_AHEAD_BYTES / (ptrdiff_t)sizeof(ppo_real);
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t end = valid_end - first < PPO_CHUNK ? valid_end : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, i;
        sums.valid = PPO_C(zero)(); /* int32 lanes: totalled every chunk */
        sums.upper = PPO_C(zero)();
        sums.lower = PPO_C(zero)();
        for (i = first; i < whole_end; i += 8) {
            /* the token pass rereads the row from the cache: ahead of the row, the next row */
            PPO_ROW(ppo_prefetch_ahead)(
                logprobs, old_logprobs, advantages, NULL, has_mask ? mask : NULL, first, i,
                ppo_ahead_by(i, valid_end, start + span, distance));
            PPO_ROW(ppo_geo_mean_sum_block)(
                has_mask, logprobs, old_logprobs, advantages, mask, i, &p, &sums);
        }
        if (i < end) {
            const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {logprobs, old_logprobs, advantages};
            PPO_ROW(ppo_tail) tail;
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, end - i);
            PPO_ROW(ppo_geo_mean_sum_block)(
                1, tail.tokens[0], tail.tokens[1], tail.tokens[2], tail.mask, 0, &p, &sums);
        }
        count += PPO_C(total)(sums.valid);
        upper_count += PPO_C(total)(sums.upper);
        lower_count += PPO_C(total)(sums.lower);
    }
    double counted = (double)count, loss = 0.0;
    double log_weight_total =
        has_weights ? PPO_ROW(ppo_log_weight_total)(has_mask, weights, start, valid_end, mask)
                    : 0.0;
    if (counted > 0.0) {
        /* exp(mean(r')) * exp(mean(log w)) in one exp */
        double weighted_ratio =
            ppo_exp64(ppo_f64x8_total(sums.kept) / counted + log_weight_total / counted);
        loss = -(ppo_f64x8_total(sums.advantage) / counted) * weighted_ratio;
    }
    ppo_vec row_grad = PPO_V(splat)((ppo_real)(loss * (double)scale));
    ptrdiff_t i = start, whole_end = valid_end - (valid_end - start) % 8;
    for (; i < whole_end; i += 8) {
        PPO_ROW(ppo_geo_mean_block)(
            has_mask, logprobs, old_logprobs, advantages, mask, i, &p, row_grad, grad);
    }
    if (i < valid_end) {
        const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {logprobs, old_logprobs, advantages};
        PPO_ROW(ppo_tail) tail;
        PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, valid_end - i);
        PPO_ROW(ppo_geo_mean_block)(
            1, tail.tokens[0], tail.tokens[1], tail.tokens[2], tail.mask, 0, &p, row_grad,
            tail.grad);
        memcpy(grad + i, tail.grad, (size_t)(valid_end - i) * sizeof(ppo_real));
    }
    for (ptrdiff_t i = valid_end; i < start + span; i++) grad[i] = 0;
    *row_loss = counted * loss;
    *row_clipped = (double)upper_count;
    *row_lower = (double)lower_count;
    *row_kl = ppo_f64x8_total(sums.kl);
}

static void PPO_ROW(ppo_geo_mean_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real log_ratio_low,
    ppo_real log_ratio_high, ppo_real* grad, double* row_loss, double* row_clipped,
    double* row_lower, double* row_kl) {
    PPO_SEQUENCE_CASES(
        PPO_ROW(ppo_geo_mean_cases), logprobs, old_logprobs, advantages, weights, start, span,
        length, mask, scale, log_ratio_low, log_ratio_high, grad, row_loss, row_clipped, row_lower,
        row_kl);
}

#undef PPO_SEQUENCE_CASES
#undef PPO_SCALAR_EXP
