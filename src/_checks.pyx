# cython: language_level=3, boundscheck=False, wraparound=False
"""The stages' common-case checks (``ppo_fast._validate.common_case``, ``common_packed``,
``common_outputs`` and ``lengths_mask``) in C.

The fast paths of the stages start by asking whether their token arrays and mask are the common
case: exact NumPy arrays of one float dtype, 2-D, of one shape, C-contiguous, aligned and
writeable, with no mask or such a bool mask. In Python those are a dozen attribute reads an array
(``flags`` builds an object each time): 0.6 us of a 4.6 us clipped surrogate at 8 x 128. Here
they are reads of the array's fields: about 50 ns. ``_validate.python_common_case`` is the same
test in Python, used where this module is not built; tests/test_checks.py holds the two equal on
every kind of array that can reach them. ``common_packed`` does the same for packed rows (1-D
arrays and cu_seqlens), and makes their starts and spans in the pass that checks cu_seqlens;
``common_outputs`` tests preallocated outputs (``out=``, ``grad_out=``) beside such inputs;
``lengths_mask`` checks lengths and writes the bool mask of their valid positions in one pass
(0.2 us at 8 x 128, where NumPy's reduction and comparison took 3.7 us).

Built by setup.py beside the kernels, against NumPy's headers (NumPy 2's, which also run on NumPy
1.x); it reads array fields only and calls nothing in NumPy's C API.
"""

cimport numpy as cnp
from libc.string cimport memcpy, memset

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
# ppo_fast._common_case.LENGTHS_AS_MASK_POSITIONS (tests/test_checks.py holds them equal)
cdef cnp.npy_intp MASK_POSITIONS = 1 << 16
LENGTHS_AS_MASK_POSITIONS = MASK_POSITIONS


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


cdef inline void _extent(cnp.ndarray array, char **low, char **high):
    """The bytes ``array`` spans, [low, high), as ``np.may_share_memory`` bounds them (its
    strides, negative ones included); empty for an array of no items. The item size is the
    Python attribute: NumPy 2's headers read it through the C API on NumPy 1.x."""
    cdef char *data = <char *>cnp.PyArray_DATA(array)
    cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(array)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(array)
    cdef int k
    cdef cnp.npy_intp below = 0, above = 0
    for k in range(cnp.PyArray_NDIM(array)):
        if dims[k] == 0:
            low[0] = high[0] = data
            return
        if strides[k] < 0:
            below += strides[k] * (dims[k] - 1)
        else:
            above += strides[k] * (dims[k] - 1)
    low[0] = data + below
    high[0] = data + above + <cnp.npy_intp>(<object>array).itemsize


cdef inline bint _overlap(cnp.ndarray a, cnp.ndarray b):
    """``np.may_share_memory(a, b)``: whether the bytes the two span overlap."""
    cdef char *low_a
    cdef char *high_a
    cdef char *low_b
    cdef char *high_b
    _extent(a, &low_a, &high_a)
    _extent(b, &low_b, &high_b)
    return low_a < high_b and low_b < high_a and low_a < high_a and low_b < high_b


def common_outputs(tuple outputs, object like, tuple inputs):
    """``_validate.python_common_outputs(outputs, like, inputs)``: whether the preallocated
    ``outputs`` (a tuple) are the common case beside ``inputs`` (a tuple of arrays and Nones) of
    the common case, ``like`` the first of them. In Python, 0.2 us a pair of arrays that do not
    both own their data (``np.may_share_memory``) and a ``flags`` object an array: about 1 us of
    gae's 3.8 us with ``out=`` at 8 x 128."""
    if type(like) is not NDARRAY:
        return False
    cdef cnp.ndarray reference = <cnp.ndarray>like
    cdef void *dtype = <void *>cnp.PyArray_DESCR(reference)
    cdef int ndim = cnp.PyArray_NDIM(reference)
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(reference)
    cdef Py_ssize_t k, j, n_inputs = len(inputs)
    cdef cnp.ndarray out, other_array
    cdef bint owns
    cdef int d
    for k in range(len(outputs)):
        value = outputs[k]
        if type(value) is not NDARRAY:
            return False
        out = <cnp.ndarray>value
        if <void *>cnp.PyArray_DESCR(out) != dtype or cnp.PyArray_NDIM(out) != ndim:
            return False
        for d in range(ndim):
            if cnp.PyArray_DIMS(out)[d] != shape[d]:
                return False
        if not _is_carray(out):
            return False
        owns = cnp.PyArray_FLAGS(out) & cnp.NPY_ARRAY_OWNDATA != 0
        for j in range(n_inputs + k):
            other = inputs[j] if j < n_inputs else outputs[j - n_inputs]
            if other is None:
                continue
            if not isinstance(other, NDARRAY):
                return False  # the callers pass arrays and Nones: anything else, the general way
            other_array = <cnp.ndarray>other
            # two distinct arrays that own their data (NumPy allocated each) share none
            if (
                owns
                and other is not value
                and cnp.PyArray_FLAGS(other_array) & cnp.NPY_ARRAY_OWNDATA
            ):
                continue
            if _overlap(out, other_array):
                return False
    return True


def lengths_mask(tuple arrays, object lengths):
    """``_common_case.python_lengths_mask(arrays, lengths)``: the bool mask of the positions
    t < lengths[b] beside padded ``arrays`` of the common case (no mask), an array of its own,
    where ``lengths`` is an exact 1-D int64 or int32 ndarray (any strides, aligned or not) of one
    entry a row, each in [0, T], for at most LENGTHS_AS_MASK_POSITIONS positions; else False."""
    if not _tokens(arrays, 2) or type(lengths) is not NDARRAY:
        return False
    cdef cnp.ndarray given = <cnp.ndarray>lengths
    cdef void *kind = <void *>cnp.PyArray_DESCR(given)
    if (kind != <void *>INT64 and kind != <void *>INT32) or cnp.PyArray_NDIM(given) != 1:
        return False
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(<cnp.ndarray>arrays[0])
    cdef cnp.npy_intp n_rows = shape[0], width = shape[1]
    if cnp.PyArray_DIMS(given)[0] != n_rows or n_rows * width > MASK_POSITIONS:
        return False
    cdef char *entry = <char *>cnp.PyArray_DATA(given)
    cdef cnp.npy_intp stride = cnp.PyArray_STRIDES(given)[0], b
    cdef bint is_wide = kind == <void *>INT64
    cdef cnp.int64_t wide
    cdef cnp.int32_t narrow
    for b in range(n_rows):  # the bounds first: nothing is allocated for lengths refused
        if is_wide:
            memcpy(&wide, entry + b * stride, 8)
        else:
            memcpy(&narrow, entry + b * stride, 4)
            wide = narrow
        if wide < 0 or wide > width:
            return False
    cdef cnp.ndarray mask = EMPTY((n_rows, width), BOOL)
    cdef char *row = <char *>cnp.PyArray_DATA(mask)
    for b in range(n_rows):
        if is_wide:
            memcpy(&wide, entry + b * stride, 8)
        else:
            memcpy(&narrow, entry + b * stride, 4)
            wide = narrow
        memset(row, 1, <size_t>wide)
        memset(row + wide, 0, <size_t>(width - wide))
        row += width
    return mask
