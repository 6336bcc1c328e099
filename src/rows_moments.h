/* -- moments and whitening --------------------------------------------------------------------- */
/* Twins of moments and whiten (ppo_fast/_numba_kernels.py). The moments' sums go token t of a row
 * to lane t % 8, the lanes added up in the fixed tree of ppo_f64x8_total (the twin's order), so
 * that both backends, every build and any thread count give the same bits. Included by rows.h,
 * once per dtype. */

/* The 8 tokens from position i into the sums: invalid lanes leave them as they are (the bits of
 * adding +0.0 there, ppo_f64x8_add_where says why), so that nothing stored at a masked position
 * reaches a sum; the count is the valid lanes' integer count (the float64 lanes' integer sums
 * had the same value in any order). A masked add and an integer count are two vector operations
 * fewer a block than selects and a float64 count: masked moments 1.03 -> 0.82 ms on float32
 * 1024 x 4096 (one thread, AMD EPYC with AVX-512; 0.65 ms with the prefetches by groups below),
 * and 0.60 -> 0.50 ms without a mask. */
PPO_INLINE void PPO_ROW(ppo_moments_block)(
    ppo_m64x8 valid, const ppo_real* x, ptrdiff_t i, ppo_f64x8 shift, ppo_c64x8* count,
    ppo_f64x8* total, ppo_f64x8* total_sq) {
    ppo_f64x8 centred = ppo_f64x8_sub(PPO_V(to_f64)(PPO_V(load)(x + i)), shift);
    *count = ppo_c64x8_add(*count, valid);
    *total = ppo_f64x8_add_where(valid, *total, centred);
    *total_sq = ppo_f64x8_add_where(valid, *total_sq, ppo_f64x8_mul(centred, centred));
}

/* The row's valid prefix only (positions before its length), then its last positions (fewer
 * than 8), prefetching PPO_STREAM_AHEAD_BYTES ahead and across the padding into the next row:
 * without, the hardware prefetchers restart at every row, and reading rows whole costs the
 * padding's bytes. */
PPO_INLINE void PPO_ROW(ppo_moments_cases)(
    int has_mask, const ppo_real* x, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, double shift, double* row_count, double* row_total,
    double* row_total_sq) {
    ppo_f64x8 shifts = ppo_f64x8_splat(shift);
    ppo_c64x8 count = ppo_c64x8_zero();
    ppo_f64x8 total = ppo_f64x8_splat(0.0), total_sq = total;
    ptrdiff_t valid_end = ppo_valid_stop(start, span, length), i;
    const ptrdiff_t distance = PPO_STREAM_AHEAD_BYTES / (ptrdiff_t)sizeof(ppo_real);
    /* Groups of 8 blocks, then the last blocks (a group whose trip count is not a constant
     * ran 1.2x this time: GCC kept its loop a block a trip). */
    for (i = start; i + 64 <= valid_end; i += 64) {
        PPO_ROW(ppo_prefetch_group)(
            x, has_mask ? mask : NULL, ppo_ahead_by(i, valid_end, start + span, distance));
        for (ptrdiff_t block = i; block < i + 64; block += 8)
            PPO_ROW(ppo_moments_block)(
                has_mask ? ppo_m64x8_from_bytes(mask + block) : ppo_m64x8_all(), x, block,
                shifts, &count, &total, &total_sq);
    }
    if (i + 8 <= valid_end)
        PPO_ROW(ppo_prefetch_group)(
            x, has_mask ? mask : NULL, ppo_ahead_by(i, valid_end, start + span, distance));
    for (; i + 8 <= valid_end; i += 8)
        PPO_ROW(ppo_moments_block)(
            has_mask ? ppo_m64x8_from_bytes(mask + i) : ppo_m64x8_all(), x, i, shifts, &count,
            &total, &total_sq);
    if (i < valid_end) {
        ptrdiff_t tail = valid_end - i;
        ppo_real tail_x[8] = {0};
        uint8_t tail_mask[8] = {0};
        memcpy(tail_x, x + i, (size_t)tail * sizeof(ppo_real));
        if (has_mask) memcpy(tail_mask, mask + i, (size_t)tail);
        PPO_ROW(ppo_moments_block)(
            ppo_valid_lanes(tail_mask, has_mask, 0, 0, tail), tail_x, 0, shifts, &count, &total,
            &total_sq);
    }
    *row_count = (double)ppo_c64x8_total(count);
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

/* The row from its end (the kernel is _spec.Kernel.backwards, and so are its rows): the padding's
 * zeros (ppo_zeros_backwards), the last positions past a multiple of 8 one by one, then the valid
 * prefix 8 tokens at a time down to the row's start in explicit lanes (gcc's own vectorization of
 * the scalar loop ran 1.6-1.8 times numba's time on rows in the cache), prefetching as GAE's
 * backward rows do (ppo_prefetch_behind). Whitening follows the moments' pass, which goes up
 * through the batch: going down, it starts on the lines that pass read last, still in the cache,
 * and the next call's moments start where it ended (float32 1024 x 4096 `whiten`, one thread, AMD
 * EPYC with AVX-512: 2.0-2.6 -> 1.9-2.0 ms; the rows from the last but each from its start, with
 * the forward prefetch, took 2.5-2.7 ms). Each token's value is the twin's: ((double)x - mean) *
 * scale + offset, rounded to the dtype, 0 where masked; in what order they are written changes no
 * bit, and a position is read just before it is written (whiten's out=x). */
static void PPO_ROW(ppo_whiten_row)(
    const ppo_real* x, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length, const uint8_t* mask,
    int has_mask, double mean, double scale, double offset, ppo_real* whitened) {
    ptrdiff_t valid_end = ppo_valid_stop(start, span, length), i;
    ptrdiff_t whole = start + (valid_end - start) / 8 * 8;
    ppo_f64x8 means = ppo_f64x8_splat(mean), scales = ppo_f64x8_splat(scale);
    ppo_f64x8 offsets = ppo_f64x8_splat(offset);
    ppo_vec zero = PPO_V(splat)(0);
    PPO_ROW(ppo_zeros_backwards)(whitened, NULL, valid_end, start + span);
    for (i = valid_end - 1; i >= whole; i--) {
        ppo_real value = (ppo_real)(((double)x[i] - mean) * scale + offset);
        whitened[i] = !has_mask || mask[i] != 0 ? value : 0;
    }
    for (i = whole - 8; i >= start; i -= 8) {
        PPO_ROW(ppo_prefetch_behind)(x, NULL, whitened, NULL, has_mask ? mask : NULL, i, i);
        ppo_f64x8 centred = ppo_f64x8_sub(PPO_V(to_f64)(PPO_V(load)(x + i)), means);
        ppo_vec value = PPO_V(from_f64)(ppo_f64x8_add(ppo_f64x8_mul(centred, scales), offsets));
        if (has_mask) value = PPO_V(select)(PPO_M(from_bytes)(mask + i), value, zero);
        PPO_V(store)(whitened + i, value);
    }
}
