/* Twin of kl_cov_top_k (ppo_fast/_numba_kernels.py): KL-Cov's token selection over a group of
 * rows (the public kl_cov_selection passes the batch as one group). Included by rows.h, once per
 * dtype.
 *
 * A first pass sums the group's valid tokens in float64 lanes (token t of a row to lane t % 8,
 * the lanes added up in the fixed tree of ppo_f64x8_total at the end: the oracle's order, so
 * the means are its bits), a second keeps the k strongest tokens so far in a heap whose root is
 * the weakest. Both run 8 tokens at a time: the second computes 8 covariances and leaves the
 * block when none of its valid ones reaches the root, which is almost every block once the heap
 * is full (the root only rises, so a token below it at the block's start stays below it), and
 * offers the block's tokens one by one, in order, otherwise. O(n log k) with k scratch slots.
 * Strength is the covariance (a NaN counts as -inf), then the earlier position. */

#ifndef PPO_FAST_COVARIANCE_HEAP
#define PPO_FAST_COVARIANCE_HEAP
/* Whether (key, position) ranks below (other_key, other_position). */
PPO_INLINE int ppo_weaker(double key, int64_t position, double other_key, int64_t other_position) {
    return key < other_key || (key == other_key && position > other_position);
}

PPO_INLINE void ppo_swap(double* keys, int64_t* positions, ptrdiff_t a, ptrdiff_t b) {
    double key = keys[a];
    int64_t position = positions[a];
    keys[a] = keys[b];
    positions[a] = positions[b];
    keys[b] = key;
    positions[b] = position;
}

/* Moves the token at `node` up the heap to its place. */
PPO_INLINE void ppo_sift_up(double* keys, int64_t* positions, ptrdiff_t node) {
    while (node > 0) {
        ptrdiff_t parent = (node - 1) / 2;
        if (!ppo_weaker(keys[node], positions[node], keys[parent], positions[parent])) return;
        ppo_swap(keys, positions, node, parent);
        node = parent;
    }
}

/* Moves the token at `node` down the heap to its place (the weakest at the root). */
PPO_INLINE void ppo_sift_down(double* keys, int64_t* positions, ptrdiff_t size, ptrdiff_t node) {
    for (;;) {
        ptrdiff_t weakest = node;
        for (ptrdiff_t child = 2 * node + 1; child <= 2 * node + 2; child++)
            if (child < size &&
                ppo_weaker(keys[child], positions[child], keys[weakest], positions[weakest]))
                weakest = child;
        if (weakest == node) return;
        ppo_swap(keys, positions, node, weakest);
        node = weakest;
    }
}

/* Offers the token at `position` with covariance `key` to the heap of the k strongest so far:
 * while it is not full the token goes in, up to its place; then it displaces the weakest (the
 * root) if it is stronger. */
PPO_INLINE void ppo_offer(
    double* keys, int64_t* positions, ptrdiff_t* size, ptrdiff_t k, double key, int64_t position) {
    if (key != key) key = -INFINITY;
    if (*size < k) {
        keys[*size] = key;
        positions[*size] = position;
        ppo_sift_up(keys, positions, (*size)++);
    } else if (key >= keys[0] && ppo_weaker(keys[0], positions[0], key, position)) {
        keys[0] = key;
        positions[0] = position;
        ppo_sift_down(keys, positions, *size, 0);
    }
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
 * valid prefix): offers the valid ones to the heap one by one, or none when the heap is full and
 * no valid covariance reaches its root. */
PPO_INLINE void PPO_ROW(ppo_kl_cov_offer_block)(
    const ppo_real* logprobs, const ppo_real* advantages, const uint8_t* mask, int has_mask,
    ptrdiff_t i, ptrdiff_t t, ptrdiff_t length, ptrdiff_t start, ppo_f64x8 mean_adv,
    ppo_f64x8 mean_logp, double* keys, int64_t* positions, ptrdiff_t* size, ptrdiff_t k) {
    ppo_f64x8 key = ppo_f64x8_mul(
        ppo_f64x8_sub(PPO_V(to_f64)(PPO_V(load)(advantages + i)), mean_adv),
        ppo_f64x8_sub(PPO_V(to_f64)(PPO_V(load)(logprobs + i)), mean_logp));
    if (*size == k) {
        ppo_m64x8 valid = ppo_valid_lanes(mask, has_mask, i, t, length);
        if (!ppo_m64x8_any(ppo_m64x8_and(valid, ppo_f64x8_le(ppo_f64x8_splat(keys[0]), key))))
            return;
    }
    double block[8];
    ppo_f64x8_store(block, key);
    for (ptrdiff_t lane = 0; lane < 8; lane++) {
        if (t + lane >= length || (has_mask && mask[i + lane] == 0)) continue;
        ppo_offer(keys, positions, size, k, block[lane], (int64_t)(start + t + lane));
    }
}

/* One group: its rows are rows[0 .. n_rows-1] (in row order). Returns 1 when the heap cannot be
 * allocated, else 0. */
static int PPO_ROW(ppo_kl_cov_top_k_group)(
    const ppo_real* logprobs, const ppo_real* advantages, const int64_t* starts,
    const int64_t* spans, const int64_t* lengths, const uint8_t* mask, int has_mask,
    const int64_t* rows, ptrdiff_t n_rows, double ratio, uint8_t* selected) {
    ppo_f64x8 count_lanes = ppo_f64x8_splat(0.0), adv_lanes = count_lanes, logp_lanes = count_lanes;
    const ptrdiff_t distance = PPO_STREAM_AHEAD_BYTES / (ptrdiff_t)sizeof(ppo_real);
    for (ptrdiff_t j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
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
            PPO_ROW(ppo_kl_cov_tail_fill)(
                &tail, logprobs, advantages, mask, has_mask, i, valid_end - i);
            PPO_ROW(ppo_kl_cov_sums_block)(
                ppo_valid_lanes(tail.mask, has_mask, 0, i - start, length), tail.logprobs,
                tail.advantages, 0, &count_lanes, &adv_lanes, &logp_lanes);
        }
    }
    double count = ppo_f64x8_total(count_lanes); /* exact: an integer below 2^53 */
    if (count == 0) return 0;
    double mean_adv = ppo_f64x8_total(adv_lanes) / count;
    double mean_logp = ppo_f64x8_total(logp_lanes) / count;
    double wanted = ratio * count;
    ptrdiff_t k = wanted >= count ? (ptrdiff_t)count
                                  : ((int64_t)wanted > 1 ? (ptrdiff_t)(int64_t)wanted : 1);
    double* keys = (double*)malloc((size_t)k * (sizeof(double) + sizeof(int64_t)));
    if (keys == NULL) return 1;
    int64_t* positions = (int64_t*)(keys + k);
    ptrdiff_t size = 0;
    ppo_f64x8 mean_advs = ppo_f64x8_splat(mean_adv), mean_logps = ppo_f64x8_splat(mean_logp);
    for (ptrdiff_t j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
        ptrdiff_t start = starts[b], span = spans[b];
        ptrdiff_t valid_end = ppo_valid_stop(start, span, lengths[b]), i;
        ptrdiff_t length = valid_end - start; /* the valid prefix: never past the span */
        for (i = start; i + 8 <= valid_end; i += 8) {
            PPO_ROW(ppo_prefetch_ahead)(
                logprobs, advantages, NULL, NULL, has_mask ? mask : NULL, start, i,
                ppo_ahead_by(i, valid_end, start + span, distance));
            PPO_ROW(ppo_kl_cov_offer_block)(
                logprobs, advantages, mask, has_mask, i, i - start, length, start, mean_advs,
                mean_logps, keys, positions, &size, k);
        }
        if (i < valid_end) {
            PPO_ROW(ppo_kl_cov_tail) tail;
            PPO_ROW(ppo_kl_cov_tail_fill)(
                &tail, logprobs, advantages, mask, has_mask, i, valid_end - i);
            PPO_ROW(ppo_kl_cov_offer_block)(
                tail.logprobs, tail.advantages, tail.mask, has_mask, 0, i - start, length, start,
                mean_advs, mean_logps, keys, positions, &size, k);
        }
    }
    for (ptrdiff_t m = 0; m < size; m++) selected[positions[m]] = 1;
    free(keys);
    return 0;
}
