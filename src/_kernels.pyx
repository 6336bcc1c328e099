# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True
"""The Cython backend: one kernel per stage, written over rows.

setup.py builds this file twice, as ppo_fast._cython_kernels (any CPU) and, on x86-64, as
ppo_fast._cython_kernels_avx2 (CPUs with AVX2 and FMA; ppo_fast/_cython_backend.py chooses).
Each kernel is the twin of the numba kernel its docstring names (ppo_fast/_numba_kernels.py) and
has the oracle's signature (ppo_fast/_reference.py), n_threads last. Conventions:

- Token arrays are C-contiguous float32 or float64 (the fused type ``floating``); inputs are
  ``const``, so read-only arrays are accepted. starts, spans and lengths are int64, the mask uint8
  (empty: no mask), per-row parameters float64 (the losses' params and scales: the input dtype).
- Each row is computed by a ``cdef inline`` row function called from a ``prange`` over rows, with
  ``n_threads`` threads. A row's arithmetic and its reductions never depend on the thread that
  runs it, so results are identical bit for bit on any number of threads. Keeping the row body
  out of the ``prange`` also keeps Cython from turning a per-row ``+=`` into an OpenMP reduction.
- The arithmetic is the numba twins', operation for operation: ``fma()`` exactly where they call
  ``llvm.fma`` (the GAE chain, the losses' polynomial exp), and setup.py compiles with
  ``-ffp-contract=off`` so that nothing else is fused (numba does not contract). Both builds give
  the same bits; numba gives them too, up to the libm behind ``exp`` and the order of the loss
  kernels' row sums (see the losses below).
- Bounds and wrap-around checks are off (the twins index with unsigned integers for the same
  reason); the stages validate every index before they call in.
- Without OpenMP the ``prange`` loops run serially; ``OPENMP`` says which build this is.
"""

from cython.parallel cimport prange
from libc.math cimport fma, fmaf
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from _rows cimport is_valid, kl_value

ctypedef fused floating:
    float
    double

cdef extern from *:
    """
    #ifdef _OPENMP
    #define PPO_FAST_OPENMP 1
    #else
    #define PPO_FAST_OPENMP 0
    #endif
    #if defined(__AVX2__) && defined(__FMA__)
    #define PPO_FAST_AVX2_FMA 1
    #else
    #define PPO_FAST_AVX2_FMA 0
    #endif
    /* Whether this CPU (and its OS) can run the AVX2 and FMA build. */
    static int ppo_fast_cpu_has_avx2_fma(void) {
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    #else
        return 0;
    #endif
    }
    """
    const int PPO_FAST_OPENMP
    const int PPO_FAST_AVX2_FMA
    int ppo_fast_cpu_has_avx2_fma()

OPENMP = bool(PPO_FAST_OPENMP)
BUILT_FOR_AVX2_FMA = bool(PPO_FAST_AVX2_FMA)
CPU_HAS_AVX2_FMA = bool(ppo_fast_cpu_has_avx2_fma())


cdef inline void _kl_penalty_row(
    const floating* logprobs,
    const floating* ref_logprobs,
    Py_ssize_t start,
    Py_ssize_t span,
    int estimator,
    double clamp,
    floating* out,
) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(start, start + span):
        out[i] = <floating>kl_value(
            <double>logprobs[i] - <double>ref_logprobs[i], estimator, clamp
        )


def kl_penalty(
    const floating[::1] logprobs,
    const floating[::1] ref_logprobs,
    const int64_t[::1] starts,
    const int64_t[::1] spans,
    int estimator,
    double clamp,
    floating[::1] out,
    int n_threads,
):
    """Twin: ppo_fast/_numba_kernels.py _kl_penalty_rows."""
    cdef Py_ssize_t b
    for b in prange(starts.shape[0], nogil=True, num_threads=max(n_threads, 1), schedule="static"):
        _kl_penalty_row(
            &logprobs[0], &ref_logprobs[0], starts[b], spans[b], estimator, clamp, &out[0]
        )


cdef inline void _shape_rewards_row(
    double score,
    const floating* logprobs,
    const floating* ref_logprobs,
    Py_ssize_t start,
    Py_ssize_t span,
    Py_ssize_t length,
    const uint8_t* mask,
    bint has_mask,
    double kl_coef,
    int estimator,
    double clamp,
    floating* out,
) noexcept nogil:
    cdef Py_ssize_t t, i
    cdef Py_ssize_t last = start + span  # one past the row when it has no valid position
    cdef double reward
    for t in range(span - 1, -1, -1):
        if is_valid(mask, has_mask, start + t, t, length):
            last = start + t
            break
    for t in range(span):
        i = start + t
        if is_valid(mask, has_mask, i, t, length):
            reward = -kl_coef * kl_value(
                <double>logprobs[i] - <double>ref_logprobs[i], estimator, clamp
            )
            # Adding 0.0 off the last token, as the twins do, turns a -0.0 reward into +0.0.
            out[i] = <floating>(reward + (score if i == last else 0.0))
        else:
            out[i] = 0.0


def shape_rewards(
    const double[::1] scores,
    const floating[::1] logprobs,
    const floating[::1] ref_logprobs,
    const int64_t[::1] starts,
    const int64_t[::1] spans,
    const int64_t[::1] lengths,
    const uint8_t[::1] mask,
    double kl_coef,
    int estimator,
    double clamp,
    floating[::1] out,
    int n_threads,
):
    """Twin: ppo_fast/_numba_kernels.py _shape_rewards_rows."""
    cdef Py_ssize_t b
    cdef bint has_mask = mask.shape[0] != 0
    for b in prange(starts.shape[0], nogil=True, num_threads=max(n_threads, 1), schedule="static"):
        _shape_rewards_row(
            scores[b],
            &logprobs[0],
            &ref_logprobs[0],
            starts[b],
            spans[b],
            lengths[b],
            &mask[0],
            has_mask,
            kl_coef,
            estimator,
            clamp,
            &out[0],
        )


cdef inline void _gae_row(
    const floating* rewards,
    const floating* values,
    Py_ssize_t start,
    Py_ssize_t span,
    Py_ssize_t length,
    const uint8_t* mask,
    bint has_mask,
    double gamma,
    double lam,
    double next_value,
    floating* advantages,
    floating* returns,
) noexcept nogil:
    cdef Py_ssize_t t, i
    cdef double gamma_lam = gamma * lam
    cdef double running = 0.0
    cdef double value, delta
    for t in range(span - 1, -1, -1):
        i = start + t
        if is_valid(mask, has_mask, i, t, length):
            value = values[i]
            # One rounding per multiply-add, as the twin's llvm.fma: the same bits as numba, and
            # the running advantage is a latency-bound chain, where a fused op halves the latency.
            delta = fma(gamma, next_value, <double>rewards[i]) - value
            running = fma(gamma_lam, running, delta)
            advantages[i] = <floating>running
            returns[i] = <floating>(running + value)
            next_value = value
        else:
            advantages[i] = 0.0
            returns[i] = 0.0


def gae(
    const floating[::1] rewards,
    const floating[::1] values,
    const int64_t[::1] starts,
    const int64_t[::1] spans,
    const int64_t[::1] lengths,
    const uint8_t[::1] mask,
    const double[::1] gammas,
    const double[::1] lams,
    const double[::1] bootstrap,
    floating[::1] advantages,
    floating[::1] returns,
    int n_threads,
):
    """Twin: ppo_fast/_numba_kernels.py _gae_rows. The running state is float64 whatever the
    input dtype."""
    cdef Py_ssize_t b
    cdef bint has_mask = mask.shape[0] != 0
    for b in prange(starts.shape[0], nogil=True, num_threads=max(n_threads, 1), schedule="static"):
        _gae_row(
            &rewards[0],
            &values[0],
            starts[b],
            spans[b],
            lengths[b],
            &mask[0],
            has_mask,
            gammas[b],
            lams[b],
            bootstrap[b],
            &advantages[0],
            &returns[0],
        )


cdef inline void _moments_row(
    const floating* x,
    Py_ssize_t start,
    Py_ssize_t span,
    Py_ssize_t length,
    const uint8_t* mask,
    bint has_mask,
    double shift,
    double* count,
    double* total,
    double* total_sq,
) noexcept nogil:
    cdef Py_ssize_t t, i
    cdef double centred
    cdef double row_count = 0.0, row_total = 0.0, row_total_sq = 0.0
    for t in range(span):
        i = start + t
        if is_valid(mask, has_mask, i, t, length):
            centred = <double>x[i] - shift
            row_count += 1.0
            row_total += centred
            row_total_sq += centred * centred
    count[0] = row_count
    total[0] = row_total
    total_sq[0] = row_total_sq


def moments(
    const floating[::1] x,
    const int64_t[::1] starts,
    const int64_t[::1] spans,
    const int64_t[::1] lengths,
    const uint8_t[::1] mask,
    double shift,
    double[::1] counts,
    double[::1] sums,
    double[::1] sums_sq,
    int n_threads,
):
    """Twin: ppo_fast/_numba_kernels.py _moments_rows."""
    cdef Py_ssize_t b
    cdef bint has_mask = mask.shape[0] != 0
    for b in prange(starts.shape[0], nogil=True, num_threads=max(n_threads, 1), schedule="static"):
        _moments_row(
            &x[0],
            starts[b],
            spans[b],
            lengths[b],
            &mask[0],
            has_mask,
            shift,
            &counts[b],
            &sums[b],
            &sums_sq[b],
        )


cdef inline void _whiten_row(
    const floating* x,
    Py_ssize_t start,
    Py_ssize_t span,
    Py_ssize_t length,
    const uint8_t* mask,
    bint has_mask,
    double mean,
    double scale,
    double offset,
    floating* out,
) noexcept nogil:
    # The twin's loop, split so that the compiler vectorizes it: the valid prefix with or
    # without a mask, then the padding. Under a mask every position is computed and the mask
    # selects (which -fno-trapping-math allows on every lane); each store is the twin's.
    cdef Py_ssize_t i
    cdef Py_ssize_t valid_end = start + min(length, span)
    cdef floating whitened
    if has_mask:
        for i in range(start, valid_end):
            whitened = <floating>((<double>x[i] - mean) / scale + offset)
            out[i] = whitened if mask[i] != 0 else 0.0
    else:
        for i in range(start, valid_end):
            out[i] = <floating>((<double>x[i] - mean) / scale + offset)
    for i in range(valid_end, start + span):
        out[i] = 0.0


def whiten(
    const floating[::1] x,
    const int64_t[::1] starts,
    const int64_t[::1] spans,
    const int64_t[::1] lengths,
    const uint8_t[::1] mask,
    double mean,
    double scale,
    double offset,
    floating[::1] out,
    int n_threads,
):
    """Twin: ppo_fast/_numba_kernels.py _whiten_rows."""
    cdef Py_ssize_t b
    cdef bint has_mask = mask.shape[0] != 0
    for b in prange(starts.shape[0], nogil=True, num_threads=max(n_threads, 1), schedule="static"):
        _whiten_row(
            &x[0],
            starts[b],
            spans[b],
            lengths[b],
            &mask[0],
            has_mask,
            mean,
            scale,
            offset,
            &out[0],
        )


# -- Fused losses ---------------------------------------------------------------------------------
#
# Per-token arithmetic runs in the input dtype and every sum in float64, as in the twins; the
# twins' types are kept where numba's promotion makes them float64 (the weight, and so the
# gradient's product, are float64 there). The per-token work is branch-free so that the compiler
# vectorizes it. The row sums cannot follow numba's (it lets LLVM reassociate them): each row is
# summed in LANES partial sums (token t goes to lane t % LANES), added up in a fixed order. That
# vectorizes without reassociation and gives the same bits in both builds and on any number of
# threads. CHUNK tokens at a time go through a stack buffer between the two loops.

cdef enum:
    LANES = 8
    CHUNK = 256  # a multiple of LANES

# The twins' exp_poly (ppo_fast/_numba_kernels.py _exp32 and _exp64), constant for constant:
# exp(x) = 2^n p(r) with x = n ln2 + r, n found by the 1.5 * 2^(mantissa bits) shift trick and
# 2^n built from its exponent bits; inputs saturate so that 2^n stays a normal number.
# (memcpy is how C reads a float's bits; compilers turn it into a register move.)


cdef inline float _exp32(float x) noexcept nogil:
    cdef float shift = 12582912.0  # 1.5 * 2^23
    cdef float shifted, n, r, p, power
    cdef int32_t shifted_bits, shift_bits
    cdef uint32_t power_bits
    if <float>-87.3 > x:
        x = <float>-87.3
    if <float>88.3 < x:
        x = <float>88.3
    shifted = fmaf(x, <float>1.44269504, shift)
    n = shifted - shift
    r = fmaf(-n, <float>0.693359375, x)
    r = fmaf(-n, <float>-2.12194440e-4, r)
    p = fmaf(<float>1.9875691500e-4, r, <float>1.3981999507e-3)
    p = fmaf(p, r, <float>8.3334519073e-3)
    p = fmaf(p, r, <float>4.1665795894e-2)
    p = fmaf(p, r, <float>1.6666665459e-1)
    p = fmaf(p, r, <float>5.0000001201e-1)
    p = fmaf(p * r, r, r) + <float>1.0
    memcpy(&shifted_bits, &shifted, 4)
    memcpy(&shift_bits, &shift, 4)
    # Unsigned, so that the shift is defined; the saturation keeps n + 127 within 1..254.
    power_bits = <uint32_t>(shifted_bits - shift_bits + 127) << 23
    memcpy(&power, &power_bits, 4)
    return p * power


cdef inline double _exp64(double x) noexcept nogil:
    cdef double shift = 6755399441055744.0  # 1.5 * 2^52
    cdef double shifted, n, r, p, power
    cdef int64_t shifted_bits, shift_bits
    cdef uint64_t power_bits
    if -708.0 > x:
        x = -708.0
    if 709.0 < x:
        x = 709.0
    shifted = fma(x, 1.4426950408889634, shift)
    n = shifted - shift
    r = fma(-n, 6.93147180369123816490e-01, x)
    r = fma(-n, 1.90821492927058770002e-10, r)
    p = fma(2.08767569878680989792e-09, r, 2.50521083854417187751e-08)
    p = fma(p, r, 2.75573192239858906526e-07)
    p = fma(p, r, 2.75573192239858906526e-06)
    p = fma(p, r, 2.48015873015873015873e-05)
    p = fma(p, r, 1.98412698412698412698e-04)
    p = fma(p, r, 1.38888888888888888889e-03)
    p = fma(p, r, 8.33333333333333333333e-03)
    p = fma(p, r, 4.16666666666666666667e-02)
    p = fma(p, r, 1.66666666666666666667e-01)
    p = fma(p, r, 0.5)
    p = fma(p, r, 1.0)
    p = fma(p, r, 1.0)
    memcpy(&shifted_bits, &shifted, 8)
    memcpy(&shift_bits, &shift, 8)
    power_bits = <uint64_t>(shifted_bits - shift_bits + 1023) << 52
    memcpy(&power, &power_bits, 8)
    return p * power


cdef inline floating exp_poly(floating x) noexcept nogil:
    if floating is float:
        return _exp32(x)
    else:
        return _exp64(x)


cdef inline floating clip(floating x, floating low, floating high) noexcept nogil:
    # The twins' min(max(x, low), high), comparison for comparison.
    if low > x:
        x = low
    if high < x:
        x = high
    return x


cdef inline void _sum_into_lanes(
    const double* terms, Py_ssize_t n, double* lanes
) noexcept nogil:
    # Each lane adds every LANES-th term in order; the buffer's tail past n holds zeros.
    cdef Py_ssize_t j = 0, lane
    while j < n:
        for lane in range(LANES):
            lanes[lane] += terms[j + lane]
        j += LANES


cdef inline double _lanes_total(const double* lanes) noexcept nogil:
    cdef double total = 0.0
    cdef Py_ssize_t lane
    for lane in range(LANES):
        total += lanes[lane]
    return total


cdef inline void _policy_token(
    bint valid,
    double weight,
    floating log_ratio,
    floating advantage,
    floating low,
    floating high,
    floating dual,
    floating clamp,
    floating scale,
    floating* grad,
    double* loss_term,
    double* clipped_term,
    double* dual_term,
    double* kl_term,
) noexcept nogil:
    # Everything is computed and then selected, so that the loop over tokens vectorizes.
    cdef floating zero = scale - scale  # as the twin: 0 in the input dtype
    cdef floating ratio, unclipped, clipped, objective
    cdef bint inside, is_clipped, is_dual, active
    cdef double gradient
    inside = (log_ratio >= -clamp) & (log_ratio <= clamp)
    log_ratio = clip(log_ratio, -clamp, clamp)
    ratio = exp_poly(log_ratio)
    unclipped = ratio * advantage
    clipped = clip(ratio, low, high) * advantage
    is_clipped = clipped < unclipped
    objective = clipped if is_clipped else unclipped
    is_dual = (advantage < zero) & (dual * advantage > objective)
    objective = dual * advantage if is_dual else objective
    active = valid & inside & (not is_clipped) & (not is_dual)
    gradient = -weight * <double>(advantage * ratio) * <double>scale
    grad[0] = <floating>gradient if active else zero
    loss_term[0] = -weight * <double>objective if valid else 0.0
    clipped_term[0] = 1.0 if valid & is_clipped else 0.0
    dual_term[0] = 1.0 if valid & is_dual else 0.0
    kl_term[0] = -<double>log_ratio if valid else 0.0


cdef inline void _clipped_surrogate_row(
    const floating* logprobs,
    const floating* old_logprobs,
    const floating* advantages,
    const floating* weights,
    bint has_weights,
    Py_ssize_t start,
    Py_ssize_t span,
    Py_ssize_t length,
    const uint8_t* mask,
    bint has_mask,
    floating low,
    floating high,
    floating dual,
    floating clamp,
    floating scale,
    floating* grad,
    double* row_loss,
    double* row_clipped,
    double* row_dual,
    double* row_kl,
) noexcept nogil:
    cdef double loss_terms[CHUNK]
    cdef double clipped_terms[CHUNK]
    cdef double dual_terms[CHUNK]
    cdef double kl_terms[CHUNK]
    cdef double loss_lanes[LANES]
    cdef double clipped_lanes[LANES]
    cdef double dual_lanes[LANES]
    cdef double kl_lanes[LANES]
    cdef Py_ssize_t first = 0, n, j, i, valid_end
    for j in range(LANES):
        loss_lanes[j] = clipped_lanes[j] = dual_lanes[j] = kl_lanes[j] = 0.0
    while first < span:
        n = min(CHUNK, span - first)
        # One loop per case, so that no load in it is conditional and, without a mask, validity
        # is a constant: the compiler then vectorizes each (numba's LLVM unswitches the twin).
        valid_end = max(0, min(n, length - first))
        if has_mask and has_weights:
            for j in range(valid_end):
                i = start + first + j
                _policy_token(
                    mask[i] != 0, weights[i],
                    logprobs[i] - old_logprobs[i], advantages[i], low, high, dual, clamp, scale,
                    &grad[i], &loss_terms[j], &clipped_terms[j], &dual_terms[j], &kl_terms[j],
                )
        elif has_mask:
            for j in range(valid_end):
                i = start + first + j
                _policy_token(
                    mask[i] != 0, 1.0,
                    logprobs[i] - old_logprobs[i], advantages[i], low, high, dual, clamp, scale,
                    &grad[i], &loss_terms[j], &clipped_terms[j], &dual_terms[j], &kl_terms[j],
                )
        elif has_weights:
            for j in range(valid_end):
                i = start + first + j
                _policy_token(
                    True, weights[i],
                    logprobs[i] - old_logprobs[i], advantages[i], low, high, dual, clamp, scale,
                    &grad[i], &loss_terms[j], &clipped_terms[j], &dual_terms[j], &kl_terms[j],
                )
        else:
            for j in range(valid_end):
                i = start + first + j
                _policy_token(
                    True, 1.0,
                    logprobs[i] - old_logprobs[i], advantages[i], low, high, dual, clamp, scale,
                    &grad[i], &loss_terms[j], &clipped_terms[j], &dual_terms[j], &kl_terms[j],
                )
        # Past the row's length nothing is valid: what the token function gives there.
        for j in range(valid_end, n):
            grad[start + first + j] = 0.0
            loss_terms[j] = clipped_terms[j] = dual_terms[j] = kl_terms[j] = 0.0
        for j in range(n, (n + LANES - 1) // LANES * LANES):
            loss_terms[j] = clipped_terms[j] = dual_terms[j] = kl_terms[j] = 0.0
        _sum_into_lanes(loss_terms, n, loss_lanes)
        _sum_into_lanes(clipped_terms, n, clipped_lanes)
        _sum_into_lanes(dual_terms, n, dual_lanes)
        _sum_into_lanes(kl_terms, n, kl_lanes)
        first += CHUNK
    row_loss[0] = _lanes_total(loss_lanes)
    row_clipped[0] = _lanes_total(clipped_lanes)
    row_dual[0] = _lanes_total(dual_lanes)
    row_kl[0] = _lanes_total(kl_lanes)


def clipped_surrogate(
    const floating[::1] logprobs,
    const floating[::1] old_logprobs,
    const floating[::1] advantages,
    const floating[::1] weights,
    const int64_t[::1] starts,
    const int64_t[::1] spans,
    const int64_t[::1] lengths,
    const uint8_t[::1] mask,
    const floating[::1] params,
    const floating[::1] grad_scale,
    floating[::1] grad,
    double[::1] row_loss,
    double[::1] row_clipped,
    double[::1] row_dual,
    double[::1] row_kl,
    int n_threads,
):
    """Twin: ppo_fast/_numba_kernels.py _clipped_surrogate_rows. One pass: loss, gradient and
    statistics; params = [1 - clip_low, 1 + clip_high, dual clip, log-ratio clamp]."""
    cdef Py_ssize_t b
    cdef bint has_mask = mask.shape[0] != 0
    cdef bint has_weights = weights.shape[0] != 0
    for b in prange(starts.shape[0], nogil=True, num_threads=max(n_threads, 1), schedule="static"):
        _clipped_surrogate_row(
            &logprobs[0],
            &old_logprobs[0],
            &advantages[0],
            &weights[0],
            has_weights,
            starts[b],
            spans[b],
            lengths[b],
            &mask[0],
            has_mask,
            params[0],
            params[1],
            params[2],
            params[3],
            grad_scale[b],
            &grad[0],
            &row_loss[b],
            &row_clipped[b],
            &row_dual[b],
            &row_kl[b],
        )


cdef inline void _value_token(
    bint valid,
    floating value,
    floating old,
    floating target,
    floating clip_range,
    floating scale,
    floating* grad,
    double* loss_term,
    double* clipped_term,
) noexcept nogil:
    cdef floating zero = scale - scale  # as the twin: 0 in the input dtype
    cdef floating error, unclipped, clipped_error, clipped
    cdef bint is_clipped
    error = value - target
    unclipped = error * error
    clipped_error = clip(value, old - clip_range, old + clip_range) - target
    clipped = clipped_error * clipped_error
    is_clipped = clipped > unclipped
    grad[0] = error * scale if valid & (not is_clipped) else zero
    loss_term[0] = <double>(clipped if is_clipped else unclipped) * 0.5 if valid else 0.0
    clipped_term[0] = 1.0 if valid & is_clipped else 0.0


cdef inline void _value_loss_row(
    const floating* values,
    const floating* old_values,
    const floating* returns,
    Py_ssize_t start,
    Py_ssize_t span,
    Py_ssize_t length,
    const uint8_t* mask,
    bint has_mask,
    floating clip_range,
    floating scale,
    floating* grad,
    double* row_loss,
    double* row_clipped,
) noexcept nogil:
    cdef double loss_terms[CHUNK]
    cdef double clipped_terms[CHUNK]
    cdef double loss_lanes[LANES]
    cdef double clipped_lanes[LANES]
    cdef Py_ssize_t first = 0, n, j, i, valid_end
    for j in range(LANES):
        loss_lanes[j] = clipped_lanes[j] = 0.0
    while first < span:
        n = min(CHUNK, span - first)
        # As in _clipped_surrogate_row: the valid prefix, one loop per case, then the rest.
        valid_end = max(0, min(n, length - first))
        if has_mask:
            for j in range(valid_end):
                i = start + first + j
                _value_token(
                    mask[i] != 0, values[i], old_values[i], returns[i],
                    clip_range, scale, &grad[i], &loss_terms[j], &clipped_terms[j],
                )
        else:
            for j in range(valid_end):
                i = start + first + j
                _value_token(
                    True, values[i], old_values[i], returns[i],
                    clip_range, scale, &grad[i], &loss_terms[j], &clipped_terms[j],
                )
        for j in range(valid_end, n):
            grad[start + first + j] = 0.0
            loss_terms[j] = clipped_terms[j] = 0.0
        for j in range(n, (n + LANES - 1) // LANES * LANES):
            loss_terms[j] = clipped_terms[j] = 0.0
        _sum_into_lanes(loss_terms, n, loss_lanes)
        _sum_into_lanes(clipped_terms, n, clipped_lanes)
        first += CHUNK
    row_loss[0] = _lanes_total(loss_lanes)
    row_clipped[0] = _lanes_total(clipped_lanes)


def value_loss(
    const floating[::1] values,
    const floating[::1] old_values,
    const floating[::1] returns,
    const int64_t[::1] starts,
    const int64_t[::1] spans,
    const int64_t[::1] lengths,
    const uint8_t[::1] mask,
    const floating[::1] params,
    const floating[::1] grad_scale,
    floating[::1] grad,
    double[::1] row_loss,
    double[::1] row_clipped,
    int n_threads,
):
    """Twin: ppo_fast/_numba_kernels.py _value_loss_rows. One pass; params = [clip range]."""
    cdef Py_ssize_t b
    cdef bint has_mask = mask.shape[0] != 0
    for b in prange(starts.shape[0], nogil=True, num_threads=max(n_threads, 1), schedule="static"):
        _value_loss_row(
            &values[0],
            &old_values[0],
            &returns[0],
            starts[b],
            spans[b],
            lengths[b],
            &mask[0],
            has_mask,
            params[0],
            grad_scale[b],
            &grad[0],
            &row_loss[b],
            &row_clipped[b],
        )
