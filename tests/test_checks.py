"""The stages' common-case test in C (ppo_fast._checks, src/_checks.pyx) against the same test in
Python (``_validate.python_common_case``): equal on every kind of array that can reach them, and
the C one in use where it is built (CI builds it: PPO_FAST_REQUIRE_CYTHON=1).

The common case is exact NumPy arrays of one float dtype (float32 or float64, native byte order),
2-D, of one shape, C-contiguous, aligned and writeable, with no mask or such a bool mask. A wrong
answer either way is a defect: True sends an array the kernel cannot take straight to it, False
only costs the general way's time, but the two must agree (the fast path's results are the general
way's, tests/test_fast_path.py). The packed rows' test, the preallocated outputs' and the lengths
taken as a mask (``lengths_mask``) are held to their Python twins the same way.
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


# ---- packed rows: 1-D token arrays and cu_seqlens (``common_packed``) ----

N_TOKENS = 15  # SHAPE's positions, packed


def packed_variants(dtype) -> dict[str, object]:
    """1-D token arrays of every kind, by name (``variants`` of the packed shape)."""
    plain = np.zeros(N_TOKENS, dtype=dtype)
    return {
        "plain": plain,
        "other length": np.zeros(N_TOKENS + 1, dtype=dtype),
        "2-D": np.zeros(SHAPE, dtype=dtype),
        "0-D": np.zeros((), dtype=dtype),
        "strided view": np.zeros(2 * N_TOKENS, dtype=dtype)[::2],
        "read-only": read_only(plain.copy()),
        "subclass": plain.copy().view(Subclass),
        "byte-swapped": plain.astype(np.dtype(dtype).newbyteorder()),
        "list": plain.tolist(),
    } | ({"unaligned": np.zeros(N_TOKENS * np.dtype(dtype).itemsize + 1, np.uint8)[1:].view(dtype)}
         if np.dtype(dtype).itemsize > 1 else {})  # fmt: skip


def cu_variants() -> dict[str, object]:
    """cu_seqlens of every kind, for N_TOKENS tokens, by name."""
    good = np.array([0, 4, 4, 11, 15])
    wide = np.zeros(2 * good.size, np.int64)
    wide[::2] = good
    unaligned_cu = np.zeros(good.size * 8 + 1, np.uint8)[1:].view(np.int64)
    unaligned_cu[:] = good
    return {
        "int64": good,
        "int32": good.astype(np.int32),
        "read-only int64": read_only(good.copy()),
        "one row": np.array([0, N_TOKENS]),
        "empty rows only": np.array([0, 0, 0, N_TOKENS]),
        "int16": good.astype(np.int16),
        "uint64": good.astype(np.uint64),
        "float": good.astype(np.float64),
        "byte-swapped": good.astype(np.dtype(np.int64).newbyteorder()),
        "strided view": wide[::2],
        "unaligned": unaligned_cu,
        "2-D": good[None, :],
        "subclass": good.copy().view(Subclass),
        "list": good.tolist(),
        "empty": np.zeros(0, np.int64),
        "no rows": np.array([0]),
        "not from 0": np.array([1, 4, 15]),
        "decreasing": np.array([0, 5, 4, 15]),
        "short of N": np.array([0, 4, 14]),
        "past N": np.array([0, 4, 16]),
        "negative": np.array([0, -1, 15]),
        "int32 decreasing": np.array([0, 5, 4, 15], np.int32),
        "scalar": np.int64(0),
        "None": None,
    }


def test_the_packed_common_case_gives_the_general_ways_starts_and_spans():
    """Accepted: exact 1-D float arrays of one dtype and length and an int64 or int32 C-contiguous
    cu_seqlens from 0 to N, never decreasing (read-only too): the starts and spans of
    ``_validate.rows``, int64 arrays of their own. Everything else: None."""
    accepted = {"int64", "int32", "read-only int64", "one row", "empty rows only"}
    for test in (_checks.common_packed, _validate.python_common_packed):
        for dtype in FLOATS:
            a, b = np.zeros(N_TOKENS, dtype), np.ones(N_TOKENS, dtype)
            for name, cu in cu_variants().items():
                got = test((a, b), cu)
                assert (got is not None) == (name in accepted), (test, name)
                if got is None:
                    continue
                rows = _validate.rows((N_TOKENS,), cu_seqlens=cu)
                for made, expected in zip(got, (rows.starts, rows.spans), strict=True):
                    assert made.dtype == np.int64 and made.flags.c_contiguous, name
                    assert np.array_equal(made, expected), name
                    assert not np.may_share_memory(made, cu), name
            other = np.float64 if dtype == np.float32 else np.float32
            assert test((a, np.zeros(N_TOKENS, other)), np.array([0, 15])) is None
            assert test((np.zeros(0, dtype),), np.array([0])) is not None  # no rows, no tokens
            for name, value in packed_variants(dtype).items():
                alone = name in ("plain", "other length")
                cu = np.array([0, np.size(value)]) if np.ndim(value) == 1 else np.array([0, 15])
                assert (test((value,), cu) is not None) == alone, name
                assert (test((a, value), np.array([0, 15])) is not None) == (name == "plain")


@pytest.mark.parametrize("n_arrays", [1, 2, 3])
def test_the_compiled_packed_test_equals_the_python_one_on_every_kind_of_input(n_arrays):
    tokens = [
        (f"{np.dtype(dtype).name} {name}", value)
        for dtype in (*FLOATS, *OTHERS)
        for name, value in packed_variants(dtype).items()
    ]
    checked = 0
    for (token_name, first), (cu_name, cu) in itertools.product(tokens, cu_variants().items()):
        arrays = (first,) + (np.zeros(N_TOKENS, dtype=np.float32),) * (n_arrays - 1)
        expected = _validate.python_common_packed(arrays, cu)
        got = _checks.common_packed(arrays, cu)
        assert (got is None) == (expected is None), (token_name, cu_name)
        if got is not None:
            assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
            checked += 1
    assert checked > 0


# The compiled tests that take a second array, each with its token array, an accepted second
# array and a refused one made from it (reversed cu_seqlens; lengths past T).
SECOND_ARRAYS = {
    "common_packed": (lambda: np.zeros(N_TOKENS, np.float32), [0, 4, 15], lambda cu: cu[::-1]),
    "lengths_mask": (lambda: np.zeros(SHAPE, np.float32), [1, 5, 0], lambda lengths: lengths + 1),
}


@pytest.mark.parametrize("name", list(SECOND_ARRAYS))
def test_the_compiled_tests_of_cu_seqlens_and_lengths_are_in_use_and_keep_nothing(name):
    """``_validate`` uses the compiled test, and its accepted and refused calls leave no
    reference to their arrays behind and the arrays as they were."""
    assert getattr(_validate, name) is getattr(_checks, name)
    test = getattr(_checks, name)
    tokens, values, refused = SECOND_ARRAYS[name]
    a, given = tokens(), np.array(values)
    counts = (sys.getrefcount(a), sys.getrefcount(given))
    for _ in range(100):
        test((a, a), given)
        test((a, a), refused(given))
    assert (sys.getrefcount(a), sys.getrefcount(given)) == counts
    assert np.array_equal(given, values)


# ---- preallocated outputs beside the inputs (``common_outputs``) ----


def output_cases() -> dict[str, tuple[tuple, np.ndarray, tuple]]:
    """(outputs, like, inputs) of every kind that reaches ``common_outputs``, by name: outputs of
    every variant, and outputs that share bytes with an input or with each other, or do not
    though neither owns its data (views of one buffer, apart), in every position."""
    a, b = np.zeros(SHAPE, np.float32), np.ones(SHAPE, np.float32)
    mask = np.ones(SHAPE, bool)
    base = np.zeros((4, *SHAPE), np.float32)  # one buffer: its planes are apart
    wide = np.zeros((SHAPE[0], 3 * SHAPE[1]), np.float32)
    flat = np.zeros(4 * a.size, np.float32)
    mask_bytes = np.zeros(8 * a.size, np.uint8)  # a bool mask, then room for two float32 outputs
    mask_view = mask_bytes[: a.size].view(bool).reshape(SHAPE)  # a mask that is a view
    lengths = np.arange(2 * SHAPE[0])[::-2]  # a strided, reversed int64 view
    inputs = (a, b, mask, None, None)
    cases = {}
    for name, value in variants(np.float32).items():
        cases[f"{name} output"] = ((value,), a, inputs)
        cases[f"{name} second output"] = ((np.empty_like(a), value), a, inputs)
    for name, value in variants(np.float64).items():
        cases[f"float64 {name} output"] = ((value,), a, inputs)
    cases |= {
        "two fresh outputs": ((np.empty_like(a), np.empty_like(a)), a, inputs),
        "an input as output": ((a,), a, inputs),
        "the second input as output": ((np.empty_like(a), b), a, inputs),
        "one array twice": ((out := np.empty_like(a), out), a, inputs),
        "planes of one buffer": ((base[0], base[1]), base[2], (base[2], base[3], None)),
        "a plane beside its buffer's other planes": ((base[1],), a, (a, base[0], base[2])),
        "overlapping reshaped views": (
            (
                flat[: a.size].reshape(SHAPE),
                flat[a.size // 2 : a.size // 2 + a.size].reshape(SHAPE),
            ),
            a,
            inputs,
        ),
        "apart reshaped views": (
            (flat[: a.size].reshape(SHAPE), flat[a.size : 2 * a.size].reshape(SHAPE)),
            a,
            inputs,
        ),
        "an output over a view mask's bytes": (
            (mask_bytes[: 4 * a.size].view(np.float32).reshape(SHAPE),),
            a,
            (a, b, mask_view, None),
        ),
        "an output apart from a view mask": (
            (mask_bytes[4 * a.size :].view(np.float32).reshape(SHAPE),),
            a,
            (a, b, mask_view, None),
        ),
        "an output inside strided lengths' bounds": (
            (wide[:, SHAPE[1] : 2 * SHAPE[1]].copy(),),
            a,
            (a, b, None, lengths, None),
        ),
        "a column block of a wide buffer beside another": (
            (np.ascontiguousarray(wide[:, : SHAPE[1]]),),
            a,
            (a, wide[:, ::3], None),
        ),
        "an output inside a strided input's bounds": (
            (flat[1 : 1 + a.size].reshape(SHAPE),),
            a,
            (a, flat[::4][: a.size].reshape(SHAPE), None),
        ),
        "an output inside a reversed input's bounds": (
            (flat[3 * a.size - 5 : 4 * a.size - 5].reshape(SHAPE),),  # over its last items
            a,
            (a, flat[::-1][: a.size].reshape(SHAPE), None),
        ),
        "empty outputs and inputs": (
            (np.zeros((0, 4), np.float32),),
            np.zeros((0, 4), np.float32),
            (np.zeros((0, 4), np.float32), None),
        ),
        "an empty view inside an input's buffer": (
            (flat[:0].reshape(0, 4),),
            flat[:0].reshape(0, 4),
            (flat, None),
        ),
        "1-D packed outputs": (
            (np.empty(15, np.float32),),
            np.zeros(15, np.float32),
            (np.zeros(15, np.float32), None),
        ),
        "a 1-D output beside a 2-D like": ((np.empty(15, np.float32),), a, inputs),
    }
    return cases


def test_the_compiled_outputs_test_equals_the_python_one_and_is_in_use():
    assert _validate.common_outputs is _checks.common_outputs
    answers = {}
    for name, (outputs, like, given) in output_cases().items():
        expected = _validate.python_common_outputs(outputs, like, given)
        assert _checks.common_outputs(outputs, like, given) == expected, name
        answers[name] = expected
    # both answers among the cases, as each case's name says
    accepted = [
        "plain output",
        "two fresh outputs",
        "planes of one buffer",
        "apart reshaped views",
        "a plane beside its buffer's other planes",
        "an output apart from a view mask",
        "empty outputs and inputs",
        "1-D packed outputs",
    ]
    refused = [
        "an input as output",
        "the second input as output",
        "one array twice",
        "overlapping reshaped views",
        "an output over a view mask's bytes",
        "an output inside a strided input's bounds",
        "an output inside a reversed input's bounds",
        "read-only output",
        "subclass output",
        "float64 plain output",
        "a 1-D output beside a 2-D like",
        "Fortran order second output",
    ]
    assert all(answers[name] for name in accepted), [n for n in accepted if not answers[n]]
    assert not any(answers[name] for name in refused), [n for n in refused if answers[n]]


# ---- lengths as the bool mask of their valid positions (``lengths_mask``) ----


def lengths_variants() -> dict[str, object]:
    """Lengths of every kind the fast paths can be given beside (3, 5) arrays, by name: in
    [0, T] and past it either way, of each integer width and another dtype, of other shapes,
    strided, reversed, unaligned, read-only, a subclass, a list."""
    good = np.array([0, 5, 2])
    raw = np.zeros(3 * 8 + 1, np.uint8)
    misaligned = raw[1:].view(np.int64)
    misaligned[:] = good
    assert not misaligned.flags.aligned
    cases = {
        "int64": good,
        "int32": good.astype(np.int32),
        "zeros": np.zeros(3, np.int64),
        "all T": np.full(3, 5, np.int32),
        "past T": np.array([0, 6, 2]),
        "negative": np.array([0, -1, 2], np.int32),
        "int64 min": np.array([0, np.iinfo(np.int64).min, 2]),
        "int32 min": np.array([0, np.iinfo(np.int32).min, 2], np.int32),
        "huge": np.array([0, 2**40, 2]),
        "int16": good.astype(np.int16),
        "uint64": good.astype(np.uint64),
        "uint32": good.astype(np.uint32),
        "float64": good.astype(np.float64),
        "bool": good.astype(bool),
        "byte-swapped": good.astype(np.dtype(np.int64).newbyteorder()),
        "one short": good[:2],
        "one more": np.array([0, 5, 2, 1]),
        "2-D": good[None, :],
        "0-D": np.array(3),
        "strided": np.array([0, 9, 5, 9, 2])[::2],
        "reversed": good[::-1].copy()[::-1],
        "reversed past T": np.array([2, 6, 0])[::-1],
        "unaligned": misaligned,
        "read-only": read_only(good.copy()),
        "subclass": good.copy().view(Subclass),
        "list": good.tolist(),
        "None": None,
    }
    return cases


def test_the_compiled_lengths_mask_equals_the_python_one_on_every_kind_of_input():
    """Every kind of lengths beside every kind of token array (and beside a common one, then
    beside a second token array of another kind): the same mask, or False, both ways."""
    tokens = [*inputs(), ("empty rows", np.zeros((0, 5), np.float32))]
    lengths = [*lengths_variants().items(), ("no rows", np.zeros(0, np.int64))]
    plain = np.zeros(SHAPE, np.float32)
    checked = 0
    for (token_name, first), (name, given) in itertools.product(tokens, lengths):
        for arrays in ((first,), (plain, first)):
            expected = _validate.python_lengths_mask(arrays, given)
            got = _checks.lengths_mask(arrays, given)
            assert (got is False) == (expected is False), (token_name, name, len(arrays))
            if got is not False:
                assert type(got) is np.ndarray and got.dtype == np.bool_, (token_name, name)
                assert got.flags.carray and got.flags.owndata, (token_name, name)
                assert got.tobytes() == expected.tobytes(), (token_name, name)
                checked += 1
    assert checked >= 2 * 9  # the good lengths, beside float32 and float64 arrays
    # the largest batch taken as a mask, and one position past it
    positions = _checks.LENGTHS_AS_MASK_POSITIONS
    assert positions == _validate.LENGTHS_AS_MASK_POSITIONS
    for width, taken in ((positions // 4, True), (positions // 4 + 1, False)):
        arrays = (np.zeros((4, width), np.float32),)
        given = np.array([0, width, 1, width // 2])
        expected = _validate.python_lengths_mask(arrays, given)
        got = _checks.lengths_mask(arrays, given)
        assert (got is not False) == (expected is not False) == taken
        if taken:
            assert got.tobytes() == expected.tobytes()
