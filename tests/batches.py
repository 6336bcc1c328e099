"""Hypothesis strategies for ragged batches in every layout (the hostile and the ordinary).

A generated batch is a list of rows, each a per-position validity pattern, rendered in one of
the layouts of DESIGN.md section 2: padded + mask (holes, left or right padding), padded +
lengths, packed with cu_seqlens, or padded with no layout. Positions that are not valid are
filled with NaN, +inf or -inf: nothing stored there may reach any output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

LAYOUTS = ("mask", "lengths", "packed", "none")


@dataclass
class Batch:
    layout: str
    dtype: np.dtype
    valid: np.ndarray  # bool, shaped like the token arrays
    n_rows: int
    layout_kwargs: dict = field(default_factory=dict)
    rng: np.random.Generator = None

    @property
    def shape(self):
        return self.valid.shape

    def tokens(self, low=-2.0, high=2.0, poison=True) -> np.ndarray:
        """A per-token array; positions that are not valid hold NaN or inf when `poison`."""
        x = self.rng.uniform(low, high, self.shape).astype(self.dtype)
        if poison and not self.valid.all():
            junk = np.array([np.nan, np.inf, -np.inf], dtype=self.dtype)
            x[~self.valid] = junk[self.rng.integers(0, 3, int((~self.valid).sum()))]
        return x

    def row_values(self, low=-1.0, high=1.0) -> np.ndarray:
        return self.rng.uniform(low, high, self.n_rows)


@st.composite
def ragged_batches(
    draw, layouts=LAYOUTS, dtypes=(np.float32, np.float64), max_rows=6, max_len=40, long_rows=True
):
    layout = draw(st.sampled_from(layouts))
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    n_rows = draw(st.integers(0, max_rows))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Now and then a row of a few thousand tokens, to exercise long recursions.
    width_max = 3000 if long_rows and draw(st.integers(0, 9)) == 0 else max_len
    if layout == "packed":
        lengths = [draw(st.integers(0, width_max)) for _ in range(n_rows)]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        valid = np.ones(int(cu[-1]), dtype=bool)
        return Batch(layout, dtype, valid, n_rows, {"cu_seqlens": cu}, rng)
    width = draw(st.integers(0, width_max))
    valid = np.ones((n_rows, width), dtype=bool)
    kwargs: dict = {}
    if layout == "lengths":
        lengths = rng.integers(0, width + 1, n_rows)
        # Force the edge cases in: empty rows, length-1 rows and full rows.
        for b, special in zip(
            range(n_rows),
            draw(st.lists(st.sampled_from([0, 1, width]), max_size=n_rows)),
            strict=False,
        ):
            lengths[b] = min(special, width)
        valid = np.arange(width)[None, :] < lengths[:, None]
        kwargs = {"lengths": lengths}
    elif layout == "mask":
        hole_rate = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9]))
        valid = rng.random((n_rows, width)) >= hole_rate
        for b in range(n_rows):
            pad = draw(st.sampled_from(["none", "left", "right", "empty", "one"]))
            cut = int(rng.integers(0, width + 1))
            if pad == "left":
                valid[b, :cut] = False
            elif pad == "right":
                valid[b, cut:] = False
            elif pad == "empty":
                valid[b] = False
            elif pad == "one" and width:
                valid[b] = False
                valid[b, int(rng.integers(0, width))] = True
        mask_type = draw(st.sampled_from([bool, np.int64, np.float32, np.uint8]))
        kwargs = {"mask": valid.astype(mask_type)}
    return Batch(layout, dtype, valid, n_rows, kwargs, rng)
