"""The only input boundary of ppo_fast.

Every public stage calls in here before it dispatches to a backend, so the kernels can trust
what they get: C-contiguous float32/float64 token arrays of one shape and dtype, and a `Rows`
description of the batch. Every error names the argument and says how to fix it.

Rows (DESIGN.md section 2): row b occupies the flat positions ``starts[b] .. starts[b]+spans[b]-1``;
of those, the first ``lengths[b]`` may be valid, and where a mask is given only those with
``mask == 1`` are. The three public layouts map onto it as

    padded + mask     starts = b*T, spans = lengths = T, mask = mask.ravel()
    padded + lengths  starts = b*T, spans = T, lengths = lengths
    packed            starts = cu_seqlens[:-1], spans = lengths = diff(cu_seqlens)
    none (2-D)        starts = b*T, spans = lengths = T

Rows may also carry groups (``_groups.with_groups``): the group of each row, for the estimators
that reduce per group.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # _groups validates through this module: no import at run time
    from ._groups import Groups

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_EMPTY_MASK = np.zeros(0, dtype=np.uint8)


@dataclass(frozen=True)
class Rows:
    """A batch of rows over flat token storage; see the module docstring."""

    shape: tuple[int, ...]
    starts: np.ndarray  # int64 (B,)
    spans: np.ndarray  # int64 (B,)
    lengths: np.ndarray  # int64 (B,)
    mask: np.ndarray  # uint8 (N,), or (0,) when every position within lengths is valid
    packed: bool
    groups: Groups | None = None  # the group of each row, when the caller gives them

    @property
    def n_rows(self) -> int:
        return int(self.starts.shape[0])

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


def _describe(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def token_arrays(elementwise: bool = False, **arrays: Any) -> tuple[np.ndarray, ...]:
    """Per-token arrays: same shape, one float dtype (float32 or float64), 1-D or 2-D
    (any number of dimensions when `elementwise`).

    Returns C-contiguous arrays; a non-contiguous input is copied, never modified.
    """
    out = []
    first_name = first = None
    for name, value in arrays.items():
        if value is None:
            raise TypeError(f"{name} is required: pass a float32 or float64 array")
        if hasattr(value, "__torch_function__") and not isinstance(value, np.ndarray):
            raise TypeError(
                f"{name} is a torch tensor: use ppo_fast.torch, which takes tensors, "
                f"or pass {name}.numpy()"
            )
        array = np.asarray(value)
        if array.dtype not in FLOAT_DTYPES:
            hint = (
                f"cast it with {name}.astype(np.float32)"
                if array.dtype.kind in "biuf"
                else "pass real floating-point numbers"
            )
            raise TypeError(f"{name} must be float32 or float64, got dtype {array.dtype}: {hint}")
        if not elementwise and array.ndim not in (1, 2):
            raise ValueError(
                f"{name} must be 2-D (B, T) padded or 1-D (N,) packed, got shape {array.shape}"
            )
        if first is None:
            first_name, first = name, array
        else:
            if array.shape != first.shape:
                raise ValueError(
                    f"{name} has shape {array.shape} but {first_name} has shape {first.shape}: "
                    "every per-token array must have the same shape"
                )
            if array.dtype != first.dtype:
                raise TypeError(
                    f"{name} is {array.dtype} but {first_name} is {first.dtype}: "
                    f"cast both to one dtype, e.g. {name}.astype(np.{first.dtype})"
                )
        out.append(np.ascontiguousarray(array))
    return tuple(out)


def _index_array(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "__torch_function__") and not isinstance(value, np.ndarray):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "iu" and not (array.size == 0 and array.dtype.kind == "f"):
        raise TypeError(
            f"{name} must hold integers, got dtype {array.dtype}: "
            f"cast it with {name}.astype(np.int64)"
        )
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    return array.astype(np.int64)


def _mask_array(mask: Any, shape: tuple[int, ...]) -> np.ndarray:
    if hasattr(mask, "__torch_function__") and not isinstance(mask, np.ndarray):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.shape != shape:
        raise ValueError(
            f"mask has shape {mask.shape} but the token arrays have shape {shape}: "
            "pass a 0/1 mask of the same (B, T) shape"
        )
    if mask.dtype == np.bool_:
        return np.ascontiguousarray(mask).reshape(-1).view(np.uint8)
    if mask.dtype.kind not in "biuf":
        raise TypeError(f"mask must be bool or 0/1 numbers, got dtype {mask.dtype}")
    is_one = mask == 1
    if not np.all(is_one | (mask == 0)):
        bad = mask[~(is_one | (mask == 0))].flat[0]
        raise ValueError(
            f"mask must hold only 0 and 1, found {bad!r}: pass (mask > 0) for a boolean mask"
        )
    return is_one.reshape(-1).view(np.uint8)


def rows(
    shape: tuple[int, ...],
    *,
    mask: Any = None,
    lengths: Any = None,
    cu_seqlens: Any = None,
) -> Rows:
    """Describe the batch of `shape` given at most one of mask / lengths / cu_seqlens."""
    given = [
        n
        for n, v in (("mask", mask), ("lengths", lengths), ("cu_seqlens", cu_seqlens))
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"pass at most one of mask, lengths and cu_seqlens, got {' and '.join(given)}: "
            "they are three ways of saying which positions are valid"
        )
    if cu_seqlens is not None:
        if len(shape) != 1:
            raise ValueError(
                f"cu_seqlens describes packed 1-D arrays, but the token arrays have shape {shape}: "
                "flatten the valid tokens into 1-D arrays, or use mask/lengths for (B, T) arrays"
            )
        cu = _index_array(cu_seqlens, "cu_seqlens")
        n = shape[0]
        if cu.shape[0] < 1:
            raise ValueError("cu_seqlens must have B+1 entries starting at 0, got an empty array")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
        spans = np.diff(cu)
        if np.any(spans < 0):
            b = int(np.argmax(spans < 0))
            raise ValueError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{b + 1}]={cu[b + 1]} "
                f"< cu_seqlens[{b}]={cu[b]}"
            )
        if cu[-1] != n:
            raise ValueError(f"cu_seqlens must end at the number of tokens N={n}, got {cu[-1]}")
        return Rows(shape, cu[:-1].copy(), spans, spans, _EMPTY_MASK, True)

    if len(shape) != 2:
        raise ValueError(
            f"the token arrays are 1-D with shape {shape}: pass cu_seqlens for packed rows "
            "(cu_seqlens=[0, N] for one row), or reshape them to (B, T)"
        )
    n_rows, width = shape
    starts = np.arange(n_rows, dtype=np.int64) * width
    spans = np.full(n_rows, width, dtype=np.int64)
    if lengths is not None:
        lens = _index_array(lengths, "lengths")
        if lens.shape[0] != n_rows:
            raise ValueError(f"lengths must have shape ({n_rows},), got {lens.shape}")
        if np.any((lens < 0) | (lens > width)):
            b = int(np.argmax((lens < 0) | (lens > width)))
            raise ValueError(f"lengths must lie in [0, T={width}], got lengths[{b}]={lens[b]}")
        return Rows(shape, starts, spans, lens, _EMPTY_MASK, False)
    flat_mask = _EMPTY_MASK if mask is None else _mask_array(mask, shape)
    return Rows(shape, starts, spans, spans, flat_mask, False)


def per_row(
    name: str, value: Any, n_rows: int, *, lo: float = -math.inf, hi: float = math.inf
) -> np.ndarray:
    """A scalar or (B,) real hyperparameter or per-row value, as float64 (B,), within [lo, hi]."""
    if hasattr(value, "__torch_function__") and not isinstance(value, np.ndarray):
        value = value.detach().cpu().numpy()
    if isinstance(value, int | float) and not isinstance(value, bool):
        # The common case, a plain scalar: checked without building arrays (per-call overhead).
        return np.full(n_rows, scalar(name, value, lo=lo, hi=hi))
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a real number or a (B,) array, got dtype {array.dtype}")
    if array.ndim == 0:
        array = np.full(n_rows, float(array))
    elif array.shape != (n_rows,):
        raise ValueError(
            f"{name} must be a scalar or have shape ({n_rows},), one value per row, "
            f"got shape {array.shape}"
        )
    array = array.astype(np.float64)
    if lo > -math.inf or hi < math.inf:
        bad = ~((array >= lo) & (array <= hi))  # NaN is caught here too
        if np.any(bad):
            raise ValueError(f"{name} must lie in [{lo:g}, {hi:g}], got {array[bad][0]!r}")
    return array


def scalar(
    name: str, value: Any, *, lo: float = -math.inf, hi: float = math.inf, open_lo: bool = False
) -> float:
    """A finite real hyperparameter within [lo, hi] (or (lo, hi] with open_lo)."""
    try:
        number = (
            float(operator.index(value)) if isinstance(value, int | np.integer) else float(value)
        )
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {_describe(value)}") from None
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a real number, got a bool")
    below = number <= lo if open_lo else number < lo
    if math.isnan(number) or below or number > hi:
        bound = "(" if open_lo else "["
        raise ValueError(f"{name} must lie in {bound}{lo:g}, {hi:g}], got {number!r}")
    return number


def choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")
    return value
