# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True
"""The Cython backend: one kernel per stage, written over rows.

setup.py builds this file as ppo_fast._cython_kernels (any CPU) and, on x86-64, also as
ppo_fast._cython_kernels_avx2 (CPUs with AVX2 and FMA) and ppo_fast._cython_kernels_avx512 (with
AVX-512 F and DQ too); ppo_fast/_cython_backend.py takes the widest in ``CPU_BUILDS``.
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
  ``llvm.fma`` (the GAE chain here, the polynomial exp of k3 and the losses in src/_lanes.h),
  and setup.py compiles with ``-ffp-contract=off`` so that nothing else is fused (numba does not
  contract). Every build gives the same bits; numba gives them too, up to the order of the row
  sums of the moments and loss kernels (see the rows in C below).
- The KL, shaped-reward, moments and loss kernels do their rows in C, src/_loss_rows.h, over the
  explicit lanes of src/_lanes.h; both headers are included below and compiled into this module.
- Bounds and wrap-around checks are off (the twins index with unsigned integers for the same
  reason); the stages validate every index before they call in.
- Without OpenMP the ``prange`` loops run serially; ``OPENMP`` says which build this is.
"""

from cython.parallel cimport prange
from libc.math cimport fma
from libc.stdint cimport int64_t, uint8_t

from _rows cimport is_valid

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
    #if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__) && defined(__AVX512DQ__)
    #define PPO_FAST_BUILD "avx512"
    #elif defined(__AVX2__) && defined(__FMA__)
    #define PPO_FAST_BUILD "avx2-fma"
    #else
    #define PPO_FAST_BUILD "portable"
    #endif
    /* The widest build this CPU (and its OS, which libgcc's checks include) can run:
     * 2 for avx512, 1 for avx2-fma, 0 for portable only. */
    static int ppo_fast_cpu_level(void) {
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        __builtin_cpu_init();
        if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? 2 : 1;
    #else
        return 0;
    #endif
    }
    """
    const int PPO_FAST_OPENMP
    const char* PPO_FAST_BUILD
    int ppo_fast_cpu_level()

OPENMP = bool(PPO_FAST_OPENMP)
BUILD = PPO_FAST_BUILD.decode("ascii")  # the instructions this module was compiled for
CPU_BUILDS = ("avx512", "avx2-fma", "portable")[2 - ppo_fast_cpu_level():]  # widest first


# -- Rows in C ------------------------------------------------------------------------------------
#
# The KL, shaped-reward and moments rows, and the fused losses' rows: each is one call to a kernel
# of src/_loss_rows.h, written in C over the eight explicit lanes of src/_lanes.h (AVX2 and FMA
# intrinsics in the _avx2 build, AVX-512 for float64 in the _avx512 build, generic vectors
# otherwise), with the same arithmetic as the numba twins. Why C: their exp is vectorized (k3 and
# the policy loss), which libm's is not; and a row's loss or moments is a sum, and GCC vectorizes
# a floating-point sum only if it may reassociate it, which would tie the order of addition to each
# build's vector width; the lanes fix that order in the source (token t of a row in lane t % 8, the
# lanes added up in a fixed tree), so every build and any number of threads give the same bits.
# The twins sum in another order (LLVM's reassoc), so sums agree with numba's to rounding.

cdef extern from *:
    """
    #define PPO_FAST_LOSS_DTYPE 32
    #include "_loss_rows.h"
    #undef PPO_FAST_LOSS_DTYPE
    #define PPO_FAST_LOSS_DTYPE 64
    #include "_loss_rows.h"
    #undef PPO_FAST_LOSS_DTYPE
    """
    void ppo_kl_penalty_row_f32(
        const float* logprobs, const float* ref_logprobs, Py_ssize_t start, Py_ssize_t span,
        int estimator, double clamp, float* out,
    ) noexcept nogil
    void ppo_kl_penalty_row_f64(
        const double* logprobs, const double* ref_logprobs, Py_ssize_t start, Py_ssize_t span,
        int estimator, double clamp, double* out,
    ) noexcept nogil
    void ppo_shape_rewards_row_f32(
        double score, const float* logprobs, const float* ref_logprobs, Py_ssize_t start,
        Py_ssize_t span, Py_ssize_t length, const uint8_t* mask, bint has_mask, double kl_coef,
        int estimator, double clamp, float* out,
    ) noexcept nogil
    void ppo_shape_rewards_row_f64(
        double score, const double* logprobs, const double* ref_logprobs, Py_ssize_t start,
        Py_ssize_t span, Py_ssize_t length, const uint8_t* mask, bint has_mask, double kl_coef,
        int estimator, double clamp, double* out,
    ) noexcept nogil
    void ppo_moments_row_f32(
        const float* x, Py_ssize_t start, Py_ssize_t span, Py_ssize_t length,
        const uint8_t* mask, bint has_mask, double shift, double* count, double* total,
        double* total_sq,
    ) noexcept nogil
    void ppo_moments_row_f64(
        const double* x, Py_ssize_t start, Py_ssize_t span, Py_ssize_t length,
        const uint8_t* mask, bint has_mask, double shift, double* count, double* total,
        double* total_sq,
    ) noexcept nogil
    void ppo_clipped_surrogate_row_f32(
        const float* logprobs, const float* old_logprobs, const float* advantages,
        const float* weights, bint has_weights, Py_ssize_t start, Py_ssize_t span,
        Py_ssize_t length, const uint8_t* mask, bint has_mask, const float* params, float scale,
        float* grad, double* row_loss, double* row_clipped, double* row_dual, double* row_kl,
    ) noexcept nogil
    void ppo_clipped_surrogate_row_f64(
        const double* logprobs, const double* old_logprobs, const double* advantages,
        const double* weights, bint has_weights, Py_ssize_t start, Py_ssize_t span,
        Py_ssize_t length, const uint8_t* mask, bint has_mask, const double* params,
        double scale, double* grad, double* row_loss, double* row_clipped, double* row_dual,
        double* row_kl,
    ) noexcept nogil
    void ppo_value_loss_row_f32(
        const float* values, const float* old_values, const float* returns, Py_ssize_t start,
        Py_ssize_t span, Py_ssize_t length, const uint8_t* mask, bint has_mask,
        float clip_range, float scale, float* grad, double* row_loss, double* row_clipped,
    ) noexcept nogil
    void ppo_value_loss_row_f64(
        const double* values, const double* old_values, const double* returns,
        Py_ssize_t start, Py_ssize_t span, Py_ssize_t length, const uint8_t* mask,
        bint has_mask, double clip_range, double scale, double* grad, double* row_loss,
        double* row_clipped,
    ) noexcept nogil


cdef inline void _kl_penalty_row(
    const floating* logprobs,
    const floating* ref_logprobs,
    Py_ssize_t start,
    Py_ssize_t span,
    int estimator,
    double clamp,
    floating* out,
) noexcept nogil:
    if floating is float:
        ppo_kl_penalty_row_f32(logprobs, ref_logprobs, start, span, estimator, clamp, out)
    else:
        ppo_kl_penalty_row_f64(logprobs, ref_logprobs, start, span, estimator, clamp, out)


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
    if floating is float:
        ppo_shape_rewards_row_f32(
            score, logprobs, ref_logprobs, start, span, length, mask, has_mask, kl_coef,
            estimator, clamp, out,
        )
    else:
        ppo_shape_rewards_row_f64(
            score, logprobs, ref_logprobs, start, span, length, mask, has_mask, kl_coef,
            estimator, clamp, out,
        )


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
    if floating is float:
        ppo_moments_row_f32(x, start, span, length, mask, has_mask, shift, count, total, total_sq)
    else:
        ppo_moments_row_f64(x, start, span, length, mask, has_mask, shift, count, total, total_sq)


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
    const floating* params,
    floating scale,
    floating* grad,
    double* row_loss,
    double* row_clipped,
    double* row_dual,
    double* row_kl,
) noexcept nogil:
    if floating is float:
        ppo_clipped_surrogate_row_f32(
            logprobs, old_logprobs, advantages, weights, has_weights, start, span, length, mask,
            has_mask, params, scale, grad, row_loss, row_clipped, row_dual, row_kl,
        )
    else:
        ppo_clipped_surrogate_row_f64(
            logprobs, old_logprobs, advantages, weights, has_weights, start, span, length, mask,
            has_mask, params, scale, grad, row_loss, row_clipped, row_dual, row_kl,
        )


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
            &params[0],
            grad_scale[b],
            &grad[0],
            &row_loss[b],
            &row_clipped[b],
            &row_dual[b],
            &row_kl[b],
        )


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
    if floating is float:
        ppo_value_loss_row_f32(
            values, old_values, returns, start, span, length, mask, has_mask, clip_range, scale,
            grad, row_loss, row_clipped,
        )
    else:
        ppo_value_loss_row_f64(
            values, old_values, returns, start, span, length, mask, has_mask, clip_range, scale,
            grad, row_loss, row_clipped,
        )


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
