# cython: language_level=3
"""Per-token helpers shared by the row kernels of src/*.pyx.

Twin of the validity test that the kernels of ppo_fast/_numba_kernels.py write inline (it
mirrors ppo_fast/_reference.py). It is ``cdef inline``, so this file compiles into every kernel
that cimports it and needs no module of its own. The KL estimators are in src/_loss_rows.h
(``ppo_kl_values``), over the lanes of src/_lanes.h.
"""

from libc.stdint cimport uint8_t


cdef inline bint is_valid(
    const uint8_t* mask, bint has_mask, Py_ssize_t i, Py_ssize_t t, Py_ssize_t length
) noexcept nogil:
    # An empty mask means every position within the row's length is valid.
    return t < length and (not has_mask or mask[i] != 0)
