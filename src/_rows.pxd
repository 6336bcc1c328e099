# cython: language_level=3
"""Per-token helpers shared by the row kernels of src/*.pyx.

Twins of ``kl_value`` and of the validity test that the kernels of ppo_fast/_numba_kernels.py
write inline (both mirror ppo_fast/_reference.py). They are ``cdef inline``, so this file
compiles into every kernel that cimports it and needs no module of its own.
"""

from libc.math cimport INFINITY, exp, fabs
from libc.stdint cimport uint8_t

# Estimator codes, as in ppo_fast/rewards.py.
cdef enum:
    K1 = 0
    K2 = 1
    K3 = 2
    ABS = 3


cdef inline bint is_valid(
    const uint8_t* mask, bint has_mask, Py_ssize_t i, Py_ssize_t t, Py_ssize_t length
) noexcept nogil:
    # An empty mask means every position within the row's length is valid.
    return t < length and (not has_mask or mask[i] != 0)


cdef inline double kl_value(double log_ratio, int estimator, double clamp) noexcept nogil:
    cdef double value
    if estimator == K1:
        value = log_ratio
    elif estimator == K2:
        value = 0.5 * log_ratio * log_ratio
    elif estimator == K3:
        # exp(-log_ratio) overflows to inf for log_ratio < -709; the clamp then bounds it.
        value = (exp(-log_ratio) if -log_ratio < 709.0 else INFINITY) - 1.0 + log_ratio
    else:
        value = fabs(log_ratio)
    # The twins' min(max(value, -clamp), clamp), comparison for comparison: NaN stays NaN.
    if -clamp > value:
        value = -clamp
    if clamp < value:
        value = clamp
    return value
