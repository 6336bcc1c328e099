/* Twins of _clipped_surrogate_rows and _value_loss_rows (ppo_fast/_numba_losses.py), operation
 * for operation. Included by rows.h, once per dtype. */

/* -- clipped surrogate ------------------------------------------------------------------------- */

typedef struct {
    ppo_vec low, high, dual, clamp, negative_clamp, zero, token_scale;
    ppo_f64x8 scale;
    ppo_clipped_exp clipped_exp;
} PPO_ROW(ppo_policy_params);

typedef struct {
    ppo_f64x8 loss, kl;
    ppo_count clipped, dual;
} PPO_ROW(ppo_policy_sums);

/* The twin's loop body for the 8 tokens from position i, their ratios given. */
PPO_INLINE void PPO_ROW(ppo_policy_block)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, const uint8_t* mask, ptrdiff_t i,
    ppo_vec ratio, const PPO_ROW(ppo_policy_params) * p, ppo_real* grad,
    PPO_ROW(ppo_policy_sums) * sums) {
    ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
    ppo_vec advantage = PPO_V(load)(advantages + i);
    ppo_vec raw_log_ratio = PPO_V(sub)(PPO_V(load)(logprobs + i), PPO_V(load)(old_logprobs + i));
    ppo_vec log_ratio = PPO_ROW(ppo_clip)(raw_log_ratio, p->negative_clamp, p->clamp);
    /* the twin's (log_ratio >= -clamp) & (log_ratio <= clamp), false on NaN as well */
    ppo_mask inside = PPO_V(eq)(log_ratio, raw_log_ratio);
    ppo_vec unclipped = PPO_V(mul)(ratio, advantage);
    ppo_vec clipped = PPO_V(mul)(PPO_ROW(ppo_clip)(ratio, p->low, p->high), advantage);
    ppo_mask is_clipped = PPO_V(lt)(clipped, unclipped);
    ppo_vec objective = PPO_V(select)(is_clipped, clipped, unclipped);
    ppo_vec dual_objective = PPO_V(mul)(p->dual, advantage);
    ppo_mask is_dual =
        PPO_M(and)(PPO_V(lt)(advantage, p->zero), PPO_V(gt)(dual_objective, objective));
    objective = PPO_V(select)(is_dual, dual_objective, objective);
    ppo_mask sloped = PPO_M(and_not)(PPO_M(and_not)(inside, is_clipped), is_dual);
    /* -weight * slope * scale, the slope `unclipped` (advantage * ratio) where sloped and 0 on a
     * flat branch: times the weight, so that a NaN or inf weight still says so */
    ppo_vec slope = PPO_V(select)(sloped, unclipped, p->zero);
    sums->loss = PPO_ROW(ppo_policy_gradient)(
        has_weights, weights, i, valid, slope, objective, p->zero, p->token_scale, p->scale, grad,
        sums->loss);
    sums->kl = ppo_f64x8_sub(sums->kl, PPO_V(to_f64_where)(valid, log_ratio));
    sums->clipped = PPO_C(add)(sums->clipped, PPO_M(and)(valid, is_clipped));
    sums->dual = PPO_C(add)(sums->dual, PPO_M(and)(valid, is_dual));
}

/* The row's valid prefix (positions before its length), a chunk at a time: the chunk's ratios
 * first, then the rest. Fused, each block's long exp chain held every other operation of the block
 * waiting in the scheduler; apart, the exps of a chunk overlap (1.3 to 1.6 times faster). While
 * the ratios are computed, the next chunk's inputs are prefetched, since loads no longer run far
 * enough ahead on their own (about 1.1 times faster on (1024, 4096) rows), and past the row's
 * last chunk, the next row's first (ppo_ahead: float32 (1024, 4096) rows with lengths in
 * [T/2, T], one thread, 3.3 -> 2.8 ms). Positions past the length get a zero gradient and
 * nothing else, which is what the twin computes for them. */
PPO_INLINE void PPO_ROW(ppo_clipped_surrogate_cases)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, const PPO_ROW(ppo_policy_params) * p, ppo_real* grad,
    double* row_loss, double* row_clipped, double* row_dual, double* row_kl) {
    ppo_real ratios[PPO_CHUNK];
    ppo_f64x8 loss = ppo_f64x8_splat(0.0), kl = ppo_f64x8_splat(0.0);
    int64_t clipped = 0, dual = 0;
    ptrdiff_t valid_end = ppo_valid_stop(start, span, length);
    /* A mask's trailing invalid words too, like the positions past the length: their inputs are
     * not read (float32 (1024, 4096) rows whose second half is padding: 0.72-0.75x the time). */
    if (has_mask) valid_end = ppo_mask_stop(mask, start, valid_end);
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t end = valid_end - first < PPO_CHUNK ? valid_end : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, i;
        PPO_ROW(ppo_policy_sums) sums = {loss, kl, PPO_C(zero)(), PPO_C(zero)()};
        PPO_ROW(ppo_chunk_ratios)(
            logprobs, old_logprobs, advantages, has_weights ? weights : NULL,
            has_mask ? mask : NULL, first, whole_end, valid_end, start + span, &p->clipped_exp,
            p->negative_clamp, p->clamp, ratios);
        for (i = first; i < whole_end; i += 8) {
            PPO_ROW(ppo_policy_block)(
                has_mask, has_weights, logprobs, old_logprobs, advantages, weights, mask, i,
                PPO_V(load)(ratios + (i - first)), p, grad, &sums);
        }
        if (i < end) {
            const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL};
            PPO_ROW(ppo_tail) tail;
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, end - i);
            ppo_vec ratio = PPO_ROW(ppo_clipped_ratio)(
                tail.tokens[0], tail.tokens[1], 0, p->negative_clamp, p->clamp);
            PPO_ROW(ppo_policy_block)(
                1, has_weights, tail.tokens[0], tail.tokens[1], tail.tokens[2], tail.tokens[3],
                tail.mask, 0, ratio, p, tail.grad, &sums);
            memcpy(grad + i, tail.grad, (size_t)(end - i) * sizeof(ppo_real));
        }
        loss = sums.loss;
        kl = sums.kl;
        clipped += PPO_C(total)(sums.clipped);
        dual += PPO_C(total)(sums.dual);
    }
    for (ptrdiff_t i = valid_end; i < start + span; i++) grad[i] = 0;
    *row_loss = ppo_f64x8_total(loss);
    *row_clipped = (double)clipped;
    *row_dual = (double)dual;
    *row_kl = ppo_f64x8_total(kl);
}

static void PPO_ROW(ppo_clipped_surrogate_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real ratio_low, ppo_real ratio_high,
    ppo_real dual_clip, ppo_real log_ratio_clamp, ppo_real* grad, double* row_loss,
    double* row_clipped, double* row_dual, double* row_kl) {
    PPO_ROW(ppo_policy_params) p;
    p.low = PPO_V(splat)(ratio_low);
    p.high = PPO_V(splat)(ratio_high);
    p.dual = PPO_V(splat)(dual_clip);
    p.clamp = PPO_V(splat)(log_ratio_clamp);
    p.negative_clamp = PPO_V(splat)(-log_ratio_clamp);
    p.clipped_exp = ppo_clipped_exp_of(log_ratio_clamp);
    p.zero = PPO_V(splat)(scale - scale); /* as the twin: 0 in the dtype */
    p.scale = ppo_f64x8_splat((double)scale);
    p.token_scale = PPO_V(splat)(scale);
    /* One specialization per case: without a mask or weights, nothing is loaded for them. */
#define PPO_CASE(mask_case, weights_case)                                                   \
    PPO_ROW(ppo_clipped_surrogate_cases)(                                                   \
        mask_case, weights_case, logprobs, old_logprobs, advantages, weights, start, span, \
        length, mask, &p, grad, row_loss, row_clipped, row_dual, row_kl)
    if (has_mask && has_weights)
        PPO_CASE(1, 1);
    else if (has_mask)
        PPO_CASE(1, 0);
    else if (has_weights)
        PPO_CASE(0, 1);
    else
        PPO_CASE(0, 0);
#undef PPO_CASE
}

/* -- value loss -------------------------------------------------------------------------------- */

/* The twin's loop body for the 8 tokens from position i, `valid` as the mask and length allow. */
PPO_INLINE void PPO_ROW(ppo_value_block)(
    ppo_mask valid, const ppo_real* values, const ppo_real* old_values, const ppo_real* returns,
    ptrdiff_t i, ppo_vec clip_range, ppo_vec scale, ppo_vec zero, ppo_real* grad, ppo_f64x8* loss,
    ppo_count* clipped_count) {
    ppo_vec value = PPO_V(load)(values + i), old = PPO_V(load)(old_values + i);
    ppo_vec target = PPO_V(load)(returns + i);
    ppo_vec error = PPO_V(sub)(value, target);
    ppo_vec unclipped = PPO_V(mul)(error, error);
    ppo_vec clipped_error = PPO_V(sub)(
        PPO_ROW(ppo_clip)(value, PPO_V(sub)(old, clip_range), PPO_V(add)(old, clip_range)),
        target);
    ppo_vec clipped = PPO_V(mul)(clipped_error, clipped_error);
    ppo_mask is_clipped = PPO_V(gt)(clipped, unclipped);
    ppo_mask sloped = PPO_M(and_not)(valid, is_clipped);
    PPO_V(store)(grad + i, PPO_V(select)(sloped, PPO_V(mul)(error, scale), zero));
    ppo_vec chosen = PPO_V(select)(valid, PPO_V(select)(is_clipped, clipped, unclipped), zero);
    *loss = ppo_f64x8_add(*loss, ppo_f64x8_mul(PPO_V(to_f64)(chosen), ppo_f64x8_splat(0.5)));
    *clipped_count = PPO_C(add)(*clipped_count, PPO_M(and)(valid, is_clipped));
}

/* Unlike the policy loss, every position of the row is computed, as in the twin: this kernel is
 * bound by memory, and reading rows whole keeps the hardware prefetcher streaming from one row to
 * the next (skipping the padding made (1024, 4096) float32 rows up to 1.5 times slower). */
PPO_INLINE void PPO_ROW(ppo_value_loss_cases)(
    int has_mask, const ppo_real* values, const ppo_real* old_values, const ppo_real* returns,
    ptrdiff_t start, ptrdiff_t span, ptrdiff_t length, const uint8_t* mask, ppo_real clip_range,
    ppo_real scale, ppo_real* grad, double* row_loss, double* row_clipped) {
    ppo_vec clip_ranges = PPO_V(splat)(clip_range), scales = PPO_V(splat)(scale);
    ppo_vec zero = PPO_V(splat)(scale - scale); /* as the twin: 0 in the dtype */
    ppo_f64x8 loss = ppo_f64x8_splat(0.0);
    int64_t clipped = 0;
    /* Blocks wholly before the length need no test of it. */
    ptrdiff_t within = length < span ? (length > 0 ? length - length % 8 : 0) : span - span % 8;
    for (ptrdiff_t first = 0; first < span; first += PPO_CHUNK) {
        ptrdiff_t end = span - first < PPO_CHUNK ? span : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, t = first;
        ppo_count clipped_count = PPO_C(zero)();
        for (; t < (within < whole_end ? within : whole_end); t += 8) {
            ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + start + t) : PPO_M(all)();
            PPO_ROW(ppo_value_block)(
                valid, values, old_values, returns, start + t, clip_ranges, scales, zero, grad,
                &loss, &clipped_count);
        }
        for (; t < whole_end; t += 8) {
            ppo_mask valid = PPO_M(first)(length - t);
            if (has_mask) valid = PPO_M(and)(valid, PPO_M(from_bytes)(mask + start + t));
            PPO_ROW(ppo_value_block)(
                valid, values, old_values, returns, start + t, clip_ranges, scales, zero, grad,
                &loss, &clipped_count);
        }
        if (t < end) {
            const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {values, old_values, returns, NULL};
            PPO_ROW(ppo_tail) tail;
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, start + t, end - t);
            ppo_mask valid = PPO_M(and)(PPO_M(from_bytes)(tail.mask), PPO_M(first)(length - t));
            PPO_ROW(ppo_value_block)(
                valid, tail.tokens[0], tail.tokens[1], tail.tokens[2], 0, clip_ranges, scales,
                zero, tail.grad, &loss, &clipped_count);
            memcpy(grad + start + t, tail.grad, (size_t)(end - t) * sizeof(ppo_real));
        }
        clipped += PPO_C(total)(clipped_count);
    }
    *row_loss = ppo_f64x8_total(loss);
    *row_clipped = (double)clipped;
}

static void PPO_ROW(ppo_value_loss_row)(
    const ppo_real* values, const ppo_real* old_values, const ppo_real* returns, ptrdiff_t start,
    ptrdiff_t span, ptrdiff_t length, const uint8_t* mask, int has_mask, ppo_real scale,
    ppo_real clip_range, ppo_real* grad, double* row_loss, double* row_clipped) {
    if (has_mask)
        PPO_ROW(ppo_value_loss_cases)(
            1, values, old_values, returns, start, span, length, mask, clip_range, scale, grad,
            row_loss, row_clipped);
    else
        PPO_ROW(ppo_value_loss_cases)(
            0, values, old_values, returns, start, span, length, mask, clip_range, scale, grad,
            row_loss, row_clipped);
}
