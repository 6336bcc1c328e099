/* The kernels' log: the twin of ppo_fast/_numba_core.py _log32 and _log64, operation for
 * operation (the method and the constants: ppo_fast/_spec.py LOG32, LOG64).
 *
 * Its constants (PPO_LOG32_*, PPO_LOG64_* and the two series) are not written here: the Cython
 * module generated from src/_kernels.pyx.tp defines them from ppo_fast/_spec.py, as exp's. Scalar
 * and branch-free (conditional expressions the compiler turns into selects), so that a loop over
 * a scratch row of arguments can vectorize. Within 1 ulp of log in both dtypes; +0 and -0 give
 * -inf, a negative argument NaN, inf inf and NaN NaN. ln2 comes in exp's two parts. */
#ifndef PPO_FAST_LOG_H
#define PPO_FAST_LOG_H

#ifndef PPO_LOG64_OFFSET
#error "log.h: its constants come from the module generated from src/_kernels.pyx.tp"
#endif

PPO_INLINE float ppo_log32(float x) {
    int tiny = x < PPO_LOG32_TINY;
    float scaled = tiny ? x * PPO_LOG32_SCALE : x, m, f, half_square, s, z, r, n, y;
    uint32_t bits, m_bits;
    int32_t k;
    memcpy(&bits, &scaled, 4);
    /* unsigned, so that it wraps: for the arguments it can overflow (NaN, negative ones) the
     * result is replaced below, and for the others it agrees with the twin's int64 */
    bits += PPO_LOG32_OFFSET;
    k = (int32_t)(bits >> PPO_LOG32_SHIFT) - PPO_LOG32_BIAS - (tiny ? PPO_LOG32_SCALE_BITS : 0);
    m_bits = (bits & PPO_LOG32_MANTISSA) + PPO_LOG32_SQRT_HALF;
    memcpy(&m, &m_bits, 4);
    f = m - 1.0f;
    half_square = 0.5f * f * f;
    s = f / (2.0f + f);
    z = s * s;
    r = ppo_log32_series[0];
    for (int j = 1; j < 4; j++) r = fmaf(r, z, ppo_log32_series[j]);
    r = r * z;
    n = (float)k;
    y = n * PPO_EXP32_LN2_HIGH - ((half_square - (s * (half_square + r) + n * PPO_EXP32_LN2_LOW)) - f);
    y = x == INFINITY ? x : y;
    y = x == 0.0f ? -INFINITY : y;
    return x < 0.0f ? NAN : (x == x ? y : x);
}
PPO_INLINE double ppo_log64(double x) {
    int tiny = x < PPO_LOG64_TINY;
    double scaled = tiny ? x * PPO_LOG64_SCALE : x, m, f, half_square, s, z, r, n, y;
    uint64_t bits, m_bits;
    int64_t k;
    memcpy(&bits, &scaled, 8);
    bits += PPO_LOG64_OFFSET; /* unsigned, as in ppo_log32 */
    k = (int64_t)(bits >> PPO_LOG64_SHIFT) - PPO_LOG64_BIAS - (tiny ? PPO_LOG64_SCALE_BITS : 0);
    m_bits = (bits & PPO_LOG64_MANTISSA) + PPO_LOG64_SQRT_HALF;
    memcpy(&m, &m_bits, 8);
    f = m - 1.0;
    half_square = 0.5 * f * f;
    s = f / (2.0 + f);
    z = s * s;
    r = ppo_log64_series[0];
    for (int j = 1; j < 10; j++) r = fma(r, z, ppo_log64_series[j]);
    r = r * z;
    n = (double)k;
    y = n * PPO_EXP64_LN2_HIGH - ((half_square - (s * (half_square + r) + n * PPO_EXP64_LN2_LOW)) - f);
    y = x == INFINITY ? x : y;
    y = x == 0.0 ? -INFINITY : y;
    return x < 0.0 ? NAN : (x == x ? y : x);
}

#endif
