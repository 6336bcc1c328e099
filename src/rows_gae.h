/* -- GAE --------------------------------------------------------------------------------------- */
/* Twin of gae (ppo_fast/_numba_kernels.py), function for function: ppo_gae_span of _gae_span,
 * ppo_gae_summary of _gae_summary, ppo_gae_seed of _gae_seed, ppo_gae_rows of gae. The running
 * state is float64 whatever the dtype, and each multiply-add is one fma, as the twins' llvm.fma
 * (the same bits as numba). Included by rows.h, once per dtype.
 *
 * The kernel takes the whole batch (the table's `chunks`: the generated Cython calls
 * ppo_gae_rows once) and runs its own OpenMP loops. A row whose valid extent is longer than
 * PPO_GAE_LONG_ROW positions runs in chunks of PPO_GAE_CHUNK positions (the values of
 * _spec.GAE_CHUNKS), cut at multiples of PPO_GAE_CHUNK from its start: fixed by the row, never by
 * the threads, so that the results are the same on any number of threads. The work units are
 * the other rows and these chunks, in row order:
 *   pass 1 (parallel over every chunk but each row's first) reads a chunk and summarises it
 *          with a zero carry (ppo_gae_summary);
 *   a short serial pass per row combines the summaries right to left into each chunk's seed:
 *          the value after it and the running advantage there (ppo_gae_seed);
 *   pass 2 (parallel over units) runs the recursion over each unit from its seed, 8 valid
 *          positions at a time (ppo_gae_span), writing the advantages and returns.
 * A row that runs whole, and a row's last chunk, are seeded with the row's bootstrap and 0, as
 * the recursion is: a short row gets the bits of ppo_gae_span alone. The other chunks' seeds are the
 * combined summaries, reassociated float64 sums (within the oracle's tolerances; a sum beyond
 * float64's range may overflow in one order and not in the other).
 *
 * The sizes, measured on a 2-core AMD EPYC (float32) when pass 2 ran the recursion a position at
 * a time: pass 2 cost about 1.1 ns a position (the chain of fma, 4 cycles each), pass 1 about
 * 0.14 ns (eight lanes, at the speed of reading), so that the extra pass cost a long row 10-15%
 * on one thread; pass 2 by blocks (ppo_gae_block) costs about 0.5 ns a position in cache on a
 * 2 GHz Intel Xeon with AVX-512, so the extra pass is now about a quarter. A row is cut when it
 * is longer than the least work the thread policy gives a thread (65,536 positions,
 * _threads.MIN_POSITIONS_PER_THREAD): a shorter one cannot fill a thread on its own. A chunk of
 * 16,384 positions is about 18 us of pass 2, far above its fixed cost (its search for its last
 * valid position, pass 1's folds and powers, its step of the serial pass: about a microsecond),
 * and gives a row of 131,072 positions eight units; chunks of 8,192 to 65,536 measured the same
 * on two threads, within the noise of a shared machine. */

#ifndef PPO_FAST_ROWS_GAE_ONCE
#define PPO_FAST_ROWS_GAE_ONCE
#include <stdlib.h>

/* The chunks of a row: 0 when it runs whole, else its valid extent cut every PPO_GAE_CHUNK. */
PPO_INLINE ptrdiff_t ppo_gae_chunks(ptrdiff_t span, ptrdiff_t length) {
    ptrdiff_t valid_end = length < span ? (length > 0 ? length : 0) : span;
    return valid_end <= PPO_GAE_LONG_ROW ? 0 : (valid_end + PPO_GAE_CHUNK - 1) / PPO_GAE_CHUNK;
}

/* base ** exponent by squaring, the twin's operations (pow() would round as its libm does). */
PPO_INLINE double ppo_power(double base, uint64_t exponent) {
    double result = 1.0;
    while (exponent != 0) {
        if (exponent & 1) result = result * base;
        base = base * base;
        exponent >>= 1;
    }
    return result;
}

/* fma(factor, carry, local), where factor = (gamma lam)^n may underflow to 0 for a gamma lam > 0
 * where the recursion would carry an inf on: an inf or NaN carry then goes with the factor 1
 * (the twin, _gae_carry, says why that is the recursion's result). */
PPO_INLINE double ppo_gae_carry(double carry, double factor, double gamma_lam, double local) {
    if (factor == 0.0 && gamma_lam > 0.0 && !isfinite(carry)) factor = 1.0;
    return fma(factor, carry, local);
}

/* The recursion eight valid positions at a time (the twin's _gae_scan): for a block whose
 * lane 7 is its last position, the advantages are
 *   A_j = sum_{k=0}^{7-j} c^k delta_{j+k} + c^(8-j) A_after,  c = gamma lam,
 * the TD errors' sums in three steps of lanes moved down (1, 2 and 4 lanes: a log-step scan),
 * then the running advantage after the block times the powers. The chain from one block to the
 * next is one fma (the running advantage at lane 0), not eight: the plain recursion is bound by
 * that chain's latency, 4 cycles a position. The sums are reassociated, within a few ulp of the
 * recursion's (the oracle's tolerances), and the same on every backend and thread count.
 *
 * Taken only where it cannot differ from the recursion in anything but rounding (gamma lam is
 * in [0, 1], as the stage checks): every TD error of the block within 2^1000 and the running
 * advantage within 2^1020, so that no inf or NaN goes in and no partial sum overflows in one
 * order and not in the other; and (gamma lam)^8 > 0 unless gamma lam = 0, so that no power of
 * it underflows to 0 where the recursion's repeated products keep a small advantage. A block
 * outside them takes the recursion. */
typedef struct {
    /* gamma, gamma lam, (gamma lam)^2 and ^4 in every lane, and lane j (gamma lam)^(8 - j): made
     * once a span, not as splats in the block, where GCC broadcast them again in every block, on
     * the shuffle port that the block's lane moves (valignq) need too */
    ppo_f64x8 gammas, gamma_lams, gl_2s, gl_4s, powers;
    double gl_8; /* (gamma lam)^8, the running advantage's factor from one block to the next */
    int blocks;  /* whether blocks may take the scan */
} ppo_gae_scan;

PPO_INLINE void ppo_gae_scan_init(ppo_gae_scan* scan, double gamma, double gamma_lam) {
    double c = gamma_lam, c2 = c * c, c3 = c2 * c, c4 = c2 * c2, c8 = c4 * c4;
    double powers[8] = {c8, c4 * c3, c4 * c2, c4 * c, c4, c3, c2, c};
    scan->gammas = ppo_f64x8_splat(gamma);
    scan->gamma_lams = ppo_f64x8_splat(c);
    scan->gl_2s = ppo_f64x8_splat(c2);
    scan->gl_4s = ppo_f64x8_splat(c4);
    scan->powers = ppo_f64x8_load(powers);
    scan->gl_8 = c8;
    scan->blocks = c == 0.0 || c8 != 0.0;
}

/* The advantages of a block of 8 valid positions (lane 7 the last) from their rewards and
 * values, the value after the block and the running advantage there; the running advantage
 * at lane 0 in *running. 0, with nothing written, where the block is outside the scan's bounds. */
PPO_INLINE int ppo_gae_block(
    const ppo_gae_scan* scan, ppo_f64x8 rewards, ppo_f64x8 values, double next_value,
    double* running, ppo_f64x8* advantages) {
    ppo_f64x8 errors = ppo_f64x8_sub(
        ppo_f64x8_fma(scan->gammas, ppo_f64x8_down1_fill(values, next_value), rewards), values);
    ppo_m64x8 bounded = ppo_f64x8_le(ppo_f64x8_abs(errors), ppo_f64x8_splat(0x1p1000));
    if (!(fabs(*running) <= 0x1p1020) ||
        ppo_m64x8_any(ppo_m64x8_and_not(ppo_m64x8_all(), bounded)))
        return 0;
    ppo_f64x8 sums =
        ppo_f64x8_fma(scan->gamma_lams, ppo_f64x8_down1_fill(errors, 0.0), errors);
    sums = ppo_f64x8_fma(scan->gl_2s, ppo_f64x8_down2(sums), sums);
    sums = ppo_f64x8_fma(scan->gl_4s, ppo_f64x8_down4(sums), sums);
    *advantages = ppo_f64x8_fma(scan->powers, ppo_f64x8_splat(*running), sums);
    /* Lane 0 again as a scalar: the next block waits on one fma, not on a broadcast too. */
    *running = fma(scan->gl_8, *running, ppo_f64x8_lane0(sums));
    return 1;
}

/* One unit of work: a row that runs whole (chunk -1) or one chunk of a long row; its summary
 * (pass 1) and its seed (the combine). */
typedef struct {
    int64_t row, chunk;
    int64_t count, last; /* valid positions, and the index of the last one */
    double first_value, local;
    double seed_value, seed_carry;
} ppo_gae_unit;
#endif

/* One valid position by the plain recursion. */
#define PPO_GAE_RUN(i)                                                                  \
    do {                                                                                \
        double value_ = (double)values[(i)];                                            \
        /* One rounding per multiply-add, as the twin's llvm.fma: the same bits as numba, \
         * and a fused op halves the latency of the running advantage's chain. */       \
        double delta_ = fma(gamma, next_value, (double)rewards[(i)]) - value_;          \
        running = fma(gamma_lam, running, delta_);                                      \
        advantages[(i)] = (ppo_real)running;                                            \
        returns[(i)] = (ppo_real)(running + value_);                                    \
        next_value = value_;                                                            \
    } while (0)

/* Positions low .. high-1 of the row at start, backwards, from the value after them and the
 * running advantage there (the twin's _gae_span). Each run of adjacent valid positions goes in
 * blocks of 8 by the scan (ppo_gae_block), counted from the run's last position; the run's
 * first positions that fill no block, and a block outside the scan's bounds, take the plain
 * recursion. So a row's bits depend only on its runs: the same with lengths, with a mask
 * without holes, or packed. (Blocks gathered across holes were slower on scattered holes than
 * the recursion: a branch a position to gather, one to scatter.) */
PPO_INLINE void PPO_ROW(ppo_gae_span)(
    const ppo_real* rewards, const ppo_real* values, ptrdiff_t start, ptrdiff_t low,
    ptrdiff_t high, ptrdiff_t length, const uint8_t* mask, int has_mask, double gamma,
    double gamma_lam, double next_value, double running, ppo_real* advantages,
    ppo_real* returns) {
    ptrdiff_t end = high < length ? high : length, t, i;
    int j;
    if (end < low) end = low;
    /* The positions past the valid extent, and a mask's trailing words of 8 invalid bytes (a
     * right-padded row's padding), are zeros, written by blocks (position by position, through
     * the loop below, they cost more than a valid position). */
    if (has_mask) end = ppo_mask_stop(mask + start, low, end);
    PPO_ROW(ppo_zeros_backwards)(advantages, returns, start + end, start + high);
    ppo_gae_scan scan;
    ppo_gae_scan_init(&scan, gamma, gamma_lam);
    t = end;
    while (t > low) {
        ppo_f64x8 block;
        if (scan.blocks && t - low >= 8 && (!has_mask || ppo_all_valid8(mask + start + t - 8))) {
            i = start + t - 8;
            PPO_ROW(ppo_prefetch_behind)(
                rewards, values, advantages, returns, has_mask ? mask : NULL, t, i);
            ppo_f64x8 block_values = PPO_V(to_f64)(PPO_V(load)(values + i));
            if (ppo_gae_block(
                    &scan, PPO_V(to_f64)(PPO_V(load)(rewards + i)), block_values, next_value,
                    &running, &block)) {
                PPO_V(store)(advantages + i, PPO_V(from_f64)(block));
                PPO_V(store)(returns + i, PPO_V(from_f64)(ppo_f64x8_add(block, block_values)));
                next_value = ppo_f64x8_lane0(block_values);
            } else {
                for (j = 7; j >= 0; j--) PPO_GAE_RUN(i + j);
            }
            t -= 8;
        } else if (has_mask) {
            /* A hole among the 8 positions below t, or fewer than 8 left: the valid positions
             * down to the highest hole by the recursion (fewer than 8: no block), then the
             * hole, and the blocks start again at the valid position below it. One branch that
             * exits at the hole, where a check of 8 bytes a position would mispredict too. */
            do {
                i = start + --t;
                if (mask[i] == 0) {
                    advantages[i] = 0;
                    returns[i] = 0;
                    break;
                }
                PPO_GAE_RUN(i);
            } while (t > low);
        } else {
            i = start + --t;
            PPO_GAE_RUN(i);
        }
    }
}
#undef PPO_GAE_RUN

/* The TD errors of the 8 positions from i on, each from the value at the next position (the
 * twin's _td_errors): fma(gamma, values[i + j + 1], rewards[i + j]) - values[i + j]. */
PPO_INLINE ppo_f64x8 PPO_ROW(ppo_gae_errors)(
    const ppo_real* rewards, const ppo_real* values, ptrdiff_t i, double gamma) {
    ppo_f64x8 next_values = PPO_V(to_f64)(PPO_V(load)(values + i + 1));
    ppo_f64x8 errors = ppo_f64x8_fma(
        ppo_f64x8_splat(gamma), next_values, PPO_V(to_f64)(PPO_V(load)(rewards + i)));
    return ppo_f64x8_sub(errors, PPO_V(to_f64)(PPO_V(load)(values + i)));
}

/* One position of pass 1's plain recursion (nothing written). */
#define PPO_GAE_STEP(i)                                                                 \
    do {                                                                                \
        double value_ = (double)values[(i)];                                            \
        double delta_ = fma(gamma, next_value, (double)rewards[(i)]) - value_;          \
        running = fma(gamma_lam, running, delta_);                                      \
        next_value = value_;                                                            \
        count++;                                                                        \
    } while (0)

/* Pass 1 of a chunk, positions low .. high-1 (within the row's valid extent): its valid count,
 * the index of its last valid position, the value at its first, and the advantage at its first
 * by the recursion seeded with 0 at its last (the twin's docstring has the lanes' algebra). */
PPO_INLINE void PPO_ROW(ppo_gae_summary)(
    const ppo_real* rewards, const ppo_real* values, ptrdiff_t start, ptrdiff_t low,
    ptrdiff_t high, const uint8_t* mask, int has_mask, double gamma, double gamma_lam,
    ppo_gae_unit* unit) {
    ptrdiff_t end = high, last = high, t, j, i;
    if (has_mask) end = ppo_mask_stop(mask + start, low, end);
    for (t = end - 1; t >= low; t--) {
        if (!has_mask || mask[start + t] != 0) {
            last = t;
            break;
        }
    }
    unit->count = 0;
    if (last == high) return;
    double gl_2 = gamma_lam * gamma_lam, gl_4 = gl_2 * gl_2, gl_8 = gl_4 * gl_4;
    double next_value = (double)values[start + last], running = 0.0;
    int64_t count = 1;
    int blocks = gamma_lam == 0.0 || gl_8 != 0.0;
    t = last;
    while (t - low >= 8) {
        i = start + t - 8;
        if (has_mask && !ppo_all_valid8(mask + i)) {
            if (!ppo_none_valid8(mask + i))
                for (j = 7; j >= 0; j--)
                    if (mask[i + j] != 0) PPO_GAE_STEP(i + j);
            t -= 8;
            continue;
        }
        if (!blocks) break;
        /* A run of valid blocks from the one at i down, as the twin's lanes (its position 7
         * takes the value after the block, which may lie past a hole). */
        double lanes[8];
        ppo_f64x8_store(lanes, PPO_ROW(ppo_gae_errors)(rewards, values, i, gamma));
        lanes[7] = fma(gamma, next_value, (double)rewards[i + 7]) - (double)values[i + 7];
        ppo_f64x8 sums = ppo_f64x8_load(lanes), factor = ppo_f64x8_splat(gl_8);
        uint64_t n_blocks = 1;
        t -= 8;
        while (t - low >= 8 && (!has_mask || ppo_all_valid8(mask + start + t - 8))) {
            i = start + t - 8;
            sums = ppo_f64x8_fma(factor, sums, PPO_ROW(ppo_gae_errors)(rewards, values, i, gamma));
            n_blocks++;
            t -= 8;
        }
        ppo_f64x8_store(lanes, sums);
        double pair_3 = fma(gamma_lam, lanes[7], lanes[6]);
        double pair_2 = fma(gamma_lam, lanes[5], lanes[4]);
        double pair_1 = fma(gamma_lam, lanes[3], lanes[2]);
        double pair_0 = fma(gamma_lam, lanes[1], lanes[0]);
        double folded = fma(gl_4, fma(gl_2, pair_3, pair_2), fma(gl_2, pair_1, pair_0));
        running = ppo_gae_carry(running, ppo_power(gl_8, n_blocks), gamma_lam, folded);
        next_value = (double)values[i];
        count += 8 * (int64_t)n_blocks;
    }
    for (t = t - 1; t >= low; t--)
        if (!has_mask || mask[start + t] != 0) PPO_GAE_STEP(start + t);
    unit->count = count;
    unit->last = start + last;
    unit->first_value = next_value;
    unit->local = running;
}
#undef PPO_GAE_STEP

/* The combine step, right to left: from a chunk's summary and the (next value, running
 * advantage) after the chunk, those before it. */
PPO_INLINE void PPO_ROW(ppo_gae_seed)(
    const ppo_real* rewards, const ppo_real* values, const ppo_gae_unit* unit, double gamma,
    double gamma_lam, double* next_value, double* carry) {
    if (unit->count == 0) return;
    double value = (double)values[unit->last];
    double at_last =
        fma(gamma_lam, *carry, fma(gamma, *next_value, (double)rewards[unit->last]) - value);
    *carry = ppo_gae_carry(
        at_last, ppo_power(gamma_lam, (uint64_t)(unit->count - 1)), gamma_lam, unit->local);
    *next_value = unit->first_value;
}

/* The batch, as ppo_gae_rows takes it. */
typedef struct {
    const ppo_real *rewards, *values;
    const int64_t *starts, *spans, *lengths;
    const uint8_t* mask;
    int has_mask;
    const double *gammas, *lams, *bootstrap;
    ppo_real *advantages, *returns;
} PPO_ROW(ppo_gae_batch);

/* Pass 1 of unit u (a row's chunk but its first). */
PPO_INLINE void PPO_ROW(ppo_gae_summarise)(const PPO_ROW(ppo_gae_batch) * x, ppo_gae_unit* unit) {
    ptrdiff_t b = unit->row, low = unit->chunk * PPO_GAE_CHUNK;
    ptrdiff_t valid_end = x->lengths[b] < x->spans[b] ? x->lengths[b] : x->spans[b];
    ptrdiff_t high = low + PPO_GAE_CHUNK < valid_end ? low + PPO_GAE_CHUNK : valid_end;
    PPO_ROW(ppo_gae_summary)(
        x->rewards, x->values, x->starts[b], low, high, x->mask, x->has_mask, x->gammas[b],
        x->gammas[b] * x->lams[b], unit);
}

/* The serial pass: each row's units right to left, a unit's seed (the value after it and the
 * running advantage there) from the unit after it; a row's last unit gets the row's bootstrap
 * and 0. */
PPO_INLINE void PPO_ROW(ppo_gae_combine)(
    const PPO_ROW(ppo_gae_batch) * x, ppo_gae_unit* units, ptrdiff_t n_units) {
    for (ptrdiff_t u = n_units - 1; u >= 0; u--) {
        ptrdiff_t b = units[u].row;
        if (u == n_units - 1 || units[u + 1].row != b) {
            units[u].seed_value = x->bootstrap[b];
            units[u].seed_carry = 0.0;
            continue;
        }
        double next_value = units[u + 1].seed_value, carry = units[u + 1].seed_carry;
        double gamma = x->gammas[b];
        PPO_ROW(ppo_gae_seed)(
            x->rewards, x->values, &units[u + 1], gamma, gamma * x->lams[b], &next_value, &carry);
        units[u].seed_value = next_value;
        units[u].seed_carry = carry;
    }
}

/* Pass 2 of unit u: the recursion over it from its seed, by blocks (ppo_gae_span; a row's last
 * unit to the end of its span, past its valid extent). */
PPO_INLINE void PPO_ROW(ppo_gae_unit_run)(
    const PPO_ROW(ppo_gae_batch) * x, const ppo_gae_unit* units, ptrdiff_t n_units,
    ptrdiff_t u) {
    ptrdiff_t b = units[u].row;
    int row_ends = u == n_units - 1 || units[u + 1].row != b;
    ptrdiff_t low = units[u].chunk < 0 ? 0 : units[u].chunk * PPO_GAE_CHUNK;
    ptrdiff_t high = row_ends ? x->spans[b] : low + PPO_GAE_CHUNK;
    PPO_ROW(ppo_gae_span)(
        x->rewards, x->values, x->starts[b], low, high, x->lengths[b], x->mask, x->has_mask,
        x->gammas[b], x->gammas[b] * x->lams[b], units[u].seed_value, units[u].seed_carry,
        x->advantages, x->returns);
}

/* One row by ppo_gae_span, as the batch function below runs every row that is not long:
 * the common-case entry's row (the stages take the common case only for rows no longer than
 * PPO_GAE_LONG_ROW, so its results are the batch function's). */
static void PPO_ROW(ppo_gae_row)(
    const ppo_real* rewards, const ppo_real* values, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, int has_mask, double gamma, double lam,
    double bootstrap, ppo_real* advantages, ppo_real* returns) {
    PPO_ROW(ppo_gae_span)(
        rewards, values, start, 0, span, length, mask, has_mask, gamma, gamma * lam, bootstrap,
        0.0, advantages, returns);
}

/* The whole batch on n_threads threads: 0, or 1 when the units' scratch cannot be allocated.
 * With long rows the three passes run in one OpenMP region (its barriers between them): a
 * region's start wakes the idle threads, which OMP_WAIT_POLICY=PASSIVE puts to sleep after
 * each region, at a cost of the order of this call's work. */
static int PPO_ROW(ppo_gae_rows)(
    const ppo_real* rewards, const ppo_real* values, const int64_t* starts, const int64_t* spans,
    const int64_t* lengths, const uint8_t* mask, int has_mask, ptrdiff_t n_rows,
    const double* gammas, const double* lams, const double* bootstrap, ppo_real* advantages,
    ppo_real* returns, int n_threads) {
    ptrdiff_t b, u, s, n_chunks = 0;
    for (b = 0; b < n_rows; b++) n_chunks += ppo_gae_chunks(spans[b], lengths[b]);
    if (n_chunks == 0) {
#define PPO_GAE_WHOLE_ROW(b)                                                                    \
    PPO_ROW(ppo_gae_span)(                                                                      \
        rewards, values, starts[b], 0, spans[b], lengths[b], mask, has_mask, gammas[b],         \
        gammas[b] * lams[b], bootstrap[b], 0.0, advantages, returns)
        /* The rows from the last (_spec.Kernel.backwards says why), on each thread too. */
        if (n_threads > 1) {
#pragma omp parallel for schedule(static) num_threads(n_threads)
            for (b = 0; b < n_rows; b++) PPO_GAE_WHOLE_ROW(n_rows - 1 - b);
        } else {
            for (b = n_rows - 1; b >= 0; b--) PPO_GAE_WHOLE_ROW(b);
        }
#undef PPO_GAE_WHOLE_ROW
        return 0;
    }
    PPO_ROW(ppo_gae_batch)
    x = {rewards, values, starts, spans, lengths, mask, has_mask, gammas, lams, bootstrap,
         advantages, returns};
    /* The units in row order (a row's chunks from its first), and the chunks pass 1 reads. */
    ptrdiff_t n_units = n_chunks, n_summarised = 0;
    for (b = 0; b < n_rows; b++) n_units += ppo_gae_chunks(spans[b], lengths[b]) == 0;
    ppo_gae_unit* units = (ppo_gae_unit*)malloc((size_t)n_units * sizeof(ppo_gae_unit));
    ppo_gae_unit** summarised = (ppo_gae_unit**)malloc((size_t)n_chunks * sizeof(ppo_gae_unit*));
    if (units == NULL || summarised == NULL) {
        free(units);
        free(summarised);
        return 1;
    }
    u = 0;
    for (b = 0; b < n_rows; b++) {
        ptrdiff_t chunks = ppo_gae_chunks(spans[b], lengths[b]);
        for (ptrdiff_t c = 0; c < (chunks > 0 ? chunks : 1); c++, u++) {
            units[u].row = b;
            units[u].chunk = chunks > 0 ? c : -1;
            units[u].count = 0;
            if (c > 0) summarised[n_summarised++] = &units[u];
        }
    }
    /* Both parallel passes from the last unit, as the rows above. */
    if (n_threads > 1) {
#pragma omp parallel num_threads(n_threads)
        {
#pragma omp for schedule(static)
            for (s = 0; s < n_summarised; s++)
                PPO_ROW(ppo_gae_summarise)(&x, summarised[n_summarised - 1 - s]);
#pragma omp single
            PPO_ROW(ppo_gae_combine)(&x, units, n_units);
#pragma omp for schedule(static)
            for (u = 0; u < n_units; u++)
                PPO_ROW(ppo_gae_unit_run)(&x, units, n_units, n_units - 1 - u);
        }
    } else {
        for (s = n_summarised - 1; s >= 0; s--) PPO_ROW(ppo_gae_summarise)(&x, summarised[s]);
        PPO_ROW(ppo_gae_combine)(&x, units, n_units);
        for (u = n_units - 1; u >= 0; u--) PPO_ROW(ppo_gae_unit_run)(&x, units, n_units, u);
    }
    free(units);
    free(summarised);
    return 0;
}
