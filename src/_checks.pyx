# cython: language_level=3, boundscheck=False, wraparound=False
"""The stages' common-case check (``ppo_fast._validate.common_case``) in C.

The fast paths of the stages start by asking whether their token arrays and mask are the common
case: exact NumPy arrays of one float dtype, 2-D, of one shape, C-contiguous, aligned and
writeable, with no mask or such a bool mask. In Python those are a dozen attribute reads an array
(``flags`` builds an object each time): 0.6 us of a 4.6 us clipped surrogate at 8 x 128. Here
they are reads of the array's fields: about 50 ns. ``_validate.python_common_case`` is the same
test in Python, used where this module is not built; tests/test_checks.py holds the two equal on
every kind of array that can reach them.

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


cdef inline bint _is_carray(cnp.ndarray array):
    # ``array.flags.carray``: C-contiguous, aligned and writeable.
    return (cnp.PyArray_FLAGS(array) & cnp.NPY_ARRAY_CARRAY) == cnp.NPY_ARRAY_CARRAY


cdef inline bint _like(object value, void *dtype, cnp.npy_intp *shape):
    """Whether ``value`` is an exact ndarray of ``dtype`` and the 2-D ``shape``, C-contiguous,
    aligned and writeable."""
    if type(value) is not NDARRAY:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>value
    if <void *>cnp.PyArray_DESCR(array) != dtype or cnp.PyArray_NDIM(array) != 2:
        return False
    cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(array)
    return dims[0] == shape[0] and dims[1] == shape[1] and _is_carray(array)


def common_case(tuple arrays, object mask):
    """``_validate.python_common_case(arrays, mask)``: whether the token ``arrays`` (a tuple,
    one or more) and the ``mask`` (None or an array) are the common case."""
    first = arrays[0]
    if type(first) is not NDARRAY:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>first
    if not _is_carray(array) or cnp.PyArray_NDIM(array) != 2:
        return False
    cdef void *dtype = <void *>cnp.PyArray_DESCR(array)
    if dtype != <void *>FLOAT32 and dtype != <void *>FLOAT64:
        return False
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(array)
    cdef Py_ssize_t k
    for k in range(1, len(arrays)):
        if not _like(arrays[k], dtype, shape):
            return False
    return mask is None or _like(mask, <void *>BOOL, shape)
