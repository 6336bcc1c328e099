/* Twin of kl_cov_top_k (ppo_fast/_numba_kernels.py), operation for operation: KL-Cov's token
 * selection over a group of rows (the public kl_cov_selection passes the batch as one group).
 * Included by rows.h, once per dtype.
 *
 * A first pass sums the group's valid tokens in order (float64, one addition after another: the
 * means are the oracle's bits), a second keeps the k strongest tokens so far in a heap whose root
 * is the weakest, so that almost every token costs one comparison: O(n log k) with k scratch
 * slots. Strength is the covariance (a NaN counts as -inf), then the earlier position. */

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
#endif

/* One group: its rows are rows[0 .. n_rows-1] (in row order). Returns 1 when the heap cannot be
 * allocated, else 0. */
static int PPO_ROW(ppo_kl_cov_top_k_group)(
    const ppo_real* logprobs, const ppo_real* advantages, const int64_t* starts,
    const int64_t* spans, const int64_t* lengths, const uint8_t* mask, int has_mask,
    const int64_t* rows, ptrdiff_t n_rows, double ratio, ppo_real* selected) {
    int64_t count = 0;
    double total_adv = 0.0, total_logp = 0.0;
    for (ptrdiff_t j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
        ptrdiff_t start = starts[b], span = spans[b];
        ptrdiff_t valid_end = start + ppo_valid_end(span, lengths[b]);
        for (ptrdiff_t i = start; i < start + span; i++) selected[i] = 0;
        for (ptrdiff_t i = start; i < valid_end; i++) {
            if (has_mask && mask[i] == 0) continue;
            count++;
            total_adv += (double)advantages[i];
            total_logp += (double)logprobs[i];
        }
    }
    if (count == 0) return 0;
    double mean_adv = total_adv / (double)count, mean_logp = total_logp / (double)count;
    double wanted = ratio * (double)count;
    ptrdiff_t k = wanted >= (double)count ? (ptrdiff_t)count
                                          : ((int64_t)wanted > 1 ? (ptrdiff_t)(int64_t)wanted : 1);
    double* keys = (double*)malloc((size_t)k * (sizeof(double) + sizeof(int64_t)));
    if (keys == NULL) return 1;
    int64_t* positions = (int64_t*)(keys + k);
    ptrdiff_t size = 0;
    for (ptrdiff_t j = 0; j < n_rows; j++) {
        int64_t b = rows[j];
        ptrdiff_t start = starts[b], span = spans[b];
        ptrdiff_t valid_end = start + ppo_valid_end(span, lengths[b]);
        for (ptrdiff_t i = start; i < valid_end; i++) {
            if (has_mask && mask[i] == 0) continue;
            double key = ((double)advantages[i] - mean_adv) * ((double)logprobs[i] - mean_logp);
            if (key != key) key = -INFINITY;
            if (size < k) { /* not full: the new token goes in, up to its place */
                keys[size] = key;
                positions[size] = (int64_t)i;
                ppo_sift_up(keys, positions, size++);
            } else if (key >= keys[0] && ppo_weaker(keys[0], positions[0], key, (int64_t)i)) {
                keys[0] = key; /* it displaces the weakest */
                positions[0] = (int64_t)i;
                ppo_sift_down(keys, positions, size, 0);
            }
        }
    }
    for (ptrdiff_t m = 0; m < size; m++) selected[positions[m]] = 1;
    free(keys);
    return 0;
}
