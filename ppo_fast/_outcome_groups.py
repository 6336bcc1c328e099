"""What the outcome estimators (``outcome``) share: a batch's rows, groups and layout, the
per-group statistics in float64 (counts, sums, centred variances), the conventions every
estimator applies (groups of one row, NaN scores, ddof, std), whitening over the batch's tokens
and the broadcast of a value per row onto its tokens. The formulas and conventions are in
``outcome``'s docstring.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from . import _groups, _loops, _result_arrays, _rows, _validate
from ._groups import Groups, factorize

Singleton = Literal["raw", "zero", "error"]
NanPolicy = Literal["propagate", "omit", "raise"]
SINGLETONS = ("raw", "zero", "error")
NAN_POLICIES = ("propagate", "omit", "raise")
STDS = ("group", "batch")
# Below this many positions per row, broadcasting onto the tokens takes the repeat-and-AND path.
NARROW_ROWS = 64


class _Grouping(NamedTuple):
    """A ``Groups`` whose ids are a writeable copy: ``np.bincount``, ``np.take`` and indexing
    copy or slow down on the read-only ids of a ``Groups`` on every call (3x for take at
    B=65,536), and one copy costs less than one of those."""

    ids: np.ndarray  # int64 (B,), writeable, never written
    n_groups: int
    labels: np.ndarray  # (n_groups,)


class _Batch(NamedTuple):
    """The checked inputs of an estimator."""

    scores: np.ndarray  # float64 (B,) or (B, K)
    dtype: np.dtype  # of the result
    groups: _Grouping
    layout: _rows.Rows | None  # the tokens the advantages go onto, or None for (B,)


def _batch(
    scores: ArrayLike,
    groups: object,
    mask: ArrayLike | None,
    lengths: ArrayLike | None,
    cu_seqlens: ArrayLike | None,
    padded_length: int | None,
    ndim: int = 1,
) -> _Batch:
    array = _validate.row_data("scores", scores, ndim)
    n_rows = array.shape[0]
    layout = _validate.row_layout(
        n_rows, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens, padded_length=padded_length
    )
    n_labels = _n_labels(groups)
    if n_labels is not None and n_labels != n_rows:
        raise ValueError(
            f"scores has {n_rows} rows but groups has {n_labels} labels: pass one group label "
            "per row"
        )
    if not isinstance(groups, Groups):
        groups = factorize(groups, n_rows)
    grouping = _Grouping(groups.ids.copy(), groups.n_groups, groups.labels)
    return _Batch(array.astype(np.float64, copy=False), array.dtype, grouping, layout)


def _n_labels(groups: object) -> int | None:
    """How many labels ``groups`` holds, when that is known without reading them."""
    if isinstance(groups, Groups):
        return groups.n_rows
    if isinstance(groups, np.ndarray) and groups.ndim == 1:
        return groups.shape[0]
    if isinstance(groups, list | tuple):
        return len(groups)
    return None  # factorize reads it, and says what is wrong with it


def _result(advantages: np.ndarray, batch: _Batch) -> np.ndarray:
    """The float64 (B,) advantages in the result's dtype, on the layout's tokens when given."""
    per_row = advantages.astype(batch.dtype, copy=False)
    if batch.layout is None:
        return per_row
    return _broadcast(per_row, batch.layout)


def _broadcast(
    per_row: np.ndarray, layout: _rows.Rows, out: np.ndarray | None = None
) -> np.ndarray:
    if out is None:
        out = _result_arrays.empty(layout.shape, per_row.dtype)
    if layout.packed:
        out[...] = np.repeat(per_row, layout.spans)
        return out
    n_rows, width = layout.shape
    by_mask = layout.mask.shape[0] > 0
    # A bool mask's bytes may be other than 0/1 (DESIGN.md section 2): read as bytes, != 0.
    mask = layout.mask.reshape(n_rows, width).view(np.uint8) if by_mask else None
    loop = _loops.compiled("broadcast_by_mask" if by_mask else "broadcast_by_lengths")
    if loop is not None:
        loop(per_row, mask if by_mask else layout.lengths, out)
        return out
    valid = mask != 0 if by_mask else np.arange(width) < layout.lengths[:, None]
    if width >= NARROW_ROWS:
        out.fill(0)
        np.copyto(out, per_row[:, None], where=valid)
        return out
    # copyto's masked loop pays per row: narrow rows (many rows of few tokens) are faster as
    # each value repeated, then ANDed with all ones or all zeros, which gives +0.0 at the masked
    # positions whatever the value (NaN and inf included): the same bits as copyto's.
    out[...] = np.repeat(per_row, width).reshape(n_rows, width)
    bits = out.view(np.int32 if out.dtype == np.float32 else np.int64)
    np.bitwise_and(bits, np.negative(valid.view(np.int8)), out=bits)
    return out


def _row_tokens(
    layout: _rows.Rows | None, token_counts: ArrayLike | None, n_rows: int
) -> np.ndarray | None:
    """int64 (B,): the valid tokens of each row, from the layout or ``token_counts``."""
    if token_counts is not None:
        if layout is not None:
            raise ValueError(
                "token_counts and a layout (mask, lengths or cu_seqlens) both give the rows' "
                "token counts: pass one of them"
            )
        return _validate.row_counts("token_counts", token_counts, n_rows)
    if layout is None:
        return None
    return layout.valid_counts


def _present(scores: np.ndarray, nan: str) -> np.ndarray | None:
    """The rows whose score enters the statistics, or None for every row."""
    if nan == "propagate":
        return None
    missing = np.isnan(scores)
    if not missing.any():
        return None
    if nan == "raise":
        where = np.unravel_index(int(np.argmax(missing)), scores.shape)
        index = ", ".join(map(str, where))
        raise ValueError(
            f"scores[{index}] is NaN: pass nan='omit' to leave NaN scores out of their group's "
            "statistics, or nan='propagate' to make their groups' advantages NaN"
        )
    return ~missing


def _group_counts(groups: _Grouping, present: np.ndarray | None) -> np.ndarray:
    """float64 (G,): the number of scores in each group's statistics."""
    return _count_and_sum(np.zeros(groups.ids.shape[0]), groups, present)[0]


def _group_sums(values: np.ndarray, groups: _Grouping, present: np.ndarray | None) -> np.ndarray:
    """float64 (G,): the sum of each group's per-row ``values`` over the rows present."""
    return _count_and_sum(values, groups, present)[1]


def _count_and_sum(
    values: np.ndarray, groups: _Grouping, present: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """float64 (G,) twice: the number of rows present in each group and the sum of their
    ``values``, each group summed in row order (the bits of a loop over the rows)."""
    return _groups.count_and_sum(
        groups.ids, groups.n_groups, values.astype(np.float64, copy=False), present
    )


def _group_variances(
    centred: np.ndarray,
    groups: _Grouping,
    counts: np.ndarray,
    present: np.ndarray | None,
    ddof: int,
) -> np.ndarray:
    """float64 (G,): sum of the squared centred scores of each group / (n_g - ddof)."""
    # A group of one gets its std elsewhere.
    return _group_sums(centred * centred, groups, present) / (counts - ddof)


def _singletons(
    groups: _Grouping, counts: np.ndarray, singleton: str, present: np.ndarray | None
) -> np.ndarray | None:
    """bool (G,): the groups with a single score in their statistics, or None if none has."""
    single = counts == 1
    if not single.any():
        return None
    if singleton == "error":
        group = int(np.argmax(single))
        members = np.flatnonzero(groups.ids == group)
        if present is not None:
            members = members[present[members]]
        label = groups.labels[group : group + 1].tolist()[0]
        score = "one score" if present is None else "one score that is not NaN"
        raise ValueError(
            f"group {label!r} has {score} (row {members[0]}), so nothing to compare it with: "
            "pass singleton='raw' (baseline 0 and std 1: the score passes through) or "
            "singleton='zero' (advantage 0)"
        )
    return single


def _quiet() -> np.errstate:
    """No warnings from the arithmetic: NaN and inf scores are data, and they propagate."""
    return np.errstate(divide="ignore", invalid="ignore", over="ignore")


def _choices(singleton: str, nan: str) -> None:
    _validate.choice("singleton", singleton, SINGLETONS)
    _validate.choice("nan", nan, NAN_POLICIES)


def _ddof(ddof: object) -> int:
    fix = "0 (population std) or 1 (unbiased, torch.std's default)"
    if not isinstance(ddof, int | np.integer) or isinstance(ddof, bool):
        raise TypeError(f"ddof must be the int {fix}, got {_validate._describe(ddof)}")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be {fix}, got {ddof}")
    return int(ddof)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be True or False, got {_validate._describe(value)}")
    return bool(value)


def _grpo_rows(
    scores: np.ndarray,
    groups: _Grouping,
    std: str | None,
    eps: float,
    eps_in_sqrt: bool,
    ddof: int,
    singleton: str,
    present: np.ndarray | None,
) -> np.ndarray:
    """float64 (B,) GRPO advantages of one column of scores."""
    counts, sums = _count_and_sum(scores, groups, present)
    means = sums / counts
    single = _singletons(groups, counts, singleton, present)
    if single is not None and singleton == "raw":
        means[single] = 0.0
    if std == "group":
        centred, squares = _groups.centre(scores, groups.ids, means, present)
        variances = squares / (counts - ddof)  # a group of one gets its std below
    else:
        centred = np.subtract(scores, _per_row(means, groups))
        if std is None:
            return centred
        variances = np.full(groups.n_groups, _batch_variance(scores, present, ddof))
    if single is not None:
        variances[single] = 1.0
    scales = np.sqrt(variances + eps) if eps_in_sqrt else np.sqrt(variances) + eps
    return _groups.divide(centred, groups.ids, scales)


def _per_row(per_group: np.ndarray, groups: _Grouping) -> np.ndarray:
    """float64 (B,): each row's group's value, in a new array."""
    return _groups.per_row(per_group, groups.ids)


def _batch_variance(scores: np.ndarray, present: np.ndarray | None, ddof: int) -> float:
    values = scores if present is None else scores[present]
    n = values.shape[0]
    if n <= ddof:
        return math.nan  # never used: every group then has at most one score
    centred = values - values.sum() / n
    return float(np.sum(centred * centred)) / (n - ddof)


def _whiten_rows(
    values: np.ndarray,
    tokens: np.ndarray | None,
    unbiased: bool,
    eps: float,
    present: np.ndarray | None,
) -> np.ndarray:
    """Whiten per-row values over the batch's tokens: row b counted ``tokens[b]`` times (once
    each without a layout)."""
    weights = np.ones(values.shape[0]) if tokens is None else tokens.astype(np.float64)
    n_tokens = float(weights.sum())
    if n_tokens == 0 or (unbiased and n_tokens == 1):
        what = "no valid token" if n_tokens == 0 else "a single valid token and unbiased=True"
        raise ValueError(
            f"whiten: {what} (empty batch, or an empty mask, lengths, cu_seqlens or "
            "token_counts): nothing to normalise; pass whiten=False"
        )
    # A row without a token is not in the statistics: nothing it holds may change a result.
    counted = weights > 0
    if present is not None:
        counted &= present
    weights, kept = weights[counted], values[counted]
    total = weights.sum()
    # With nan="omit" no row may be left (every score NaN): the statistics are then NaN, and so
    # is every result, as each row's value is NaN already.
    mean = np.sum(weights * kept) / total
    centred = kept - mean
    variance = np.sum(weights * centred * centred) / (total - 1.0 if unbiased else total)
    scale = np.sqrt(variance + eps)
    if scale == 0.0:
        raise ValueError("whiten: the variance is 0 and whiten_eps=0: pass whiten_eps > 0")
    return (values - mean) / scale


def _std(std: object) -> str | None:
    if std is not None and (not isinstance(std, str) or std not in STDS):
        raise ValueError(f"std must be 'group', 'batch' or None (no scaling), got {std!r}")
    return std
