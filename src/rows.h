/* The Cython backend's row kernels in C, one row per call: what src/_kernels.pyx (generated from
 * src/_kernels.pyx.tp and ppo_fast/_spec.py) calls from its prange over rows. Each kernel is the
 * twin, operation for operation, of the numba kernel of the same name in
 * ppo_fast/_numba_kernels.py, and has the table's arguments in the table's order (_spec.py):
 * inputs, start and span (and length, mask and has_mask), row inputs, scalars, outputs and
 * pointers to the row's row outputs. One header per family:
 *
 *   rows_kl.h       kl_penalty, shape_rewards (the KL estimators, specialised per estimator)
 *   rows_gae.h      gae (the whole batch per call, ppo_gae_rows: its long rows run in chunks)
 *   rows_returns.h  discounted_returns, remax, optimal_token_baseline (this one per group of rows:
 *                   ppo_<kernel>_group, with the layout of the whole batch and the group's rows)
 *   rows_moments.h  moments, whiten
 *   rows_loss.h     clipped_surrogate, value_loss
 *   rows_policy.h   reinforce, cispo, sapo
 *   rows_sequence.h gspo, geo_mean (a pre-pass per row)
 *   rows_token.h    dppo, kl_cov
 *   rows_covariance.h kl_cov_top_k (KL-Cov's selection, per group of rows)
 *
 * Written once over the dtype: the generated module includes this file twice, with
 * PPO_FAST_DTYPE 32 and then 64, which defines ppo_<kernel>_row_f32 and then the _f64 twins.
 * Within, ppo_real is the dtype and ppo_vec, ppo_mask and ppo_count its lane types (lanes.h);
 * PPO_V(op), PPO_M(op) and PPO_C(op) name their operations.
 *
 * Why C over explicit lanes rather than Cython: lanes.h. Per-token arithmetic runs in the dtype
 * and every sum in float64, with the twins' types where numba's promotion makes them float64 (the
 * policy loss's weight, and so its gradient's product). Tokens go 8 at a time, token t of a row in
 * lane t % 8; a row's last partial block is copied into zero-padded lanes that are invalid. An
 * invalid lane is zeroed before it reaches a sum, so that nothing stored at a masked position
 * (NaN, inf) does; a zero term adds nothing, as the twins' `else 0.0`.
 */
#include "lanes.h"


#if PPO_FAST_DTYPE == 32
#define ppo_real float
#define PPO_LANES f32x8
#define PPO_MASKS m32x8
#define PPO_COUNTS c32x8
#define PPO_ROW(name) name##_f32
#elif PPO_FAST_DTYPE == 64
#define ppo_real double
#define PPO_LANES f64x8
#define PPO_MASKS m64x8
#define PPO_COUNTS c64x8
#define PPO_ROW(name) name##_f64
#else
#error "rows.h: define PPO_FAST_DTYPE as 32 or 64 before including it"
#endif

#ifndef PPO_FAST_ROWS_NAMES
#define PPO_FAST_ROWS_NAMES
#define PPO_CONCAT_(a, b) a##b
#define PPO_CONCAT(a, b) PPO_CONCAT_(a, b)
#define PPO_V(operation) PPO_CONCAT(PPO_CONCAT(ppo_, PPO_LANES), PPO_CONCAT(_, operation))
#define PPO_M(operation) PPO_CONCAT(PPO_CONCAT(ppo_, PPO_MASKS), PPO_CONCAT(_, operation))
#define PPO_C(operation) PPO_CONCAT(PPO_CONCAT(ppo_, PPO_COUNTS), PPO_CONCAT(_, operation))
#define PPO_CHUNK 256 /* tokens a row goes through at a time: a multiple of 8 */

/* Which of the 8 tokens from position t of a row are valid. */
PPO_INLINE ppo_m64x8 ppo_valid_lanes(
    const uint8_t* mask, int has_mask, ptrdiff_t i, ptrdiff_t t, ptrdiff_t length) {
    ppo_m64x8 valid = ppo_m64x8_first(length - t);
    return has_mask ? ppo_m64x8_and(valid, ppo_m64x8_from_bytes(mask + i)) : valid;
}

/* Whether the 8 mask bytes from p on are all nonzero: a word has a zero byte exactly when
 * (word - 0x01..01) & ~word & 0x80..80 is nonzero (Hacker's Delight 6-1). */
PPO_INLINE int ppo_all_valid8(const uint8_t* p) {
    uint64_t word;
    memcpy(&word, p, 8);
    return ((word - 0x0101010101010101ULL) & ~word & 0x8080808080808080ULL) == 0;
}

/* Whether the 8 mask bytes from p on are all zero. */
PPO_INLINE int ppo_none_valid8(const uint8_t* p) {
    uint64_t word;
    memcpy(&word, p, 8);
    return word == 0;
}

/* stop, less the mask's trailing words of 8 invalid bytes down to low (a right-padded row's
 * padding, at most 7 positions of it left): the positions from it on are not valid. */
PPO_INLINE ptrdiff_t ppo_mask_stop(const uint8_t* mask, ptrdiff_t low, ptrdiff_t stop) {
    while (stop - low >= 8 && ppo_none_valid8(mask + stop - 8)) stop -= 8;
    return stop;
}

/* Where the valid prefix of the row at start ends (its positions before its length): an index
 * into the token arrays, as rows_returns.h's ppo_valid_end is a count. */
PPO_INLINE ptrdiff_t ppo_valid_stop(ptrdiff_t start, ptrdiff_t span, ptrdiff_t length) {
    return start + (length < span ? (length > 0 ? length : 0) : span);
}

/* The position PPO_CHUNK tokens of work ahead of position i of a row whose computed positions end
 * at valid_end: past it, the same distance into the next row (at next_row = start + span), so that
 * the prefetches below cross the padding a row skips. Without it the hardware prefetchers restart
 * at every row (float32 (1024, 4096) rows with lengths in [T/2, T], REINFORCE, one thread: 2.9 ms,
 * 2.1 with it; the padding's cost, with nothing of it read). A prefetch never faults, so the next
 * row may be past the last one. */
PPO_INLINE ptrdiff_t ppo_ahead_by(
    ptrdiff_t i, ptrdiff_t valid_end, ptrdiff_t next_row, ptrdiff_t distance) {
    ptrdiff_t ahead = i + distance;
    return ahead < valid_end ? ahead : ahead - valid_end + next_row;
}
PPO_INLINE ptrdiff_t ppo_ahead(ptrdiff_t i, ptrdiff_t valid_end, ptrdiff_t next_row) {
    return ppo_ahead_by(i, valid_end, next_row, PPO_CHUNK);
}

/* How far ahead a pass that streams through its rows with little work per token prefetches
 * (ppo_ahead_by): PPO_CHUNK positions are too close at a fraction of a nanosecond per token.
 * Masked moments over (1024, 4096) rows with lengths in [T/2, T], one thread: float32 0.59 ms
 * reading rows whole, 0.59 skipping the padding 1 KiB ahead, 0.43 4 KiB, 0.39 8 KiB, 0.50-0.72
 * 16 KiB; float64 1.15 ms whole, 0.71 at 8 KiB. */
#define PPO_STREAM_AHEAD_BYTES 8192
#endif
#define ppo_vec PPO_CONCAT(ppo_, PPO_LANES)
#define ppo_mask PPO_CONCAT(ppo_, PPO_MASKS)
#define ppo_count PPO_CONCAT(ppo_, PPO_COUNTS)

/* The twins' min(max(x, low), high), comparison for comparison. */
PPO_INLINE ppo_vec PPO_ROW(ppo_clip)(ppo_vec x, ppo_vec low, ppo_vec high) {
    return PPO_V(min)(high, PPO_V(max)(low, x));
}

/* The policy losses' last step for the 8 tokens from position i: stores the gradient
 * -weight * slope * scale at grad + i where valid (0 elsewhere) and returns the loss sum plus
 * -weight * objective where valid (to_f64_where: 0 elsewhere, whatever the objective is there,
 * in the conversion to float64). As the twins: the weight in float64 (numba's is, either way:
 * its 1 is an integer), the products in float64 rounded to the dtype at the store; a NaN or
 * inf weight still says so. Without weights the weight is 1, and
 * (-slope) * scale in float64 rounded to the dtype is (-slope) * scale in the dtype, bit for bit
 * (two float32 multiply exactly in float64, so the one rounding is the float32 product's), and
 * loss + -objective is loss - objective: the same bits, NaN signs included, as the general
 * path (which the compilers build as a sign flip and a subtraction), for fewer operations (the
 * clipped surrogate 0.93x the time on float32 (1024, 4096) rows, one thread). */
PPO_INLINE ppo_f64x8 PPO_ROW(ppo_policy_gradient)(
    int has_weights, const ppo_real* weights, ptrdiff_t i, ppo_mask valid, ppo_vec slope,
    ppo_vec objective, ppo_vec zero, ppo_vec token_scale, ppo_f64x8 scale, ppo_real* grad,
    ppo_f64x8 loss) {
    if (!has_weights) {
        ppo_vec gradient = PPO_V(mul)(PPO_V(negative)(slope), token_scale);
        PPO_V(store)(grad + i, PPO_V(select)(valid, gradient, zero));
        return ppo_f64x8_sub(loss, PPO_V(to_f64_where)(valid, objective));
    }
    ppo_f64x8 negative_weight =
        ppo_f64x8_negative(PPO_V(to_f64_where)(valid, PPO_V(load)(weights + i)));
    ppo_f64x8 gradient = ppo_f64x8_mul(ppo_f64x8_mul(negative_weight, PPO_V(to_f64)(slope)), scale);
    PPO_V(store)(grad + i, PPO_V(select)(valid, PPO_V(from_f64)(gradient), zero));
    return ppo_f64x8_add(
        loss, ppo_f64x8_mul(negative_weight, PPO_V(to_f64_where)(valid, objective)));
}

/* Prefetches the cache lines of position `ahead` (ppo_ahead) of up to four token arrays and the
 * mask (NULL: none), once a line of the pass from position first on, at each block i (the loss
 * rows' passes). */
PPO_INLINE void PPO_ROW(ppo_prefetch_ahead)(
    const ppo_real* a, const ppo_real* b, const ppo_real* c, const ppo_real* d,
    const uint8_t* mask, ptrdiff_t first, ptrdiff_t i, ptrdiff_t ahead) {
    if ((i - first) % (64 / sizeof(ppo_real)) == 0) {
        ptrdiff_t bytes = ahead * (ptrdiff_t)sizeof(ppo_real);
        if (a) ppo_prefetch(a, bytes);
        if (b) ppo_prefetch(b, bytes);
        if (c) ppo_prefetch(c, bytes);
        if (d) ppo_prefetch(d, bytes);
        if (mask && (i - first) % 64 == 0) ppo_prefetch(mask, ahead);
    }
}

/* The streaming passes' (moments, whiten) prefetches for the 64 positions from `ahead`
 * (ppo_ahead_by) of x, and their mask's line (NULL: none), at once before a group of 8 blocks,
 * as numba's twins (_numba_core._prefetch_ahead, _PREFETCH_BLOCK positions): a test a block
 * (ppo_prefetch_ahead) kept GCC's loop a block a trip, and the moments over float32 1024 x 4096
 * (one thread, AMD EPYC with AVX-512) took 0.81 ms that way, 0.65 ms this way (numba's 0.64). */
PPO_INLINE void PPO_ROW(ppo_prefetch_group)(
    const ppo_real* x, const uint8_t* mask, ptrdiff_t ahead) {
    for (ptrdiff_t line = 0; line < 64; line += 64 / (ptrdiff_t)sizeof(ppo_real))
        ppo_prefetch(x, (ahead + line) * (ptrdiff_t)sizeof(ppo_real));
    if (mask) ppo_prefetch(mask, ahead);
}

/* The backward rows' (GAE, the returns, whitening) prefetches: at each block of 8 positions
 * i .. i+7 that a row run backwards reaches (t: the block's end, from any fixed origin, going down
 * by 8 a block), the cache lines PPO_CHUNK positions below i of the arrays it reads (b may be
 * NULL) and, for writing, of those it writes (NULL: none), a line's worth of blocks apart, and of
 * the mask (NULL: none). The hardware prefetchers do not run far enough ahead of a descending
 * stream on their own: float32 (1024, 4096) GAE, one thread, 4.6 ms without them, 2.7 ms with
 * them (in the cache: 2.1 ms). Positions below the row's start are the previous row's or before
 * the arrays: harmless, since a prefetch never faults. */
PPO_INLINE void PPO_ROW(ppo_prefetch_behind)(
    const ppo_real* a, const ppo_real* b, ppo_real* out_a, ppo_real* out_b, const uint8_t* mask,
    ptrdiff_t t, ptrdiff_t i) {
    const ptrdiff_t blocks_per_line = 64 / 8 / (ptrdiff_t)sizeof(ppo_real);
    if (((t >> 3) & (blocks_per_line - 1)) == 0) {
        ptrdiff_t bytes = (i - PPO_CHUNK) * (ptrdiff_t)sizeof(ppo_real);
        ppo_prefetch(a, bytes);
        if (b) ppo_prefetch(b, bytes);
        if (out_a) ppo_prefetch_for_write(out_a, bytes);
        if (out_b) ppo_prefetch_for_write(out_b, bytes);
        if (mask && ((t >> 3) & 7) == 0) ppo_prefetch(mask, i - PPO_CHUNK);
    }
}

/* Zeros at positions first .. end-1 of a and of b (NULL: none), from the last down, a block of 8
 * at a time: the padding of a row that runs backwards (GAE, the returns). Written in the direction
 * of their rows' stream (_spec.Kernel.backwards): a forward memset of each row's padding, between
 * two descending runs, cost float32 (1024, 4096) GAE with lengths in [T/2, T] 12% from memory, one
 * thread, AMD EPYC (3.8-3.9 ms, 3.4-3.5 with this), and nothing in the cache. */
PPO_INLINE void PPO_ROW(ppo_zeros_backwards)(
    ppo_real* a, ppo_real* b, ptrdiff_t first, ptrdiff_t end) {
    ppo_vec zeros = PPO_V(splat)(0);
    ptrdiff_t k = end;
    for (; k - first >= 8; k -= 8) {
        PPO_V(store)(a + k - 8, zeros);
        if (b) PPO_V(store)(b + k - 8, zeros);
    }
    for (; k > first; k--) {
        a[k - 1] = 0;
        if (b) b[k - 1] = 0;
    }
}

/* The ratios exp(clip(logprobs - old_logprobs, -clamp, clamp)) of the 8 tokens from position i:
 * the policy losses' ratio, for the odd block of a chunk and a row's tail. */
PPO_INLINE ppo_vec PPO_ROW(ppo_clipped_ratio)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, ptrdiff_t i, ppo_vec negative_clamp,
    ppo_vec clamp) {
    ppo_vec log_ratio = PPO_V(sub)(PPO_V(load)(logprobs + i), PPO_V(load)(old_logprobs + i));
    return PPO_V(exp)(PPO_ROW(ppo_clip)(log_ratio, negative_clamp, clamp));
}

/* A chunk's ratios exp(clip(logprobs - old_logprobs, -clamp, clamp)) at its whole blocks (positions
 * first .. whole_end) into ratios[0 ..): two blocks a step (lanes.h's clipped_exp16, its clamp
 * prepared in clipped_exp), then the odd one, prefetching PPO_CHUNK tokens of work ahead of each
 * block (ppo_ahead: the row's computed positions end at valid_end, the next row starts at
 * next_row) in the inputs the chunk's main pass reads (NULL: absent).
 * The pre-pass of the policy losses (rows_loss.h, rows_policy.h). */
PPO_INLINE void PPO_ROW(ppo_chunk_ratios)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, const uint8_t* mask, ptrdiff_t first, ptrdiff_t whole_end,
    ptrdiff_t valid_end, ptrdiff_t next_row, const ppo_clipped_exp* clipped_exp,
    ppo_vec negative_clamp, ppo_vec clamp, ppo_real* ratios) {
    ptrdiff_t i;
    for (i = first; i + 16 <= whole_end; i += 16) {
        for (ptrdiff_t block = i; block < i + 16; block += 8) {
            PPO_ROW(ppo_prefetch_ahead)(
                logprobs, old_logprobs, advantages, weights, mask, first, block,
                ppo_ahead(block, valid_end, next_row));
        }
        PPO_V(clipped_exp16)(logprobs + i, old_logprobs + i, clipped_exp, ratios + (i - first));
    }
    for (; i < whole_end; i += 8) {
        PPO_ROW(ppo_prefetch_ahead)(
            logprobs, old_logprobs, advantages, weights, mask, first, i,
            ppo_ahead(i, valid_end, next_row));
        PPO_V(store)(
            ratios + (i - first),
            PPO_ROW(ppo_clipped_ratio)(logprobs, old_logprobs, i, negative_clamp, clamp));
    }
}

/* A row's last partial block: `count` < 8 tokens from position i of up to PPO_TAIL_ARRAYS token
 * arrays (NULL or left out of the initializer: absent), and their mask (all valid without one),
 * in zero-padded lanes. */
#ifndef PPO_TAIL_ARRAYS
#define PPO_TAIL_ARRAYS 4 /* log-probabilities, old ones, advantages, weights */
#endif
typedef struct {
    ppo_real tokens[PPO_TAIL_ARRAYS][8], grad[8];
    uint8_t mask[8];
} PPO_ROW(ppo_tail);

/* Each token array's lanes are one vector store of a partial load (PPO_V(load_first)), and the
 * mask's 8 bytes one 8-byte store on little-endian machines: the block then loads whole vectors
 * from the tail, and a load that spans several smaller stores before it cannot take their data
 * from the store buffer but waits until they reach the cache. Measured with the item-by-item copy
 * and without it (float32 1024x8, lengths in [4, 8], one thread, kernel alone): the geometric
 * mean 76 -> 47 us, GSPO 80 -> 50 us; numba's twin, built the same way, 156 -> 40-45 us. */
PPO_INLINE void PPO_ROW(ppo_tail_fill)(
    PPO_ROW(ppo_tail) * tail, const ppo_real* const arrays[PPO_TAIL_ARRAYS], int has_mask,
    const uint8_t* mask, ptrdiff_t i, ptrdiff_t count) {
    ppo_vec zero = PPO_V(splat)((ppo_real)0);
    for (int k = 0; k < PPO_TAIL_ARRAYS; k++) {
        PPO_V(store)(tail->tokens[k], arrays[k] ? PPO_V(load_first)(arrays[k] + i, count) : zero);
    }
    PPO_V(store)(tail->grad, zero);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    memset(tail->mask, 0, sizeof tail->mask);
    for (ptrdiff_t lane = 0; lane < count; lane++) tail->mask[lane] = has_mask ? mask[i + lane] : 1;
#else
    uint64_t bytes = 0;
    for (ptrdiff_t lane = 0; lane < count; lane++) {
        bytes |= (uint64_t)(has_mask ? mask[i + lane] : 1) << (8 * lane);
    }
    memcpy(tail->mask, &bytes, sizeof bytes);
#endif
}

#include "rows_kl.h"
#include "rows_gae.h"
#include "rows_returns.h"
#include "rows_moments.h"
#include "rows_loss.h"
#include "rows_policy.h"
#include "rows_sequence.h"
#include "rows_token.h"
#include "rows_covariance.h"

#undef ppo_real
#undef PPO_LANES
#undef PPO_MASKS
#undef PPO_COUNTS
#undef PPO_ROW
#undef ppo_vec
#undef ppo_mask
#undef ppo_count
