/* Twin of kl_cov_top_k (ppo_fast/_numba_covariance.py): KL-Cov's token selection over a group of
 * rows (the public kl_cov_selection passes the batch as one group). Included by rows.h, once per
 * dtype.
 *
 * A first pass sums each row's valid tokens in float64 lanes (token t of the row to lane t % 8,
 * the lanes added up in the fixed tree of ppo_f64x8_total), and the group's sums are its rows'
 * added in row order: the oracle's order, so the means are its bits. A second keeps candidates
 * for the k strongest tokens in a buffer (ppo_top_k) that takes a token at least as strong as
 * the k-th strongest kept so far, its threshold, and keeps its k strongest when full. Both run
 * 8 tokens at a time: the second computes 8 covariances and leaves the block when none of its
 * valid ones reaches the threshold, which is almost every block once the buffer has filled
 * (the threshold only rises, so a token below it stays out of the top k), and offers the
 * block's tokens one by one otherwise. O(n + k log(n / k)) time with at most 2k + 8 slots a
 * thread. Strength is the covariance (a NaN counts as -inf), then the earlier position. Both
 * passes share the group's rows among the threads (ppo_kl_cov_top_k_group says how, and why
 * the result does not depend on them). */

#ifndef PPO_FAST_COVARIANCE_TOP_K
#define PPO_FAST_COVARIANCE_TOP_K
/* The kth smallest (from 0) of a[0 .. n-1], which it reorders: Hoare's selection, the median
 * of three as the pivot. Keys are never NaN here (a NaN counts as -inf), so < is a total order. */
#define PPO_SELECT(name, type)                                                                  \
    static type name(type* a, ptrdiff_t n, ptrdiff_t kth) {                                     \
        ptrdiff_t lo = 0, hi = n - 1;                                                           \
        while (hi > lo) {                                                                       \
            type x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi], pivot;                        \
            pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));     \
            ptrdiff_t i = lo, j = hi;                                                           \
            while (i <= j) {                                                                    \
                while (a[i] < pivot) i++;                                                       \
                while (pivot < a[j]) j--;                                                       \
                if (i <= j) {                                                                   \
                    type t = a[i];                                                              \
                    a[i++] = a[j];                                                              \
                    a[j--] = t;                                                                 \
                }                                                                               \
            }                                                                                   \
            if (kth <= j)                                                                       \
                hi = j;                                                                         \
            else if (kth >= i)                                                                  \
                lo = i;                                                                         \
            else                                                                                \
                return a[kth];                                                                  \
        }                                                                                       \
        return a[kth];                                                                          \
    }
PPO_SELECT(ppo_select_f64, double)
PPO_SELECT(ppo_select_i64, int64_t)
#undef PPO_SELECT

/* The k strongest tokens seen so far, among more: a buffer of `capacity` (>= k + 8) candidates
 * that takes every token at least as strong as `threshold` (the k-th strongest key kept so far,
 * -inf until the buffer first fills) and, when full, keeps its k strongest (ppo_top_k_keep),
 * which raises the threshold. Strength is the key, then the earlier position. Appending is a store,
 * so a candidate costs a few nanoseconds where a heap's sift cost about a hundred (mispredicted
 * branches at every level). */
typedef struct {
    double* keys;
    int64_t* positions;
    double* scratch; /* capacity items, for the selections */
    ptrdiff_t size, capacity, k;
    double threshold;
} ppo_top_k;

/* Keeps the k strongest of the buffer's candidates (when it holds more) and raises the
 * threshold to the k-th strongest key. The kept ones are those above that key, and of those
 * equal to it the lowest positions: exactly k, positions being distinct. */
static void ppo_top_k_keep(ppo_top_k* top) {
    ptrdiff_t size = top->size, k = top->k, m, above = 0, tied = 0, kept = 0;
    if (size <= k) return;
    memcpy(top->scratch, top->keys, (size_t)size * sizeof(double));
    double kth = ppo_select_f64(top->scratch, size, size - k);
    /* Branch-free loops: each item is written to the next slot, which a kept one keeps (half
     * of them are kept: a branch on it would be mispredicted as often). */
    int64_t* tied_positions = (int64_t*)top->scratch;
    for (m = 0; m < size; m++) {
        above += top->keys[m] > kth;
        tied_positions[tied] = top->positions[m];
        tied += top->keys[m] == kth;
    }
    ptrdiff_t need = k - above; /* 1 .. tied */
    int64_t last = need < tied ? ppo_select_i64(tied_positions, tied, need - 1) : INT64_MAX;
    for (m = 0; m < size; m++) {
        double key = top->keys[m];
        int64_t position = top->positions[m];
        top->keys[kept] = key;
        top->positions[kept] = position;
        kept += (key > kth) | ((key == kth) & (position <= last));
    }
    top->size = kept;
    top->threshold = kth;
}

/* At most how many ranges of rows (threads) share KL-Cov's second pass. */
#define PPO_KL_COV_PARTS 64

/* Takes the token at `position` with covariance `key` (a NaN counts as -inf) when it is at
 * least as strong as the threshold; the caller has made room (ppo_top_k_room: the slot is
 * written either way). */
PPO_INLINE void ppo_top_k_take(ppo_top_k* top, double key, int64_t position) {
    if (key != key) key = -INFINITY;
    top->keys[top->size] = key; /* branch-free: the next slot, which a taken token keeps */
    top->positions[top->size] = position;
    top->size += key >= top->threshold;
}

/* Room for 8 more candidates (the capacity is at least k + 8). */
PPO_INLINE void ppo_top_k_room(ppo_top_k* top) {
    if (top->size > top->capacity - 8) ppo_top_k_keep(top);
}
#endif

/* A row's last valid positions, fewer than 8 from position i (`count` of them), in zero-padded
 * lanes with their mask bytes, for the two passes' last blocks. */
typedef struct {
    ppo_real logprobs[8], advantages[8];
    uint8_t mask[8];
} PPO_ROW(ppo_kl_cov_tail);

PPO_INLINE void PPO_ROW(ppo_kl_cov_tail_fill)(
    PPO_ROW(ppo_kl_cov_tail) * tail, const ppo_real* logprobs, const ppo_real* advantages,
    const uint8_t* mask, int has_mask, ptrdiff_t i, ptrdiff_t count) {
    memset(tail, 0, sizeof *tail);
    memcpy(tail->logprobs, logprobs + i, (size_t)count * sizeof(ppo_real));
    memcpy(tail->advantages, advantages + i, (size_t)count * sizeof(ppo_real));
    if (has_mask) memcpy(tail->mask, mask + i, (size_t)count);
}

/* The 8 tokens from position i of a row: valid ones add their advantage and log-prob to the
 * lanes (and 1 to the count's); the others add +0.0, which leaves a sum that starts at +0.0
 * unchanged (NaN and inf included), so nothing stored at a masked position reaches the means. */
PPO_INLINE void PPO_ROW(ppo_kl_cov_sums_block)(
    ppo_m64x8 valid, const ppo_real* logprobs, const ppo_real* advantages, ptrdiff_t i,
    ppo_f64x8* count, ppo_f64x8* total_adv, ppo_f64x8* total_logp) {
    ppo_f64x8 zero = ppo_f64x8_splat(0.0);
    *count = ppo_f64x8_add(*count, ppo_f64x8_select(valid, ppo_f64x8_splat(1.0), zero));
    *total_adv = ppo_f64x8_add(
        *total_adv, ppo_f64x8_select(valid, PPO_V(to_f64)(PPO_V(load)(advantages + i)), zero));
    *total_logp = ppo_f64x8_add(
        *total_logp, ppo_f64x8_select(valid, PPO_V(to_f64)(PPO_V(load)(logprobs + i)), zero));
}

/* The second pass over the 8 tokens from position i of a row (t = i - start; `length`: the row's
 * valid prefix): offers the valid ones one by one, or none when the threshold is above -inf and
 * no valid covariance reaches it. Not when it is -inf: a NaN key counts as -inf but compares
 * false. */
PPO_INLINE void PPO_ROW(ppo_kl_cov_offer_block)(
    const ppo_real* logprobs, const ppo_real* advantages, const uint8_t* mask, int has_mask,
    ptrdiff_t i, ptrdiff_t t, ptrdiff_t length, ptrdiff_t start, ppo_f64x8 mean_adv,
    ppo_f64x8 mean_logp, ppo_top_k* top) {
    ppo_f64x8 key = ppo_f64x8_mul(
        ppo_f64x8_sub(PPO_V(to_f64)(PPO_V(load)(advantages + i)), mean_adv),
        ppo_f64x8_sub(PPO_V(to_f64)(PPO_V(load)(logprobs + i)), mean_logp));
    if (top->threshold > -INFINITY) {
        ppo_m64x8 valid = ppo_valid_lanes(mask, has_mask, i, t, length);
        if (!ppo_m64x8_any(
                ppo_m64x8_and(valid, ppo_f64x8_le(ppo_f64x8_splat(top->threshold), key))))
            return;
    }
    double block[8];
    ppo_f64x8_store(block, key);
    ppo_top_k_room(top);
    for (ptrdiff_t lane = 0; lane < 8; lane++) {
        if (t + lane >= length || (has_mask && mask[i + lane] == 0)) continue;
        ppo_top_k_take(top, block[lane], (int64_t)(start + t + lane));
    }
}

/* Row j of a group (row rows[j]): its valid tokens' sums in lanes, each lane from +0.0, added up
 * in the fixed tree (its count, advantages and log-probs into sums[0 .. 2]); zeroes its flags. */
PPO_INLINE void PPO_ROW(ppo_kl_cov_row_sums)(
    const ppo_real* logprobs, const ppo_real* advantages, const int64_t* starts,
    const int64_t* spans, const int64_t* lengths, const uint8_t* mask, int has_mask, int64_t b,
    uint8_t* selected, double* sums) {
    ppo_f64x8 count_lanes = ppo_f64x8_splat(0.0), adv_lanes = count_lanes, logp_lanes = count_lanes;
    const ptrdiff_t distance = PPO_STREAM_AHEAD_BYTES / (ptrdiff_t)sizeof(ppo_real);
    ptrdiff_t start = starts[b], span = spans[b];
    ptrdiff_t valid_end = ppo_valid_stop(start, span, lengths[b]), i;
    ptrdiff_t length = valid_end - start; /* the valid prefix: never past the span */
    memset(selected + start, 0, (size_t)span);
    for (i = start; i + 8 <= valid_end; i += 8) {
        PPO_ROW(ppo_prefetch_ahead)(
            logprobs, advantages, NULL, NULL, has_mask ? mask : NULL, start, i,
            ppo_ahead_by(i, valid_end, start + span, distance));
        PPO_ROW(ppo_kl_cov_sums_block)(
            ppo_valid_lanes(mask, has_mask, i, i - start, length), logprobs, advantages, i,
            &count_lanes, &adv_lanes, &logp_lanes);
    }
    if (i < valid_end) { /* the row's last valid positions, fewer than 8 */
        PPO_ROW(ppo_kl_cov_tail) tail;
        PPO_ROW(ppo_kl_cov_tail_fill)(&tail, logprobs, advantages, mask, has_mask, i, valid_end - i);
        PPO_ROW(ppo_kl_cov_sums_block)(
            ppo_valid_lanes(tail.mask, has_mask, 0, i - start, length), tail.logprobs,
            tail.advantages, 0, &count_lanes, &adv_lanes, &logp_lanes);
    }
    sums[0] = ppo_f64x8_total(count_lanes); /* exact: an integer below 2^53 */
    sums[1] = ppo_f64x8_total(adv_lanes);
    sums[2] = ppo_f64x8_total(logp_lanes);
}

/* Offers the valid tokens of the group's rows rows[first .. end-1] to `top`. */
static void PPO_ROW(ppo_kl_cov_offer_rows)(
    const ppo_real* logprobs, const ppo_real* advantages, const int64_t* starts,
    const int64_t* spans, const int64_t* lengths, const uint8_t* mask, int has_mask,
    const int64_t* rows, ptrdiff_t first, ptrdiff_t end, double mean_adv, double mean_logp,
    ppo_top_k* top) {
    const ptrdiff_t distance = PPO_STREAM_AHEAD_BYTES / (ptrdiff_t)sizeof(ppo_real);
    ppo_f64x8 mean_advs = ppo_f64x8_splat(mean_adv), mean_logps = ppo_f64x8_splat(mean_logp);
    for (ptrdiff_t j = first; j < end; j++) {
        int64_t b = rows[j];
        ptrdiff_t start = starts[b], span = spans[b];
        ptrdiff_t valid_end = ppo_valid_stop(start, span, lengths[b]), i;
        ptrdiff_t length = valid_end - start;
        for (i = start; i + 8 <= valid_end; i += 8) {
            PPO_ROW(ppo_prefetch_ahead)(
                logprobs, advantages, NULL, NULL, has_mask ? mask : NULL, start, i,
                ppo_ahead_by(i, valid_end, start + span, distance));
            PPO_ROW(ppo_kl_cov_offer_block)(
                logprobs, advantages, mask, has_mask, i, i - start, length, start, mean_advs,
                mean_logps, top);
        }
        if (i < valid_end) {
            PPO_ROW(ppo_kl_cov_tail) tail;
            PPO_ROW(ppo_kl_cov_tail_fill)(
                &tail, logprobs, advantages, mask, has_mask, i, valid_end - i);
            PPO_ROW(ppo_kl_cov_offer_block)(
                tail.logprobs, tail.advantages, tail.mask, has_mask, 0, i - start, length, start,
                mean_advs, mean_logps, top);
        }
    }
}

/* One group, its rows rows[0 .. n_rows-1] (in row order), on n_threads threads. The rows' sums
 * run in parallel, each row on its own; the group's are the rows' added in row order, so that
 * they do not depend on the threads. The second pass gives each of up to n_threads ranges of
 * rows (of about equal positions) a buffer of its own (ppo_top_k), and offers the others' k
 * strongest to the first's: the k strongest of the group are the k strongest of the ranges' k
 * strongest, and strength is a total order (the position breaks ties), so the selection does
 * not depend on the ranges. A buffer holds up to min(2k, max(k, the range's valid tokens)) + 8
 * candidates. Returns 1 when the scratch cannot be allocated, else 0. */
static int PPO_ROW(ppo_kl_cov_top_k_group)(
    const ppo_real* logprobs, const ppo_real* advantages, const int64_t* starts,
    const int64_t* spans, const int64_t* lengths, const uint8_t* mask, int has_mask,
    const int64_t* rows, ptrdiff_t n_rows, double ratio, uint8_t* selected, int n_threads) {
    if (n_rows == 0) return 0;
    double* row_sums = (double*)malloc((size_t)n_rows * 3 * sizeof(double));
    if (row_sums == NULL) return 1;
    ptrdiff_t j;
    if (n_threads > 1) {
#pragma omp parallel for schedule(static) num_threads(n_threads)
        for (j = 0; j < n_rows; j++)
            PPO_ROW(ppo_kl_cov_row_sums)(
                logprobs, advantages, starts, spans, lengths, mask, has_mask, rows[j], selected,
                row_sums + 3 * j);
    } else {
        for (j = 0; j < n_rows; j++)
            PPO_ROW(ppo_kl_cov_row_sums)(
                logprobs, advantages, starts, spans, lengths, mask, has_mask, rows[j], selected,
                row_sums + 3 * j);
    }
    double count = 0.0, total_adv = 0.0, total_logp = 0.0;
    for (j = 0; j < n_rows; j++) {
        count += row_sums[3 * j];
        total_adv += row_sums[3 * j + 1];
        total_logp += row_sums[3 * j + 2];
    }
    if (count == 0) {
        free(row_sums);
        return 0;
    }
    double mean_adv = total_adv / count, mean_logp = total_logp / count;
    double wanted = ratio * count;
    ptrdiff_t k = wanted >= count ? (ptrdiff_t)count
                                  : ((int64_t)wanted > 1 ? (ptrdiff_t)(int64_t)wanted : 1);
    /* the ranges of rows: about equal positions each (a row's span, plus one) */
    ptrdiff_t n_parts = n_threads < n_rows ? n_threads : n_rows, part = 1, p;
    if (n_parts > PPO_KL_COV_PARTS) n_parts = PPO_KL_COV_PARTS;
    if (n_parts < 1) n_parts = 1;
    ptrdiff_t bounds[PPO_KL_COV_PARTS + 1];
    ppo_top_k tops[PPO_KL_COV_PARTS];
    double total = 0.0, so_far = 0.0;
    for (j = 0; j < n_rows; j++) total += (double)spans[rows[j]] + 1.0;
    bounds[0] = 0;
    for (j = 0; j < n_rows; j++) {
        so_far += (double)spans[rows[j]] + 1.0;
        while (part < n_parts && so_far >= total * (double)part / (double)n_parts)
            bounds[part++] = j + 1;
    }
    while (part <= n_parts) bounds[part++] = n_rows;
    int failed = 0;
    for (p = 0; p < n_parts; p++) {
        double tokens = 0.0;
        for (j = bounds[p]; j < bounds[p + 1]; j++) tokens += row_sums[3 * j];
        ptrdiff_t capacity = (tokens > (double)k ? (ptrdiff_t)tokens : k);
        if (capacity > 2 * k) capacity = 2 * k;
        capacity += 8;
        tops[p].keys = (double*)malloc((size_t)capacity * (2 * sizeof(double) + sizeof(int64_t)));
        tops[p].positions = (int64_t*)(tops[p].keys + capacity);
        tops[p].scratch = (double*)(tops[p].positions + capacity);
        tops[p].size = 0;
        tops[p].capacity = capacity;
        tops[p].k = k;
        tops[p].threshold = -INFINITY;
        failed |= tops[p].keys == NULL;
    }
    free(row_sums);
    if (!failed) {
        if (n_parts > 1) {
#pragma omp parallel for schedule(static, 1) num_threads((int)n_parts)
            for (p = 0; p < n_parts; p++) {
                PPO_ROW(ppo_kl_cov_offer_rows)(
                    logprobs, advantages, starts, spans, lengths, mask, has_mask, rows,
                    bounds[p], bounds[p + 1], mean_adv, mean_logp, &tops[p]);
                ppo_top_k_keep(&tops[p]);
            }
        } else {
            PPO_ROW(ppo_kl_cov_offer_rows)(
                logprobs, advantages, starts, spans, lengths, mask, has_mask, rows, 0, n_rows,
                mean_adv, mean_logp, &tops[0]);
        }
        for (p = 1; p < n_parts; p++)
            for (ptrdiff_t m = 0; m < tops[p].size; m++) {
                ppo_top_k_room(&tops[0]);
                ppo_top_k_take(&tops[0], tops[p].keys[m], tops[p].positions[m]);
            }
        ppo_top_k_keep(&tops[0]);
        for (ptrdiff_t m = 0; m < tops[0].size; m++) selected[tops[0].positions[m]] = 1;
    }
    for (p = 0; p < n_parts; p++) free(tops[p].keys);
    return failed;
}
