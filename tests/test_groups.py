"""Groups: factorisation against a dict-loop reference, hostile labels, per-group reductions."""

from __future__ import annotations

import math
import tracemalloc
import uuid

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_fast import _groups, _validate
from ppo_fast._groups import Groups, factorize, group_counts, group_sums

INT64 = st.integers(-(2**63), 2**63 - 1)


def reference(labels):
    """First-seen factorisation, the obvious way."""
    index, ids = {}, []
    for label in labels:
        ids.append(index.setdefault(label, len(index)))
    return ids, list(index)


def check(labels, groups: Groups):
    ids, first = reference(list(labels))
    assert groups.ids.dtype == np.int64
    assert groups.ids.tolist() == ids
    assert groups.n_groups == len(first) == groups.labels.shape[0]
    assert groups.labels.tolist() == first
    assert groups.sizes.tolist() == [ids.count(g) for g in range(len(first))]


def objects(labels):
    """An object array of the labels; np.array would split tuples into columns."""
    array = np.empty(len(labels), dtype=object)
    for b, label in enumerate(labels):
        array[b] = label
    return array


def grouped(draw_labels, *, contiguous):
    """Uneven groups, adjacent or shuffled, with groups of one among them."""

    @st.composite
    def build(draw):
        labels = draw(st.lists(draw_labels, min_size=0, max_size=12, unique=True))
        sizes = draw(st.lists(st.integers(1, 6), min_size=len(labels), max_size=len(labels)))
        rows = [label for label, size in zip(labels, sizes, strict=True) for _ in range(size)]
        return rows if contiguous else draw(st.permutations(rows))

    return build()


@pytest.mark.parametrize("contiguous", [True, False], ids=["adjacent", "shuffled"])
@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint8, np.int32, np.int64, np.uint64, np.float32, np.float64]
)
@given(data=st.data())
def test_numeric_arrays_match_the_reference(contiguous, dtype, data):
    if np.dtype(dtype).kind in "iu":
        ints = st.integers(int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
    else:
        ints = st.integers(-(2**24), 2**24)  # exact in float32
    labels = data.draw(grouped(ints, contiguous=contiguous))
    array = np.array(labels, dtype=dtype)
    check(array.tolist(), factorize(array, len(labels)))


@pytest.mark.parametrize("contiguous", [True, False], ids=["adjacent", "shuffled"])
@given(data=st.data())
def test_lists_of_ints_strs_and_mixed_objects_match_the_reference(contiguous, data):
    label = st.one_of(
        INT64,
        st.integers(2**64, 2**70),
        st.text(max_size=4),
        st.binary(max_size=4),
        st.uuids(),
        st.tuples(st.integers(-3, 3), st.text(max_size=2)),
    )
    kind = data.draw(st.sampled_from(["int64", "str", "mixed"]))
    strategy = {"int64": INT64, "str": st.text(max_size=6), "mixed": label}[kind]
    labels = data.draw(grouped(strategy, contiguous=contiguous))
    check(labels, factorize(labels, len(labels)))
    check(labels, factorize(objects(labels), len(labels)))


@given(labels=grouped(st.text(alphabet="abcxyz", max_size=5), contiguous=False))
def test_numpy_str_and_bytes_arrays_match_the_reference(labels):
    for array in (np.array(labels, dtype=str), np.array([x.encode() for x in labels], "S")):
        check(array.tolist(), factorize(array, len(labels)))


def test_first_seen_order_not_sorted_order():
    groups = factorize([7, 3, 7, 9, 3, 3, 1], 7)
    assert groups.ids.tolist() == [0, 1, 0, 2, 1, 1, 3]
    assert groups.labels.tolist() == [7, 3, 9, 1]
    groups = factorize(["b", "a", "c", "a"], 4)
    assert groups.ids.tolist() == [0, 1, 2, 1]
    assert groups.labels.tolist() == ["b", "a", "c"]


def test_uuids_tuples_and_equal_objects_of_different_types():
    u, v = uuid.uuid4(), uuid.uuid4()
    groups = factorize([u, v, uuid.UUID(str(u)), (1, "a"), (1, "a")], 5)
    assert groups.ids.tolist() == [0, 1, 0, 2, 2]
    assert groups.labels.tolist() == [u, v, (1, "a")]
    # Python equality for objects: 1, 1.0 and np.int64(1) are one label.
    assert factorize(np.array([1, 1.0, np.int64(1), "1"], dtype=object), 4).ids.tolist() == [
        0,
        0,
        0,
        1,
    ]


@pytest.mark.parametrize(
    "labels",
    [
        [10**12, -1, 10**12, 0],
        np.array([10**12, -1, 10**12, 0]),
        np.array([2**64 - 1, 0, 2**64 - 1, 2**63], dtype=np.uint64),
        [2**64 - 1, -1, 2**64 - 1, 2**70],
        np.array([-(2**63), 2**63 - 1, -(2**63), -1]),
        np.array([1e300, -1e300, 1e300, 0.0]),
    ],
    ids=["list", "int64", "uint64", "beyond-64-bits", "int64-extremes", "float-huge"],
)
def test_huge_and_negative_ids_are_never_memory_indices(labels):
    tracemalloc.start()
    try:
        groups = factorize(labels, len(labels))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    check(list(labels), groups)
    assert groups.labels[0] == labels[0]


def test_uint64_near_2_64_is_not_merged_with_minus_one():
    """A list mixing 2**64 - 1 and -1 is exactly the case np.asarray reads as float64."""
    assert factorize([2**64 - 1, -1, 2**64 - 2], 3).n_groups == 3


def test_uneven_partial_and_single_groups():
    groups = factorize([5, 5, 5, 8, 2, 2, 9], 7)
    assert groups.sizes.tolist() == [3, 1, 2, 1]
    assert group_counts(groups).tolist() == [3, 1, 2, 1]
    alone = factorize(np.arange(5), 5)
    assert alone.ids.tolist() == [0, 1, 2, 3, 4]
    assert alone.sizes.tolist() == [1] * 5
    one = factorize(["p"] * 4, 4)
    assert one.n_groups == 1 and one.ids.tolist() == [0] * 4


@pytest.mark.parametrize(
    "labels",
    [
        [],
        (),
        np.zeros(0, np.int64),
        np.zeros(0, np.float64),
        np.zeros(0, object),
        np.array([], "U3"),
    ],
)
def test_no_rows(labels):
    groups = factorize(labels, 0)
    assert groups.n_groups == 0 and groups.n_rows == 0
    assert groups.ids.dtype == np.int64 and groups.ids.shape == (0,)
    assert groups.labels.shape == (0,)
    assert group_counts(groups).shape == (0,)
    sums = group_sums(groups, np.zeros(0))
    assert sums.dtype == np.float64 and sums.shape == (0,)


def test_torch_tensors_go_through_numpy():
    torch = pytest.importorskip("torch")
    groups = factorize(torch.tensor([4, 2, 4]), 3)
    assert groups.ids.tolist() == [0, 1, 0] and groups.labels.tolist() == [4, 2]
    sums = group_sums(groups, torch.tensor([1.0, 2.0, 3.0]))
    assert sums.tolist() == [4.0, 2.0]


@pytest.mark.parametrize(
    ("labels", "n_rows", "error", "pattern"),
    [
        ([1, 2, 3], 2, ValueError, r"groups must have shape \(2,\)"),
        (np.zeros((2, 1), np.int64), 2, ValueError, r"groups must have shape \(2,\)"),
        (np.int64(3), 1, ValueError, r"groups must have shape \(1,\)"),
        (np.array([1.0, 2.5]), 2, TypeError, r"groups\[1\] = 2.5 is not an integer"),
        (np.array([1.0, np.nan]), 2, TypeError, r"groups\[1\] = nan"),
        (np.array([1.0, np.inf]), 2, TypeError, r"groups\[1\] = inf"),
        ([0.5, 1.0], 2, TypeError, r"groups\[0\] = 0.5"),
        (np.array([True, False]), 2, TypeError, r"groups is a bool array"),
        ([True, False], 2, TypeError, r"groups is a bool array"),
        (np.array([1 + 0j, 2]), 2, TypeError, r"groups must hold integer ids"),
        (np.array(["a", None], dtype=object), 2, ValueError, r"groups\[1\] is None"),
        (["a", "b", None], 3, ValueError, r"groups\[2\] is None"),
        (["a", float("nan")], 2, ValueError, r"groups\[1\] is NaN"),
        (["a", [1]], 2, TypeError, r"groups\[1\] = \[1\] is not hashable"),
        (objects(["a", np.zeros(2)]), 2, TypeError, r"groups\[1\] = .* is not hashable"),
        ("ab", 2, TypeError, r"groups must be a sequence of 2 group labels"),
        ([1, 2], -1, ValueError, r"n_rows must be the number of rows"),
        ([1, 2], 2.0, TypeError, r"n_rows must be an int"),
    ],
)
def test_bad_labels_are_named(labels, n_rows, error, pattern):
    with pytest.raises(error, match=pattern):
        factorize(labels, n_rows)


def test_bad_reduction_arguments_are_named():
    groups = factorize([1, 1, 2], 3)
    with pytest.raises(ValueError, match=r"values must be a scalar or have shape \(3,\)"):
        group_sums(groups, np.zeros(4))
    with pytest.raises(TypeError, match="values must be a real number"):
        group_sums(groups, np.array(["a", "b", "c"]))
    with pytest.raises(TypeError, match="groups must be a Groups"):
        group_sums([1, 1, 2], np.zeros(3))
    with pytest.raises(TypeError, match="groups must be a Groups"):
        group_counts(np.array([1, 1, 2]))


def test_inputs_are_never_modified_and_results_are_read_only():
    u = [str(uuid.uuid4()) for _ in range(3)]
    inputs = [
        np.array([3, 1, 3, 2]),
        np.array([3.0, 1.0, 3.0, 2.0]),
        np.array(["c", "a", "c", "b"]),
        np.array([u[0], u[1], u[0], u[2]], dtype=object),
        [u[0], u[1], u[0], u[2]],
    ]
    for labels in inputs:
        before = labels.copy()
        if isinstance(labels, np.ndarray):
            labels.flags.writeable = False  # a read-only input must be enough, too
        groups = factorize(labels, 4)
        assert np.array_equal(np.asarray(labels), np.asarray(before))
        assert not groups.ids.flags.writeable and not groups.labels.flags.writeable
        assert not np.shares_memory(groups.labels, np.asarray(labels))
    values = np.array([1.0, 2.0, 3.0, 4.0])
    group_sums(factorize([1, 2, 1, 2], 4), values)
    assert values.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_grouping_compares_by_identity_and_can_key_a_cache():
    """``Groups`` holds arrays, whose ``==`` is elementwise: a field-by-field equality (and the
    hash a frozen dataclass derives from it) would raise instead of answering. A grouping is
    equal only to itself, and hashable, so that a caller can key a cache of per-batch results
    by it."""
    groups = factorize([1, 2, 1], 3)
    same_labels = factorize([1, 2, 1], 3)
    assert groups == groups and groups != same_labels
    cache = {groups: "first", same_labels: "second"}
    assert cache[groups] == "first" and cache[same_labels] == "second"


FINITE = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


@given(data=st.data())
def test_sums_are_row_ordered_and_accurate(data):
    labels = data.draw(grouped(st.integers(-5, 5), contiguous=False))
    values = data.draw(st.lists(FINITE, min_size=len(labels), max_size=len(labels)))
    groups = factorize(labels, len(labels))
    sums = group_sums(groups, np.array(values, dtype=np.float64))
    assert sums.dtype == np.float64 and sums.shape == (groups.n_groups,)
    in_row_order = [0.0] * groups.n_groups
    members = [[] for _ in range(groups.n_groups)]
    for g, x in zip(groups.ids.tolist(), values, strict=True):
        in_row_order[g] += x
        members[g].append(x)
    # Bit for bit the row-ordered sum: deterministic whatever the machine.
    assert sums.tolist() == in_row_order
    for g, xs in enumerate(members):
        exact = math.fsum(xs)
        assert abs(sums[g] - exact) <= 1e-12 * math.fsum(map(abs, xs))
    squares = group_sums(groups, np.array(values) ** 2)
    assert np.all(squares >= 0)
    np.testing.assert_array_equal(group_counts(groups), [len(xs) for xs in members])


def test_float32_values_are_summed_in_float64():
    groups = factorize([0, 0, 0], 3)
    values = np.array([2**24, 1, 1], dtype=np.float32)
    assert group_sums(groups, values).tolist() == [2**24 + 2]


def test_broadcasting_a_per_group_value_back_to_rows():
    groups = factorize(["q1", "q2", "q1", "q3", "q2"], 5)
    means = group_sums(groups, np.array([1.0, 2.0, 3.0, 4.0, 6.0])) / groups.sizes
    assert means[groups.ids].tolist() == [2.0, 4.0, 2.0, 4.0, 4.0]


def test_rows_carry_their_groups():
    rows = _groups.with_groups(_validate.rows((3, 4)), ["b", "a", "b"])
    assert rows.groups is not None
    assert rows.groups.ids.tolist() == [0, 1, 0]
    assert rows.starts.tolist() == [0, 4, 8]
    with pytest.raises(ValueError, match="groups"):
        _groups.with_groups(_validate.rows((3, 4)), ["a", "b"])


def _integer_batches(rng: np.random.Generator, n_rows: int) -> list[np.ndarray]:
    prompts = rng.permutation(n_rows // 8) * 10**6 + 10**12
    adjacent = np.repeat(prompts, 8)
    return [
        adjacent,
        rng.permutation(adjacent),
        rng.integers(-(2**63), 2**63 - 1, n_rows),  # every row its own group: the table grows
        rng.integers(-3, 3, n_rows).astype(np.int8),
        (rng.integers(0, 40, n_rows).astype(np.uint64) << np.uint64(58)) | np.uint64(1),
        np.arange(n_rows) << 40,  # keys that differ only in high bits
        np.concatenate([adjacent[: n_rows // 2], -adjacent[: n_rows // 2]]),
    ]


@pytest.mark.parametrize("n_rows", [_groups.MIN_LABELS_TO_HASH, 3 * _groups.MIN_LABELS_TO_HASH])
def test_integer_hash_table_numbers_groups_as_sorting_does(n_rows):
    """Integer labels beyond MIN_LABELS_TO_HASH go through the hash table; the sort path is its
    independent twin: same ids, same labels, same dtype."""
    assert _groups._hash_factorizer() is not None  # numba is a core dependency
    for labels in _integer_batches(np.random.default_rng(n_rows), n_rows):
        hashed = factorize(labels, n_rows)
        sorted_ = _groups._factorize_sortable(labels, _groups._runs(labels))
        assert hashed.n_groups == sorted_.n_groups
        np.testing.assert_array_equal(hashed.ids, sorted_.ids)
        np.testing.assert_array_equal(hashed.labels, sorted_.labels)
        assert hashed.labels.dtype == labels.dtype
        check(labels.tolist(), hashed)


def test_integer_hash_table_memory_follows_the_rows_not_the_values():
    n_rows = 4 * _groups.MIN_LABELS_TO_HASH
    labels = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, n_rows)
    factorize(labels, n_rows)  # compiled before measuring
    tracemalloc.start()
    try:
        factorize(labels, n_rows)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * n_rows
