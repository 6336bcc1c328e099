# cython: language_level=3, boundscheck=False, wraparound=False
"""The stages' common-case checks (``ppo_fast._validate.common_case`` and ``common_packed``) in C.

The fast paths of the stages start by asking whether their token arrays and mask are the common
case: exact NumPy arrays of one float dtype, 2-D, of one shape, C-contiguous, aligned and
writeable, with no mask or such a bool mask. In Python those are a dozen attribute reads an array
(``flags`` builds an object each time): 0.6 us of a 4.6 us clipped surrogate at 8 x 128. Here
they are reads of the array's fields: about 50 ns. ``_validate.python_common_case`` is the same
test in Python, used where this module is not built; tests/test_checks.py holds the two equal on
every kind of array that can reach them. ``common_packed`` does the same for packed rows (1-D
arrays and cu_seqlens), and makes their starts and spans in the pass that checks cu_seqlens.

Built by setup.py beside the kernels, against NumPy's headers (NumPy 2's, which also run on NumPy
1.x); it reads array fields only and calls nothing in NumPy's C API.
"""

cimport numpy as cnp

import numpy as np

# Compared by identity, as the Python test does (``dtype is``): a byte-swapped float32, or one
# with metadata, is another dtype object, and goes the general way.
cdef object NDARRAY = np.ndarray
cdef object FLOAT32 = np.dtype(np.float32)
cdef object FLOAT64 = np.dtype(np.float64)
cdef object BOOL = np.dtype(np.bool_)
cdef object INT32 = np.dtype(np.int32)
cdef object INT64 = np.dtype(np.int64)
cdef object EMPTY = np.empty


cdef inline bint _is_carray(cnp.ndarray array):
    # ``array.flags.carray``: C-contiguous, aligned and writeable.
    return (cnp.PyArray_FLAGS(array) & cnp.NPY_ARRAY_CARRAY) == cnp.NPY_ARRAY_CARRAY


cdef inline bint _tokens(tuple arrays, int ndim):
    """Whether ``arrays`` are exact ndarrays of one float dtype and one ``ndim``-D shape,
    C-contiguous, aligned and writeable."""
    first = arrays[0]
    if type(first) is not NDARRAY:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>first
    if not _is_carray(array) or cnp.PyArray_NDIM(array) != ndim:
        return False
    cdef void *dtype = <void *>cnp.PyArray_DESCR(array)
    if dtype != <void *>FLOAT32 and dtype != <void *>FLOAT64:
        return False
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(array)
    cdef Py_ssize_t k
    for k in range(1, len(arrays)):
        if not _like(arrays[k], dtype, shape, ndim):
            return False
    return True


cdef inline bint _like(object value, void *dtype, cnp.npy_intp *shape, int ndim):
    """Whether ``value`` is an exact ndarray of ``dtype`` and the ``ndim``-D (1 or 2)
    ``shape``, C-contiguous, aligned and writeable."""
    if type(value) is not NDARRAY:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>value
    if <void *>cnp.PyArray_DESCR(array) != dtype or cnp.PyArray_NDIM(array) != ndim:
        return False
    cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(array)
    return (
        dims[0] == shape[0] and (ndim == 1 or dims[1] == shape[1]) and _is_carray(array)
    )


def common_case(tuple arrays, object mask):
    """``_validate.python_common_case(arrays, mask)``: whether the token ``arrays`` (a tuple,
    one or more) and the ``mask`` (None or an array) are the common case."""
    if not _tokens(arrays, 2):
        return False
    cdef cnp.ndarray first = <cnp.ndarray>arrays[0]
    return mask is None or _like(mask, <void *>BOOL, cnp.PyArray_DIMS(first), 2)


def common_packed(tuple arrays, object cu_seqlens):
    """``_validate.python_common_packed(arrays, cu_seqlens)``: the rows' (starts, spans), int64
    arrays of their own, where the token ``arrays`` (a tuple, one or more) and ``cu_seqlens`` are
    the packed common case; else None."""
    if not _tokens(arrays, 1) or type(cu_seqlens) is not NDARRAY:
        return None
    cdef cnp.ndarray cu = <cnp.ndarray>cu_seqlens
    cdef void *kind = <void *>cnp.PyArray_DESCR(cu)
    cdef int flags = cnp.PyArray_FLAGS(cu)
    if (
        (kind != <void *>INT64 and kind != <void *>INT32)
        or cnp.PyArray_NDIM(cu) != 1
        or cnp.PyArray_DIMS(cu)[0] < 1
        or flags & cnp.NPY_ARRAY_ALIGNED == 0
        or flags & cnp.NPY_ARRAY_C_CONTIGUOUS == 0
    ):
        return None
    cdef cnp.npy_intp n_rows = cnp.PyArray_DIMS(cu)[0] - 1
    cdef cnp.npy_intp n_tokens = cnp.PyArray_DIMS(<cnp.ndarray>arrays[0])[0]
    cdef cnp.ndarray starts = EMPTY(n_rows, INT64)
    cdef cnp.ndarray spans = EMPTY(n_rows, INT64)
    cdef cnp.int64_t *start = <cnp.int64_t *>cnp.PyArray_DATA(starts)
    cdef cnp.int64_t *span = <cnp.int64_t *>cnp.PyArray_DATA(spans)
    cdef cnp.int64_t *wide = <cnp.int64_t *>cnp.PyArray_DATA(cu)
    cdef cnp.int32_t *narrow = <cnp.int32_t *>cnp.PyArray_DATA(cu)
    cdef bint is_wide = kind == <void *>INT64
    cdef cnp.int64_t low = wide[0] if is_wide else narrow[0]
    cdef cnp.int64_t high
    cdef cnp.npy_intp b
    if low != 0:
        return None
    for b in range(n_rows):
        high = wide[b + 1] if is_wide else narrow[b + 1]
        if high < low:
            return None
        start[b] = low
        span[b] = high - low
        low = high
    if low != n_tokens:
        return None
    return starts, spans
