"""Groups of rows (DESIGN.md section 2): factorised once, reduced per group in float64.

A group is the set of rows sampled for one prompt: the n responses that GRPO or RLOO compare
with each other. Every row belongs to exactly one group. Groups may be uneven, partial (a group
cut by a micro-batch boundary) or of size one, and the rows of a group need not be adjacent.

The caller names each row's group with a label, ``groups[b]``: an integer id (any integer dtype,
Python ints, integral floats) or any hashable uid (str, bytes, uuid.UUID, tuples, a mix of
objects). ``factorize(groups, n_rows)`` returns ``Groups`` with

    ids[b]     int64 in [0, n_groups): the group of row b, numbered in first-seen order
               (row 0 is in group 0; the next new label opens group 1, and so on)
    labels[g]  the label of group g as it was given, at its first occurrence

Two labels name the same group when they compare equal: numpy equality for numeric, str and
bytes arrays; Python ``==`` and ``hash`` for objects, so ``1``, ``1.0`` and ``np.int64(1)`` in
one object array are one group. A label that cannot name a group is an error: None, NaN, a
non-integral float in a float array, a bool array, an unhashable object.

Labels are never memory indices. They are only compared (sorted, or hashed into a dict), never
used to index or size an array: verl PR 7150 is a uid of 1e12 used as an index that tried to
allocate terabytes. Only the dense ids index memory, so a uid of 10**12, -1 or 2**64 - 1 costs
what any other does.

Cost: rows of a group usually come adjacent, so runs of equal adjacent labels are collapsed
first wherever that halves the rows (groups of 8 leave an eighth). Integer arrays then go through
one pass of an open-addressing hash table (numba, O(B), sized by the labels left, never by their
values); float, str and bytes arrays, and integers where numba is not installed or the labels
left are few, are sorted; objects go through one dict pass at C speed, never a sort of Python
objects. All paths give the same ids.

Reductions: ``group_counts`` and ``group_sums`` (float64, each group summed in row order, so the
result is deterministic); broadcasting a per-group value back onto rows is ``per_group[g.ids]``.
A group's sum of squares is ``group_sums(g, x * x)``; for a variance sum the squares of
``x - (group_sums(g, x) / group_counts(g))[g.ids]``, which does not cancel as ``E[x^2] - E[x]^2``
does.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _loops, _rows, _validate


@dataclass(frozen=True, eq=False)
class Groups:
    """The rows of a batch factorised into groups; see the module docstring."""

    ids: np.ndarray  # int64 (B,), read-only
    n_groups: int
    labels: np.ndarray  # (n_groups,), read-only

    @property
    def n_rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def sizes(self) -> np.ndarray:
        """int64 (n_groups,): the number of rows in each group."""
        return np.bincount(self.ids, minlength=self.n_groups)


def factorize(groups: Any, n_rows: int) -> Groups:
    """Factorise the (B,) group labels `groups` of a batch of `n_rows` rows, in first-seen order."""
    labels = _labels(groups, _n_rows(n_rows))
    # The rows of a group usually come adjacent (n samples per prompt, repeated in place): only
    # the first label of each run of equal labels needs sorting or hashing.
    if labels.dtype.kind in "iu":
        return _factorize_integers(labels)
    heads = _runs(labels)
    if labels.dtype == object:
        return _factorize_hashable(labels, heads)
    return _factorize_sortable(labels, heads)


def with_groups(rows: _rows.Rows, groups: Any) -> _rows.Rows:
    """``rows`` carrying the factorised ``groups`` (one label per row) of the batch."""
    return rows._replace(groups=factorize(groups, rows.n_rows))


def group_counts(groups: Groups) -> np.ndarray:
    """int64 (n_groups,): the number of rows in each group."""
    return _groups(groups).sizes


def group_sums(groups: Groups, values: Any) -> np.ndarray:
    """float64 (n_groups,): the sum of the per-row `values` (B,) over each group, in row order."""
    groups = _groups(groups)
    array = _validate.per_row("values", values, groups.n_rows, allow_inf=True, allow_nan=True)
    return count_and_sum(groups.ids, groups.n_groups, array.astype(np.float64, copy=False))[1]


def count_and_sum(
    ids: np.ndarray, n_groups: int, values: np.ndarray, present: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """float64 (n_groups,) twice: how many rows of each group are ``present`` (bool (B,); None
    for every row) and the sum of their float64 ``values``, added one row after another.

    Adding in row order into one float64 accumulator per group gives the same bits as a loop over
    the rows (and as ``np.bincount``), whatever the machine or thread count. Compiled, rows of one
    group that come adjacent add in a register (about 2x np.bincount's speed at B=65,536, and one
    pass for both results); np.bincount where numba is not installed.
    """
    add = _loops.compiled("add_by_group")
    if add is None:
        if present is None:
            counts = np.bincount(ids, minlength=n_groups).astype(np.float64)
        else:
            counts = np.bincount(ids, weights=present, minlength=n_groups)
            values = np.where(present, values, 0.0)
        sums = np.bincount(ids, weights=values, minlength=n_groups)
        # bincount of no rows is int64, weights or not
        return counts.astype(np.float64, copy=False), sums.astype(np.float64, copy=False)
    counts, sums = np.zeros(n_groups), np.zeros(n_groups)
    add(ids, values, _loops.EVERY_ROW if present is None else present, counts, sums)
    return counts, sums


def centre(
    values: np.ndarray, ids: np.ndarray, means: np.ndarray, present: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """float64 (B,) and (n_groups,): ``values - means[ids]``, and the sum of its squares over
    each group's rows ``present`` (None: every row), added in row order as ``count_and_sum``."""
    centred = np.empty(ids.shape[0])
    squares = np.zeros(means.shape[0])
    loop = _loops.compiled("centre_by_group")
    if loop is not None:
        loop(values, ids, means, _loops.EVERY_ROW if present is None else present, centred, squares)
        return centred, squares
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf values are data
        np.subtract(values, per_row(means, ids), out=centred)
        weights = centred * centred
    if present is not None:
        weights = np.where(present, weights, 0.0)
    squares += np.bincount(ids, weights=weights, minlength=means.shape[0])
    return centred, squares


def divide(values: np.ndarray, ids: np.ndarray, per_group: np.ndarray) -> np.ndarray:
    """float64 (B,): ``values / per_group[ids]`` in a new array. The gather, then one
    vectorized division: a division per row inside the gathering loop is not vectorized, and
    took twice as long at B=65,536."""
    divisors = per_row(per_group, ids)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.divide(values, divisors, out=divisors)


def per_row(per_group: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(B,): each row's group's value, ``per_group[ids]``, in a new array."""
    take = _loops.compiled("take_by_group")
    if take is None:
        # The ids lie in [0, n_groups): mode="clip" only skips the bounds check of the default.
        return np.take(per_group, ids, mode="clip")
    out = np.empty(ids.shape[0], dtype=per_group.dtype)
    take(per_group, ids, out)
    return out


def _groups(groups: Any) -> Groups:
    if not isinstance(groups, Groups):
        raise TypeError(
            f"groups must be a Groups, got {_validate._describe(groups)}: "
            "pass ppo_fast._groups.factorize(groups, n_rows)"
        )
    return groups


def _n_rows(n_rows: Any) -> int:
    try:
        n = operator.index(n_rows)
    except TypeError:
        raise TypeError(
            f"n_rows must be an int, the number of rows B, got {_validate._describe(n_rows)}"
        ) from None
    if n < 0:
        raise ValueError(f"n_rows must be the number of rows B >= 0, got {n}")
    return n


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _labels(groups: Any, n_rows: int) -> np.ndarray:
    """The labels as a 1-D numeric, str, bytes or object array."""
    if isinstance(groups, str | bytes):
        raise TypeError(
            f"groups must be a sequence of {n_rows} group labels, one per row, "
            f"got a single {type(groups).__name__}: wrap the labels in a list"
        )
    if hasattr(groups, "__torch_function__") and not isinstance(groups, np.ndarray):
        groups = groups.detach().cpu().numpy()
    if isinstance(groups, Sequence):
        # Not np.asarray: it would split tuple uids into columns and read [2**64 - 1, -1] as
        # float64, silently merging ids. Only a list of one kind of number becomes an array.
        _check_shape((len(groups),), n_rows)
        # Only a sequence that starts with a number pays for a look at every label's type.
        if groups and isinstance(groups[0], int | float | np.number | np.bool_):
            kinds = set(map(type, groups))
            if all(issubclass(k, bool | np.bool_) for k in kinds):
                raise _bool_error()
            if all(_is_int_type(k) for k in kinds):
                for dtype in (np.int64, np.uint64):
                    try:
                        return np.array(groups, dtype=dtype)
                    except OverflowError:
                        pass  # Python ints beyond 64 bits: still hashable uids
            if all(issubclass(k, float | np.floating) for k in kinds):
                return _integral(np.array(groups, dtype=np.float64))
        return np.fromiter(groups, dtype=object, count=len(groups))
    array = np.asarray(groups)
    _check_shape(array.shape, n_rows)
    kind = array.dtype.kind
    if kind in "iuUSO":
        return array
    if kind == "f":
        return _integral(array)
    if kind == "b":
        raise _bool_error()
    raise TypeError(
        f"groups must hold integer ids or hashable uids, got dtype {array.dtype}: "
        "pass integers (e.g. groups.astype(np.int64)), strings or a list of uids"
    )


def _is_int_type(kind: type) -> bool:
    return issubclass(kind, int | np.integer) and not issubclass(kind, bool | np.bool_)


def _check_shape(shape: tuple[int, ...], n_rows: int) -> None:
    if shape != (n_rows,):
        raise ValueError(
            f"groups must have shape ({n_rows},), one group label per row, got shape {shape}"
        )


def _bool_error() -> TypeError:
    return TypeError(
        "groups is a bool array, which names at most two groups and is most likely a mask: "
        "pass one integer id or uid per row (e.g. groups.astype(np.int64) if that is intended)"
    )


def _integral(array: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(array) | (array != np.trunc(array))
    if np.any(bad):
        b = int(np.argmax(bad))
        raise TypeError(
            f"groups is a float array and groups[{b}] = {array[b].item()!r} is not an integer: "
            "group ids must be integers or hashable uids, and every row needs one; "
            "pass integer ids, e.g. groups.astype(np.int64)"
        )
    return array


def _runs(labels: np.ndarray) -> np.ndarray | None:
    """The first row of each run of equal adjacent labels; None where runs do not halve the rows
    (shuffled groups), as then collapsing them costs more than it saves."""
    new_run = np.ones(labels.shape[0], dtype=bool)
    try:
        new_run[1:] = labels[1:] != labels[:-1]
    except (TypeError, ValueError):
        pass  # objects that cannot be compared: one run per row, and the dict pass says why
    heads = np.flatnonzero(new_run)
    return heads if 2 * heads.shape[0] <= labels.shape[0] else None


def _per_row(per_run: np.ndarray, heads: np.ndarray | None, n_rows: int) -> np.ndarray:
    return per_run if heads is None else np.repeat(per_run, np.diff(heads, append=n_rows))


def _factorize_sortable(labels: np.ndarray, heads: np.ndarray | None) -> Groups:
    head_labels = labels if heads is None else labels[heads]
    n_runs = head_labels.shape[0]
    if n_runs == 0:
        return Groups(_read_only(np.zeros(0, np.int64)), 0, _read_only(labels.copy()))
    order = np.argsort(head_labels)  # unstable: the first run of a value comes from the minimum
    ordered = head_labels[order]
    new_value = np.empty(n_runs, dtype=bool)
    new_value[0] = True
    new_value[1:] = ordered[1:] != ordered[:-1]
    value_starts = np.flatnonzero(new_value)
    first_run = np.minimum.reduceat(order, value_starts)
    by_first_seen = np.argsort(first_run)
    n_groups = by_first_seen.shape[0]
    group_of_value = np.empty(n_groups, dtype=np.int64)
    group_of_value[by_first_seen] = np.arange(n_groups)
    run_ids = np.empty(n_runs, dtype=np.int64)
    run_ids[order] = np.repeat(group_of_value, np.diff(value_starts, append=n_runs))
    return Groups(
        _read_only(_per_row(run_ids, heads, labels.shape[0])),
        n_groups,
        _read_only(head_labels[first_run[by_first_seen]]),
    )


# Below this many rows sorting costs a few microseconds: not worth the hash table's allocation,
# nor its compilation on a first call.
MIN_LABELS_TO_HASH = 2048


def _factorize_integers(labels: np.ndarray) -> Groups:
    n_rows = labels.shape[0]
    factorize_keys = _hash_factorizer() if n_rows >= MIN_LABELS_TO_HASH else None
    if factorize_keys is None:
        return _factorize_sortable(labels, _runs(labels))
    # Equal labels of one integer array have equal 64-bit patterns and unequal ones unequal
    # patterns: uint64 read as int64 is a bijection, narrower integers widen exactly.
    if labels.dtype == np.uint64:
        keys = labels.view(np.int64)
    else:
        keys = labels.astype(np.int64, copy=False)
    ids = np.empty(n_rows, dtype=np.int64)
    first_rows = np.empty(n_rows, dtype=np.int64)
    size = 1 << (2 * n_rows - 1).bit_length()  # half full with every key a group of its own
    n_groups = factorize_keys(
        np.ascontiguousarray(keys),
        np.empty(size, dtype=np.int64),
        np.empty(size, dtype=np.int64),
        ids,
        first_rows,
    )
    return Groups(_read_only(ids), n_groups, _read_only(labels[first_rows[:n_groups]]))


def _hash_factorize(
    keys: np.ndarray,
    table_keys: np.ndarray,
    table_ids: np.ndarray,
    ids: np.ndarray,
    first_seen: np.ndarray,
) -> int:
    """Number ``keys`` in first-seen order into ``ids``; ``first_seen[g]`` is group g's first row.

    A row whose key equals the previous row's joins its group without a look-up: the rows of a
    group usually come adjacent. Other keys go through linear probing in a power-of-two table
    kept at most half full. It starts small and doubles as groups appear, so the memory it
    touches follows the number of groups, never the keys' values (``table_keys`` and
    ``table_ids`` are allocated at the largest size, 2B, but untouched beyond the part in use).
    Growing re-inserts each group's first key. The slot is the top bits of the key times
    2^64 / phi (Fibonacci hashing), so that keys that differ only in high bits
    (uid = prompt * 10**6 + k) still spread. Returns the number of groups.
    """
    bits = 10
    while (1 << bits) > table_ids.shape[0]:
        bits -= 1
    table_ids[: 1 << bits] = -1
    n_groups = 0
    for b in range(keys.shape[0]):
        key = keys[b]
        if b > 0 and key == keys[b - 1]:
            ids[b] = ids[b - 1]
            continue
        mask = (1 << bits) - 1
        slot = ((key * -7046029254386353131) >> (64 - bits)) & mask
        found = table_ids[slot]
        while found >= 0 and table_keys[slot] != key:
            slot = (slot + 1) & mask
            found = table_ids[slot]
        if found < 0:
            found = n_groups
            table_keys[slot] = key
            table_ids[slot] = found
            first_seen[found] = b
            n_groups += 1
            if 2 * n_groups > (1 << bits):
                bits += 1
                mask = (1 << bits) - 1
                table_ids[: 1 << bits] = -1
                for group in range(n_groups):
                    moved = keys[first_seen[group]]
                    slot = ((moved * -7046029254386353131) >> (64 - bits)) & mask
                    while table_ids[slot] >= 0:
                        slot = (slot + 1) & mask
                    table_keys[slot] = moved
                    table_ids[slot] = group
        ids[b] = found
    return n_groups


@functools.cache
def _hash_factorizer() -> Any:
    """``_hash_factorize`` compiled by numba, or None where numba does not import."""
    return _loops.jit(_hash_factorize)


def _factorize_hashable(labels: np.ndarray, heads: np.ndarray | None) -> Groups:
    head_labels = (labels if heads is None else labels[heads]).tolist()
    try:
        first_seen = dict.fromkeys(head_labels)  # insertion order is first-seen order
    except TypeError:
        b, label = next((b, x) for b, x in enumerate(labels) if not _hashable(x))
        raise TypeError(
            f"groups[{b}] = {label!r} is not hashable ({_validate._describe(label)}): "
            "a uid must be hashable, e.g. a str, an int, a uuid.UUID or a tuple"
        ) from None
    kinds = set(map(type, first_seen))
    if type(None) in kinds:
        b = next(b for b, x in enumerate(labels) if x is None)
        raise ValueError(f"groups[{b}] is None: every row needs a group label")
    if any(issubclass(k, float | np.floating) for k in kinds):
        # NaN is not equal to itself, so it cannot name a group that other rows share.
        nan = next((b for b, x in enumerate(labels) if _is_nan(x)), None)
        if nan is not None:
            raise ValueError(f"groups[{nan}] is NaN: every row needs a group label")
    n_groups = len(first_seen)
    index = dict(zip(first_seen, range(n_groups), strict=True))
    run_ids = np.fromiter(
        map(index.__getitem__, head_labels), dtype=np.int64, count=len(head_labels)
    )
    return Groups(
        _read_only(_per_row(run_ids, heads, labels.shape[0])),
        n_groups,
        _read_only(np.fromiter(first_seen, dtype=object, count=n_groups)),
    )


def _hashable(label: Any) -> bool:
    try:
        hash(label)
    except TypeError:
        return False
    return True


def _is_nan(label: Any) -> bool:
    return isinstance(label, float | np.floating) and math.isnan(label)
