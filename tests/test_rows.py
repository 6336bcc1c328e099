"""The batch model (``ppo_fast._rows``): the valid counts, the group layout of the estimators
that reduce per group, and the caches of the layout arrays a stage builds on every call.

The stages' tests reach all of it through the public functions; these pin what those cannot
see: that the cached arrays are shared and the caches bounded, that a zero's sign and NaN are
keyed as the comments say, and that the group layout is the one the kernels assume.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ppo_fast import _groups, _rows, _validate

CACHE_BOUND = 64  # entries of each layout cache; a full cache is emptied, then the new one kept


@pytest.fixture(autouse=True)
def _empty_caches():
    _rows._padded_layouts.clear()
    _rows._constant_rows.clear()
    yield
    _rows._padded_layouts.clear()
    _rows._constant_rows.clear()


def test_the_padded_layout_is_shared_between_calls_and_its_cache_is_bounded():
    starts, spans = _rows.padded_layout(3, 5)
    np.testing.assert_array_equal(starts, [0, 5, 10])
    np.testing.assert_array_equal(spans, [5, 5, 5])
    assert starts.dtype == spans.dtype == np.int64
    again = _rows.padded_layout(3, 5)
    assert again[0] is starts and again[1] is spans  # built once, not on every call
    for width in range(6, 5 + CACHE_BOUND):
        _rows.padded_layout(3, width)
    assert len(_rows._padded_layouts) == CACHE_BOUND
    assert _rows.padded_layout(3, 5)[0] is starts  # a hit does not empty a full cache
    _rows.padded_layout(4, 5)  # one more: emptied, then kept
    assert len(_rows._padded_layouts) == 1
    assert _rows.padded_layout(3, 5)[0] is not starts


def test_constant_rows_are_shared_keyed_by_the_sign_of_zero_and_never_by_nan():
    half = _rows.constant_rows(0.5, 4)
    np.testing.assert_array_equal(half, np.full(4, 0.5))
    assert half.dtype == np.float64 and _rows.constant_rows(0.5, 4) is half
    single = _rows.constant_rows(0.5, 4, np.dtype(np.float32))
    assert single.dtype == np.float32 and single is not half
    # 0.0 == -0.0 and they hash alike, but a kernel may give different bits for them
    negative = _rows.constant_rows(-0.0, 3)
    positive = _rows.constant_rows(0.0, 3)
    assert np.signbit(negative).all() and not np.signbit(positive).any()
    assert np.signbit(_rows.constant_rows(-0.0, 3)).all()
    assert _rows.constant_rows(0.0, 3) is positive
    # NaN never equals a key: kept, every NaN would be a new entry
    entries = len(_rows._constant_rows)
    for _ in range(3):
        assert np.isnan(_rows.constant_rows(math.nan, 4)).all()
        assert np.isnan(_rows.constant_rows(float("nan"), 4)).all()
    assert len(_rows._constant_rows) == entries


def test_the_constant_rows_cache_is_bounded():
    first = _rows.constant_rows(1.0, 2)
    for k in range(2, 1 + CACHE_BOUND):
        _rows.constant_rows(float(k), 2)
    assert len(_rows._constant_rows) == CACHE_BOUND
    assert _rows.constant_rows(1.0, 2) is first
    _rows.constant_rows(-1.0, 2)  # one more: emptied, then kept
    assert len(_rows._constant_rows) == 1
    np.testing.assert_array_equal(_rows.constant_rows(1.0, 2), [1.0, 1.0])


def test_the_group_layout_lists_each_groups_rows_in_row_order():
    rows = _groups.with_groups(_validate.rows((6, 3)), np.array(["c", "a", "c", "b", "a", "c"]))
    # first-seen order: c -> 0, a -> 1, b -> 2
    np.testing.assert_array_equal(rows.groups.ids, [0, 1, 0, 2, 1, 0])
    layout = rows.group_arguments
    np.testing.assert_array_equal(layout["group_rows"], [0, 2, 5, 1, 4, 3])
    np.testing.assert_array_equal(layout["group_starts"], [0, 3, 5, 6])
    assert layout["group_rows"].dtype == layout["group_starts"].dtype == np.int64
    for g in range(rows.groups.n_groups):  # group g's rows, by number
        members = layout["group_rows"][layout["group_starts"][g] : layout["group_starts"][g + 1]]
        np.testing.assert_array_equal(members, np.flatnonzero(rows.groups.ids == g))


def test_rows_without_groups_have_no_group_layout():
    with pytest.raises(ValueError, match="these rows carry no groups"):
        _ = _validate.rows((2, 3)).group_arguments


@pytest.mark.parametrize("width", [1, _rows.COUNT_BY_ROW - 1, _rows.COUNT_BY_ROW])
def test_valid_counts_count_the_nonzero_mask_bytes_of_each_row(width):
    rng = np.random.default_rng(width)
    mask = rng.random((5, width)) < 0.6
    rows = _validate.rows((5, width), mask=mask)
    np.testing.assert_array_equal(rows.valid_counts, mask.sum(axis=1))
    lengths = rng.integers(0, width + 1, 5)
    assert _validate.rows((5, width), lengths=lengths).valid_counts.tolist() == lengths.tolist()
