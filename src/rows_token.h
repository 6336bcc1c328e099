/* Twins of dppo and kl_cov (ppo_fast/_numba_losses.py), operation for operation. Included by
 * rows.h, once per dtype.
 *
 * Eight lanes at a time, as rows_policy.h: a row's valid prefix in chunks of PPO_CHUNK tokens,
 * the chunk's exps (and DPPO's binary KLs) first into scratch rows, then the rest 8 tokens at a
 * time, a row's last partial block in the zero-padded invalid lanes of PPO_ROW(ppo_tail).
 * Per-token arithmetic runs in the dtype (DPPO's binary KL in float64, compared in float64),
 * the weight in float64 as the twins' (numba's promotion), every sum in float64 in 8 lanes
 * added up in a fixed tree (an order of its own, the same on any number of threads), every count
 * an integer. An invalid position gets a zero gradient and adds a zero term to each sum, as the
 * twins' selects: whatever is stored there (NaN, inf) reaches nothing. */

/* -- DPPO (binary TV or binary KL) ------------------------------------------------------------- */

typedef struct {
    ppo_vec zero, one, low, negative_low, high, cap, clamp, negative_clamp, token_scale;
    ppo_f64x8 scale, wide_low, wide_high; /* the binary KL's bounds, for it is in float64 */
    int binary_kl;
} PPO_ROW(ppo_dppo_params);

typedef struct {
    ppo_f64x8 loss, kl;
    ppo_count outside, capped;
} PPO_ROW(ppo_dppo_sums);

/* The exps of the 8 tokens from position i: the ratio (of the clamped log-ratio), the
 * probability and the old one (for the TV; 0 for the binary KL). */
PPO_INLINE void PPO_ROW(ppo_dppo_exps)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, ptrdiff_t i,
    const PPO_ROW(ppo_dppo_params) * p, ppo_vec* ratio, ppo_vec* prob, ppo_vec* old_prob) {
    ppo_vec logprob = PPO_V(load)(logprobs + i), old = PPO_V(load)(old_logprobs + i);
    ppo_vec log_ratio = PPO_ROW(ppo_clip)(PPO_V(sub)(logprob, old), p->negative_clamp, p->clamp);
    *ratio = PPO_V(exp)(log_ratio);
    *prob = *old_prob = p->zero;
    if (p->binary_kl) return; /* its probabilities are float64's: ppo_dppo_wide_exp */
    *prob = PPO_V(exp)(logprob);
    *old_prob = PPO_V(exp)(old);
}

/* ppo_dppo_exps for the 16 tokens from position i, two blocks at once (lanes.h's _pair
 * operations: one AVX-512 register holds both blocks of float32), stored at the chunk's
 * scratch rows from `at`. */
PPO_INLINE void PPO_ROW(ppo_dppo_exps_pair)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, ptrdiff_t i,
    const PPO_ROW(ppo_dppo_params) * p, ppo_real* ratios, ppo_real* probs, ppo_real* old_probs,
    ptrdiff_t at) {
    ppo_vec logprob0 = PPO_V(load)(logprobs + i), logprob1 = PPO_V(load)(logprobs + i + 8);
    ppo_vec old0 = PPO_V(load)(old_logprobs + i), old1 = PPO_V(load)(old_logprobs + i + 8);
    ppo_vec log_ratio0 =
        PPO_ROW(ppo_clip)(PPO_V(sub)(logprob0, old0), p->negative_clamp, p->clamp);
    ppo_vec log_ratio1 =
        PPO_ROW(ppo_clip)(PPO_V(sub)(logprob1, old1), p->negative_clamp, p->clamp);
    ppo_vec first, second;
    PPO_V(exp_pair)(log_ratio0, log_ratio1, &first, &second);
    PPO_V(store)(ratios + at, first);
    PPO_V(store)(ratios + at + 8, second);
    if (p->binary_kl) return; /* its probabilities are float64's: ppo_dppo_wide_exp */
    PPO_V(exp_pair)(logprob0, logprob1, &first, &second);
    PPO_V(store)(probs + at, first);
    PPO_V(store)(probs + at + 8, second);
    PPO_V(exp_pair)(old0, old1, &first, &second);
    PPO_V(store)(old_probs + at, first);
    PPO_V(store)(old_probs + at + 8, second);
}

/* exp of the 8 values from position i, in float64 (the binary KL's probabilities). */
PPO_INLINE ppo_f64x8 PPO_ROW(ppo_dppo_wide_exp)(const ppo_real* values, ptrdiff_t i) {
    return ppo_f64x8_exp(PPO_V(to_f64)(PPO_V(load)(values + i)));
}

/* 1 where the binary KL of the 8 tokens from position i, p_old * (old - logp) + (1 - p_old) *
 * log((1 - p_old + 1e-8) / ((1 - p) + 1e-8)), is at most its bound (high where A > 0, else low),
 * else 0, given their float64 probabilities: in float64, for in float32 its two terms cancel
 * below their rounding wherever |p - p_old| < 3e-4 (the twin, _binary_kls). */
PPO_INLINE ppo_vec PPO_ROW(ppo_dppo_within)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    ptrdiff_t i, ppo_f64x8 prob, ppo_f64x8 old_prob, const PPO_ROW(ppo_dppo_params) * p) {
    ppo_f64x8 logprob = PPO_V(to_f64)(PPO_V(load)(logprobs + i));
    ppo_f64x8 old = PPO_V(to_f64)(PPO_V(load)(old_logprobs + i));
    ppo_f64x8 one = ppo_f64x8_splat(1.0), eps = ppo_f64x8_splat(1e-8);
    ppo_f64x8 complement = ppo_f64x8_sub(one, old_prob);
    ppo_f64x8 quotient = ppo_f64x8_div(
        ppo_f64x8_add(complement, eps), ppo_f64x8_add(ppo_f64x8_sub(one, prob), eps));
    ppo_f64x8 distance = ppo_f64x8_add(ppo_f64x8_mul(old_prob, ppo_f64x8_sub(old, logprob)),
                                       ppo_f64x8_mul(complement, ppo_f64x8_log(quotient)));
    ppo_f64x8 advantage = PPO_V(to_f64)(PPO_V(load)(advantages + i));
    ppo_f64x8 bound = ppo_f64x8_select(
        ppo_f64x8_gt(advantage, ppo_f64x8_splat(0.0)), p->wide_high, p->wide_low);
    return PPO_V(from_f64)(
        ppo_f64x8_select(ppo_f64x8_le(distance, bound), one, ppo_f64x8_splat(0.0)));
}

/* The twin's loop body for the 8 tokens from position i, their exps (and for the binary KL,
 * whether it is within its bound: ppo_dppo_within) given. */
PPO_INLINE void PPO_ROW(ppo_dppo_block)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, const uint8_t* mask, ptrdiff_t i,
    ppo_vec ratio, ppo_vec prob, ppo_vec old_prob, ppo_vec within,
    const PPO_ROW(ppo_dppo_params) * p, ppo_real* grad, PPO_ROW(ppo_dppo_sums) * sums) {
    ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
    ppo_vec logprob = PPO_V(load)(logprobs + i), old = PPO_V(load)(old_logprobs + i);
    ppo_vec advantage = PPO_V(load)(advantages + i);
    ppo_vec log_ratio = PPO_ROW(ppo_clip)(PPO_V(sub)(logprob, old), p->negative_clamp, p->clamp);
    ppo_mask positive = PPO_V(gt)(advantage, p->zero), inside_positive, inside_negative;
    if (p->binary_kl) { /* p <= p_old read as logp <= old: exp is increasing */
        ppo_mask close = PPO_V(gt)(within, p->zero);
        inside_positive = PPO_M(or)(close, PPO_V(le)(logprob, old));
        inside_negative = PPO_M(or)(close, PPO_V(le)(old, logprob));
    } else {
        ppo_vec difference = PPO_V(sub)(prob, old_prob);
        inside_positive = PPO_V(le)(difference, p->high);
        inside_negative = PPO_V(le)(p->negative_low, difference);
    }
    ppo_mask inside = PPO_M(or)(PPO_M(and)(positive, inside_positive),
                                PPO_M(and_not)(inside_negative, positive));
    ppo_vec keep = PPO_V(select)(inside, p->one, p->zero);
    /* the twin's min(ratio, cap): cap < ratio ? cap : ratio */
    ppo_vec slope = PPO_V(mul)(advantage, PPO_V(min)(p->cap, ratio));
    ppo_vec objective = PPO_V(mul)(PPO_V(mul)(slope, logprob), keep);
    sums->loss = PPO_ROW(ppo_policy_gradient)(
        has_weights, weights, i, valid, PPO_V(mul)(slope, keep), objective, p->zero,
        p->token_scale, p->scale, grad, sums->loss);
    sums->kl = ppo_f64x8_sub(sums->kl, PPO_V(to_f64_where)(valid, log_ratio));
    sums->outside = PPO_C(add)(sums->outside, PPO_M(and_not)(valid, inside));
    ppo_mask capped = PPO_M(and)(PPO_M(and)(valid, inside), PPO_V(gt)(ratio, p->cap));
    sums->capped = PPO_C(add)(sums->capped, capped);
}

/* The row's valid prefix, a chunk at a time: the chunk's exps (the ratios, the probabilities),
 * prefetching the next chunk's inputs meanwhile (past the row's end, the next row's: ppo_ahead),
 * then for the binary KL whether it is within its bound, each pass a short chain per block (as
 * the ratios and sigmoids of rows_policy.h), then the rest. */
PPO_INLINE void PPO_ROW(ppo_dppo_cases)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, const PPO_ROW(ppo_dppo_params) * p, ppo_real* grad,
    double* row_loss, double* row_outside, double* row_capped, double* row_kl) {
    ppo_real ratios[PPO_CHUNK], probs[PPO_CHUNK], old_probs[PPO_CHUNK], withins[PPO_CHUNK];
    double wide_probs[PPO_CHUNK], wide_old_probs[PPO_CHUNK];
    ppo_f64x8 loss = ppo_f64x8_splat(0.0), kl = ppo_f64x8_splat(0.0);
    int64_t outside = 0, capped = 0;
    ptrdiff_t valid_end = ppo_valid_stop(start, span, length);
    if (has_mask) valid_end = ppo_mask_stop(mask, start, valid_end); /* as rows_loss.h's */
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t end = valid_end - first < PPO_CHUNK ? valid_end : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, i;
        PPO_ROW(ppo_dppo_sums) sums = {loss, kl, PPO_C(zero)(), PPO_C(zero)()};
        /* the exps two blocks a step, then the odd block left */
        for (i = first; i + 16 <= whole_end; i += 16) {
            PPO_ROW(ppo_prefetch_ahead)(
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL,
                has_mask ? mask : NULL, first, i, ppo_ahead(i, valid_end, start + span));
            PPO_ROW(ppo_prefetch_ahead)(
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL,
                has_mask ? mask : NULL, first, i + 8,
                ppo_ahead(i + 8, valid_end, start + span));
            PPO_ROW(ppo_dppo_exps_pair)(
                logprobs, old_logprobs, i, p, ratios, probs, old_probs, i - first);
        }
        for (; i < whole_end; i += 8) {
            PPO_ROW(ppo_prefetch_ahead)(
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL,
                has_mask ? mask : NULL, first, i, ppo_ahead(i, valid_end, start + span));
            ppo_vec ratio, prob, old_prob;
            PPO_ROW(ppo_dppo_exps)(logprobs, old_logprobs, i, p, &ratio, &prob, &old_prob);
            PPO_V(store)(ratios + (i - first), ratio);
            PPO_V(store)(probs + (i - first), prob);
            PPO_V(store)(old_probs + (i - first), old_prob);
        }
        /* the binary KL's float64 exps a pass each, as its twin's, then whether it is within
         * (one pass of all of it held the log's constants on the stack: with the dtype's
         * exps of the probabilities, 21.4 ms against 15.9 at 1024 x 4096, float32, 1 thread) */
        for (i = first; p->binary_kl && i < whole_end; i += 8)
            ppo_f64x8_store(wide_probs + (i - first), PPO_ROW(ppo_dppo_wide_exp)(logprobs, i));
        for (i = first; p->binary_kl && i < whole_end; i += 8)
            ppo_f64x8_store(
                wide_old_probs + (i - first), PPO_ROW(ppo_dppo_wide_exp)(old_logprobs, i));
        for (i = first; p->binary_kl && i < whole_end; i += 8)
            PPO_V(store)(withins + (i - first),
                         PPO_ROW(ppo_dppo_within)(
                             logprobs, old_logprobs, advantages, i,
                             ppo_f64x8_load(wide_probs + (i - first)),
                             ppo_f64x8_load(wide_old_probs + (i - first)), p));
        for (i = first; i < whole_end; i += 8) {
            ppo_vec within = p->zero;
            if (p->binary_kl) within = PPO_V(load)(withins + (i - first));
            PPO_ROW(ppo_dppo_block)(
                has_mask, has_weights, logprobs, old_logprobs, advantages, weights, mask, i,
                PPO_V(load)(ratios + (i - first)), PPO_V(load)(probs + (i - first)),
                PPO_V(load)(old_probs + (i - first)), within, p, grad, &sums);
        }
        if (i < end) {
            const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL};
            PPO_ROW(ppo_tail) tail;
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, end - i);
            ppo_vec ratio, prob, old_prob, within = p->zero;
            PPO_ROW(ppo_dppo_exps)(tail.tokens[0], tail.tokens[1], 0, p, &ratio, &prob, &old_prob);
            if (p->binary_kl)
                within = PPO_ROW(ppo_dppo_within)(
                    tail.tokens[0], tail.tokens[1], tail.tokens[2], 0,
                    PPO_ROW(ppo_dppo_wide_exp)(tail.tokens[0], 0),
                    PPO_ROW(ppo_dppo_wide_exp)(tail.tokens[1], 0), p);
            PPO_ROW(ppo_dppo_block)(
                1, has_weights, tail.tokens[0], tail.tokens[1], tail.tokens[2], tail.tokens[3],
                tail.mask, 0, ratio, prob, old_prob, within, p, tail.grad, &sums);
            memcpy(grad + i, tail.grad, (size_t)(end - i) * sizeof(ppo_real));
        }
        loss = sums.loss;
        kl = sums.kl;
        outside += PPO_C(total)(sums.outside);
        capped += PPO_C(total)(sums.capped);
    }
    for (ptrdiff_t i = valid_end; i < start + span; i++) grad[i] = 0;
    *row_loss = ppo_f64x8_total(loss);
    *row_outside = (double)outside;
    *row_capped = (double)capped;
    *row_kl = ppo_f64x8_total(kl);
}

/* One specialization per case: without a mask or weights, nothing is loaded for them. */
#define PPO_TOKEN_CASES(cases, ...)                                                            \
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

static void PPO_ROW(ppo_dppo_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, int divergence, ppo_real divergence_low,
    ppo_real divergence_high, ppo_real ratio_cap, ppo_real log_ratio_clamp, ppo_real* grad,
    double* row_loss, double* row_outside, double* row_capped, double* row_kl) {
    const ppo_real zero = scale - scale, one = 1; /* 0 in the dtype, as the twin */
    PPO_ROW(ppo_dppo_params) p;
    p.zero = PPO_V(splat)(zero);
    p.one = PPO_V(splat)(one);
    p.low = PPO_V(splat)(divergence_low);
    p.negative_low = PPO_V(splat)(-divergence_low);
    p.high = PPO_V(splat)(divergence_high);
    p.wide_low = ppo_f64x8_splat((double)divergence_low);
    p.wide_high = ppo_f64x8_splat((double)divergence_high);
    p.cap = PPO_V(splat)(ratio_cap);
    p.clamp = PPO_V(splat)(log_ratio_clamp);
    p.negative_clamp = PPO_V(splat)(-log_ratio_clamp);
    p.scale = ppo_f64x8_splat((double)scale);
    p.token_scale = PPO_V(splat)(scale);
    p.binary_kl = divergence == 1; /* _spec.DIVERGENCES */
    PPO_TOKEN_CASES(
        PPO_ROW(ppo_dppo_cases), logprobs, old_logprobs, advantages, weights, start, span, length,
        mask, &p, grad, row_loss, row_outside, row_capped, row_kl);
}

/* -- KL-Cov ------------------------------------------------------------------------------------ */

typedef struct {
    ppo_vec zero, one, negative_one, coef;
    ppo_vec token_scale;
    ppo_f64x8 scale;
    int penalise; /* coef != 0: with coef 0 no token is penalised, whatever is selected */
} PPO_ROW(ppo_kl_cov_params);

typedef struct {
    ppo_f64x8 loss, distance;
    ppo_count penalised;
} PPO_ROW(ppo_kl_cov_sums);

/* The twin's loop body for the 8 tokens from position i, their ratios and selection flags
 * (`selected`, a byte per token) given. */
PPO_INLINE void PPO_ROW(ppo_kl_cov_block)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const uint8_t* selected, const ppo_real* weights,
    const uint8_t* mask, ptrdiff_t i, ppo_vec ratio, const PPO_ROW(ppo_kl_cov_params) * p,
    ppo_real* grad, PPO_ROW(ppo_kl_cov_sums) * sums) {
    ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
    ppo_vec log_ratio = PPO_V(sub)(PPO_V(load)(logprobs + i), PPO_V(load)(old_logprobs + i));
    ppo_mask penalised = p->penalise ? PPO_M(from_bytes)(selected + i) : PPO_M(first)(0);
    ppo_vec distance = PPO_V(abs)(log_ratio); /* numba's abs: |-0| = +0 */
    /* sign: 0 at 0, NaN at NaN (the log-ratio itself, where it is neither < nor > 0) */
    ppo_vec sign = PPO_V(select)(
        PPO_V(gt)(log_ratio, p->zero), p->one,
        PPO_V(select)(PPO_V(lt)(log_ratio, p->zero), p->negative_one, log_ratio));
    ppo_vec base = PPO_V(mul)(PPO_V(load)(advantages + i), ratio);
    ppo_vec objective =
        PPO_V(select)(penalised, PPO_V(sub)(base, PPO_V(mul)(p->coef, distance)), base);
    ppo_vec slope = PPO_V(select)(penalised, PPO_V(sub)(base, PPO_V(mul)(p->coef, sign)), base);
    sums->loss = PPO_ROW(ppo_policy_gradient)(
        has_weights, weights, i, valid, slope, objective, p->zero, p->token_scale, p->scale, grad,
        sums->loss);
    sums->distance = ppo_f64x8_add(sums->distance, PPO_V(to_f64_where)(valid, distance));
    sums->penalised = PPO_C(add)(sums->penalised, PPO_M(and)(valid, penalised));
}

PPO_INLINE void PPO_ROW(ppo_kl_cov_cases)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, const uint8_t* selected,
    ptrdiff_t start, ptrdiff_t span, ptrdiff_t length, const uint8_t* mask,
    const PPO_ROW(ppo_kl_cov_params) * p, ppo_real* grad, double* row_loss,
    double* row_penalised, double* row_abs_kl) {
    ppo_real ratios[PPO_CHUNK];
    ppo_f64x8 loss = ppo_f64x8_splat(0.0), distance = ppo_f64x8_splat(0.0);
    int64_t penalised = 0;
    ptrdiff_t valid_end = ppo_valid_stop(start, span, length);
    if (has_mask) valid_end = ppo_mask_stop(mask, start, valid_end); /* as rows_loss.h's */
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t end = valid_end - first < PPO_CHUNK ? valid_end : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, i;
        PPO_ROW(ppo_kl_cov_sums) sums = {loss, distance, PPO_C(zero)()};
        for (i = first; i < whole_end; i += 8) {
            ptrdiff_t ahead = ppo_ahead(i, valid_end, start + span);
            PPO_ROW(ppo_prefetch_ahead)(
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL,
                has_mask ? mask : NULL, first, i, ahead);
            if ((i - first) % 64 == 0) ppo_prefetch(selected, ahead); /* a byte a token */
            ppo_vec log_ratio =
                PPO_V(sub)(PPO_V(load)(logprobs + i), PPO_V(load)(old_logprobs + i));
            PPO_V(store)(ratios + (i - first), PPO_V(exp)(log_ratio));
        }
        for (i = first; i < whole_end; i += 8) {
            PPO_ROW(ppo_kl_cov_block)(
                has_mask, has_weights, logprobs, old_logprobs, advantages, selected, weights,
                mask, i, PPO_V(load)(ratios + (i - first)), p, grad, &sums);
        }
        if (i < end) {
            const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL};
            PPO_ROW(ppo_tail) tail;
            uint8_t tail_selected[8] = {0};
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, end - i);
            memcpy(tail_selected, selected + i, (size_t)(end - i));
            ppo_vec ratio = PPO_V(exp)(PPO_V(sub)(PPO_V(load)(tail.tokens[0]),
                                                  PPO_V(load)(tail.tokens[1])));
            PPO_ROW(ppo_kl_cov_block)(
                1, has_weights, tail.tokens[0], tail.tokens[1], tail.tokens[2], tail_selected,
                tail.tokens[3], tail.mask, 0, ratio, p, tail.grad, &sums);
            memcpy(grad + i, tail.grad, (size_t)(end - i) * sizeof(ppo_real));
        }
        loss = sums.loss;
        distance = sums.distance;
        penalised += PPO_C(total)(sums.penalised);
    }
    for (ptrdiff_t i = valid_end; i < start + span; i++) grad[i] = 0;
    *row_loss = ppo_f64x8_total(loss);
    *row_penalised = (double)penalised;
    *row_abs_kl = ppo_f64x8_total(distance);
}

static void PPO_ROW(ppo_kl_cov_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, const uint8_t* selected, ptrdiff_t start,
    ptrdiff_t span, ptrdiff_t length, const uint8_t* mask, int has_mask, ppo_real scale,
    ppo_real coef, ppo_real* grad, double* row_loss, double* row_penalised, double* row_abs_kl) {
    const ppo_real zero = scale - scale, one = 1; /* 0 in the dtype, as the twin */
    PPO_ROW(ppo_kl_cov_params) p;
    p.zero = PPO_V(splat)(zero);
    p.one = PPO_V(splat)(one);
    p.negative_one = PPO_V(splat)(-one);
    p.coef = PPO_V(splat)(coef);
    p.penalise = coef != 0;
    p.scale = ppo_f64x8_splat((double)scale);
    p.token_scale = PPO_V(splat)(scale);
    PPO_TOKEN_CASES(
        PPO_ROW(ppo_kl_cov_cases), logprobs, old_logprobs, advantages, weights, selected, start,
        span, length, mask, &p, grad, row_loss, row_penalised, row_abs_kl);
}

#undef PPO_TOKEN_CASES
