"""Column names, the verl and OpenRLHF presets, and the zero-copy view of Arrow list columns as
ppo_fast's packed layout.

A ``list<float>`` Arrow column of B rows is an offsets buffer (B+1 integers) and a flat values
buffer: row b is ``values[offsets[b] : offsets[b+1]]``. That is the packed layout of DESIGN.md
section 2 with ``cu_seqlens = offsets - offsets[0]`` (a sliced or chunked column's offsets need
not start at 0) and the packed token array ``values[offsets[0] : offsets[B]]``, a view of the
column's buffer: no padded tensor and no Python list is built, and no loop runs over rows in
Python. This module is the input boundary of ``ppo_fast.data``: every column is checked here
(type, nulls, list lengths against the other token columns of the row) and an error names the
column, the row (counted from 0 over the whole input) and the fix.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._arrow import pa, pc
from ._names import FLOAT_TYPES, DataError


class TokenColumn(NamedTuple):
    """A list column as the packed layout: ``values`` (N,) a read-only view of the column's
    buffer where possible, ``cu_seqlens`` (B+1,) int64 from 0, and the column itself (whose
    offsets the outputs share)."""

    values: np.ndarray
    cu_seqlens: np.ndarray
    array: Any  # pyarrow ListArray or LargeListArray


def require(schema: Any, names: dict[str, str]) -> None:
    """A DataError naming the first of ``names`` (field -> column) missing from ``schema``."""
    for field, name in names.items():
        if schema.get_field_index(name) < 0:
            close = [n for n in schema.names if n.lower() == name.lower()]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DataError(
                f"no column {name!r} (the {field} column){hint}; the columns are "
                f"{', '.join(schema.names)}: name it with --{field.replace('_', '-')}-column "
                "(columns=Columns(...)) or choose a --preset"
            )


def _type_name(arrow_type: Any) -> str:
    """list<int64> whatever the item is called (Parquet names it "element", Arrow "item")."""
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        kind = "large_list" if pa.types.is_large_list(arrow_type) else "list"
        return f"{kind}<{arrow_type.value_type}>"
    return str(arrow_type)


def _first_null_row(array: Any, row_offset: int) -> int:
    return row_offset + int(np.flatnonzero(pc.is_null(array).to_numpy(zero_copy_only=False))[0])


def token_column(batch: Any, name: str, field: str, row_offset: int) -> TokenColumn:
    """Column ``name`` of the record batch ``batch`` as packed (N,) values and cu_seqlens;
    ``field`` is what it holds ("mask" takes bool or integers, the others float32 or float64);
    ``row_offset`` is the batch's first row in the whole input, for the errors."""
    array = batch.column(name)
    kind = array.type
    where = f"column {name!r} (the {field} column)"
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise DataError(
            f"{where} is {_type_name(kind)}; a per-token column is a list column with one list "
            "per row (list<float> or list<double>): store each row's tokens as a list"
        )
    item = kind.value_type
    if field == "mask":
        if not (pa.types.is_boolean(item) or pa.types.is_integer(item)):
            raise DataError(
                f"{where} is {_type_name(kind)}; a mask is list<bool> or a list of 0/1 integers: "
                "cast it with pyarrow.compute.cast"
            )
    elif str(item) not in FLOAT_TYPES:
        raise DataError(
            f"{where} is {_type_name(kind)}; per-token data are list<float> or list<double>: "
            f"cast it, e.g. pyarrow.compute.cast(column, pyarrow.list_(pyarrow.float32()))"
        )
    if array.null_count:
        row = _first_null_row(array, row_offset)
        raise DataError(
            f"{where} is null at row {row}; every row needs a list (an empty list for a row "
            "with no token): fill or drop the null rows"
        )
    offsets = array.offsets.to_numpy()
    start, end = int(offsets[0]), int(offsets[-1])
    flat = array.values.slice(start, end - start)
    if flat.null_count:
        position = int(np.flatnonzero(pc.is_null(flat).to_numpy(zero_copy_only=False))[0])
        row = row_offset + int(np.searchsorted(offsets, start + position, side="right")) - 1
        raise DataError(
            f"{where} has a null inside the list of row {row} (token "
            f"{start + position - int(offsets[row - row_offset])}); fill it (a mask marks tokens "
            "that are not actions) or drop the row"
        )
    # Float buffers are read in place; a bool mask is bit-packed in Arrow, so it is unpacked.
    values = flat.to_numpy(zero_copy_only=not pa.types.is_boolean(item))
    cu_seqlens = offsets.astype(np.int64)
    if start:
        cu_seqlens -= start
    return TokenColumn(values, cu_seqlens, array)


def same_rows(columns: dict[str, TokenColumn], names: dict[str, str], row_offset: int) -> None:
    """A DataError naming the first row whose lists differ in length between two columns."""
    fields = list(columns)
    if not fields:
        return
    reference = columns[fields[0]].cu_seqlens
    for field in fields[1:]:
        other = columns[field].cu_seqlens
        if not np.array_equal(reference, other):
            b = int(np.flatnonzero(np.diff(reference) != np.diff(other))[0])
            first, second = names[fields[0]], names[field]
            raise DataError(
                f"row {row_offset + b} has {int(reference[b + 1] - reference[b])} tokens in "
                f"column {first!r} but {int(other[b + 1] - other[b])} in column {second!r}; the "
                "per-token columns of a row must have one length: fix or drop the row"
            )


def row_column(batch: Any, name: str, field: str, row_offset: int) -> np.ndarray:
    """Per-row numeric column ``name`` as a float64 (B,) array (a view where it is float64)."""
    array = batch.column(name)
    where = f"column {name!r} (the {field} column)"
    kind = array.type
    if not (pa.types.is_floating(kind) or pa.types.is_integer(kind) or pa.types.is_boolean(kind)):
        raise DataError(
            f"{where} is {_type_name(kind)}; it holds one number per row: cast it to float64"
        )
    if array.null_count:
        row = _first_null_row(array, row_offset)
        raise DataError(f"{where} is null at row {row}; give every row a number or drop the row")
    return array.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def uid_column(batch: Any, name: str, row_offset: int) -> Any:
    """The group labels: the Arrow column itself (any type), checked for nulls."""
    array = batch.column(name)
    if array.null_count:
        row = _first_null_row(array, row_offset)
        raise DataError(
            f"column {name!r} (the uid column) is null at row {row}; every row needs a group "
            "label (a row alone in its group gets a unique one): fill it or drop the row"
        )
    if pa.types.is_nested(array.type):
        raise DataError(
            f"column {name!r} (the uid column) is {_type_name(array.type)}; a group label is a "
            "string or a number: give one label per row"
        )
    return array


def group_ids(labels: list[Any]) -> np.ndarray:
    """int64 (B,) group ids of the uid chunks ``labels``, numbered in first-seen order (Arrow's
    dictionary encoding of the whole column: no Python loop over the labels)."""
    if not labels:
        return np.zeros(0, dtype=np.int64)
    # Dictionary chunks (a categorical uid) may each have their own dictionary: decode first.
    decoded = [c.dictionary_decode() if pa.types.is_dictionary(c.type) else c for c in labels]
    column = pa.chunked_array(decoded).combine_chunks()
    encoded = pc.dictionary_encode(column)
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
