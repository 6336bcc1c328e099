/* What the generated `<kernel>_common` functions of src/_kernels.pyx reduce after their rows: the
 * valid positions of a mask, and the totals of the row outputs in NumPy's order of addition.
 *
 * The stages' general way sums each row output with NumPy (ppo_fast/loss.py `_totals`:
 * `row_outputs.sum(axis=1)`), which starts from 0.0 and adds NumPy's pairwise sum of the row
 * (numpy/_core/src/umath/loops_utils.h.src, DOUBLE_pairwise_sum): fewer than 8 terms one by
 * one; up to 128 terms in 8 accumulators (term i in accumulator i % 8), added as ((0 + 1) + (2 +
 * 3)) + ((4 + 5) + (6 + 7)), then the terms past the last multiple of 8 one by one; more than 128
 * split at half rounded down to a multiple of 8, each half summed so. ppo_numpy_sum repeats that
 * addition for addition, so the common case's totals have the general way's bits
 * (tests/test_fast_path.py compares them, with numba's twin ppo_fast/_numba_core.py row_totals).
 * Counting 1024 bytes here costs a fraction of np.count_nonzero's call. */
#ifndef PPO_FAST_TOTALS_H
#define PPO_FAST_TOTALS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static double ppo_pairwise_sum(const double* a, ptrdiff_t n) {
    if (n < 8) {
        double total = 0.0;
        for (ptrdiff_t i = 0; i < n; i++) total += a[i];
        return total;
    }
    if (n <= 128) {
        double r[8];
        ptrdiff_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - n % 8; i += 8) {
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        }
        double total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) total += a[i];
        return total;
    }
    ptrdiff_t half = n / 2;
    half -= half % 8;
    return ppo_pairwise_sum(a, half) + ppo_pairwise_sum(a + half, n - half);
}

/* `row_output.sum()` of NumPy, for n contiguous float64 values. */
static double ppo_numpy_sum(const double* a, ptrdiff_t n) { return 0.0 + ppo_pairwise_sum(a, n); }

/* The bytes of mask[0 .. n-1] that are not 0 (np.count_nonzero of the uint8 view). */
static int64_t ppo_count_nonzero(const uint8_t* mask, ptrdiff_t n) {
    int64_t count = 0;
    ptrdiff_t i = 0;
    const uint64_t low = 0x7f7f7f7f7f7f7f7fULL, high = 0x8080808080808080ULL;
    for (; i + 8 <= n; i += 8) {
        uint64_t word;
        memcpy(&word, mask + i, 8);
        /* 1 in each byte that is not 0 (its top bit, from either half of the byte), then the
         * eight bytes added up in the top byte of the product */
        uint64_t nonzero = ((((word & low) + low) | word) & high) >> 7;
        count += (int64_t)((nonzero * 0x0101010101010101ULL) >> 56);
    }
    for (; i < n; i++) count += mask[i] != 0;
    return count;
}
/* (valid positions, row scales) of a loss's common case with aggregation mode `agg` (a code of
 * ppo_fast/_spec.py AGGREGATIONS) and `normaliser` (num_tokens, num_seqs or loss_scale, > 0;
 * 0: none, the batch's own count) over (n_rows, width) padded rows, the mask NULL when every
 * position is valid, or over packed rows of `spans` (not NULL: every position valid; no T, so
 * seq-mean-token-sum-norm without its loss_scale divides by the valid positions): the scales
 * into scales[0 .. n_rows-1], the valid positions returned. loss._row_scales, division for
 * division (twins: ppo_fast/_backend.py common_scales and packed_scales,
 * ppo_fast/_numba_core.py _common_scales). */
static double ppo_common_scales(int agg, double normaliser, const uint8_t* mask,
                                const int64_t* spans, ptrdiff_t n_rows, ptrdiff_t width,
                                double* scales) {
    int64_t total = 0;
    double seqs = 0.0, valid, divisor;
    for (ptrdiff_t b = 0; b < n_rows; b++) {
        int64_t count = spans  ? spans[b]
                        : mask ? ppo_count_nonzero(mask + b * width, width)
                               : (int64_t)width;
        scales[b] = (double)count; /* the row's count, until the second loop */
        total += count;
        if (count > 0) seqs += 1.0;
    }
    valid = (double)total;
    if (agg == 0) /* token-mean */
        divisor = normaliser > 0 ? normaliser : valid;
    else if (agg == 3) /* seq-mean-token-sum-norm: T is the loss scale */
        divisor = normaliser > 0 ? normaliser : (spans ? valid : (double)width);
    else
        divisor = normaliser > 0 ? normaliser : seqs;
    for (ptrdiff_t b = 0; b < n_rows; b++) {
        double count = scales[b];
        if (agg != 1) /* one scale for every row */
            scales[b] = divisor ? 1.0 / divisor : 0.0;
        else /* seq-mean-token-mean */
            scales[b] = divisor && count > 0 ? 1.0 / (divisor * count) : 0.0;
    }
    return valid;
}
#endif
