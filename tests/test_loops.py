"""The numba loops of ``_loops`` against the NumPy paths their callers take without numba: the
same bits, on adjacent, shuffled and single-row groups, rows left out, NaN and inf values, and
mask bytes other than 0/1."""

from __future__ import annotations

import numpy as np
import pytest

from ppo_fast import _groups, _loops, _validate, outcome


@pytest.fixture
def without_numba(monkeypatch):
    """The callers' NumPy paths: every loop reported as not compiled."""
    monkeypatch.setattr(_loops, "compiled", lambda name: None)


def group_batches(rng: np.random.Generator):
    """(ids, values, present) triples: adjacent and shuffled groups, groups of one, NaN/inf."""
    for n_rows in (0, 1, 7, 300):
        for shuffled in (False, True):
            ids = np.repeat(np.arange(n_rows), rng.integers(1, 5, n_rows))[:n_rows]
            if shuffled:
                ids = rng.permutation(ids)
            ids = _groups.factorize(ids, n_rows).ids  # dense, first-seen, read-only
            values = rng.normal(size=n_rows) * 10.0 ** rng.integers(-8, 8, n_rows)
            values[rng.random(n_rows) < 0.05] = np.nan
            values[rng.random(n_rows) < 0.05] = -np.inf
            values[rng.random(n_rows) < 0.05] = -0.0
            for present in (None, rng.random(n_rows) < 0.7):
                yield ids, values, present


def _same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


def _group_results(ids, values, present):
    n_groups = int(ids.max(initial=-1)) + 1
    counts, sums = _groups.count_and_sum(ids, n_groups, values, present)
    means = np.divide(sums, counts, out=np.zeros(n_groups), where=counts > 0)
    centred, squares = _groups.centre(values, ids, means, present)
    scales = np.sqrt(squares) + 1.0
    return (
        counts,
        sums,
        centred,
        squares,
        _groups.per_row(means, ids),
        _groups.divide(centred, ids, scales),
    )


def test_group_loops_equal_their_numpy_twins_bit_for_bit(monkeypatch):
    assert _loops.compiled("add_by_group") is not None  # numba is a core dependency
    rng = np.random.default_rng(7)
    batches = list(group_batches(rng))
    compiled = [_group_results(*batch) for batch in batches]
    monkeypatch.setattr(_loops, "compiled", lambda name: None)
    for batch, results in zip(batches, compiled, strict=True):
        for actual, expected in zip(results, _group_results(*batch), strict=True):
            _same_bits(actual, expected)


def test_group_loops_never_write_their_inputs():
    for ids, values, present in group_batches(np.random.default_rng(8)):
        before = [a.copy() for a in (ids, values) + (() if present is None else (present,))]
        _group_results(ids, values, present)
        after = (ids, values) + (() if present is None else (present,))
        for a, b in zip(before, after, strict=True):
            _same_bits(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("width", [1, 5, 64, 130])
def test_broadcast_onto_tokens_equals_the_numpy_paths(monkeypatch, dtype, width):
    """Masked positions hold +0.0 whatever the row's value (NaN, inf, -0.0, negative); a mask
    byte other than 0/1 is valid."""
    rng = np.random.default_rng(width)
    n_rows = 9
    values = rng.normal(size=n_rows).astype(dtype)
    values[:4] = [np.nan, -np.inf, -0.0, np.inf]
    mask = rng.random((n_rows, width)) < 0.6
    mask.view(np.uint8)[mask] = rng.integers(1, 256, int(mask.sum()))
    lengths = rng.integers(0, width + 1, n_rows)
    layouts = {
        "mask": dict(mask=mask),
        "lengths": dict(lengths=lengths, padded_length=width),
        "cu_seqlens": dict(cu_seqlens=np.concatenate([[0], np.cumsum(lengths)])),
    }
    compiled = {k: outcome.broadcast_to_tokens(values, **v) for k, v in layouts.items()}
    monkeypatch.setattr(_loops, "compiled", lambda name: None)
    for name, layout in layouts.items():
        expected = outcome.broadcast_to_tokens(values, **layout)
        _same_bits(compiled[name], expected)
    masked = compiled["mask"][mask.view(np.uint8) == 0]
    assert not masked.view(np.uint8).any()  # +0.0: every byte 0


def test_estimators_give_the_same_bits_without_numba(monkeypatch):
    """The public estimators over the loops and over np.bincount/np.take/np.copyto."""
    rng = np.random.default_rng(3)
    n_rows = 4096  # beyond MIN_LABELS_TO_HASH: the hash table numbers the ids
    ids = rng.permutation(np.repeat(rng.integers(0, 10**12, n_rows // 8), 8))
    scores = rng.normal(size=n_rows).astype(np.float32)
    scores[::97] = np.nan
    mask = rng.random((n_rows, 16)) < 0.8
    calls = {
        "grpo": lambda: outcome.grpo(scores, ids, mask=mask, nan="omit"),
        "grpo batch": lambda: outcome.grpo(scores, ids, std="batch", nan="omit"),
        "dr grpo": lambda: outcome.grpo(scores, ids, std=None),
        "rloo": lambda: outcome.rloo(scores, ids, mask=mask),
        "pass@k": lambda: outcome.pass_at_k(scores, ids, nan="omit"),
        "opo": lambda: outcome.opo(scores, ids, mask=mask, nan="omit"),
    }
    compiled = {name: call() for name, call in calls.items()}
    monkeypatch.setattr(_loops, "compiled", lambda name: None)
    monkeypatch.setattr(_groups, "_hash_factorizer", lambda: None)
    for name, call in calls.items():
        _same_bits(compiled[name], call())


def test_rows_layout_is_what_broadcast_reads():
    """The mask of a Rows is uint8 bytes, flat: broadcast reshapes it to (B, T) without a copy."""
    layout = _validate.row_layout(
        2, mask=np.ones((2, 3), bool), lengths=None, cu_seqlens=None, padded_length=None
    )
    assert layout.mask.dtype == np.uint8 and layout.mask.shape == (6,)


MASK_DTYPES = ["int8", "uint8", "int32", "int64", "uint64", "float16", "float32", "float64"]


def _converted_mask(mask):
    """_validate's flat uint8 mask of ``mask``, or the message of its ValueError."""
    try:
        return _validate._mask_array(mask, mask.shape)
    except ValueError as error:
        return str(error)


@pytest.mark.parametrize("dtype", MASK_DTYPES)
def test_masks_of_numbers_convert_as_numpy_does(dtype, monkeypatch):
    """A 0/1 mask of numbers becomes the same bytes by the compiled loop as by NumPy's way, and
    a value other than 0 or 1 (2, -1, 0.5, NaN, inf; the first of several) is the same error
    naming it; the mask given is never modified."""
    rng = np.random.default_rng(11)
    masks = [(rng.random((5, 37)) < 0.6).astype(dtype) for _ in range(3)]
    masks.append(np.ones((3, 0), dtype))
    masks.append(np.ones((4, 33), dtype)[:, ::2])  # not contiguous
    bad_values = [2, 255] if np.dtype(dtype).kind == "u" else [2, -1]
    if np.dtype(dtype).kind == "f":
        bad_values += [0.5, np.nan, np.inf]
    for value in bad_values:
        mask = (rng.random((5, 37)) < 0.6).astype(dtype)
        mask[2, 5], mask[4, 30] = value, 3
        masks.append(mask)
    for mask in masks:
        given = mask.copy()
        compiled = _converted_mask(mask)
        with monkeypatch.context() as patch:
            patch.setattr(_loops, "compiled", lambda name: None)
            expected = _converted_mask(mask)
        if isinstance(expected, str):
            assert compiled == expected and "mask must hold only 0 and 1" in expected
        else:
            _same_bits(compiled, expected)
            np.testing.assert_array_equal(compiled, mask.reshape(-1) == 1)
        np.testing.assert_array_equal(mask, given)


# Not in conftest's NUMBA_PARALLEL group, which shares the kernels' parallel builds on one
# worker (about 180 s of compiles in a --durations run): this compiles a build of its own.
@pytest.mark.parametrize(
    "dtype", [d for d in MASK_DTYPES if np.dtype(d) in _validate._LOOP_MASK_DTYPES]
)
def test_masks_convert_to_the_same_bytes_and_verdict_on_any_number_of_threads(dtype):
    """``convert_mask`` on one thread and over one or two ranges of positions (the parallel
    build itself, and through the entry the stages call): the same bytes and the same verdict,
    with a bad value in the first range, the last, at a range's edge or nowhere; a call made
    while another holds numba's parallel region runs on its own thread, with the same result."""
    _numba_builds = pytest.importorskip("ppo_fast._numba_builds")  # numba, or NumPy's way
    rng = np.random.default_rng(5)
    n = 2 * 1000 + 1  # ranges of unequal length
    good = (rng.random(n) < 0.6).astype(dtype)
    cases = [good, good[:0], good[:1]]
    for position in (0, n // 2, n // 2 - 1, n - 1):  # n // 2: where the second of two starts
        bad = good.copy()
        bad[position] = 2
        cases.append(bad)
    in_parts = _loops._mask_bytes_in_parts()
    for mask in cases:
        expected = np.empty(mask.shape[0], np.uint8)
        verdict = _loops.compiled("mask_bytes")(mask, expected)
        assert verdict == bool(np.all((mask == 0) | (mask == 1)))
        for parts in (1, 2):
            out = np.full(mask.shape[0], 7, np.uint8)
            assert in_parts(mask, out, parts) == verdict
            np.testing.assert_array_equal(out, expected)
        out = np.full(mask.shape[0], 7, np.uint8)
        assert _loops.convert_mask(mask, out, 2) == verdict
        np.testing.assert_array_equal(out, expected)
        with _numba_builds._parallel_lock:
            out = np.full(mask.shape[0], 7, np.uint8)
            assert _loops.convert_mask(mask, out, 2) == verdict
            np.testing.assert_array_equal(out, expected)
