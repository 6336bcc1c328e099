/* The kernels' exp, vectorizable: the twin of ppo_fast/_numba_core.py _exp32 and _exp64.
 *
 * Its constants (PPO_EXP32_*, PPO_EXP64_* and the two polynomials) are not written here: the
 * Cython module generated from src/_kernels.pyx.tp defines them from ppo_fast/_spec.py (EXP32,
 * EXP64), the table numba reads too, before it includes src/lanes.h, which includes this file.
 * The vector forms of exp are lane operations of src/lanes.h (one per instruction set); this file
 * holds the one-lane form that the builds without AVX2 and FMA apply lane by lane.
 */
#ifndef PPO_FAST_EXP_H
#define PPO_FAST_EXP_H

#ifndef PPO_EXP64_LOW
#error "exp.h: its constants come from the module generated from src/_kernels.pyx.tp"
#endif

/* exp(x) = 2^n p(r) with x = n ln2 + r, n found by the 1.5 * 2^(mantissa bits) shift trick and
 * 2^n built from its exponent bits; inputs saturate so that 2^n stays a normal number. The float32
 * and float64 forms are written out side by side on purpose: their bit widths, exponent biases
 * and polynomial tails differ, and each mirrors its numba twin line for line. */
/* exp's value where its argument is not finite: NaN, inf and -inf give NaN, inf and 0 (as the
 * twins' _exact_where_nonfinite: the saturation is for finite arguments only). */
#define PPO_EXACT_WHERE_NONFINITE(argument, y) \
    ((argument) != (argument) || (argument) == INFINITY ? (argument) : (argument) == -INFINITY ? 0 : (y))

PPO_INLINE float ppo_exp32(float argument) {
    float x = argument;
    float shift = PPO_EXP32_SHIFT, shifted, n, r, p, power;
    uint32_t shifted_bits, shift_bits, power_bits;
    if (PPO_EXP32_LOW > x) x = PPO_EXP32_LOW;
    if (PPO_EXP32_HIGH < x) x = PPO_EXP32_HIGH;
    shifted = fmaf(x, PPO_EXP32_LOG2E, shift);
    n = shifted - shift;
    r = fmaf(-n, PPO_EXP32_LN2_HIGH, x);
    r = fmaf(-n, PPO_EXP32_LN2_LOW, r);
    p = ppo_exp32_polynomial[0];
    for (int k = 1; k < 6; k++) p = fmaf(p, r, ppo_exp32_polynomial[k]);
    p = fmaf(p * r, r, r) + 1.0f;
    memcpy(&shifted_bits, &shifted, 4);
    memcpy(&shift_bits, &shift, 4);
    power_bits = (shifted_bits - shift_bits + 127u) << 23; /* unsigned, so that it wraps */
    memcpy(&power, &power_bits, 4);
    return PPO_EXACT_WHERE_NONFINITE(argument, p * power);
}
PPO_INLINE double ppo_exp64(double argument) {
    double x = argument;
    double shift = PPO_EXP64_SHIFT, shifted, n, r, p, power;
    uint64_t shifted_bits, shift_bits, power_bits;
    if (PPO_EXP64_LOW > x) x = PPO_EXP64_LOW;
    if (PPO_EXP64_HIGH < x) x = PPO_EXP64_HIGH;
    shifted = fma(x, PPO_EXP64_LOG2E, shift);
    n = shifted - shift;
    r = fma(-n, PPO_EXP64_LN2_HIGH, x);
    r = fma(-n, PPO_EXP64_LN2_LOW, r);
    p = ppo_exp64_polynomial[0];
    for (int k = 1; k < 13; k++) p = fma(p, r, ppo_exp64_polynomial[k]);
    memcpy(&shifted_bits, &shifted, 8);
    memcpy(&shift_bits, &shift, 8);
    power_bits = (shifted_bits - shift_bits + 1023u) << 52;
    memcpy(&power, &power_bits, 8);
    return PPO_EXACT_WHERE_NONFINITE(argument, p * power);
}

#endif
