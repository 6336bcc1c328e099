"""Every kernel of the table on a generated batch: the cases the generic tests run.

A case is one kernel with one choice of its scalars (each scalar walks through the table's
examples or codes, every code of a specialised kernel gets its own case), its optional inputs
present or absent, on one ragged batch whose invalid positions hold NaN or inf; a kernel over
groups sees the batch's rows in random groups (uneven, not adjacent, some of one row). Nothing
here names a kernel: a kernel added to ``_spec.KERNELS`` is in every case list.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from batches import Batch

from ppo_fast import _examples, _groups, _rows, _validate
from ppo_fast._spec import CODE, ELEMENTWISE, FLAGS, GROUPS, KERNELS, Kernel


@dataclass
class Case:
    kernel: Kernel
    name: str
    arguments: dict[str, Any]  # every argument but n_threads

    def run(self, backend_module, n_threads: int = 1) -> dict[str, np.ndarray]:
        """The kernel's outputs and row outputs on fresh copies of the output arrays."""
        arguments = dict(self.arguments)
        written = [a.name for a in (*self.kernel.outputs, *self.kernel.row_outputs)]
        for name in written:
            # NaN-filled (flags: 0xAB), so that a position a kernel fails to write shows.
            junk = 0xAB if arguments[name].dtype == np.uint8 else np.nan
            arguments[name] = np.full_like(arguments[name], junk)
        arguments["n_threads"] = n_threads
        getattr(backend_module, self.kernel.name)(*self.kernel.bind(arguments))
        return {name: arguments[name] for name in written}

    @contextlib.contextmanager
    def described(self, what: str = ""):
        """A failed assertion inside re-raised with ``what`` and the whole case (``describe``).

        Built only on failure: formatting every argument with ``np.array2string`` for each
        assertion's message, passed or not, was four fifths of the differential tests' time."""
        try:
            yield
        except AssertionError as error:
            raise AssertionError(f"{what}\n{self.describe()}\n{error}") from error

    def describe(self) -> str:
        """The whole case, for a failure message (bottleneck's reduce_test style)."""
        lines = [f"kernel={self.kernel.name} case={self.name}"]
        for name, value in self.arguments.items():
            if self.kernel.outputs and name in {a.name for a in self.kernel.outputs}:
                continue
            text = np.array2string(np.asarray(value), threshold=64, precision=17)
            lines.append(f"  {name} = {text}")
        return "\n".join(lines)


def _rows_of(batch: Batch, kernel: Kernel) -> _rows.Rows:
    if kernel.layout == ELEMENTWISE:
        # Elementwise kernels see the positions cut into rows: the batch's rows serve.
        rows = _validate.rows(batch.shape, **batch.layout_kwargs)
        return _rows.Rows(rows.shape, rows.starts, rows.spans, rows.spans, rows.mask, False)
    rows = _validate.rows(batch.shape, **batch.layout_kwargs)
    if kernel.layout == GROUPS:
        labels = batch.rng.integers(0, max(1, (batch.n_rows + 1) // 2), batch.n_rows)
        rows = _groups.with_groups(rows, labels)
    return rows


def _scalar_choices(kernel: Kernel) -> list[dict[str, Any]]:
    """Each scalar walks through its examples, and each code through its codes (every code of
    a specialised kernel gets its own cases)."""
    codes = _examples.codes(kernel)
    walking = [s for s in kernel.scalars if s.name != kernel.specialise]
    values = {s.name: range(len(s.choices)) if s.dtype == CODE else s.examples for s in walking}
    longest = max((len(v) for v in values.values()), default=1)
    choices = []
    for code in codes:
        for k in range(longest):
            choice = dict(code)
            for name, walk in values.items():
                choice[name] = walk[k % len(walk)]
            choices.append(choice)
    return choices


def cases(batch: Batch, kernels=None, nonfinite: bool = False) -> list[Case]:
    """Every kernel (or those named) in every scalar choice, optional inputs on and off.

    With ``nonfinite``, about one valid position in eight of each input holds NaN, inf or -inf
    too: every backend must give the oracle's NaN and inf pattern there (DESIGN.md section 3).
    """
    out = []
    for kernel in (KERNELS[name] for name in kernels) if kernels else KERNELS.values():
        rows = _rows_of(batch, kernel)
        invalid = ~batch.valid.reshape(-1)
        if kernel.layout == ELEMENTWISE:
            invalid[:] = False  # every position is an input there
        has_optional = any(a.optional for a in kernel.inputs)
        for optional in (True, False) if has_optional else (True,):
            for scalars in _scalar_choices(kernel):
                arguments = _examples.arguments(
                    kernel, rows, batch.dtype, batch.rng, scalars=scalars, optional=optional
                )
                for array in kernel.inputs:
                    values = arguments[array.name]
                    if array.dtype == FLAGS:  # any nonzero byte is a set flag
                        junk = np.array([1, 0xFF, 0x80], dtype=values.dtype)
                    else:
                        junk = np.array([np.nan, np.inf, -np.inf], dtype=values.dtype)
                    poisoned = invalid.copy() if values.size else np.zeros(0, bool)
                    if nonfinite and values.size:
                        poisoned |= batch.rng.random(values.size) < 1 / 8
                    if poisoned.any():
                        values[poisoned] = junk[batch.rng.integers(0, 3, int(poisoned.sum()))]
                name = " ".join(f"{k}={v}" for k, v in scalars.items())
                out.append(Case(kernel, f"{name} optional={optional}", arguments))
    return out
