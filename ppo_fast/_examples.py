"""Example arguments for any kernel of the table, from its entry alone.

Warmup, the first-call probe of the benchmarks and the generic differential test
(tests/test_kernels.py) call every kernel of ``_spec.KERNELS`` through this module, so a kernel
added to the table is compiled, probed and tested without further edits; warmup and
tests/test_fast_path.py call the common-case entries (``_backend.common``) through it too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _groups
from ._rows import Rows
from ._spec import CODE, ELEMENTWISE, FLAGS, FLOAT64, GROUPS, SCALES, TOKEN, Array, Kernel


def argument_dtype(dtype: str, token_dtype: np.dtype) -> np.dtype:
    if dtype == FLAGS:
        return np.dtype(np.uint8)
    return np.dtype(np.float64) if dtype == FLOAT64 else token_dtype


def token_values(array: Array, size: Any, token_dtype: np.dtype, rng: np.random.Generator):
    """A token input drawn as the table says: uniform in [low, high], or flags set at random."""
    if array.dtype == FLAGS:
        return (rng.random(size) < 0.5).astype(np.uint8)
    return rng.uniform(array.low, array.high, size).astype(token_dtype)


def scalar_value(kernel: Kernel, name: str, value: Any, token_dtype: np.dtype) -> Any:
    """A scalar as the backends take it: an int code, a float, or a NumPy scalar of the dtype."""
    dtype = kernel.scalar(name).dtype
    if dtype == CODE:
        return int(value)
    if dtype == TOKEN:
        return token_dtype.type(value)
    return float(value)


def arguments(
    kernel: Kernel,
    rows: Rows,
    dtype: Any,
    rng: np.random.Generator,
    *,
    scalars: dict[str, Any] | None = None,
    optional: bool = True,
) -> dict[str, Any]:
    """Every argument of ``kernel`` but n_threads, by name, over the batch ``rows``.

    Inputs and row inputs are drawn uniformly in their table ranges; scalars are the table's first
    example (code 0) unless given; optional inputs are present when ``optional``, else empty.
    A kernel over groups takes the groups the rows carry, or pairs of adjacent rows when they
    carry none. Outputs are fresh ``np.empty`` arrays, so that a kernel must write every position.
    """
    token_dtype = np.dtype(dtype)
    n_positions = rows.n_positions
    named: dict[str, Any] = {}
    for array in kernel.inputs:
        size = n_positions if optional or not array.optional else 0
        named[array.name] = token_values(array, size, token_dtype, rng)
    named["starts"], named["spans"] = rows.starts, rows.spans
    if kernel.layout != ELEMENTWISE:
        named["lengths"], named["mask"] = rows.lengths, rows.mask
    if kernel.layout == GROUPS:
        if rows.groups is None:
            rows = _groups.with_groups(rows, np.arange(rows.n_rows) // 2)
        named.update(rows.group_arguments)
    for array in kernel.row_inputs:
        values = rng.uniform(array.low, array.high, rows.n_rows)
        named[array.name] = values.astype(argument_dtype(array.dtype, token_dtype))
    given = scalars or {}
    for scalar in kernel.scalars:
        default = 0 if scalar.dtype == CODE else scalar.examples[0]
        named[scalar.name] = scalar_value(
            kernel, scalar.name, given.get(scalar.name, default), token_dtype
        )
    for array in kernel.outputs:
        named[array.name] = np.empty(n_positions, argument_dtype(array.dtype, token_dtype))
    for array in kernel.row_outputs:
        named[array.name] = np.empty(rows.n_rows)
    return named


def common_arguments(
    kernel: Kernel,
    shape: tuple[int, int],
    dtype: Any,
    rng: np.random.Generator,
    *,
    optional: bool = False,
) -> dict[str, Any]:
    """Every argument of ``kernel``'s common-case entry (``Kernel.common_arguments``) but
    n_threads, by name, over (B, T) = ``shape`` with no mask: (B, T) inputs drawn as in
    ``arguments``, a loss's ``agg`` token-mean's code (0) and ``normaliser`` 0.0 (its own
    count), one value of each row input (a float), the table's first example of each scalar,
    fresh (B, T) outputs; optional inputs (weights) flat, present when ``optional``, else
    empty; flags (KL-Cov's selection) a bool array. Each of the types the public calls hand
    the entry (``policy._run_common``), so that ``ppo_fast.warmup`` compiles their overloads."""
    token_dtype = np.dtype(dtype)
    named: dict[str, Any] = {}
    for array in kernel.inputs:
        size = shape if optional or not array.optional else (0,)
        named[array.name] = token_values(array, size, token_dtype, rng)
        if array.dtype == FLAGS:  # the public calls hand the entry a bool array (KL-Cov's)
            named[array.name] = named[array.name].view(np.bool_)
        elif array.optional:  # and no weights as an empty (0,) array: weights are flat too
            named[array.name] = named[array.name].reshape(-1)
    named["mask"] = None
    if kernel.aggregates:
        named["agg"], named["normaliser"] = 0, 0.0  # token-mean over the batch's count
    for array in kernel.row_inputs:
        if array.name != SCALES:
            named[array.name] = float(rng.uniform(array.low, array.high))
    for scalar in kernel.scalars:
        default = 0 if scalar.dtype == CODE else scalar.examples[0]
        named[scalar.name] = scalar_value(kernel, scalar.name, default, token_dtype)
    for array in kernel.outputs:
        named[array.name] = np.empty(shape, argument_dtype(array.dtype, token_dtype))
    return named


def codes(kernel: Kernel) -> list[dict[str, int]]:
    """One scalar override per value of the kernel's specialised code (every build of it)."""
    if kernel.specialise is None:
        return [{}]
    count = len(kernel.scalar(kernel.specialise).choices)
    return [{kernel.specialise: code} for code in range(count)]
