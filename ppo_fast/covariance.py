"""The covariance-based token selections of Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy
Mechanism of Reinforcement Learning for Reasoning Language Models"; verl 0.9.1's "clip_cov" and
"kl_cov"), for ``clip_cov_loss`` and ``kl_cov_loss`` (``ppo_fast.policy``), which take the
selection as an input.

Over the valid tokens of the whole batch (n of them), with means over them (float64):

    cov_t = (A_t - mean(A)) * (logp_t - mean(logp))

Each mean's sum is taken in a fixed order, the kernels' (the oracle's ``kl_cov_top_k`` states
it): row by row, token t of a row into lane t % 8, the 8 lanes added up in a fixed tree, then
the rows' sums added in row order; so every backend, build and thread count selects the same
tokens (the rows' sums are taken in parallel, each on its own).

- ``kl_cov_selection``: the k = max(1, floor(n * ratio)) tokens of largest covariance (none when
  n = 0). Ties at the k-th value go to the earliest positions (row-major in the padded layouts,
  storage order when packed), so the result is a function of the inputs alone.
- ``clip_cov_selection``: the candidates are the valid tokens that PPO's clip leaves unclipped
  (-A * clip(rho, 1 - clip_low, 1 + clip_high) > -A * rho is false; rho = exp(logp - old)) with
  ``lower`` < cov_t < ``upper``; k = max(1, floor(n * ratio)) of them (all when there are fewer)
  are drawn uniformly without replacement by a NumPy generator seeded with ``seed``: the same
  seed gives the same tokens. verl draws them with ``torch.randperm`` from torch's global
  generator; ``ppo_fast.compat.verl`` does the same to reproduce verl's choice.

Both return a bool array shaped like ``logprobs``, True at the selected tokens (never at a
position that is not valid). A NaN covariance is never a Clip-Cov candidate (it compares
false) and counts as the smallest in KL-Cov's top-k.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _result_arrays, _rows, _threads, _validate

_BOOL = np.dtype(np.bool_)


def valid_positions(
    shape: tuple[int, ...],
    *,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> np.ndarray:
    """Whether each position of the flat storage is valid (bool (N,)), for the layout given."""
    rows = _validate.rows(tuple(shape), mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    if rows.packed:  # every position of a packed row is valid
        valid = np.ones(rows.n_positions, dtype=bool)
    else:
        width = rows.shape[1]
        valid = (np.arange(width)[None, :] < rows.lengths[:, None]).ravel()
    if rows.mask.shape[0]:
        valid &= rows.mask != 0
    return valid


def _covariances(
    logprobs: Any, advantages: Any, layout: dict[str, Any], others: dict[str, Any] | None = None
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    arrays = {"logprobs": logprobs, "advantages": advantages, **(others or {})}
    checked, rows = _validate.batch(arrays, **layout)
    valid = valid_positions(rows.shape, **layout)
    logp, adv = (a.ravel() for a in checked[:2])
    count = np.count_nonzero(valid)
    cov = np.full(logp.shape, np.nan)
    if count:
        # float64 means over the valid tokens, then the products (float64) at those tokens
        mean_adv = np.sum(adv, where=valid, dtype=np.float64) / count
        mean_logp = np.sum(logp, where=valid, dtype=np.float64) / count
        np.multiply(
            np.subtract(adv, mean_adv, dtype=np.float64),
            np.subtract(logp, mean_logp, dtype=np.float64),
            out=cov,
            where=valid,
        )
    return cov, valid, checked


def _count(ratio: float, n_valid: int) -> int:
    return max(int(ratio * n_valid), 1)


def kl_cov_selection(
    logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    ratio: float = 0.0002,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    backend: str | None = None,
) -> np.ndarray:
    """KL-Cov's selection: the valid tokens of largest covariance; see the module docstring.

    One compiled pass for the means and one for the top-k (kernel ``kl_cov_top_k``: the whole batch
    is its one group; the common case, as the stages' fast paths take it, calls it straight away:
    ``_kl_cov_selection_common``), in O(n + k log(n / k)) time and at most 2k + 8 slots of scratch a
    thread; the second passes over each block of 8 tokens none of which reaches the k-th strongest
    kept so far. Both share the rows among the threads (a buffer of candidates for each thread's
    range of rows, merged: the k strongest of the ranges' k strongest).

    Parameters
    ----------
    logprobs, advantages
        (B, T) padded or (N,) packed, float32 or float64.
    ratio
        The fraction of the valid tokens to select (> 0, finite; verl's kl_cov_ratio).
    mask, lengths, cu_seqlens
        At most one, as for ``clipped_surrogate``.
    backend
        As for every stage (None: the default).
    """
    if type(ratio) is not float:
        ratio = _validate.fast_real(ratio)
    if type(ratio) is float and 0.0 < ratio < math.inf:
        layout = _validate.common_layout((logprobs, advantages), mask, lengths, cu_seqlens)
        if layout is not False:
            return _kl_cov_selection_common(logprobs, advantages, ratio, layout, backend)
    ratio = _validate.scalar("ratio", ratio, lo=0.0, open_lo=True)
    checked, rows = _validate.batch(
        {"logprobs": logprobs, "advantages": advantages},
        mask=mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
    )
    logp, adv = checked
    selected = _result_arrays.empty(logp.shape, _BOOL)  # the kernel writes flags in bool's bytes
    _backend.run(
        "kl_cov_top_k",
        backend,
        logprobs=logp.ravel(),
        advantages=adv.ravel(),
        **rows.arguments,
        group_rows=np.arange(rows.n_rows, dtype=np.int64),
        group_starts=np.array([0, rows.n_rows], dtype=np.int64),
        ratio=ratio,
        selected=selected.view(np.uint8).ravel(),
    )
    return selected


# (group_rows, group_starts) of a batch of B rows that is one group, by B: shared by every call,
# nothing writes into them (bounded as _rows' caches).
_whole_batch_groups: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _kl_cov_selection_common(
    logprobs: np.ndarray,
    advantages: np.ndarray,
    ratio: float,
    mask: np.ndarray | None,
    backend: str | None,
) -> np.ndarray:
    """The common case, checked by the caller (``_validate.common_case``: two C-contiguous (B,
    T) arrays of one float dtype; no mask or a bool one, ``_validate.converted_mask``'s for a
    0/1 one of numbers or for lengths; or two such 1-D arrays, ``mask`` their packed rows'
    (starts, spans) from ``_validate.common_packed``; a float ratio in (0, inf)): the general
    way's kernel call, its arguments made without the general way's checks and copies (8 x 128,
    Intel Xeon: 8.5-8.9 -> 5.0 us on Cython, of which the kernel takes 1.5-2.8).
    tests/test_fast_path.py and test_fast_path_packed.py compare the two."""
    if type(mask) is tuple:  # packed rows
        starts, spans = mask
        n_rows = len(starts)
        layout = (starts, spans, spans, _rows.EMPTY_MASK)
        mask = None
    else:
        n_rows, width = logprobs.shape
        layout = _rows.padded_arguments(n_rows, width, mask)
    groups = _whole_batch_groups.get(n_rows)
    if groups is None:
        groups = (np.arange(n_rows, dtype=np.int64), np.array([0, n_rows], dtype=np.int64))
        if len(_whole_batch_groups) >= 64:
            _whole_batch_groups.clear()
        _whole_batch_groups[n_rows] = groups
    selected = _result_arrays.empty(logprobs.shape, _BOOL)
    n_threads = _threads.threads_for(n_rows, logprobs.size)
    kernel = _backend.table_kernel(
        "kl_cov_top_k", backend, n_threads, logprobs.dtype, mask is not None
    )
    kernel(
        logprobs.reshape(-1),
        advantages.reshape(-1),
        *layout,
        *groups,
        ratio,
        selected.view(np.uint8).reshape(-1),
        n_threads,
    )
    return selected


def clip_cov_selection(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    seed: int | np.random.Generator,
    ratio: float = 0.0002,
    lower: float = 1.0,
    upper: float = 5.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> np.ndarray:
    """Clip-Cov's selection: tokens of covariance in (lower, upper) drawn at random; see the
    module docstring.

    Parameters
    ----------
    seed
        An int, or a ``numpy.random.Generator`` (which the draw advances).
    ratio
        The fraction of the valid tokens to select (> 0, finite; verl's clip_cov_ratio).
    lower, upper
        The open interval of covariances a candidate lies in (verl's clip_cov_lb, clip_cov_ub;
        lower <= upper).
    clip_low, clip_high
        PPO's clip: tokens it clips are not candidates (``clip_high=None``: ``clip_low``).
    """
    ratio = _validate.scalar("ratio", ratio, lo=0.0, open_lo=True)
    lower = _validate.scalar("lower", lower, allow_inf=True)
    upper = _validate.scalar("upper", upper, allow_inf=True)
    if lower > upper:
        raise ValueError(
            f"lower must be <= upper, got lower={lower} and upper={upper}: the candidates' "
            "covariances lie strictly between them"
        )
    low = _validate.scalar("clip_low", clip_low, lo=0.0, hi=1.0)
    high = low if clip_high is None else _validate.scalar("clip_high", clip_high, lo=0.0)
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer | np.random.Generator):
        raise TypeError(
            f"seed must be an int or a numpy.random.Generator, got {type(seed).__name__}: "
            "pass seed=0 (any int) for a reproducible draw"
        )
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(int(seed))
    layout = {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
    cov, valid, checked = _covariances(logprobs, advantages, layout, {"old_logprobs": old_logprobs})
    logp, adv, old = (a.ravel() for a in checked)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio_t = np.exp(logp - old)
        clipped = -adv * np.clip(ratio_t, 1.0 - low, 1.0 + high) > -adv * ratio_t
    candidates = np.flatnonzero(valid & ~clipped & (cov > lower) & (cov < upper))
    selected = np.zeros(cov.shape, dtype=bool)
    if candidates.size:
        k = min(_count(ratio, int(valid.sum())), candidates.size)
        selected[rng.permutation(candidates)[:k]] = True
    return selected.reshape(checked[0].shape)


__all__ = ["clip_cov_selection", "kl_cov_selection", "valid_positions"]
