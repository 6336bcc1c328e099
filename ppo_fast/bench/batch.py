"""The synthetic batch every benchmark row runs on, and the shapes of a run.

``Batch`` holds B responses of up to T tokens, right-padded, with lengths drawn between T/2 and
T, and 0 in every per-token array past a row's end (where OpenRLHF's action_mask and TRL's
masked_fill put 0).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

DEFAULT_SHAPES = ((8, 128), (256, 1024), (1024, 4096))
# The last two: a few long rows, which GAE cuts into chunks to share among threads.
ALL_SHAPES = ((8, 128), (256, 1024), (1024, 4096), (64, 32768), (4, 131072), (1, 262144))
SCALING_WIDTH = 1000  # scaling batches are (tokens / 1000, 1000)
GROUP_SIZE = 8  # responses per prompt, adjacent rows, for the estimators over groups


def parse_shape(text: str) -> tuple[int, int]:
    """'256x1024' -> (256, 1024)."""
    try:
        rows, width = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a shape is BxT, like 256x1024; got {text!r}") from None
    if rows < 1 or width < 1:
        raise ValueError(f"a shape needs B >= 1 and T >= 1, got {text!r}")
    return rows, width


def shape_name(shape: Sequence[int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def scaling_shape(tokens: int) -> tuple[int, int]:
    """The batch of the scaling sweep with ``tokens`` positions: rows of 1000 tokens."""
    width = min(tokens, SCALING_WIDTH)
    return max(1, tokens // width), width


class Batch:
    """B right-padded responses of up to T tokens in one dtype; arrays are built on first use.

    Every per-token array is 0 past a row's length. The values drawn: log-probabilities in
    (-inf, 0], the old and reference log-probabilities within about 0.15 of them (so that about
    a fifth of the tokens are clipped at 0.2), rewards, values, returns and advantages standard
    normal-ish. Deterministic in (shape, dtype, seed).
    """

    def __init__(self, shape: Sequence[int], dtype: Any = np.float32, seed: int = 0):
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype)
        self.seed = seed

    @property
    def tokens(self) -> int:
        return self.shape[0] * self.shape[1]

    def _rng(self, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream, *self.shape])

    def _normal(self, stream: int, scale: float = 1.0) -> np.ndarray:
        x = self._rng(stream).standard_normal(self.shape, dtype=self.dtype)
        if scale != 1.0:
            x *= self.dtype.type(scale)
        x *= self.mask
        return x

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        width = self.shape[1]
        return self._rng(0).integers(max(1, width // 2), width + 1, self.shape[0]).astype(np.int64)

    @functools.cached_property
    def mask(self) -> np.ndarray:
        return np.arange(self.shape[1]) < self.lengths[:, None]

    @functools.cached_property
    def uids(self) -> np.ndarray:
        """The prompt of each row as verl names it: a uuid4 string per prompt, in an object array,
        ``GROUP_SIZE`` adjacent rows per prompt (``n`` samples repeated in place)."""
        n_prompts = -(-self.shape[0] // GROUP_SIZE)
        random = self._rng(10).integers(0, 256, (n_prompts, 16), dtype=np.uint8)
        prompts = [str(uuid.UUID(bytes=bytes(row), version=4)) for row in random]
        return np.repeat(np.array(prompts, dtype=object), GROUP_SIZE)[: self.shape[0]]

    @functools.cached_property
    def group_ids(self) -> np.ndarray:
        """The prompt of each row as an int64 id: ``GROUP_SIZE`` adjacent rows per prompt."""
        return np.arange(self.shape[0], dtype=np.int64) // GROUP_SIZE

    @functools.cached_property
    def scores(self) -> np.ndarray:
        return self._rng(1).standard_normal(self.shape[0]).astype(self.dtype)

    @functools.cached_property
    def logprobs(self) -> np.ndarray:
        x = self._normal(2)
        np.abs(x, out=x)
        np.negative(x, out=x)
        return x

    @functools.cached_property
    def ref_logprobs(self) -> np.ndarray:
        return self.logprobs + self._normal(3, 0.15)

    @functools.cached_property
    def old_logprobs(self) -> np.ndarray:
        return self.logprobs + self._normal(4, 0.15)

    @functools.cached_property
    def rewards(self) -> np.ndarray:
        return self._normal(5, 0.1)

    @functools.cached_property
    def values(self) -> np.ndarray:
        return self._normal(6)

    @functools.cached_property
    def old_values(self) -> np.ndarray:
        return self.values + self._normal(7, 0.15)

    @functools.cached_property
    def returns(self) -> np.ndarray:
        return self._normal(8)

    @functools.cached_property
    def advantages(self) -> np.ndarray:
        return self._normal(9)

    def nbytes(self, name: str) -> int:
        """The bytes of array ``name``, computed from the shape: nothing is allocated."""
        if name in ("scores", "lengths", "group_ids"):
            count, itemsize = self.shape[0], self.dtype.itemsize if name == "scores" else 8
        else:
            count, itemsize = self.tokens, 1 if name == "mask" else self.dtype.itemsize
        return count * itemsize
