/* Eight lanes of float32 or float64: the vector layer under the row kernels of rows.h.
 *
 * Why explicit lanes: a row's loss is a sum, and GCC vectorizes a floating-point sum only when it
 * may reassociate it (the numba twins let LLVM do so), which would tie the order of addition to
 * the vector width of each build. Here the lanes are in the source: token t of a row always goes
 * to lane t % 8 and the lanes are added up in a fixed tree, so the portable, AVX2 and AVX-512
 * builds, and any number of threads, give the same bits. Explicit vectors also spare the loss
 * kernels what GCC makes of their uint8 mask in an auto-vectorized loop (32 tokens a step, mostly
 * spilled).
 *
 * One interface, three implementations: AVX2 and FMA intrinsics (setup.py's _avx2 build; its
 * _avx512 build keeps them for float32, encoded with EVEX and 32 vector registers (AVX-512VL),
 * with float32's masks in mask registers, and holds float64's eight lanes in one AVX-512
 * register, which halves the instructions of the float64 lanes, k3's exp above all); GCC and
 * Clang generic 16-byte vectors (their other builds: SSE2, NEON, ...); plain C lane by lane
 * (other compilers).
 * Each operation is the same IEEE operation in all of them, so they agree bit for bit: max(a, b)
 * and min(a, b) are x86's a > b ? a : b and a < b ? a : b (which keep b when either is NaN: the
 * twins' clip, comparison for comparison), fma is fused, float64 -> float32 rounds to nearest, and
 * comparisons are false on NaN. exp and log are exp.h's and log.h's functions operation for
 * operation: written out in intrinsics in the AVX2 and AVX-512 blocks, applied lane by lane in
 * the others.
 *
 * Types: ppo_f32x8 and ppo_f64x8 (values), ppo_m32x8 and ppo_m64x8 (masks, one per lane of the
 * values of the same width), ppo_c32x8 and ppo_c64x8 (counts of true mask lanes). Operations are
 * named ppo_<type>_<operation>, so that rows.h can pick them by dtype.
 *
 * The blocks below repeat one another's shape on purpose: each implements the whole interface for
 * its types and instruction set, one line an operation, so that any one block can be read against
 * the interface on its own. Generating them from one macro would save lines and hide which
 * instruction each operation is, which is what a reader of this file checks.
 */
#ifndef PPO_FAST_LANES_H
#define PPO_FAST_LANES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(_MSC_VER)
#define PPO_INLINE static __forceinline
#else
#define PPO_INLINE static inline __attribute__((always_inline))
#endif

/* A hint to fetch the cache line at base + bytes, which may lie past the end of an array: a
 * prefetch never faults, and the address is computed as an integer. */
PPO_INLINE void ppo_prefetch(const void* base, ptrdiff_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch((const void*)((uintptr_t)base + (uintptr_t)bytes));
#else
    (void)base;
    (void)bytes;
#endif
}

/* The same for a line about to be written (the write's read for ownership, started early). */
PPO_INLINE void ppo_prefetch_for_write(void* base, ptrdiff_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch((void*)((uintptr_t)base + (uintptr_t)bytes), 1);
#else
    (void)base;
    (void)bytes;
#endif
}

#include "exp.h"
#include "log.h"

#if defined(__AVX2__) && defined(__FMA__)
/* -- AVX2 and FMA ------------------------------------------------------------------------------ */
#include <immintrin.h>

typedef __m256 ppo_f32x8;
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__AVX512BW__)
/* The _avx512 build: float32's masks in mask registers, as float64's (below), so that a
 * comparison writes a mask register, a select is one masked blend, a mask from the bytes is one
 * vptestmb, and a count is a popcount on the integer ports (as numba's LLVM code does). With
 * masks as vectors of all ones, GCC moved them between vector and mask registers around the
 * masked instructions it chose, a few vector instructions a block more. Measured on float32
 * (32, 2048) batches in the cache, one thread, Cython before and after: the clipped surrogate
 * 65-67 -> 55 us a call, the value loss 35-36 -> 29-30, GSPO 56-58 -> 47-48, the geometric mean
 * 51-52 -> 47-48, CISPO 51-52 -> 48-49 (numba: 54, 25, 42-44, 44, 46). The same bits. */
#define PPO_M32X8_REGISTERS 1
typedef __mmask8 ppo_m32x8;
typedef int64_t ppo_c32x8;
#else
typedef __m256 ppo_m32x8;  /* all ones or zero per lane */
typedef __m256i ppo_c32x8; /* int32 per lane: rows_loss.h totals them every chunk */
#endif

PPO_INLINE ppo_f32x8 ppo_f32x8_splat(float x) { return _mm256_set1_ps(x); }
PPO_INLINE ppo_f32x8 ppo_f32x8_load(const float* p) { return _mm256_loadu_ps(p); }
PPO_INLINE void ppo_f32x8_store(float* p, ppo_f32x8 x) { _mm256_storeu_ps(p, x); }
/* p[0 .. count - 1] in the first count lanes (0 <= count <= 8), 0 in the others, reading nothing
 * past them: a row's last partial block (rows.h ppo_tail_fill). */
PPO_INLINE ppo_f32x8 ppo_f32x8_load_first(const float* p, ptrdiff_t count) {
    __m256i first = _mm256_cmpgt_epi32(
        _mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(p, first);
}
PPO_INLINE ppo_f32x8 ppo_f32x8_add(ppo_f32x8 a, ppo_f32x8 b) { return _mm256_add_ps(a, b); }
PPO_INLINE ppo_f32x8 ppo_f32x8_sub(ppo_f32x8 a, ppo_f32x8 b) { return _mm256_sub_ps(a, b); }
PPO_INLINE ppo_f32x8 ppo_f32x8_mul(ppo_f32x8 a, ppo_f32x8 b) { return _mm256_mul_ps(a, b); }
PPO_INLINE ppo_f32x8 ppo_f32x8_div(ppo_f32x8 a, ppo_f32x8 b) { return _mm256_div_ps(a, b); }
PPO_INLINE ppo_f32x8 ppo_f32x8_max(ppo_f32x8 a, ppo_f32x8 b) { return _mm256_max_ps(a, b); }
PPO_INLINE ppo_f32x8 ppo_f32x8_min(ppo_f32x8 a, ppo_f32x8 b) { return _mm256_min_ps(a, b); }
PPO_INLINE ppo_f32x8 ppo_f32x8_abs(ppo_f32x8 x) { /* clears the sign bit, as fabs does */
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
}
PPO_INLINE ppo_f32x8 ppo_f32x8_negative(ppo_f32x8 x) { /* flips the sign bit, as -x does */
    return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
}
#ifdef PPO_M32X8_REGISTERS
PPO_INLINE ppo_m32x8 ppo_f32x8_eq(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_cmp_ps_mask(a, b, _CMP_EQ_OQ);
}
PPO_INLINE ppo_m32x8 ppo_f32x8_lt(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_cmp_ps_mask(a, b, _CMP_LT_OQ);
}
PPO_INLINE ppo_m32x8 ppo_f32x8_gt(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_cmp_ps_mask(a, b, _CMP_GT_OQ);
}
PPO_INLINE ppo_m32x8 ppo_f32x8_le(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_cmp_ps_mask(a, b, _CMP_LE_OQ);
}
PPO_INLINE ppo_f32x8 ppo_f32x8_select(ppo_m32x8 m, ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_mask_blend_ps(m, b, a); /* a where m is set */
}

PPO_INLINE ppo_m32x8 ppo_m32x8_from_bytes(const uint8_t* p) { /* lane i: p[i] != 0 */
    int64_t bytes;
    memcpy(&bytes, p, 8);
    __m128i wide = _mm_cvtsi64_si128(bytes);
    return (ppo_m32x8)_mm_test_epi8_mask(wide, wide);
}
/* The other operations on these masks and counts are float64's, whose masks and counts are the
 * same __mmask8 and int64_t (the AVX-512 float64 block below defines them). */
#define ppo_m32x8_all ppo_m64x8_all
#define ppo_m32x8_and ppo_m64x8_and
#define ppo_m32x8_and_not ppo_m64x8_and_not
#define ppo_m32x8_or ppo_m64x8_or
#define ppo_m32x8_first ppo_m64x8_first
#define ppo_c32x8_zero ppo_c64x8_zero
#define ppo_c32x8_add ppo_c64x8_add
#define ppo_c32x8_total ppo_c64x8_total
#else
PPO_INLINE ppo_m32x8 ppo_f32x8_eq(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_cmp_ps(a, b, _CMP_EQ_OQ);
}
PPO_INLINE ppo_m32x8 ppo_f32x8_lt(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_cmp_ps(a, b, _CMP_LT_OQ);
}
PPO_INLINE ppo_m32x8 ppo_f32x8_gt(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_cmp_ps(a, b, _CMP_GT_OQ);
}
PPO_INLINE ppo_m32x8 ppo_f32x8_le(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_cmp_ps(a, b, _CMP_LE_OQ);
}
PPO_INLINE ppo_f32x8 ppo_f32x8_select(ppo_m32x8 m, ppo_f32x8 a, ppo_f32x8 b) {
    return _mm256_blendv_ps(b, a, m);
}

PPO_INLINE ppo_m32x8 ppo_m32x8_all(void) { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
PPO_INLINE ppo_m32x8 ppo_m32x8_and(ppo_m32x8 a, ppo_m32x8 b) { return _mm256_and_ps(a, b); }
PPO_INLINE ppo_m32x8 ppo_m32x8_and_not(ppo_m32x8 a, ppo_m32x8 b) { /* a and not b */
    return _mm256_andnot_ps(b, a);
}
PPO_INLINE ppo_m32x8 ppo_m32x8_or(ppo_m32x8 a, ppo_m32x8 b) { return _mm256_or_ps(a, b); }
PPO_INLINE ppo_m32x8 ppo_m32x8_from_bytes(const uint8_t* p) { /* lane i: p[i] != 0 */
    int64_t bytes;
    memcpy(&bytes, p, 8);
    __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(wide, _mm256_setzero_si256()));
}
PPO_INLINE ppo_m32x8 ppo_m32x8_first(ptrdiff_t count) { /* lane i: i < count */
    __m256i bound = _mm256_set1_epi32((int32_t)(count < 0 ? 0 : count < 8 ? count : 8));
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(bound, lanes));
}

PPO_INLINE ppo_c32x8 ppo_c32x8_zero(void) { return _mm256_setzero_si256(); }
PPO_INLINE ppo_c32x8 ppo_c32x8_add(ppo_c32x8 counts, ppo_m32x8 m) { /* a true lane is -1 */
    return _mm256_sub_epi32(counts, _mm256_castps_si256(m));
}
PPO_INLINE int64_t ppo_c32x8_total(ppo_c32x8 counts) {
    int32_t lanes[8];
    memcpy(lanes, &counts, sizeof lanes);
    int64_t total = 0;
    for (int lane = 0; lane < 8; lane++) total += lanes[lane];
    return total;
}

#endif

/* exp's value where its argument is not finite: NaN, inf and -inf give NaN, inf and 0 (as the
 * twins' _exact_where_nonfinite: the saturation below is for finite arguments only). */
PPO_INLINE __m256 ppo_exact_where_nonfinite_ps(__m256 x, __m256 y) {
    __m256 is_low = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), is_low);
    y = _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
PPO_INLINE __m256d ppo_exact_where_nonfinite_pd(__m256d x, __m256d y) {
    __m256d is_low = _mm256_cmp_pd(x, _mm256_set1_pd(-INFINITY), _CMP_EQ_OQ);
    y = _mm256_blendv_pd(y, _mm256_setzero_pd(), is_low);
    y = _mm256_blendv_pd(y, x, _mm256_cmp_pd(x, _mm256_set1_pd(INFINITY), _CMP_EQ_OQ));
    return _mm256_blendv_pd(y, x, _mm256_cmp_pd(x, x, _CMP_UNORD_Q));
}

PPO_INLINE ppo_f32x8 ppo_f32x8_exp(ppo_f32x8 argument) {
    ppo_f32x8 x = argument;
    const __m256 shift = _mm256_set1_ps(PPO_EXP32_SHIFT);
    const __m256 low = _mm256_set1_ps(PPO_EXP32_LOW), high = _mm256_set1_ps(PPO_EXP32_HIGH);
    x = _mm256_min_ps(high, _mm256_max_ps(low, x));
    __m256 shifted = _mm256_fmadd_ps(x, _mm256_set1_ps(PPO_EXP32_LOG2E), shift);
    __m256 n = _mm256_sub_ps(shifted, shift);
    /* fma(-n, ., x) with -n a sign flip, not fnmadd: a NaN keeps the twin's sign */
    __m256 negative_n = _mm256_xor_ps(n, _mm256_set1_ps(-0.0f));
    __m256 r = _mm256_fmadd_ps(negative_n, _mm256_set1_ps(PPO_EXP32_LN2_HIGH), x);
    r = _mm256_fmadd_ps(negative_n, _mm256_set1_ps(PPO_EXP32_LN2_LOW), r);
    __m256 p = _mm256_set1_ps(ppo_exp32_polynomial[0]);
    for (int k = 1; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ppo_exp32_polynomial[k]));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i n_bits = _mm256_sub_epi32(_mm256_castps_si256(shifted), _mm256_castps_si256(shift));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(n_bits, _mm256_set1_epi32(127)), 23);
    return ppo_exact_where_nonfinite_ps(argument, _mm256_mul_ps(p, _mm256_castsi256_ps(power)));
}

/* log's value where its argument is 0, inf, NaN or negative, as ppo_log32 and ppo_log64 (log.h):
 * -inf (either zero), inf, NaN (the argument's own) and NaN. */
PPO_INLINE __m256 ppo_log_special_ps(__m256 x, __m256 y) {
    y = _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(-INFINITY), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ));
    y = _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_ps(y, _mm256_set1_ps(NAN), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
PPO_INLINE __m256d ppo_log_special_pd(__m256d x, __m256d y) {
    y = _mm256_blendv_pd(y, x, _mm256_cmp_pd(x, _mm256_set1_pd(INFINITY), _CMP_EQ_OQ));
    y = _mm256_blendv_pd(y, _mm256_set1_pd(-INFINITY), _mm256_cmp_pd(x, _mm256_setzero_pd(), _CMP_EQ_OQ));
    y = _mm256_blendv_pd(y, x, _mm256_cmp_pd(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_pd(y, _mm256_set1_pd(NAN), _mm256_cmp_pd(x, _mm256_setzero_pd(), _CMP_LT_OQ));
}

/* The twin of ppo_log32 (log.h), operation for operation: integer steps in int32 lanes (the
 * unsigned wrap of its bits is the lanes' two's complement), no fused multiply-add but the
 * series'. */
PPO_INLINE ppo_f32x8 ppo_f32x8_log(ppo_f32x8 x) {
    __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(PPO_LOG32_TINY), _CMP_LT_OQ);
    __m256 scaled = _mm256_blendv_ps(x, _mm256_mul_ps(x, _mm256_set1_ps(PPO_LOG32_SCALE)), tiny);
    __m256i bits = _mm256_add_epi32(_mm256_castps_si256(scaled),
                                    _mm256_set1_epi32((int32_t)PPO_LOG32_OFFSET));
    __m256i k = _mm256_sub_epi32(_mm256_srli_epi32(bits, PPO_LOG32_SHIFT),
                                 _mm256_set1_epi32(PPO_LOG32_BIAS));
    k = _mm256_sub_epi32(
        k, _mm256_and_si256(_mm256_castps_si256(tiny), _mm256_set1_epi32(PPO_LOG32_SCALE_BITS)));
    __m256i m_bits = _mm256_add_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(PPO_LOG32_MANTISSA)),
                                      _mm256_set1_epi32((int32_t)PPO_LOG32_SQRT_HALF));
    __m256 f = _mm256_sub_ps(_mm256_castsi256_ps(m_bits), _mm256_set1_ps(1.0f));
    __m256 half_square = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), f), f);
    __m256 s = _mm256_div_ps(f, _mm256_add_ps(_mm256_set1_ps(2.0f), f));
    __m256 z = _mm256_mul_ps(s, s);
    __m256 r = _mm256_set1_ps(ppo_log32_series[0]);
    for (int j = 1; j < 4; j++) r = _mm256_fmadd_ps(r, z, _mm256_set1_ps(ppo_log32_series[j]));
    r = _mm256_mul_ps(r, z);
    __m256 n = _mm256_cvtepi32_ps(k);
    __m256 inner = _mm256_add_ps(_mm256_mul_ps(s, _mm256_add_ps(half_square, r)),
                                 _mm256_mul_ps(n, _mm256_set1_ps(PPO_EXP32_LN2_LOW)));
    __m256 y = _mm256_sub_ps(_mm256_mul_ps(n, _mm256_set1_ps(PPO_EXP32_LN2_HIGH)),
                             _mm256_sub_ps(_mm256_sub_ps(half_square, inner), f));
    return ppo_log_special_ps(x, y);
}

/* ppo_log64's steps on four float64 lanes, as ppo_f32x8_log's on eight float32 ones. Its k is
 * converted to float64 exactly through the bits of 2^52 + 2^51 + k (AVX2 has no int64 -> float64
 * conversion; |k| < 2^12 here). */
PPO_INLINE __m256d ppo_log64_pd(__m256d x) {
    __m256d tiny = _mm256_cmp_pd(x, _mm256_set1_pd(PPO_LOG64_TINY), _CMP_LT_OQ);
    __m256d scaled = _mm256_blendv_pd(x, _mm256_mul_pd(x, _mm256_set1_pd(PPO_LOG64_SCALE)), tiny);
    __m256i bits = _mm256_add_epi64(_mm256_castpd_si256(scaled),
                                    _mm256_set1_epi64x((int64_t)PPO_LOG64_OFFSET));
    __m256i k = _mm256_sub_epi64(_mm256_srli_epi64(bits, PPO_LOG64_SHIFT),
                                 _mm256_set1_epi64x(PPO_LOG64_BIAS));
    k = _mm256_sub_epi64(k, _mm256_and_si256(_mm256_castpd_si256(tiny),
                                             _mm256_set1_epi64x(PPO_LOG64_SCALE_BITS)));
    __m256i m_bits =
        _mm256_add_epi64(_mm256_and_si256(bits, _mm256_set1_epi64x((int64_t)PPO_LOG64_MANTISSA)),
                         _mm256_set1_epi64x((int64_t)PPO_LOG64_SQRT_HALF));
    __m256d f = _mm256_sub_pd(_mm256_castsi256_pd(m_bits), _mm256_set1_pd(1.0));
    __m256d half_square = _mm256_mul_pd(_mm256_mul_pd(_mm256_set1_pd(0.5), f), f);
    __m256d s = _mm256_div_pd(f, _mm256_add_pd(_mm256_set1_pd(2.0), f));
    __m256d z = _mm256_mul_pd(s, s);
    __m256d r = _mm256_set1_pd(ppo_log64_series[0]);
    for (int j = 1; j < 10; j++) r = _mm256_fmadd_pd(r, z, _mm256_set1_pd(ppo_log64_series[j]));
    r = _mm256_mul_pd(r, z);
    const __m256d magic = _mm256_set1_pd(6755399441055744.0); /* 2^52 + 2^51 */
    __m256d n = _mm256_sub_pd(
        _mm256_castsi256_pd(_mm256_add_epi64(k, _mm256_castpd_si256(magic))), magic);
    __m256d inner = _mm256_add_pd(_mm256_mul_pd(s, _mm256_add_pd(half_square, r)),
                                  _mm256_mul_pd(n, _mm256_set1_pd(PPO_EXP64_LN2_LOW)));
    __m256d y = _mm256_sub_pd(_mm256_mul_pd(n, _mm256_set1_pd(PPO_EXP64_LN2_HIGH)),
                              _mm256_sub_pd(_mm256_sub_pd(half_square, inner), f));
    return ppo_log_special_pd(x, y);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* -- float64 on AVX-512F and DQ (setup.py's _avx512 build): eight lanes in one register, a mask
 * in a mask register (__mmask8, bit i for lane i), counts as the popcount of each mask. The
 * operations are those of the AVX2 block below, one instruction for its two. */
typedef __m512d ppo_f64x8;
typedef __mmask8 ppo_m64x8;
typedef int64_t ppo_c64x8;

PPO_INLINE ppo_f64x8 ppo_f64x8_splat(double x) { return _mm512_set1_pd(x); }
PPO_INLINE ppo_f64x8 ppo_f64x8_load(const double* p) { return _mm512_loadu_pd(p); }
PPO_INLINE void ppo_f64x8_store(double* p, ppo_f64x8 x) { _mm512_storeu_pd(p, x); }
PPO_INLINE ppo_f64x8 ppo_f64x8_load_first(const double* p, ptrdiff_t count) {
    return _mm512_maskz_loadu_pd((__mmask8)((1u << count) - 1u), p);
}
PPO_INLINE ppo_f64x8 ppo_f64x8_add(ppo_f64x8 a, ppo_f64x8 b) { return _mm512_add_pd(a, b); }
PPO_INLINE ppo_f64x8 ppo_f64x8_sub(ppo_f64x8 a, ppo_f64x8 b) { return _mm512_sub_pd(a, b); }
PPO_INLINE ppo_f64x8 ppo_f64x8_mul(ppo_f64x8 a, ppo_f64x8 b) { return _mm512_mul_pd(a, b); }
PPO_INLINE ppo_f64x8 ppo_f64x8_fma(ppo_f64x8 a, ppo_f64x8 b, ppo_f64x8 c) { /* a * b + c */
    return _mm512_fmadd_pd(a, b, c);
}
PPO_INLINE ppo_f64x8 ppo_f64x8_div(ppo_f64x8 a, ppo_f64x8 b) { return _mm512_div_pd(a, b); }
PPO_INLINE ppo_f64x8 ppo_f64x8_max(ppo_f64x8 a, ppo_f64x8 b) { return _mm512_max_pd(a, b); }
PPO_INLINE ppo_f64x8 ppo_f64x8_min(ppo_f64x8 a, ppo_f64x8 b) { return _mm512_min_pd(a, b); }
PPO_INLINE ppo_m64x8 ppo_f64x8_eq(ppo_f64x8 a, ppo_f64x8 b) {
    return _mm512_cmp_pd_mask(a, b, _CMP_EQ_OQ);
}
PPO_INLINE ppo_m64x8 ppo_f64x8_lt(ppo_f64x8 a, ppo_f64x8 b) {
    return _mm512_cmp_pd_mask(a, b, _CMP_LT_OQ);
}
PPO_INLINE ppo_m64x8 ppo_f64x8_gt(ppo_f64x8 a, ppo_f64x8 b) {
    return _mm512_cmp_pd_mask(a, b, _CMP_GT_OQ);
}
PPO_INLINE ppo_m64x8 ppo_f64x8_le(ppo_f64x8 a, ppo_f64x8 b) {
    return _mm512_cmp_pd_mask(a, b, _CMP_LE_OQ);
}
PPO_INLINE ppo_f64x8 ppo_f64x8_select(ppo_m64x8 m, ppo_f64x8 a, ppo_f64x8 b) {
    return _mm512_mask_blend_pd(m, b, a); /* a where m is set */
}
PPO_INLINE ppo_f64x8 ppo_f64x8_negative(ppo_f64x8 x) { /* flips the sign bit, as -x does */
    return _mm512_xor_pd(x, _mm512_set1_pd(-0.0));
}
PPO_INLINE int ppo_m64x8_any(ppo_m64x8 m) { return m != 0; }
PPO_INLINE ppo_f64x8 ppo_f64x8_abs(ppo_f64x8 x) { /* clears the sign bit, as fabs does */
    return _mm512_andnot_pd(_mm512_set1_pd(-0.0), x);
}

PPO_INLINE ppo_f64x8 ppo_f32x8_to_f64(ppo_f32x8 x) { return _mm512_cvtps_pd(x); }
/* float64 of x where m, +0 elsewhere: one zero-masked conversion (see PPO_TO_F64_WHERE) */
#define PPO_TO_F64_WHERE 1
PPO_INLINE ppo_f64x8 ppo_f32x8_to_f64_where(ppo_m32x8 m, ppo_f32x8 x) {
    return _mm512_maskz_cvtps_pd(m, x);
}
PPO_INLINE ppo_f64x8 ppo_f64x8_to_f64_where(ppo_m64x8 m, ppo_f64x8 x) {
    return _mm512_maskz_mov_pd(m, x);
}
PPO_INLINE ppo_f32x8 ppo_f32x8_from_f64(ppo_f64x8 x) { return _mm512_cvtpd_ps(x); }

PPO_INLINE ppo_m64x8 ppo_m64x8_all(void) { return (ppo_m64x8)0xFF; }
PPO_INLINE ppo_m64x8 ppo_m64x8_and(ppo_m64x8 a, ppo_m64x8 b) { return (ppo_m64x8)(a & b); }
PPO_INLINE ppo_m64x8 ppo_m64x8_and_not(ppo_m64x8 a, ppo_m64x8 b) { /* a and not b */
    return (ppo_m64x8)(a & ~b);
}
PPO_INLINE ppo_m64x8 ppo_m64x8_or(ppo_m64x8 a, ppo_m64x8 b) { return (ppo_m64x8)(a | b); }
PPO_INLINE ppo_m64x8 ppo_m64x8_from_bytes(const uint8_t* p) { /* lane i: p[i] != 0 */
    int64_t bytes;
    memcpy(&bytes, p, 8);
#if defined(__AVX512BW__) && defined(__AVX512VL__) /* one byte test, not a 512-bit widening */
    __m128i narrow = _mm_cvtsi64_si128(bytes);
    return (ppo_m64x8)_mm_test_epi8_mask(narrow, narrow);
#else
    __m512i wide = _mm512_cvtepu8_epi64(_mm_cvtsi64_si128(bytes));
    return _mm512_test_epi64_mask(wide, wide);
#endif
}
PPO_INLINE ppo_m64x8 ppo_m64x8_first(ptrdiff_t count) { /* lane i: i < count */
    return (ppo_m64x8)((1u << (count < 0 ? 0 : count < 8 ? count : 8)) - 1u);
}

PPO_INLINE ppo_c64x8 ppo_c64x8_zero(void) { return 0; }
PPO_INLINE ppo_c64x8 ppo_c64x8_add(ppo_c64x8 counts, ppo_m64x8 m) {
    return counts + __builtin_popcount((unsigned)m);
}
PPO_INLINE int64_t ppo_c64x8_total(ppo_c64x8 counts) { return counts; }

/* Lanes moved down (lane j takes lane j + k; GAE's scan, rows_gae.h): one valignq each. */
#define PPO_F64X8_SHIFTS 1
PPO_INLINE ppo_f64x8 ppo_f64x8_down1_fill(ppo_f64x8 x, double last) { /* lane 7: last */
    return _mm512_castsi512_pd(
        _mm512_alignr_epi64(_mm512_castpd_si512(_mm512_set1_pd(last)), _mm512_castpd_si512(x), 1));
}
PPO_INLINE ppo_f64x8 ppo_f64x8_down2(ppo_f64x8 x) { /* lanes 6 and 7: 0 */
    return _mm512_castsi512_pd(
        _mm512_alignr_epi64(_mm512_setzero_si512(), _mm512_castpd_si512(x), 2));
}
PPO_INLINE ppo_f64x8 ppo_f64x8_down4(ppo_f64x8 x) { /* lanes 4 to 7: 0 */
    return _mm512_castsi512_pd(
        _mm512_alignr_epi64(_mm512_setzero_si512(), _mm512_castpd_si512(x), 4));
}
PPO_INLINE double ppo_f64x8_lane0(ppo_f64x8 x) { return _mm512_cvtsd_f64(x); }

/* The AVX-512 exps (float64 here, float32 below) are exp.h's steps with three done in one
 * instruction each, the same bits (every float32 argument and 1.07e9 float64 ones checked
 * against the former steps: CHANGELOG 0.8.39): the saturation min(high, max(low, x)) with the
 * bounds given, so that the losses' clip to [-clamp, clamp] and the saturation are one pair
 * (ppo_clipped_exp16); 2^n p(r) as vscalefpd (p times an exact power of 2, rounded once, as
 * p * power is), not from the exponent's bits; and exp's value at a non-finite argument (NaN,
 * inf and -inf give NaN, inf and 0) as vfixupimmpd of the argument's class, by `table`
 * (PPO_EXP_FIXUP_*). The NaN an exp gives is the argument's own, so -n may be fnmadd's. The
 * clipped surrogate's exp pre-pass alone, float32 (32, 2048) rows in the cache, one thread, AMD
 * EPYC: 0.44 ns a token before; the whole kernel there 0.91 -> 0.85 ns by the fixup alone. */
#define PPO_EXP_FIXUP_UNCLAMPED 0x00180011 /* by class: QNaN, SNaN -> x; -inf -> +0; +inf -> x */
#define PPO_EXP_FIXUP_CLAMPED 0x00000011   /* QNaN, SNaN -> x: a finite clamp leaves no inf */
PPO_INLINE __m512d ppo_exp64_bounded_pd8(__m512d x, __m512d low, __m512d high, __m512i table) {
    const __m512d shift = _mm512_set1_pd(PPO_EXP64_SHIFT);
    __m512d bounded = _mm512_min_pd(high, _mm512_max_pd(low, x));
    __m512d shifted = _mm512_fmadd_pd(bounded, _mm512_set1_pd(PPO_EXP64_LOG2E), shift);
    __m512d n = _mm512_sub_pd(shifted, shift);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(PPO_EXP64_LN2_HIGH), bounded);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(PPO_EXP64_LN2_LOW), r);
    __m512d p = _mm512_set1_pd(ppo_exp64_polynomial[0]);
    for (int k = 1; k < 13; k++) {
        p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(ppo_exp64_polynomial[k]));
    }
    return _mm512_fixupimm_pd(_mm512_scalef_pd(p, n), x, table, 0);
}
PPO_INLINE ppo_f64x8 ppo_f64x8_exp(ppo_f64x8 argument) {
    return ppo_exp64_bounded_pd8(argument, _mm512_set1_pd(PPO_EXP64_LOW),
                                 _mm512_set1_pd(PPO_EXP64_HIGH),
                                 _mm512_set1_epi64(PPO_EXP_FIXUP_UNCLAMPED));
}

/* The twin of ppo_log64 (log.h), as ppo_log64_pd above on eight lanes; k converts exactly. */
PPO_INLINE ppo_f64x8 ppo_f64x8_log(ppo_f64x8 x) {
    __mmask8 tiny = _mm512_cmp_pd_mask(x, _mm512_set1_pd(PPO_LOG64_TINY), _CMP_LT_OQ);
    __m512d scaled = _mm512_mask_blend_pd(tiny, x, _mm512_mul_pd(x, _mm512_set1_pd(PPO_LOG64_SCALE)));
    __m512i bits = _mm512_add_epi64(_mm512_castpd_si512(scaled),
                                    _mm512_set1_epi64((int64_t)PPO_LOG64_OFFSET));
    __m512i k = _mm512_sub_epi64(_mm512_srli_epi64(bits, PPO_LOG64_SHIFT),
                                 _mm512_set1_epi64(PPO_LOG64_BIAS));
    k = _mm512_mask_sub_epi64(k, tiny, k, _mm512_set1_epi64(PPO_LOG64_SCALE_BITS));
    __m512i m_bits =
        _mm512_add_epi64(_mm512_and_si512(bits, _mm512_set1_epi64((int64_t)PPO_LOG64_MANTISSA)),
                         _mm512_set1_epi64((int64_t)PPO_LOG64_SQRT_HALF));
    __m512d f = _mm512_sub_pd(_mm512_castsi512_pd(m_bits), _mm512_set1_pd(1.0));
    __m512d half_square = _mm512_mul_pd(_mm512_mul_pd(_mm512_set1_pd(0.5), f), f);
    __m512d s = _mm512_div_pd(f, _mm512_add_pd(_mm512_set1_pd(2.0), f));
    __m512d z = _mm512_mul_pd(s, s);
    __m512d r = _mm512_set1_pd(ppo_log64_series[0]);
    for (int j = 1; j < 10; j++) r = _mm512_fmadd_pd(r, z, _mm512_set1_pd(ppo_log64_series[j]));
    r = _mm512_mul_pd(r, z);
    __m512d n = _mm512_cvtepi64_pd(k);
    __m512d inner = _mm512_add_pd(_mm512_mul_pd(s, _mm512_add_pd(half_square, r)),
                                  _mm512_mul_pd(n, _mm512_set1_pd(PPO_EXP64_LN2_LOW)));
    __m512d y = _mm512_sub_pd(_mm512_mul_pd(n, _mm512_set1_pd(PPO_EXP64_LN2_HIGH)),
                              _mm512_sub_pd(_mm512_sub_pd(half_square, inner), f));
    /* log's value where the argument is 0, inf, NaN or negative, as ppo_log_special_pd */
    y = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, _mm512_set1_pd(INFINITY), _CMP_EQ_OQ), y, x);
    y = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_EQ_OQ), y,
                             _mm512_set1_pd(-INFINITY));
    y = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, x, _CMP_UNORD_Q), y, x);
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_LT_OQ), y,
                                _mm512_set1_pd(NAN));
}

/* -- float32 exp on sixteen lanes, for two blocks of eight at once (the _pair operations): the
 * float32 lanes stay AVX2's eight, but exp is a long chain of dependent steps, and one AVX-512
 * instruction for two blocks halves it (the ratios' and DPPO-TV's exps). Operation for operation
 * ppo_f32x8_exp above, so the bits are its. */
#define PPO_F32X8_PAIRS 1

PPO_INLINE __m512 ppo_exp32_bounded_ps16(__m512 x, __m512 low, __m512 high, __m512i table) {
    const __m512 shift = _mm512_set1_ps(PPO_EXP32_SHIFT);
    __m512 bounded = _mm512_min_ps(high, _mm512_max_ps(low, x));
    __m512 shifted = _mm512_fmadd_ps(bounded, _mm512_set1_ps(PPO_EXP32_LOG2E), shift);
    __m512 n = _mm512_sub_ps(shifted, shift);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(PPO_EXP32_LN2_HIGH), bounded);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(PPO_EXP32_LN2_LOW), r);
    __m512 p = _mm512_set1_ps(ppo_exp32_polynomial[0]);
    for (int k = 1; k < 6; k++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ppo_exp32_polynomial[k]));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_fixupimm_ps(_mm512_scalef_ps(p, n), x, table, 0);
}
PPO_INLINE __m512 ppo_exp32_ps16(__m512 argument) {
    return ppo_exp32_bounded_ps16(argument, _mm512_set1_ps(PPO_EXP32_LOW),
                                  _mm512_set1_ps(PPO_EXP32_HIGH),
                                  _mm512_set1_epi32(PPO_EXP_FIXUP_UNCLAMPED));
}

PPO_INLINE __m512 ppo_ps16_join(ppo_f32x8 a, ppo_f32x8 b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}
PPO_INLINE void ppo_f32x8_exp_pair(ppo_f32x8 a, ppo_f32x8 b, ppo_f32x8* exp_a, ppo_f32x8* exp_b) {
    __m512 both = ppo_exp32_ps16(ppo_ps16_join(a, b));
    *exp_a = _mm512_castps512_ps256(both);
    *exp_b = _mm512_extractf32x8_ps(both, 1);
}

/* The losses' ratios exp(clip(a - b, -clamp, clamp)) of 16 tokens (ppo_clipped_exp16), for a
 * clamp >= 0 (inf: none): the clip and exp's saturation in one pair of bounds, and the fixup by
 * the class of a - b (NaN there is NaN clipped, bit for bit; +-inf reach exp only without a
 * clamp). A clamp < 0 or NaN, which the public functions refuse, takes exp.h's steps as they
 * are. */
#define PPO_CLIPPED_EXP16 1
typedef struct {
    __m512 low32, high32;
    __m512d low64, high64;
    __m512i table32, table64;
    ppo_f32x8 negative_clamp32, clamp32;
    ppo_f64x8 negative_clamp64, clamp64;
    int general;
} ppo_clipped_exp;
PPO_INLINE ppo_clipped_exp ppo_clipped_exp_of(double clamp) {
    ppo_clipped_exp e;
    float clamp32 = (float)clamp;
    e.low32 = _mm512_set1_ps(-clamp32 > PPO_EXP32_LOW ? -clamp32 : PPO_EXP32_LOW);
    e.high32 = _mm512_set1_ps(clamp32 < PPO_EXP32_HIGH ? clamp32 : PPO_EXP32_HIGH);
    e.low64 = _mm512_set1_pd(-clamp > PPO_EXP64_LOW ? -clamp : PPO_EXP64_LOW);
    e.high64 = _mm512_set1_pd(clamp < PPO_EXP64_HIGH ? clamp : PPO_EXP64_HIGH);
    e.table32 =
        _mm512_set1_epi32(clamp < INFINITY ? PPO_EXP_FIXUP_CLAMPED : PPO_EXP_FIXUP_UNCLAMPED);
    e.table64 =
        _mm512_set1_epi64(clamp < INFINITY ? PPO_EXP_FIXUP_CLAMPED : PPO_EXP_FIXUP_UNCLAMPED);
    e.negative_clamp32 = _mm256_set1_ps(-clamp32);
    e.clamp32 = _mm256_set1_ps(clamp32);
    e.negative_clamp64 = _mm512_set1_pd(-clamp);
    e.clamp64 = _mm512_set1_pd(clamp);
    e.general = !(clamp >= 0);
    return e;
}
PPO_INLINE void ppo_f32x8_clipped_exp16(
    const float* a, const float* b, const ppo_clipped_exp* e, float* out) {
    if (e->general) {
        for (int k = 0; k < 16; k += 8) {
            ppo_f32x8 x = _mm256_sub_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k));
            x = _mm256_min_ps(e->clamp32, _mm256_max_ps(e->negative_clamp32, x));
            _mm256_storeu_ps(out + k, ppo_f32x8_exp(x));
        }
        return;
    }
    __m512 raw = _mm512_sub_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    _mm512_storeu_ps(out, ppo_exp32_bounded_ps16(raw, e->low32, e->high32, e->table32));
}
PPO_INLINE void ppo_f64x8_clipped_exp16(
    const double* a, const double* b, const ppo_clipped_exp* e, double* out) {
    for (int k = 0; k < 16; k += 8) {
        __m512d raw = _mm512_sub_pd(_mm512_loadu_pd(a + k), _mm512_loadu_pd(b + k));
        if (e->general) {
            raw = _mm512_min_pd(e->clamp64, _mm512_max_pd(e->negative_clamp64, raw));
            _mm512_storeu_pd(out + k, ppo_f64x8_exp(raw));
        } else {
            _mm512_storeu_pd(out + k, ppo_exp64_bounded_pd8(raw, e->low64, e->high64, e->table64));
        }
    }
}

#else
/* -- float64 on AVX2: two registers of four lanes ---------------------------------------------- */
typedef struct {
    __m256d low, high;
} ppo_f64x8;
typedef ppo_f64x8 ppo_m64x8;
typedef __m256i ppo_c64x8; /* int64 per lane */

PPO_INLINE ppo_f64x8 ppo_f64x8_splat(double x) {
    ppo_f64x8 r = {_mm256_set1_pd(x), _mm256_set1_pd(x)};
    return r;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_load(const double* p) {
    ppo_f64x8 r = {_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4)};
    return r;
}
PPO_INLINE void ppo_f64x8_store(double* p, ppo_f64x8 x) {
    _mm256_storeu_pd(p, x.low);
    _mm256_storeu_pd(p + 4, x.high);
}
PPO_INLINE ppo_f64x8 ppo_f64x8_load_first(const double* p, ptrdiff_t count) {
    __m256i n = _mm256_set1_epi64x((long long)count);
    ppo_f64x8 r = {
        _mm256_maskload_pd(p, _mm256_cmpgt_epi64(n, _mm256_setr_epi64x(0, 1, 2, 3))),
        _mm256_maskload_pd(p + 4, _mm256_cmpgt_epi64(n, _mm256_setr_epi64x(4, 5, 6, 7)))};
    return r;
}
#define PPO_F64X8_BOTH_HALVES(result_type, name, intrinsic)               \
    PPO_INLINE result_type ppo_f64x8_##name(ppo_f64x8 a, ppo_f64x8 b) {   \
        result_type r = {intrinsic(a.low, b.low), intrinsic(a.high, b.high)}; \
        return r;                                                         \
    }
#define PPO_CMP_EQ(a, b) _mm256_cmp_pd(a, b, _CMP_EQ_OQ)
#define PPO_CMP_LT(a, b) _mm256_cmp_pd(a, b, _CMP_LT_OQ)
#define PPO_CMP_GT(a, b) _mm256_cmp_pd(a, b, _CMP_GT_OQ)
#define PPO_CMP_LE(a, b) _mm256_cmp_pd(a, b, _CMP_LE_OQ)
PPO_F64X8_BOTH_HALVES(ppo_f64x8, add, _mm256_add_pd)
PPO_F64X8_BOTH_HALVES(ppo_f64x8, sub, _mm256_sub_pd)
PPO_F64X8_BOTH_HALVES(ppo_f64x8, mul, _mm256_mul_pd)
PPO_INLINE ppo_f64x8 ppo_f64x8_fma(ppo_f64x8 a, ppo_f64x8 b, ppo_f64x8 c) { /* a * b + c */
    ppo_f64x8 r = {_mm256_fmadd_pd(a.low, b.low, c.low), _mm256_fmadd_pd(a.high, b.high, c.high)};
    return r;
}
PPO_F64X8_BOTH_HALVES(ppo_f64x8, div, _mm256_div_pd)
PPO_F64X8_BOTH_HALVES(ppo_f64x8, max, _mm256_max_pd)
PPO_F64X8_BOTH_HALVES(ppo_f64x8, min, _mm256_min_pd)
PPO_F64X8_BOTH_HALVES(ppo_m64x8, eq, PPO_CMP_EQ)
PPO_F64X8_BOTH_HALVES(ppo_m64x8, lt, PPO_CMP_LT)
PPO_F64X8_BOTH_HALVES(ppo_m64x8, gt, PPO_CMP_GT)
PPO_F64X8_BOTH_HALVES(ppo_m64x8, le, PPO_CMP_LE)
PPO_INLINE ppo_f64x8 ppo_f64x8_select(ppo_m64x8 m, ppo_f64x8 a, ppo_f64x8 b) {
    ppo_f64x8 r = {_mm256_blendv_pd(b.low, a.low, m.low), _mm256_blendv_pd(b.high, a.high, m.high)};
    return r;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_negative(ppo_f64x8 x) { /* flips the sign bit, as -x does */
    __m256d sign = _mm256_set1_pd(-0.0);
    ppo_f64x8 r = {_mm256_xor_pd(x.low, sign), _mm256_xor_pd(x.high, sign)};
    return r;
}
PPO_INLINE int ppo_m64x8_any(ppo_m64x8 m) { /* whether any lane is true */
    return _mm256_movemask_pd(_mm256_or_pd(m.low, m.high)) != 0;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_abs(ppo_f64x8 x) { /* clears the sign bit, as fabs does */
    __m256d sign = _mm256_set1_pd(-0.0);
    ppo_f64x8 r = {_mm256_andnot_pd(sign, x.low), _mm256_andnot_pd(sign, x.high)};
    return r;
}

PPO_INLINE ppo_f64x8 ppo_f32x8_to_f64(ppo_f32x8 x) { /* lanes 0-3 to the low half */
    ppo_f64x8 r = {_mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                   _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))};
    return r;
}
PPO_INLINE ppo_f32x8 ppo_f32x8_from_f64(ppo_f64x8 x) {
    return _mm256_set_m128(_mm256_cvtpd_ps(x.high), _mm256_cvtpd_ps(x.low));
}

PPO_INLINE ppo_m64x8 ppo_m64x8_all(void) {
    __m256d ones = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
    ppo_m64x8 r = {ones, ones};
    return r;
}
PPO_INLINE ppo_m64x8 ppo_m64x8_and(ppo_m64x8 a, ppo_m64x8 b) {
    ppo_m64x8 r = {_mm256_and_pd(a.low, b.low), _mm256_and_pd(a.high, b.high)};
    return r;
}
PPO_INLINE ppo_m64x8 ppo_m64x8_and_not(ppo_m64x8 a, ppo_m64x8 b) {
    ppo_m64x8 r = {_mm256_andnot_pd(b.low, a.low), _mm256_andnot_pd(b.high, a.high)};
    return r;
}
PPO_INLINE ppo_m64x8 ppo_m64x8_or(ppo_m64x8 a, ppo_m64x8 b) {
    ppo_m64x8 r = {_mm256_or_pd(a.low, b.low), _mm256_or_pd(a.high, b.high)};
    return r;
}
PPO_INLINE ppo_m64x8 ppo_m64x8_from_bytes(const uint8_t* p) {
    int32_t low, high;
    memcpy(&low, p, 4);
    memcpy(&high, p + 4, 4);
    __m256i zero = _mm256_setzero_si256();
    __m256i wide_low = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(low));
    __m256i wide_high = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(high));
    ppo_m64x8 r = {_mm256_castsi256_pd(_mm256_cmpgt_epi64(wide_low, zero)),
                   _mm256_castsi256_pd(_mm256_cmpgt_epi64(wide_high, zero))};
    return r;
}
PPO_INLINE ppo_m64x8 ppo_m64x8_first(ptrdiff_t count) {
    __m256i bound = _mm256_set1_epi64x(count < 0 ? 0 : count < 8 ? count : 8);
    ppo_m64x8 r = {_mm256_castsi256_pd(_mm256_cmpgt_epi64(bound, _mm256_setr_epi64x(0, 1, 2, 3))),
                   _mm256_castsi256_pd(_mm256_cmpgt_epi64(bound, _mm256_setr_epi64x(4, 5, 6, 7)))};
    return r;
}

PPO_INLINE ppo_c64x8 ppo_c64x8_zero(void) { return _mm256_setzero_si256(); }
PPO_INLINE ppo_c64x8 ppo_c64x8_add(ppo_c64x8 counts, ppo_m64x8 m) {
    counts = _mm256_sub_epi64(counts, _mm256_castpd_si256(m.low));
    return _mm256_sub_epi64(counts, _mm256_castpd_si256(m.high));
}
PPO_INLINE int64_t ppo_c64x8_total(ppo_c64x8 counts) {
    int64_t lanes[4];
    memcpy(lanes, &counts, sizeof lanes);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/* Lanes moved down (lane j takes lane j + k; GAE's scan, rows_gae.h), across the halves. */
#define PPO_F64X8_SHIFTS 1
PPO_INLINE ppo_f64x8 ppo_f64x8_down1_fill(ppo_f64x8 x, double last) { /* lane 7: last */
    __m256d middle = _mm256_permute2f128_pd(x.low, x.high, 0x21);             /* 2 3 4 5 */
    __m256d top = _mm256_permute2f128_pd(x.high, _mm256_set1_pd(last), 0x21); /* 6 7 l l */
    ppo_f64x8 r = {_mm256_shuffle_pd(x.low, middle, 0x5), _mm256_shuffle_pd(x.high, top, 0x5)};
    return r;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_down2(ppo_f64x8 x) { /* lanes 6 and 7: 0 */
    ppo_f64x8 r = {_mm256_permute2f128_pd(x.low, x.high, 0x21),
                   _mm256_permute2f128_pd(x.high, _mm256_setzero_pd(), 0x21)};
    return r;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_down4(ppo_f64x8 x) { /* lanes 4 to 7: 0 */
    ppo_f64x8 r = {x.high, _mm256_setzero_pd()};
    return r;
}
PPO_INLINE double ppo_f64x8_lane0(ppo_f64x8 x) { return _mm256_cvtsd_f64(x.low); }

/* The two halves step by step, so that their dependency chains interleave. */
PPO_INLINE ppo_f64x8 ppo_f64x8_exp(ppo_f64x8 x) {
    const __m256d shift = _mm256_set1_pd(PPO_EXP64_SHIFT), log2e = _mm256_set1_pd(PPO_EXP64_LOG2E);
    const __m256d low = _mm256_set1_pd(PPO_EXP64_LOW), high = _mm256_set1_pd(PPO_EXP64_HIGH);
    const __m256d ln2_high = _mm256_set1_pd(PPO_EXP64_LN2_HIGH);
    const __m256d ln2_low = _mm256_set1_pd(PPO_EXP64_LN2_LOW);
    const __m256i bias = _mm256_set1_epi64x(1023);
    __m256d x0 = _mm256_min_pd(high, _mm256_max_pd(low, x.low));
    __m256d x1 = _mm256_min_pd(high, _mm256_max_pd(low, x.high));
    __m256d shifted0 = _mm256_fmadd_pd(x0, log2e, shift);
    __m256d shifted1 = _mm256_fmadd_pd(x1, log2e, shift);
    __m256d n0 = _mm256_sub_pd(shifted0, shift), n1 = _mm256_sub_pd(shifted1, shift);
    /* fma(-n, ., x) with -n a sign flip, not fnmadd: a NaN keeps the twin's sign */
    const __m256d sign = _mm256_set1_pd(-0.0);
    __m256d negative_n0 = _mm256_xor_pd(n0, sign), negative_n1 = _mm256_xor_pd(n1, sign);
    __m256d r0 = _mm256_fmadd_pd(negative_n0, ln2_high, x0);
    __m256d r1 = _mm256_fmadd_pd(negative_n1, ln2_high, x1);
    r0 = _mm256_fmadd_pd(negative_n0, ln2_low, r0);
    r1 = _mm256_fmadd_pd(negative_n1, ln2_low, r1);
    __m256d p0 = _mm256_set1_pd(ppo_exp64_polynomial[0]), p1 = p0;
    for (int k = 1; k < 13; k++) {
        __m256d coefficient = _mm256_set1_pd(ppo_exp64_polynomial[k]);
        p0 = _mm256_fmadd_pd(p0, r0, coefficient);
        p1 = _mm256_fmadd_pd(p1, r1, coefficient);
    }
    __m256i n0_bits = _mm256_sub_epi64(_mm256_castpd_si256(shifted0), _mm256_castpd_si256(shift));
    __m256i n1_bits = _mm256_sub_epi64(_mm256_castpd_si256(shifted1), _mm256_castpd_si256(shift));
    __m256i power0 = _mm256_slli_epi64(_mm256_add_epi64(n0_bits, bias), 52);
    __m256i power1 = _mm256_slli_epi64(_mm256_add_epi64(n1_bits, bias), 52);
    ppo_f64x8 r = {
        ppo_exact_where_nonfinite_pd(x.low, _mm256_mul_pd(p0, _mm256_castsi256_pd(power0))),
        ppo_exact_where_nonfinite_pd(x.high, _mm256_mul_pd(p1, _mm256_castsi256_pd(power1)))};
    return r;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_log(ppo_f64x8 x) {
    ppo_f64x8 r = {ppo_log64_pd(x.low), ppo_log64_pd(x.high)};
    return r;
}
#endif /* AVX-512 */

#elif defined(__GNUC__) || defined(__clang__)
/* -- GCC and Clang elsewhere: generic 16-byte vectors (SSE2, NEON, ...) ------------------------ */
/* Two or four native vectors per lane type: generic vectors wider than the target's are lowered
 * lane by lane, comparisons and selects included. */

typedef float ppo_v4f __attribute__((vector_size(16)));
typedef int32_t ppo_v4i __attribute__((vector_size(16)));
typedef double ppo_v2d __attribute__((vector_size(16)));
typedef int64_t ppo_v2l __attribute__((vector_size(16)));
typedef struct {
    ppo_v4f a, b;
} ppo_f32x8;
typedef struct {
    ppo_v4i a, b; /* all ones or zero per lane */
} ppo_m32x8;
typedef ppo_m32x8 ppo_c32x8; /* int32 per lane: rows_loss.h totals them every chunk */
typedef struct {
    ppo_v2d a, b, c, d;
} ppo_f64x8;
typedef struct {
    ppo_v2l a, b, c, d;
} ppo_m64x8;
typedef ppo_m64x8 ppo_c64x8;

/* PPO_PARTS_<type>(F) applies F to the name of each part. */
#define PPO_PARTS_f32x8(F) F(a) F(b)
#define PPO_PARTS_f64x8(F) F(a) F(b) F(c) F(d)
#define PPO_PART_SPLAT(p) r.p = (__typeof__(r.p)){0} + x;
#define PPO_PART_ADD(p) a.p += b.p;
#define PPO_PART_SUB(p) a.p -= b.p;
#define PPO_PART_MUL(p) a.p *= b.p;
#define PPO_PART_DIV(p) a.p /= b.p;
#define PPO_PART_EQ(p) r.p = (__typeof__(r.p))(a.p == b.p);
#define PPO_PART_LT(p) r.p = (__typeof__(r.p))(a.p < b.p);
#define PPO_PART_GT(p) r.p = (__typeof__(r.p))(a.p > b.p);
#define PPO_PART_LE(p) r.p = (__typeof__(r.p))(a.p <= b.p);
#define PPO_PART_SELECT(p) \
    a.p = (__typeof__(a.p))((m.p & (__typeof__(m.p))a.p) | (~m.p & (__typeof__(m.p))b.p));
#define PPO_PART_ALL(p) r.p = ~(__typeof__(r.p)){0};
#define PPO_PART_AND(p) a.p &= b.p;
#define PPO_PART_AND_NOT(p) a.p &= ~b.p;
#define PPO_PART_OR(p) a.p |= b.p;
#define PPO_PART_ZERO(p) r.p = (__typeof__(r.p)){0};
#define PPO_PART_COUNT(p) counts.p -= m.p; /* a true lane is -1 */
#define PPO_PART_TOTAL(p) \
    for (int k = 0; k < (int)(sizeof counts.p / sizeof counts.p[0]); k++) total += counts.p[k];

#define PPO_GENERIC_LANES(name, real, mask)                                                 \
    PPO_INLINE ppo_##name ppo_##name##_splat(real x) {                                     \
        ppo_##name r;                                                                      \
        PPO_PARTS_##name(PPO_PART_SPLAT) return r;                                         \
    }                                                                                      \
    PPO_INLINE ppo_##name ppo_##name##_load(const real* p) {                               \
        ppo_##name r;                                                                      \
        memcpy(&r, p, sizeof r);                                                           \
        return r;                                                                          \
    }                                                                                      \
    PPO_INLINE void ppo_##name##_store(real* p, ppo_##name x) { memcpy(p, &x, sizeof x); } \
    PPO_INLINE ppo_##name ppo_##name##_load_first(const real* p, ptrdiff_t count) {        \
        real first[8] = {0};                                                               \
        memcpy(first, p, (size_t)count * sizeof(real));                                    \
        return ppo_##name##_load(first);                                                   \
    }                                                                                      \
    PPO_INLINE ppo_##name ppo_##name##_add(ppo_##name a, ppo_##name b) {                   \
        PPO_PARTS_##name(PPO_PART_ADD) return a;                                           \
    }                                                                                      \
    PPO_INLINE ppo_##name ppo_##name##_sub(ppo_##name a, ppo_##name b) {                   \
        PPO_PARTS_##name(PPO_PART_SUB) return a;                                           \
    }                                                                                      \
    PPO_INLINE ppo_##name ppo_##name##_mul(ppo_##name a, ppo_##name b) {                   \
        PPO_PARTS_##name(PPO_PART_MUL) return a;                                           \
    }                                                                                      \
    PPO_INLINE ppo_##name ppo_##name##_div(ppo_##name a, ppo_##name b) {                   \
        PPO_PARTS_##name(PPO_PART_DIV) return a;                                           \
    }                                                                                      \
    PPO_INLINE ppo_##mask ppo_##name##_eq(ppo_##name a, ppo_##name b) {                    \
        ppo_##mask r;                                                                      \
        PPO_PARTS_##name(PPO_PART_EQ) return r;                                            \
    }                                                                                      \
    PPO_INLINE ppo_##mask ppo_##name##_lt(ppo_##name a, ppo_##name b) {                    \
        ppo_##mask r;                                                                      \
        PPO_PARTS_##name(PPO_PART_LT) return r;                                            \
    }                                                                                      \
    PPO_INLINE ppo_##mask ppo_##name##_gt(ppo_##name a, ppo_##name b) {                    \
        ppo_##mask r;                                                                      \
        PPO_PARTS_##name(PPO_PART_GT) return r;                                            \
    }                                                                                      \
    PPO_INLINE ppo_##mask ppo_##name##_le(ppo_##name a, ppo_##name b) {                    \
        ppo_##mask r;                                                                      \
        PPO_PARTS_##name(PPO_PART_LE) return r;                                            \
    }                                                                                      \
    PPO_INLINE ppo_##name ppo_##name##_select(ppo_##mask m, ppo_##name a, ppo_##name b) {  \
        PPO_PARTS_##name(PPO_PART_SELECT) return a;                                        \
    }                                                                                      \
    PPO_INLINE ppo_##name ppo_##name##_max(ppo_##name a, ppo_##name b) {                   \
        return ppo_##name##_select(ppo_##name##_gt(a, b), a, b);                           \
    }                                                                                      \
    PPO_INLINE ppo_##name ppo_##name##_min(ppo_##name a, ppo_##name b) {                   \
        return ppo_##name##_select(ppo_##name##_lt(a, b), a, b);                           \
    }                                                                                      \
    PPO_INLINE ppo_##mask ppo_##mask##_all(void) {                                         \
        ppo_##mask r;                                                                      \
        PPO_PARTS_##name(PPO_PART_ALL) return r;                                           \
    }                                                                                      \
    PPO_INLINE ppo_##mask ppo_##mask##_and(ppo_##mask a, ppo_##mask b) {                   \
        PPO_PARTS_##name(PPO_PART_AND) return a;                                           \
    }                                                                                      \
    PPO_INLINE ppo_##mask ppo_##mask##_and_not(ppo_##mask a, ppo_##mask b) {               \
        PPO_PARTS_##name(PPO_PART_AND_NOT) return a;                                       \
    }                                                                                      \
    PPO_INLINE ppo_##mask ppo_##mask##_or(ppo_##mask a, ppo_##mask b) {                    \
        PPO_PARTS_##name(PPO_PART_OR) return a;                                            \
    }
PPO_GENERIC_LANES(f32x8, float, m32x8)
PPO_GENERIC_LANES(f64x8, double, m64x8)

/* Masks from bytes: compare the 8 bytes with 0, then widen each byte to its lane by interleaving
 * it with itself (punpcklbw and the like on SSE2, zip on NEON). */
typedef int8_t ppo_v16b __attribute__((vector_size(16)));
typedef int16_t ppo_v8s __attribute__((vector_size(16)));
#if defined(__clang__)
#define PPO_SHUFFLE(a, b, index_type, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PPO_SHUFFLE(a, b, index_type, ...) __builtin_shuffle(a, b, (index_type){__VA_ARGS__})
#endif
PPO_INLINE ppo_m32x8 ppo_m32x8_from_bytes(const uint8_t* p) {
    int64_t bytes;
    memcpy(&bytes, p, 8);
    ppo_v2l loaded = {bytes, 0};
    ppo_v16b zero = {0}, nonzero = (ppo_v16b)loaded != zero;
    ppo_v8s words = (ppo_v8s)PPO_SHUFFLE(
        nonzero, nonzero, ppo_v16b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    ppo_m32x8 r = {(ppo_v4i)PPO_SHUFFLE(words, words, ppo_v8s, 0, 8, 1, 9, 2, 10, 3, 11),
                   (ppo_v4i)PPO_SHUFFLE(words, words, ppo_v8s, 4, 12, 5, 13, 6, 14, 7, 15)};
    return r;
}
PPO_INLINE ppo_m64x8 ppo_m64x8_from_bytes(const uint8_t* p) {
    ppo_m32x8 m = ppo_m32x8_from_bytes(p);
    ppo_m64x8 r = {(ppo_v2l)PPO_SHUFFLE(m.a, m.a, ppo_v4i, 0, 4, 1, 5),
                   (ppo_v2l)PPO_SHUFFLE(m.a, m.a, ppo_v4i, 2, 6, 3, 7),
                   (ppo_v2l)PPO_SHUFFLE(m.b, m.b, ppo_v4i, 0, 4, 1, 5),
                   (ppo_v2l)PPO_SHUFFLE(m.b, m.b, ppo_v4i, 2, 6, 3, 7)};
    return r;
}
PPO_INLINE ppo_m32x8 ppo_m32x8_first(ptrdiff_t count) {
    int32_t bound = (int32_t)(count < 0 ? 0 : count < 8 ? count : 8);
    ppo_v4i low = {0, 1, 2, 3}, high = {4, 5, 6, 7};
    ppo_m32x8 r = {low < bound, high < bound};
    return r;
}
PPO_INLINE ppo_m64x8 ppo_m64x8_first(ptrdiff_t count) {
    int64_t bound = count < 0 ? 0 : count < 8 ? count : 8;
    ppo_v2l a = {0, 1}, b = {2, 3}, c = {4, 5}, d = {6, 7};
    ppo_m64x8 r = {(ppo_v2l)(a < bound), (ppo_v2l)(b < bound), (ppo_v2l)(c < bound),
                   (ppo_v2l)(d < bound)};
    return r;
}

#define PPO_GENERIC_COUNTS(name, mask, values)                                          \
    PPO_INLINE ppo_##name ppo_##name##_zero(void) {                                    \
        ppo_##name r;                                                                  \
        PPO_PARTS_##values(PPO_PART_ZERO) return r;                                    \
    }                                                                                  \
    PPO_INLINE ppo_##name ppo_##name##_add(ppo_##name counts, ppo_##mask m) {          \
        PPO_PARTS_##values(PPO_PART_COUNT) return counts;                              \
    }                                                                                  \
    PPO_INLINE int64_t ppo_##name##_total(ppo_##name counts) {                         \
        int64_t total = 0;                                                             \
        PPO_PARTS_##values(PPO_PART_TOTAL) return total;                               \
    }
PPO_GENERIC_COUNTS(c32x8, m32x8, f32x8)
PPO_GENERIC_COUNTS(c64x8, m64x8, f64x8)

PPO_INLINE ppo_f64x8 ppo_f64x8_negative(ppo_f64x8 x) {
    ppo_f64x8 r = {-x.a, -x.b, -x.c, -x.d};
    return r;
}
/* a * b + c, fused, lane by lane (generic vectors have no fused operation). */
#define PPO_FMA2(p) {fma(a.p[0], b.p[0], c.p[0]), fma(a.p[1], b.p[1], c.p[1])}
PPO_INLINE ppo_f64x8 ppo_f64x8_fma(ppo_f64x8 a, ppo_f64x8 b, ppo_f64x8 c) {
    ppo_f64x8 r = {PPO_FMA2(a), PPO_FMA2(b), PPO_FMA2(c), PPO_FMA2(d)};
    return r;
}
#undef PPO_FMA2
PPO_INLINE int ppo_m64x8_any(ppo_m64x8 m) {
    ppo_v2l either = (m.a | m.b) | (m.c | m.d);
    return (either[0] | either[1]) != 0;
}
#define PPO_PART_ABS(p) x.p = (ppo_v2d)((ppo_v2l)x.p & magnitude);
PPO_INLINE ppo_f64x8 ppo_f64x8_abs(ppo_f64x8 x) {
    const ppo_v2l magnitude = (ppo_v2l){0} + INT64_MAX;
    PPO_PARTS_f64x8(PPO_PART_ABS) return x;
}
#define PPO_PART_ABS32(p) x.p = (ppo_v4f)((ppo_v4i)x.p & magnitude);
PPO_INLINE ppo_f32x8 ppo_f32x8_abs(ppo_f32x8 x) {
    const ppo_v4i magnitude = (ppo_v4i){0} + INT32_MAX;
    PPO_PARTS_f32x8(PPO_PART_ABS32) return x;
}
#define PPO_PART_NEGATIVE32(p) x.p = -x.p;
PPO_INLINE ppo_f32x8 ppo_f32x8_negative(ppo_f32x8 x) {
    PPO_PARTS_f32x8(PPO_PART_NEGATIVE32) return x;
}
PPO_INLINE ppo_f64x8 ppo_f32x8_to_f64(ppo_f32x8 x) {
    ppo_f64x8 r = {{x.a[0], x.a[1]}, {x.a[2], x.a[3]}, {x.b[0], x.b[1]}, {x.b[2], x.b[3]}};
    return r;
}
PPO_INLINE ppo_f32x8 ppo_f32x8_from_f64(ppo_f64x8 x) {
    ppo_f32x8 r = {{(float)x.a[0], (float)x.a[1], (float)x.b[0], (float)x.b[1]},
                   {(float)x.c[0], (float)x.c[1], (float)x.d[0], (float)x.d[1]}};
    return r;
}

PPO_INLINE ppo_f32x8 ppo_f32x8_exp(ppo_f32x8 x) {
    float lanes[8];
    memcpy(lanes, &x, sizeof lanes);
    for (int lane = 0; lane < 8; lane++) lanes[lane] = ppo_exp32(lanes[lane]);
    memcpy(&x, lanes, sizeof lanes);
    return x;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_exp(ppo_f64x8 x) {
    double lanes[8];
    memcpy(lanes, &x, sizeof lanes);
    for (int lane = 0; lane < 8; lane++) lanes[lane] = ppo_exp64(lanes[lane]);
    memcpy(&x, lanes, sizeof lanes);
    return x;
}
PPO_INLINE ppo_f32x8 ppo_f32x8_log(ppo_f32x8 x) {
    float lanes[8];
    memcpy(lanes, &x, sizeof lanes);
    for (int lane = 0; lane < 8; lane++) lanes[lane] = ppo_log32(lanes[lane]);
    memcpy(&x, lanes, sizeof lanes);
    return x;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_log(ppo_f64x8 x) {
    double lanes[8];
    memcpy(lanes, &x, sizeof lanes);
    for (int lane = 0; lane < 8; lane++) lanes[lane] = ppo_log64(lanes[lane]);
    memcpy(&x, lanes, sizeof lanes);
    return x;
}

#else
/* -- Other compilers: lane by lane, without branches ------------------------------------------- */
/* Masks are all ones or zero in an integer of the lanes' width and a select combines bits, so
 * that no branch depends on a mask (a mispredicted branch a token). */

typedef struct {
    float lane[8];
} ppo_f32x8;
typedef struct {
    double lane[8];
} ppo_f64x8;
typedef struct {
    uint32_t lane[8];
} ppo_m32x8;
typedef struct {
    uint64_t lane[8];
} ppo_m64x8;
typedef int64_t ppo_c32x8;
typedef int64_t ppo_c64x8;

#define PPO_EACH_LANE(statement) \
    for (int lane = 0; lane < 8; lane++) statement

#define PPO_PORTABLE_LANES(name, real, mask, bits)                                            \
    PPO_INLINE ppo_##name ppo_##name##_splat(real x) {                                       \
        ppo_##name r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = x);                                                     \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_load(const real* p) {                                 \
        ppo_##name r;                                                                        \
        memcpy(r.lane, p, sizeof r.lane);                                                    \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE void ppo_##name##_store(real* p, ppo_##name x) {                              \
        memcpy(p, x.lane, sizeof x.lane);                                                    \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_load_first(const real* p, ptrdiff_t count) {          \
        ppo_##name r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = lane < count ? p[lane] : (real)0);                      \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_add(ppo_##name a, ppo_##name b) {                     \
        PPO_EACH_LANE(a.lane[lane] += b.lane[lane]);                                         \
        return a;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_sub(ppo_##name a, ppo_##name b) {                     \
        PPO_EACH_LANE(a.lane[lane] -= b.lane[lane]);                                         \
        return a;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_mul(ppo_##name a, ppo_##name b) {                     \
        PPO_EACH_LANE(a.lane[lane] *= b.lane[lane]);                                         \
        return a;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_div(ppo_##name a, ppo_##name b) {                     \
        PPO_EACH_LANE(a.lane[lane] /= b.lane[lane]);                                         \
        return a;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##name##_eq(ppo_##name a, ppo_##name b) {                      \
        ppo_##mask r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = -(bits)(a.lane[lane] == b.lane[lane]));                 \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##name##_lt(ppo_##name a, ppo_##name b) {                      \
        ppo_##mask r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = -(bits)(a.lane[lane] < b.lane[lane]));                  \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##name##_gt(ppo_##name a, ppo_##name b) {                      \
        ppo_##mask r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = -(bits)(a.lane[lane] > b.lane[lane]));                  \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##name##_le(ppo_##name a, ppo_##name b) {                      \
        ppo_##mask r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = -(bits)(a.lane[lane] <= b.lane[lane]));                 \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_select(ppo_##mask m, ppo_##name a, ppo_##name b) {    \
        bits a_bits[8], b_bits[8];                                                           \
        memcpy(a_bits, a.lane, sizeof a_bits);                                               \
        memcpy(b_bits, b.lane, sizeof b_bits);                                               \
        PPO_EACH_LANE(a_bits[lane] =                                                         \
                          (m.lane[lane] & a_bits[lane]) | (~m.lane[lane] & b_bits[lane]));  \
        memcpy(a.lane, a_bits, sizeof a_bits);                                               \
        return a;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_max(ppo_##name a, ppo_##name b) {                     \
        return ppo_##name##_select(ppo_##name##_gt(a, b), a, b);                             \
    }                                                                                        \
    PPO_INLINE ppo_##name ppo_##name##_min(ppo_##name a, ppo_##name b) {                     \
        return ppo_##name##_select(ppo_##name##_lt(a, b), a, b);                             \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##mask##_all(void) {                                           \
        ppo_##mask r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = ~(bits)0);                                              \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##mask##_and(ppo_##mask a, ppo_##mask b) {                     \
        PPO_EACH_LANE(a.lane[lane] &= b.lane[lane]);                                         \
        return a;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##mask##_and_not(ppo_##mask a, ppo_##mask b) {                 \
        PPO_EACH_LANE(a.lane[lane] &= ~b.lane[lane]);                                        \
        return a;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##mask##_or(ppo_##mask a, ppo_##mask b) {                      \
        PPO_EACH_LANE(a.lane[lane] |= b.lane[lane]);                                         \
        return a;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##mask##_from_bytes(const uint8_t* p) {                        \
        ppo_##mask r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = -(bits)(p[lane] != 0));                                 \
        return r;                                                                            \
    }                                                                                        \
    PPO_INLINE ppo_##mask ppo_##mask##_first(ptrdiff_t count) {                              \
        ppo_##mask r;                                                                        \
        PPO_EACH_LANE(r.lane[lane] = -(bits)(lane < count));                                 \
        return r;                                                                            \
    }
PPO_PORTABLE_LANES(f32x8, float, m32x8, uint32_t)
PPO_PORTABLE_LANES(f64x8, double, m64x8, uint64_t)

PPO_INLINE int64_t ppo_c32x8_zero(void) { return 0; }
PPO_INLINE int64_t ppo_c32x8_add(int64_t counts, ppo_m32x8 m) {
    PPO_EACH_LANE(counts += m.lane[lane] & 1);
    return counts;
}
PPO_INLINE int64_t ppo_c32x8_total(int64_t counts) { return counts; }
PPO_INLINE int64_t ppo_c64x8_zero(void) { return 0; }
PPO_INLINE int64_t ppo_c64x8_add(int64_t counts, ppo_m64x8 m) {
    PPO_EACH_LANE(counts += (int64_t)(m.lane[lane] & 1));
    return counts;
}
PPO_INLINE int64_t ppo_c64x8_total(int64_t counts) { return counts; }

PPO_INLINE ppo_f64x8 ppo_f64x8_negative(ppo_f64x8 x) {
    PPO_EACH_LANE(x.lane[lane] = -x.lane[lane]);
    return x;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_fma(ppo_f64x8 a, ppo_f64x8 b, ppo_f64x8 c) { /* a * b + c */
    PPO_EACH_LANE(a.lane[lane] = fma(a.lane[lane], b.lane[lane], c.lane[lane]));
    return a;
}
PPO_INLINE int ppo_m64x8_any(ppo_m64x8 m) {
    uint64_t either = 0;
    PPO_EACH_LANE(either |= m.lane[lane]);
    return either != 0;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_abs(ppo_f64x8 x) {
    PPO_EACH_LANE(x.lane[lane] = fabs(x.lane[lane]));
    return x;
}
PPO_INLINE ppo_f32x8 ppo_f32x8_abs(ppo_f32x8 x) {
    PPO_EACH_LANE(x.lane[lane] = fabsf(x.lane[lane]));
    return x;
}
PPO_INLINE ppo_f32x8 ppo_f32x8_negative(ppo_f32x8 x) {
    PPO_EACH_LANE(x.lane[lane] = -x.lane[lane]);
    return x;
}
PPO_INLINE ppo_f64x8 ppo_f32x8_to_f64(ppo_f32x8 x) {
    ppo_f64x8 r;
    PPO_EACH_LANE(r.lane[lane] = (double)x.lane[lane]);
    return r;
}
PPO_INLINE ppo_f32x8 ppo_f32x8_from_f64(ppo_f64x8 x) {
    ppo_f32x8 r;
    PPO_EACH_LANE(r.lane[lane] = (float)x.lane[lane]);
    return r;
}

PPO_INLINE ppo_f32x8 ppo_f32x8_exp(ppo_f32x8 x) {
    PPO_EACH_LANE(x.lane[lane] = ppo_exp32(x.lane[lane]));
    return x;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_exp(ppo_f64x8 x) {
    PPO_EACH_LANE(x.lane[lane] = ppo_exp64(x.lane[lane]));
    return x;
}
PPO_INLINE ppo_f32x8 ppo_f32x8_log(ppo_f32x8 x) {
    PPO_EACH_LANE(x.lane[lane] = ppo_log32(x.lane[lane]));
    return x;
}
PPO_INLINE ppo_f64x8 ppo_f64x8_log(ppo_f64x8 x) {
    PPO_EACH_LANE(x.lane[lane] = ppo_log64(x.lane[lane]));
    return x;
}
#endif

/* exp of two blocks of eight (see PPO_F32X8_PAIRS): where no wider register holds both, one
 * block after the other. */
#ifndef PPO_F32X8_PAIRS
PPO_INLINE void ppo_f32x8_exp_pair(ppo_f32x8 a, ppo_f32x8 b, ppo_f32x8* exp_a, ppo_f32x8* exp_b) {
    *exp_a = ppo_f32x8_exp(a);
    *exp_b = ppo_f32x8_exp(b);
}
#endif
PPO_INLINE void ppo_f64x8_exp_pair(ppo_f64x8 a, ppo_f64x8 b, ppo_f64x8* exp_a, ppo_f64x8* exp_b) {
    *exp_a = ppo_f64x8_exp(a);
    *exp_b = ppo_f64x8_exp(b);
}

/* x in float64 where m, +0 elsewhere: a valid lane's term of a float64 sum, an invalid one's
 * nothing (whatever is stored there: NaN, inf), as the twins' `else 0.0`. Where no instruction
 * does both, a select then the conversion. */
#ifndef PPO_TO_F64_WHERE
PPO_INLINE ppo_f64x8 ppo_f32x8_to_f64_where(ppo_m32x8 m, ppo_f32x8 x) {
    return ppo_f32x8_to_f64(ppo_f32x8_select(m, x, ppo_f32x8_splat(0.0f)));
}
PPO_INLINE ppo_f64x8 ppo_f64x8_to_f64_where(ppo_m64x8 m, ppo_f64x8 x) {
    return ppo_f64x8_select(m, x, ppo_f64x8_splat(0.0));
}
#endif

/* The losses' ratios exp(clip(a - b, -clamp, clamp)) of 16 tokens into out (see
 * PPO_CLIPPED_EXP16): where no instruction folds the steps, the clip and then exp. */
#ifndef PPO_CLIPPED_EXP16
typedef struct {
    ppo_f32x8 negative_clamp32, clamp32;
    ppo_f64x8 negative_clamp64, clamp64;
} ppo_clipped_exp;
PPO_INLINE ppo_clipped_exp ppo_clipped_exp_of(double clamp) {
    ppo_clipped_exp e;
    e.negative_clamp32 = ppo_f32x8_splat(-(float)clamp);
    e.clamp32 = ppo_f32x8_splat((float)clamp);
    e.negative_clamp64 = ppo_f64x8_splat(-clamp);
    e.clamp64 = ppo_f64x8_splat(clamp);
    return e;
}
/* One definition for both dtypes: the lanes type, its item and the clamps' width. */
#define PPO_CLIPPED_EXP16_OF(lanes, real, bits)                                              \
    PPO_INLINE void ppo_##lanes##_clipped_exp16(                                             \
        const real* a, const real* b, const ppo_clipped_exp* e, real* out) {                 \
        ppo_##lanes low = e->negative_clamp##bits, high = e->clamp##bits;                    \
        ppo_##lanes first = ppo_##lanes##_sub(ppo_##lanes##_load(a), ppo_##lanes##_load(b)); \
        ppo_##lanes second =                                                                 \
            ppo_##lanes##_sub(ppo_##lanes##_load(a + 8), ppo_##lanes##_load(b + 8));         \
        ppo_##lanes first_exp, second_exp;                                                   \
        ppo_##lanes##_exp_pair(                                                              \
            ppo_##lanes##_min(high, ppo_##lanes##_max(low, first)),                          \
            ppo_##lanes##_min(high, ppo_##lanes##_max(low, second)), &first_exp,             \
            &second_exp);                                                                    \
        ppo_##lanes##_store(out, first_exp);                                                 \
        ppo_##lanes##_store(out + 8, second_exp);                                            \
    }
PPO_CLIPPED_EXP16_OF(f32x8, float, 32)
PPO_CLIPPED_EXP16_OF(f64x8, double, 64)
#undef PPO_CLIPPED_EXP16_OF
#endif

/* Lanes moved down (lane j takes lane j + k; GAE's scan, rows_gae.h), through memory where
 * the block above has no shuffle for it. */
#ifndef PPO_F64X8_SHIFTS
PPO_INLINE ppo_f64x8 ppo_f64x8_down1_fill(ppo_f64x8 x, double last) { /* lane 7: last */
    double lanes[9];
    ppo_f64x8_store(lanes, x);
    lanes[8] = last;
    return ppo_f64x8_load(lanes + 1);
}
PPO_INLINE ppo_f64x8 ppo_f64x8_down2(ppo_f64x8 x) { /* lanes 6 and 7: 0 */
    double lanes[10];
    ppo_f64x8_store(lanes, x);
    lanes[8] = lanes[9] = 0.0;
    return ppo_f64x8_load(lanes + 2);
}
PPO_INLINE ppo_f64x8 ppo_f64x8_down4(ppo_f64x8 x) { /* lanes 4 to 7: 0 */
    double lanes[12];
    ppo_f64x8_store(lanes, x);
    lanes[8] = lanes[9] = lanes[10] = lanes[11] = 0.0;
    return ppo_f64x8_load(lanes + 4);
}
PPO_INLINE double ppo_f64x8_lane0(ppo_f64x8 x) {
    double lanes[8];
    ppo_f64x8_store(lanes, x);
    return lanes[0];
}
#endif

/* float64 rows need no conversion. */
PPO_INLINE ppo_f64x8 ppo_f64x8_to_f64(ppo_f64x8 x) { return x; }
PPO_INLINE ppo_f64x8 ppo_f64x8_from_f64(ppo_f64x8 x) { return x; }

/* a + b in the lanes of m, a in the others: a sum's step over the valid lanes only. The same bits
 * as a + (m ? b : +0.0) wherever a is not -0.0, which a sum that starts at +0.0 never is (x + y
 * is -0.0 only for two -0.0): one masked add with AVX-512, where the select and add were two. */
PPO_INLINE ppo_f64x8 ppo_f64x8_add_where(ppo_m64x8 m, ppo_f64x8 a, ppo_f64x8 b) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    return _mm512_mask_add_pd(a, m, a, b);
#else
    return ppo_f64x8_select(m, ppo_f64x8_add(a, b), a);
#endif
}

/* The lanes of a sum, added up in a fixed tree. */
PPO_INLINE double ppo_f64x8_total(ppo_f64x8 x) {
    double lanes[8];
    ppo_f64x8_store(lanes, x);
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

#endif
