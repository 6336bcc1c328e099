"""The batch model (DESIGN.md section 2): rows over flat token storage.

Row b occupies the flat positions ``starts[b] .. starts[b]+spans[b]-1``; of those, the first
``lengths[b]`` may be valid, and where a mask is given only those with ``mask != 0`` are. The
public layouts map onto it as (``_validate.rows`` builds it from them)

    padded + mask     starts = b*T, spans = lengths = T, mask = mask.ravel()
    padded + lengths  starts = b*T, spans = T, lengths = lengths
    packed            starts = cu_seqlens[:-1], spans = lengths = diff(cu_seqlens)
    none (2-D)        starts = b*T, spans = lengths = T

Rows may also carry groups (``_groups.with_groups``): the group of each row, for the estimators
that reduce per group. The layout arrays a stage builds again on every call (the padded layout,
one value for every row) come from small caches here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:  # _groups validates through _validate, which imports this module
    from ._groups import Groups

_FLOAT64 = np.dtype(np.float64)
EMPTY_MASK = np.zeros(0, dtype=np.uint8)  # the mask of rows without one: every position valid


# From this row width on, a mask's valid positions are counted row by row (``Rows.valid_counts``).
COUNT_BY_ROW = 1024


def count_by_row(mask: np.ndarray) -> np.ndarray:
    """The nonzero bytes of each row of a (B, T) uint8 ``mask``, int64 (B,): a count a row from
    ``COUNT_BY_ROW`` positions on (``Rows.valid_counts`` says why)."""
    if mask.shape[1] >= COUNT_BY_ROW:
        return np.fromiter(map(np.count_nonzero, mask), np.int64, mask.shape[0])
    return np.count_nonzero(mask, axis=1)


class Rows(NamedTuple):
    """A batch of rows over flat token storage; see the module docstring.

    A named tuple (immutable, built in a fraction of a microsecond: it is built on every call).
    Its arrays may be shared between calls (``padded_layout``): nothing writes into them.
    """

    shape: tuple[int, ...]
    starts: np.ndarray  # int64 (B,)
    spans: np.ndarray  # int64 (B,)
    lengths: np.ndarray  # int64 (B,)
    mask: np.ndarray  # uint8 (N,), or (0,) when every position within lengths is valid
    packed: bool
    groups: Groups | None = None  # the group of each row, when the caller gives them

    @property
    def n_rows(self) -> int:
        return len(self.starts)

    @property
    def n_positions(self) -> int:
        return math.prod(self.shape)

    @property
    def arguments(self) -> dict[str, np.ndarray]:
        """The layout arguments of a row kernel (``_spec.Kernel.layout_arguments``)."""
        return {
            "starts": self.starts,
            "spans": self.spans,
            "lengths": self.lengths,
            "mask": self.mask,
        }

    @property
    def valid_counts(self) -> np.ndarray:
        """Each row's valid positions, int64 (B,): its length, or with a mask its mask != 0.

        ``np.count_nonzero(mask, axis=1)`` copies the mask to bool and sums that through a cast:
        14 times the time of one count over the whole mask at 1024 x 4096 (measured on an AMD
        EPYC). ``np.count_nonzero`` of each row runs at the whole count's speed plus about 0.4 us
        a row, so it takes over from rows of ``COUNT_BY_ROW`` positions, where the two cost about
        the same."""
        if not self.mask.shape[0]:
            return self.lengths
        return count_by_row(self.mask.reshape(self.shape))

    @property
    def group_arguments(self) -> dict[str, np.ndarray]:
        """The group layout arguments of a kernel that reduces per group (``_spec.GROUPS``):
        ``group_rows``, every row once, ordered by group and within a group by row number (a
        stable sort of the group ids, so that each group's sums run in row order), and
        ``group_starts``, where each group's rows begin in it (and the end)."""
        if self.groups is None:
            raise ValueError("these rows carry no groups: attach them with _groups.with_groups")
        ids = self.groups.ids
        group_starts = np.zeros(self.groups.n_groups + 1, dtype=np.int64)
        np.cumsum(np.bincount(ids, minlength=self.groups.n_groups), out=group_starts[1:])
        return {
            "group_rows": np.argsort(ids, kind="stable").astype(np.int64, copy=False),
            "group_starts": group_starts,
        }


_padded_layouts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def padded_layout(n_rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """starts = b * T and spans = T, int64 (B,), of the padded (B, T) layout."""
    layout = _padded_layouts.get((n_rows, width))
    if layout is None:
        layout = (np.arange(n_rows, dtype=np.int64) * width, np.full(n_rows, width, dtype=np.int64))
        if len(_padded_layouts) >= 64:  # bounded: a program whose shapes never repeat
            _padded_layouts.clear()
        _padded_layouts[(n_rows, width)] = layout
    return layout


def padded_arguments(
    n_rows: int, width: int, mask: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A table kernel's layout arguments (starts, spans, lengths, mask) for (B, T) =
    (``n_rows``, ``width``) padded rows with a C-contiguous bool ``mask`` or none, as the fast
    paths pass them: every position of a row is in its length, and the mask says which are
    valid (as ``_validate.common_padded``'s ``Rows``)."""
    starts, spans = padded_layout(n_rows, width)
    return starts, spans, spans, EMPTY_MASK if mask is None else mask.reshape(-1).view(np.uint8)


_constant_rows: dict[tuple[Any, ...], np.ndarray] = {}


def constant_rows(number: float, n_rows: int, dtype: np.dtype = _FLOAT64) -> np.ndarray:
    """``np.full(n_rows, number, dtype)`` (float64 by default), from a cache: do not write into
    it."""
    # The sign of a zero is part of the key: 0.0 == -0.0, and they may give different bits.
    key = (number, n_rows, dtype) if number else (number, math.copysign(1.0, number), n_rows, dtype)
    array = _constant_rows.get(key)
    if array is None:
        array = np.full(n_rows, number, dtype=dtype)
        if number == number:  # NaN is never equal to a key: it would fill the cache
            if len(_constant_rows) >= 64:  # bounded: a program whose values never repeat
                _constant_rows.clear()
            _constant_rows[key] = array
    return array
