"""The stages' common-case test in C (ppo_fast._checks, src/_checks.pyx) against the same test in
Python (``_validate.python_common_case``): equal on every kind of array that can reach them, and
the C one in use where it is built (CI builds it: PPO_FAST_REQUIRE_CYTHON=1).

The common case is exact NumPy arrays of one float dtype (float32 or float64, native byte order),
2-D, of one shape, C-contiguous, aligned and writeable, with no mask or such a bool mask. A wrong
answer either way is a defect: True sends an array the kernel cannot take straight to it, False
only costs the general way's time, but the two must agree (the fast path's results are the general
way's, tests/test_fast_path.py).
"""

from __future__ import annotations

import importlib.machinery
import itertools
import sys

import numpy as np
import pytest

from ppo_fast import _checks, _validate

SHAPE = (3, 5)


class Subclass(np.ndarray):
    pass


def unaligned(dtype) -> np.ndarray:
    raw = np.zeros(np.prod(SHAPE) * np.dtype(dtype).itemsize + 1, dtype=np.uint8)
    array = raw[1:].view(dtype).reshape(SHAPE)
    assert not array.flags.aligned
    return array


def read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def variants(dtype) -> dict[str, object]:
    """Arrays of ``dtype`` of every kind the fast paths can be given, by name."""
    plain = np.zeros(SHAPE, dtype=dtype)
    wide = np.zeros((SHAPE[0], 2 * SHAPE[1]), dtype=dtype)
    return {
        "plain": plain,
        "other shape": np.zeros((SHAPE[0], SHAPE[1] + 1), dtype=dtype),
        "transposed shape": np.zeros(SHAPE[::-1], dtype=dtype),
        "1-D": np.zeros(SHAPE[0] * SHAPE[1], dtype=dtype),
        "3-D": np.zeros((*SHAPE, 1), dtype=dtype),
        "0-D": np.zeros((), dtype=dtype),
        "Fortran order": np.asfortranarray(plain.copy()),
        "strided view": wide[:, ::2],
        "read-only": read_only(plain.copy()),
        "subclass": plain.copy().view(Subclass),
        "masked array": np.ma.zeros(SHAPE, dtype=dtype),
        "memmap-like subclass": plain.copy().view(np.memmap),
        "byte-swapped": plain.astype(np.dtype(dtype).newbyteorder()),
        "dtype with metadata": plain.astype(np.dtype(dtype, metadata={"unit": "nat"})),
        "list": plain.tolist(),
        "scalar": dtype(0) if np.dtype(dtype).kind != "b" else True,
    } | ({"unaligned": unaligned(dtype)} if np.dtype(dtype).itemsize > 1 else {})


FLOATS = (np.float32, np.float64)
OTHERS = (np.float16, np.int64, np.uint8, np.bool_, np.complex64)


def inputs() -> list[tuple[str, object]]:
    cases = []
    for dtype in (*FLOATS, *OTHERS):
        for name, value in variants(dtype).items():
            cases.append((f"{np.dtype(dtype).name} {name}", value))
    return cases


def test_the_compiled_test_is_the_one_in_use():
    assert _validate.common_case is _checks.common_case
    assert _checks.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_the_common_case_is_accepted_and_each_departure_from_it_refused():
    for dtype in FLOATS:
        a, b, c = (np.zeros(SHAPE, dtype=dtype) for _ in range(3))
        mask = np.ones(SHAPE, dtype=bool)
        for test in (_checks.common_case, _validate.python_common_case):
            assert test((a,), None)
            assert test((a, b, c), None)
            assert test((a, b, c), mask)
            assert test((np.zeros((0, 4), dtype),), np.ones((0, 4), bool))  # empty: C-contiguous
            other = np.float64 if dtype == np.float32 else np.float32
            assert not test((a, np.zeros(SHAPE, other)), mask)  # one dtype
            assert not test((a, b), mask.astype(np.uint8))  # a mask of numbers: converted first
            assert not test((a, b), mask[:, :-1])
            for name, value in variants(dtype).items():
                # Another 2-D shape is the common case alone, not beside ``a``.
                alone = name in ("plain", "other shape", "transposed shape")
                assert test((value,), None) == alone, name
                assert test((a, value), None) == (name == "plain"), name
            for name, value in variants(np.bool_).items():
                assert test((a,), value) == (name == "plain"), name


@pytest.mark.parametrize("n_arrays", [1, 2, 3, 4])
def test_the_compiled_test_equals_the_python_one_on_every_kind_of_input(n_arrays):
    cases = inputs()
    masks = [("no mask", None), *inputs()]
    plain32 = np.zeros(SHAPE, dtype=np.float32)
    # Every first array against every mask, then every array in every later place beside a
    # common first one (and the common first one in every place after an odd one).
    checked = 0
    for (first_name, first), (mask_name, mask) in itertools.product(cases, masks):
        arrays = (first,) + (np.zeros(SHAPE, dtype=np.float32),) * (n_arrays - 1)
        expected = _validate.python_common_case(arrays, mask)
        assert _checks.common_case(arrays, mask) == expected, (first_name, mask_name)
        checked += expected
    for place in range(1, n_arrays):
        for name, value in cases:
            arrays = [plain32] * n_arrays
            arrays[place] = value
            arrays = tuple(arrays)
            for mask in (None, np.ones(SHAPE, bool)):
                expected = _validate.python_common_case(arrays, mask)
                assert _checks.common_case(arrays, mask) == expected, (place, name)
    assert checked > 0  # the common case itself was among them


def test_the_inputs_are_not_modified_or_kept():
    a = np.zeros(SHAPE, np.float32)
    mask = np.ones(SHAPE, bool)
    before = (a.flags.writeable, mask.flags.writeable)
    counts = (sys.getrefcount(a), sys.getrefcount(mask))
    for _ in range(100):
        _checks.common_case((a, a), mask)
        _checks.common_case((a, a.T), mask)
    assert (a.flags.writeable, mask.flags.writeable) == before
    assert (sys.getrefcount(a), sys.getrefcount(mask)) == counts
