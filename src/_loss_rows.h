/* The Cython backend's loss kernels, one row per call, over the eight lanes of _lanes.h.
 *
 * Twins of _clipped_surrogate_rows and _value_loss_rows in ppo_fast/_numba_kernels.py, operation
 * for operation, and (at the end) of _kl_penalty_rows, _shape_rewards_rows and _moments_rows;
 * src/_kernels.pyx calls them from its prange over rows. _lanes.h says why they
 * are written in C over explicit lanes rather than in Cython.
 *
 * Written once over the dtype: src/_kernels.pyx includes this file twice, with
 * PPO_FAST_LOSS_DTYPE 32 and then 64, which defines ppo_clipped_surrogate_row_f32 and
 * ppo_value_loss_row_f32, then their _f64 twins. Within, ppo_real is the dtype and ppo_vec,
 * ppo_mask and ppo_count its lane types; PPO_V(op), PPO_M(op) and PPO_C(op) name their operations.
 *
 * Per-token arithmetic runs in the dtype and every sum in float64, with the twins' types where
 * numba's promotion makes them float64 (the policy loss's weight, and so its gradient's product).
 * Tokens go 8 at a time, token t of a row in lane t % 8; a row's last partial block is copied into
 * zero-padded lanes that are invalid. An invalid lane is zeroed before it reaches a sum, so that
 * nothing stored at a masked position (NaN, inf) does; a zero term adds nothing, as the twins'
 * `else 0.0`.
 */
#include "_lanes.h"

#if PPO_FAST_LOSS_DTYPE == 32
#define ppo_real float
#define PPO_LANES f32x8
#define PPO_MASKS m32x8
#define PPO_COUNTS c32x8
#define PPO_ROW(name) name##_f32
#elif PPO_FAST_LOSS_DTYPE == 64
#define ppo_real double
#define PPO_LANES f64x8
#define PPO_MASKS m64x8
#define PPO_COUNTS c64x8
#define PPO_ROW(name) name##_f64
#else
#error "_loss_rows.h: define PPO_FAST_LOSS_DTYPE as 32 or 64 before including it"
#endif

#ifndef PPO_FAST_LOSS_ROWS_NAMES
#define PPO_FAST_LOSS_ROWS_NAMES
#define PPO_CONCAT_(a, b) a##b
#define PPO_CONCAT(a, b) PPO_CONCAT_(a, b)
#define PPO_V(operation) PPO_CONCAT(PPO_CONCAT(ppo_, PPO_LANES), PPO_CONCAT(_, operation))
#define PPO_M(operation) PPO_CONCAT(PPO_CONCAT(ppo_, PPO_MASKS), PPO_CONCAT(_, operation))
#define PPO_C(operation) PPO_CONCAT(PPO_CONCAT(ppo_, PPO_COUNTS), PPO_CONCAT(_, operation))
#define PPO_CHUNK 256 /* tokens a row goes through at a time: a multiple of 8 */
#endif
#define ppo_vec PPO_CONCAT(ppo_, PPO_LANES)
#define ppo_mask PPO_CONCAT(ppo_, PPO_MASKS)
#define ppo_count PPO_CONCAT(ppo_, PPO_COUNTS)

/* The twins' min(max(x, low), high), comparison for comparison. */
PPO_INLINE ppo_vec PPO_ROW(ppo_clip)(ppo_vec x, ppo_vec low, ppo_vec high) {
    return PPO_V(min)(high, PPO_V(max)(low, x));
}

/* A row's last partial block: `count` < 8 tokens from position i of up to four token arrays
 * (NULL: absent), and their mask (all valid without one), in zero-padded lanes. */
typedef struct {
    ppo_real tokens[4][8], grad[8];
    uint8_t mask[8];
} PPO_ROW(ppo_tail);

PPO_INLINE void PPO_ROW(ppo_tail_fill)(
    PPO_ROW(ppo_tail) * tail, const ppo_real* const arrays[4], int has_mask, const uint8_t* mask,
    ptrdiff_t i, ptrdiff_t count) {
    memset(tail, 0, sizeof *tail);
    for (ptrdiff_t lane = 0; lane < count; lane++) {
        for (int k = 0; k < 4; k++) {
            if (arrays[k]) tail->tokens[k][lane] = arrays[k][i + lane];
        }
        tail->mask[lane] = has_mask ? mask[i + lane] : 1;
    }
}

/* -- clipped surrogate ------------------------------------------------------------------------- */

typedef struct {
    ppo_vec low, high, dual, clamp, negative_clamp, zero;
    ppo_f64x8 scale;
} PPO_ROW(ppo_policy_params);

typedef struct {
    ppo_f64x8 loss, kl;
    ppo_count clipped, dual;
} PPO_ROW(ppo_policy_sums);

PPO_INLINE ppo_vec PPO_ROW(ppo_policy_ratio)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, ptrdiff_t i,
    const PPO_ROW(ppo_policy_params) * p) {
    ppo_vec log_ratio = PPO_V(sub)(PPO_V(load)(logprobs + i), PPO_V(load)(old_logprobs + i));
    return PPO_V(exp)(PPO_ROW(ppo_clip)(log_ratio, p->negative_clamp, p->clamp));
}

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
    ppo_mask active =
        PPO_M(and_not)(PPO_M(and_not)(PPO_M(and)(valid, inside), is_clipped), is_dual);
    /* numba's weight is float64 either way (its 1 is an integer) */
    ppo_f64x8 negative_weight = ppo_f64x8_splat(-1.0);
    if (has_weights) {
        ppo_vec weight = PPO_V(select)(valid, PPO_V(load)(weights + i), p->zero);
        negative_weight = ppo_f64x8_negative(PPO_V(to_f64)(weight));
    }
    /* -weight * (advantage * ratio) * scale, where advantage * ratio is `unclipped` */
    ppo_f64x8 gradient =
        ppo_f64x8_mul(ppo_f64x8_mul(negative_weight, PPO_V(to_f64)(unclipped)), p->scale);
    PPO_V(store)(grad + i, PPO_V(select)(active, PPO_V(from_f64)(gradient), p->zero));
    objective = PPO_V(select)(valid, objective, p->zero);
    sums->loss =
        ppo_f64x8_add(sums->loss, ppo_f64x8_mul(negative_weight, PPO_V(to_f64)(objective)));
    log_ratio = PPO_V(select)(valid, log_ratio, p->zero);
    sums->kl = ppo_f64x8_add(sums->kl, ppo_f64x8_negative(PPO_V(to_f64)(log_ratio)));
    sums->clipped = PPO_C(add)(sums->clipped, PPO_M(and)(valid, is_clipped));
    sums->dual = PPO_C(add)(sums->dual, PPO_M(and)(valid, is_dual));
}

/* The row's valid prefix (positions before its length), a chunk at a time: the chunk's ratios
 * first, then the rest. Fused, each block's long exp chain held every other operation of the block
 * waiting in the scheduler; apart, the exps of a chunk overlap (1.3 to 1.6 times faster). While
 * the ratios are computed, the next chunk's inputs are prefetched, since loads no longer run far
 * enough ahead on their own (about 1.1 times faster on (1024, 4096) rows). Positions past the
 * length get a zero gradient and nothing else, which is what the twin computes for them. */
PPO_INLINE void PPO_ROW(ppo_clipped_surrogate_cases)(
    int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, const PPO_ROW(ppo_policy_params) * p, ppo_real* grad,
    double* row_loss, double* row_clipped, double* row_dual, double* row_kl) {
    ppo_real ratios[PPO_CHUNK];
    ppo_f64x8 loss = ppo_f64x8_splat(0.0), kl = ppo_f64x8_splat(0.0);
    int64_t clipped = 0, dual = 0;
    ptrdiff_t valid_end = start + (length < span ? (length > 0 ? length : 0) : span);
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t end = valid_end - first < PPO_CHUNK ? valid_end : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, i;
        PPO_ROW(ppo_policy_sums) sums = {loss, kl, PPO_C(zero)(), PPO_C(zero)()};
        for (i = first; i < whole_end; i += 8) {
            ptrdiff_t ahead = (i + PPO_CHUNK) * (ptrdiff_t)sizeof(ppo_real);
            if ((i - first) % (64 / sizeof(ppo_real)) == 0) { /* a cache line of each */
                ppo_prefetch(logprobs, ahead);
                ppo_prefetch(old_logprobs, ahead);
                ppo_prefetch(advantages, ahead);
                if (has_weights) ppo_prefetch(weights, ahead);
                if (has_mask && (i - first) % 64 == 0) ppo_prefetch(mask, i + PPO_CHUNK);
            }
            ppo_vec ratio = PPO_ROW(ppo_policy_ratio)(logprobs, old_logprobs, i, p);
            PPO_V(store)(ratios + (i - first), ratio);
        }
        for (i = first; i < whole_end; i += 8) {
            PPO_ROW(ppo_policy_block)(
                has_mask, has_weights, logprobs, old_logprobs, advantages, weights, mask, i,
                PPO_V(load)(ratios + (i - first)), p, grad, &sums);
        }
        if (i < end) {
            const ppo_real* const arrays[4] = {
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL};
            PPO_ROW(ppo_tail) tail;
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, end - i);
            ppo_vec ratio = PPO_ROW(ppo_policy_ratio)(tail.tokens[0], tail.tokens[1], 0, p);
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

/* params = [1 - clip_low, 1 + clip_high, dual clip, log-ratio clamp], as the twin's. */
static void PPO_ROW(ppo_clipped_surrogate_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, const ppo_real* params, ppo_real scale, ppo_real* grad,
    double* row_loss, double* row_clipped, double* row_dual, double* row_kl) {
    PPO_ROW(ppo_policy_params) p;
    p.low = PPO_V(splat)(params[0]);
    p.high = PPO_V(splat)(params[1]);
    p.dual = PPO_V(splat)(params[2]);
    p.clamp = PPO_V(splat)(params[3]);
    p.negative_clamp = PPO_V(splat)(-params[3]);
    p.zero = PPO_V(splat)(scale - scale); /* as the twin: 0 in the dtype */
    p.scale = ppo_f64x8_splat((double)scale);
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
            const ppo_real* const arrays[4] = {values, old_values, returns, NULL};
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
    ptrdiff_t span, ptrdiff_t length, const uint8_t* mask, int has_mask, ppo_real clip_range,
    ppo_real scale, ppo_real* grad, double* row_loss, double* row_clipped) {
    if (has_mask)
        PPO_ROW(ppo_value_loss_cases)(
            1, values, old_values, returns, start, span, length, mask, clip_range, scale, grad,
            row_loss, row_clipped);
    else
        PPO_ROW(ppo_value_loss_cases)(
            0, values, old_values, returns, start, span, length, mask, clip_range, scale, grad,
            row_loss, row_clipped);
}

/* -- KL estimates, shaped rewards and moments -------------------------------------------------- */
/* Twins of _kl_penalty_rows, _shape_rewards_rows and _moments_rows, over the same lanes: k3's exp
 * is ppo_f64x8_exp, the twins' _exp64, which numba vectorizes and libm's exp does not; and the
 * moments' sums go token t of a row to lane t % 8, added up in a fixed tree (numba's order is
 * LLVM's reassociation), so that every build and any thread count give the same bits. */

#ifndef PPO_FAST_KL_VALUES
#define PPO_FAST_KL_VALUES
/* Estimator codes, as in ppo_fast/rewards.py. */
enum { PPO_K1 = 0, PPO_K2 = 1, PPO_K3 = 2, PPO_ABS = 3 };

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

/* Which of the 8 tokens from position t of a row are valid. */
PPO_INLINE ppo_m64x8 ppo_valid_lanes(
    const uint8_t* mask, int has_mask, ptrdiff_t i, ptrdiff_t t, ptrdiff_t length) {
    ppo_m64x8 valid = ppo_m64x8_first(length - t);
    return has_mask ? ppo_m64x8_and(valid, ppo_m64x8_from_bytes(mask + i)) : valid;
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
    /* Two blocks a step, so that their exp chains interleave (k3 is bound by their latency). */
    for (i = start; i + 16 <= whole_end; i += 16) {
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
    ptrdiff_t last = start + span, t; /* one past the row when it has no valid position */
    for (t = valid_span - 1; t >= 0; t--) {
        if (!has_mask || mask[start + t] != 0) {
            last = start + t;
            break;
        }
    }
    ptrdiff_t whole = valid_span - valid_span % 8;
    for (t = 0; t < whole; t += 8) {
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
    double score, const ppo_real* logprobs, const ppo_real* ref_logprobs, ptrdiff_t start,
    ptrdiff_t span, ptrdiff_t length, const uint8_t* mask, int has_mask, double kl_coef,
    int estimator, double clamp, ppo_real* out) {
    PPO_ESTIMATOR_CASES(
        PPO_ROW(ppo_shape_rewards_cases), score, logprobs, ref_logprobs, start, span, length,
        mask, has_mask, kl_coef, clamp, out)
}

/* The twin's loop body for the 8 tokens from position i: invalid lanes add 0 (a sum that starts
 * at +0.0 is unchanged by it), so that nothing stored at a masked position reaches a sum. */
PPO_INLINE void PPO_ROW(ppo_moments_block)(
    ppo_m64x8 valid, const ppo_real* x, ptrdiff_t i, ppo_f64x8 shift, ppo_f64x8* count,
    ppo_f64x8* total, ppo_f64x8* total_sq) {
    ppo_f64x8 zero = ppo_f64x8_splat(0.0);
    ppo_f64x8 centred = ppo_f64x8_sub(PPO_V(to_f64)(PPO_V(load)(x + i)), shift);
    *count = ppo_f64x8_add(*count, ppo_f64x8_select(valid, ppo_f64x8_splat(1.0), zero));
    *total = ppo_f64x8_add(*total, ppo_f64x8_select(valid, centred, zero));
    *total_sq =
        ppo_f64x8_add(*total_sq, ppo_f64x8_select(valid, ppo_f64x8_mul(centred, centred), zero));
}

/* Every position of the row is read, as in the twin, though those past the length add nothing:
 * reading rows whole keeps the hardware prefetcher streaming from one row to the next (stopping
 * at the length made (1024, 4096) float64 rows 1.7 times slower than numba). */
PPO_INLINE void PPO_ROW(ppo_moments_cases)(
    int has_mask, const ppo_real* x, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, double shift, double* row_count, double* row_total,
    double* row_total_sq) {
    ppo_f64x8 shifts = ppo_f64x8_splat(shift);
    ppo_f64x8 count = ppo_f64x8_splat(0.0), total = count, total_sq = count;
    ptrdiff_t whole = span - span % 8, t;
    for (t = 0; t < whole; t += 8) {
        PPO_ROW(ppo_moments_block)(
            ppo_valid_lanes(mask, has_mask, start + t, t, length), x, start + t, shifts, &count,
            &total, &total_sq);
    }
    if (t < span) {
        ptrdiff_t tail_count = span - t;
        ppo_real tail_x[8] = {0};
        uint8_t tail_mask[8] = {0};
        memcpy(tail_x, x + start + t, (size_t)tail_count * sizeof(ppo_real));
        if (has_mask) memcpy(tail_mask, mask + start + t, (size_t)tail_count);
        PPO_ROW(ppo_moments_block)(
            ppo_valid_lanes(tail_mask, has_mask, 0, t, length), tail_x, 0, shifts, &count,
            &total, &total_sq);
    }
    *row_count = ppo_f64x8_total(count);
    *row_total = ppo_f64x8_total(total);
    *row_total_sq = ppo_f64x8_total(total_sq);
}

static void PPO_ROW(ppo_moments_row)(
    const ppo_real* x, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length, const uint8_t* mask,
    int has_mask, double shift, double* row_count, double* row_total, double* row_total_sq) {
    if (has_mask)
        PPO_ROW(ppo_moments_cases)(
            1, x, start, span, length, mask, shift, row_count, row_total, row_total_sq);
    else
        PPO_ROW(ppo_moments_cases)(
            0, x, start, span, length, mask, shift, row_count, row_total, row_total_sq);
}

#undef ppo_real
#undef PPO_LANES
#undef PPO_MASKS
#undef PPO_COUNTS
#undef PPO_ROW
#undef ppo_vec
#undef ppo_mask
#undef ppo_count
