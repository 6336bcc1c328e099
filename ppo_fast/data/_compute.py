"""The computation over record batches, in two passes, with ppo_fast's public stages.

Pass 1 (only when the result needs statistics of the whole input) reads the columns it needs:

- ``gae`` and ``reinforce_plus_plus`` with whitening: each batch's raw advantages (GAE's, or the
  discounted returns), and their float64 moments per batch, (count, mean, M2) about the batch's
  own mean (two ``masked_moments`` calls: no cancellation), merged batch after batch by Chan's
  formula (``merge_moments``) into the input's global mean and variance;
- the group estimators: every row's score and uid (and, for ``reinforce_plus_plus_baseline`` and
  ``opo``, its valid-token count), then the estimator of ``ppo_fast.outcome`` once over all rows,
  uids factorised by Arrow's dictionary encoding: one advantage per row of the input (8 bytes a row,
  whatever the number of tokens).

Pass 2 reads every column, recomputes each batch and appends ``advantages`` and ``returns`` list
columns that share the offsets of the batch's token column. A ``mask`` with zeros compacts the
valid tokens first (a gather) and scatters the results back, 0 elsewhere: the packed layout has
no holes, and masked positions are transparent to every recursion (DESIGN.md section 3), so the
compacted rows give exactly the masked results.

Pass 2 recomputes pass 1's raw advantages rather than reading them back from a temporary file:
the kernels are the cheap part. On the 5.2 M-token file of bench/data_advantages.py (whitened
GAE with KL shaping, a 2-core AMD EPYC) the stages of both passes took 0.08 to 0.26 s (cProfile,
by the machine's load) of a 2.3 s run, against the Parquet writer's 0.9 to 1.2 s; spilling
them would write and read 42 MB (two float32 values a token) to save about half of that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import outcome
from ..gae import gae
from ..returns import discounted_returns, remax
from ..rewards import shape_rewards
from ..whiten import Moments, masked_moments, whiten
from . import _columns
from ._arrow import pa
from ._names import ROW_FIELDS, TOKEN_FIELDS, Columns, DataError, IfPresent, Options


def fields_used(options: Options, columns: Columns, present: Collection[str]) -> dict[str, str]:
    """field -> column name of every column the computation reads (pass 2), or a DataError
    saying which column is missing from ``columns`` and how to name it. ``present``: the data's
    column names (an ``IfPresent`` name is read where it is one of them)."""

    def read(name: str | None) -> bool:
        return name in present if isinstance(name, IfPresent) else name is not None

    named = {f: getattr(columns, f) for f in (*TOKEN_FIELDS, *ROW_FIELDS)}
    named = {f: str(n) for f, n in named.items() if read(n)}  # plain str, IfPresent's too
    if "score" not in named and "rewards" not in named:
        raise DataError(
            "no reward column: name a per-row score column (--score-column) or a per-token "
            "rewards column (--rewards-column)"
        )
    used = {f: named[f] for f in ("score", "rewards", "mask") if f in named}
    if options.grouped:
        if "uid" not in named:
            raise DataError(
                f"{options.estimator} compares the rows of a group: name the group label column "
                "with --uid-column"
            )
        used["uid"] = named["uid"]
        return _with_layout(used, named)
    for field in ("logprobs", "ref_logprobs") if options.kl_coef else ():
        if field not in named:
            raise DataError(
                f"kl_coef={options.kl_coef} needs the {field} column: name it with "
                f"--{field.replace('_', '-')}-column, or pass --kl-coef 0"
            )
        used[field] = named[field]
    if options.estimator == "gae":
        if "values" not in named:
            raise DataError("gae needs the critic's values: name the column with --values-column")
        used["values"] = named["values"]
    if options.estimator == "remax":
        if "baseline" not in named:
            raise DataError(
                "remax subtracts each row's baseline (the reward of the greedy response to its "
                "prompt): name the column with --baseline-column (verl: reward_baselines)"
            )
        used["baseline"] = named["baseline"]
    if "bootstrap" in named:
        used["bootstrap"] = named["bootstrap"]
    return _with_layout(used, named)


def _with_layout(used: dict[str, str], named: dict[str, str]) -> dict[str, str]:
    """``used`` with a per-token column (the first named of logprobs, values, ref_logprobs)
    when it has none: the outputs take its offsets."""
    if any(f in used for f in TOKEN_FIELDS):
        return used
    layout = next((f for f in ("logprobs", "values", "ref_logprobs") if f in named), None)
    if layout is None:
        raise DataError(
            "no per-token column to put the advantages on: name one with --logprobs-column, "
            "--values-column, --rewards-column or --mask-column"
        )
    return {**used, layout: named[layout]}


def first_pass_fields(options: Options, used: dict[str, str]) -> dict[str, str]:
    """The columns pass 1 reads: all of them for whitened token estimators, else the scores
    and uids (and the token columns those come from or the counts need)."""
    if not options.grouped:
        return used
    wanted = {"score", "uid", "rewards", "mask"}
    if options.estimator in ("reinforce_plus_plus_baseline", "opo"):  # the valid-token counts
        wanted |= set(used)
    return {f: n for f, n in used.items() if f in wanted}


class Extracted(NamedTuple):
    """One record batch as packed arrays (see ``extract``)."""

    n_rows: int
    tokens: dict[str, np.ndarray]  # field -> (n,) the valid tokens only, compacted by the mask
    cu_seqlens: np.ndarray | None  # (B+1,) int64 over the compacted tokens
    valid: np.ndarray | None  # (N,) bool where the mask has a zero, else None
    layout: _columns.TokenColumn | None  # the column whose offsets the outputs share
    rows: dict[str, np.ndarray]  # score, bootstrap, baseline: float64 (B,)
    uid: Any  # the Arrow uid column, or None
    dtype: np.dtype  # of the outputs


def extract(batch: Any, used: dict[str, str], row_offset: int) -> Extracted:
    """The columns ``used`` of ``batch`` (field -> name), checked, as packed arrays; errors count
    rows from ``row_offset``, the batch's first row in the whole input."""
    _columns.require(batch.schema, used)
    token_columns = {
        f: _columns.token_column(batch, used[f], f, row_offset) for f in TOKEN_FIELDS if f in used
    }
    _columns.same_rows(token_columns, used, row_offset)
    floats = {f: c.values.dtype for f, c in token_columns.items() if f != "mask"}
    if len(set(floats.values())) > 1:
        listed = ", ".join(f"{used[f]!r} is list<{d}>" for f, d in floats.items())
        raise DataError(
            f"the per-token columns have different float types ({listed}): cast them to one "
            "(pyarrow.compute.cast) so that the results have one dtype"
        )
    dtype = next(iter(floats.values()), np.dtype(np.float64))
    # None in pass 1 of a group estimator that needs no token (scores and uids only).
    layout = next(iter(token_columns.values()), None)
    cu_seqlens = None if layout is None else layout.cu_seqlens
    valid = None
    if "mask" in token_columns:
        mask = token_columns.pop("mask").values
        if not mask.all():
            valid = mask.astype(bool)
            counted = np.concatenate(([0], np.cumsum(valid, dtype=np.int64)))
            cu_seqlens = counted[cu_seqlens]
    tokens = {f: (c.values if valid is None else c.values[valid]) for f, c in token_columns.items()}
    rows = {
        f: _columns.row_column(batch, used[f], f, row_offset)
        for f in ("score", "bootstrap", "baseline")
        if f in used
    }
    uid = _columns.uid_column(batch, used["uid"], row_offset) if "uid" in used else None
    return Extracted(batch.num_rows, tokens, cu_seqlens, valid, layout, rows, uid, dtype)


def row_sums(values: np.ndarray, cu_seqlens: np.ndarray) -> np.ndarray:
    """float64 (B,): the sum of each packed row (0 for an empty row), without a loop."""
    sums = np.zeros(cu_seqlens.shape[0] - 1)
    nonempty = np.flatnonzero(np.diff(cu_seqlens) > 0)
    if nonempty.size:
        sums[nonempty] = np.add.reduceat(values, cu_seqlens[nonempty], dtype=np.float64)
    return sums


def _rewards(ex: Extracted, options: Options) -> np.ndarray:
    """The token rewards: the score on each row's last valid token, the token rewards, and
    -kl_coef * KL (``ppo_fast.shape_rewards``)."""
    token_rewards = ex.tokens.get("rewards")
    score = ex.rows.get("score")
    if options.kl_coef:
        logprobs, ref_logprobs = ex.tokens["logprobs"], ex.tokens["ref_logprobs"]
    elif score is not None:
        # No KL: shape_rewards with zero log-ratios puts the score on the last valid token.
        logprobs = ref_logprobs = np.zeros(ex.cu_seqlens[-1], dtype=ex.dtype)
    else:
        return token_rewards
    shaped = shape_rewards(
        np.zeros(ex.n_rows) if score is None else score,
        logprobs,
        ref_logprobs,
        kl_coef=options.kl_coef,
        estimator=options.kl_estimator,
        clamp=options.kl_clamp,
        cu_seqlens=ex.cu_seqlens,
        backend=options.backend,
    )
    return shaped if token_rewards is None else token_rewards + shaped


def token_results(ex: Extracted, options: Options) -> tuple[np.ndarray, np.ndarray]:
    """The unwhitened advantages and the returns of a token estimator, over the valid tokens."""
    rewards = _rewards(ex, options)
    bootstrap = ex.rows.get("bootstrap")
    if options.estimator == "gae":
        return gae(
            rewards,
            ex.tokens["values"],
            gamma=options.gamma,
            lam=options.lam,
            cu_seqlens=ex.cu_seqlens,
            bootstrap=bootstrap,
            backend=options.backend,
        )
    if options.estimator == "remax":
        return remax(
            rewards,
            ex.rows["baseline"],
            gamma=options.gamma,
            cu_seqlens=ex.cu_seqlens,
            bootstrap=bootstrap,
            backend=options.backend,
        )
    returns = discounted_returns(
        rewards,
        gamma=options.gamma,
        cu_seqlens=ex.cu_seqlens,
        bootstrap=bootstrap,
        backend=options.backend,
    )
    return returns, returns


def batch_moments(x: np.ndarray, cu_seqlens: np.ndarray, backend: str | None) -> np.ndarray:
    """float64 [count, mean, M2] of the packed ``x`` (M2: the sum of squared deviations from
    the mean), about the batch's own mean: no float64 cancellation."""
    rough = masked_moments(x, cu_seqlens=cu_seqlens, backend=backend)
    if rough.count == 0:
        return np.zeros(3)
    if not math.isfinite(rough.mean):
        return np.array([rough.count, rough.mean, math.nan])
    centred = masked_moments(x, cu_seqlens=cu_seqlens, shift=rough.mean, backend=backend)
    m2 = centred.sum_sq - centred.sum * centred.sum / centred.count
    return np.array([centred.count, centred.mean, max(m2, 0.0)])


def merge_moments(parts: Iterable[np.ndarray]) -> np.ndarray:
    """[count, mean, M2] of the union of the parts, merged in order in float64 (Chan, Golub and
    LeVeque's pairwise update): equal to the whole input's moments up to rounding."""
    count, mean, m2 = 0.0, 0.0, 0.0
    for part_count, part_mean, part_m2 in parts:
        if part_count == 0:
            continue
        total = count + part_count
        delta = part_mean - mean
        mean += delta * (part_count / total)
        m2 += part_m2 + delta * delta * (count * part_count / total)
        count = total
    return np.array([count, mean, m2])


def as_moments(merged: np.ndarray) -> Moments:
    """The ``Moments`` that ``ppo_fast.whiten(moments=...)`` takes for merged [count, mean, M2]."""
    count, mean, m2 = (float(v) for v in merged)
    if count == 0:
        raise DataError(
            "no valid token in the whole input: there is nothing to whiten (pass --no-whiten, "
            "whiten=False)"
        )
    if not math.isfinite(mean):  # NaN or inf among the data: every whitened value is NaN
        return Moments(count, math.nan, math.nan)
    return Moments(count, 0.0, m2, shift=mean)


class Statistics(NamedTuple):
    """What pass 1 found: the global moments (whitened token estimators) or one advantage per
    row of the input (group estimators)."""

    moments: Moments | None = None
    row_advantages: np.ndarray | None = None


def group_advantages(
    options: Options, scores: np.ndarray, ids: np.ndarray, token_counts: np.ndarray
) -> np.ndarray:
    """float64 (B,): the group estimator of ``options`` over every row of the input."""
    name = options.estimator
    if name == "dr_grpo":
        return outcome.grpo(scores, ids, std=None)
    if name == "gpg":
        return outcome.gpg(scores, ids, alpha=options.gpg_alpha)
    if name == "opo":
        return outcome.opo(scores, ids, token_counts=token_counts)
    if name == "reinforce_plus_plus_baseline":
        return outcome.reinforce_plus_plus_baseline(
            scores,
            ids,
            whiten=options.whiten,
            unbiased=options.unbiased,
            whiten_eps=options.whiten_eps,
            token_counts=token_counts,
        )
    return getattr(outcome, name)(scores, ids)


def row_scores(ex: Extracted) -> np.ndarray:
    """Each row's score: the score column, else the sum of its valid token rewards (verl)."""
    if "score" in ex.rows:
        return ex.rows["score"]
    return row_sums(ex.tokens["rewards"], ex.cu_seqlens)


class GroupInputs(NamedTuple):
    """What a group estimator reads of every row: float64 scores, int64 group ids (first-seen
    order) and valid-token counts, each (B,)."""

    scores: np.ndarray
    ids: np.ndarray
    token_counts: np.ndarray


def first_pass(
    batches: Iterator[Any], options: Options, used: dict[str, str], on_batch: Callable
) -> Statistics:
    """Pass 1 over ``batches`` (record batches of the first-pass columns)."""
    if options.grouped:
        rows = group_inputs(batches, used, on_batch)
        return Statistics(row_advantages=group_advantages(options, *rows))
    parts = []
    row_offset = 0
    for batch in batches:
        ex = extract(batch, used, row_offset)
        advantages, _ = token_results(ex, options)
        parts.append(batch_moments(advantages, ex.cu_seqlens, options.backend))
        row_offset += ex.n_rows
        on_batch(ex.n_rows, int(ex.layout.cu_seqlens[-1]))
    return Statistics(moments=as_moments(merge_moments(parts)))


def group_inputs(
    batches: Iterator[Any], used: dict[str, str], on_batch: Callable | None = None
) -> GroupInputs:
    """The scores, group ids and token counts of every row of ``batches``."""
    scores, labels, counts = [], [], []
    row_offset = 0
    for batch in batches:
        ex = extract(batch, used, row_offset)
        scores.append(row_scores(ex))
        labels.append(ex.uid)
        if ex.cu_seqlens is not None:
            counts.append(np.diff(ex.cu_seqlens))
        row_offset += ex.n_rows
        if on_batch is not None:
            on_batch(ex.n_rows, 0 if ex.layout is None else int(ex.layout.cu_seqlens[-1]))
    ids = _columns.group_ids(labels)
    all_scores = np.concatenate(scores) if scores else np.zeros(0)
    all_counts = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    return GroupInputs(all_scores, ids, all_counts)


def _on_tokens(values: np.ndarray, ex: Extracted) -> np.ndarray:
    """Results over the valid tokens back onto every position of the column, 0 where masked."""
    if ex.valid is None:
        return values
    full = np.zeros(ex.valid.shape[0], dtype=values.dtype)
    full[ex.valid] = values
    return full


def _list_column(values: np.ndarray, like: _columns.TokenColumn) -> Any:
    """``values`` as a list column with the offsets of ``like`` (its own buffer when those
    start at 0, as in an unsliced column: zero-copy)."""
    array = like.array
    offsets = array.offsets
    if like.cu_seqlens.shape[0] and int(offsets[0].as_py()) != 0:
        offsets = pa.array(like.cu_seqlens.astype(offsets.type.to_pandas_dtype()))
    kind = pa.LargeListArray if pa.types.is_large_list(array.type) else pa.ListArray
    return kind.from_arrays(offsets, pa.array(values))


def second_pass_batch(
    batch: Any,
    options: Options,
    used: dict[str, str],
    statistics: Statistics,
    row_offset: int,
    names: tuple[str, str],
) -> tuple[Any, int]:
    """``batch`` with the advantages and returns columns (replacing columns of those names),
    and its number of tokens."""
    ex = extract(batch, used, row_offset)
    if options.grouped:
        per_row = statistics.row_advantages[row_offset : row_offset + ex.n_rows]
        advantages = outcome.broadcast_to_tokens(per_row.astype(ex.dtype), cu_seqlens=ex.cu_seqlens)
        returns = advantages
    else:
        advantages, returns = token_results(ex, options)
        if options.whitens_tokens:
            advantages = whiten(
                advantages,
                cu_seqlens=ex.cu_seqlens,
                moments=statistics.moments,
                eps=options.whiten_eps,
                unbiased=options.unbiased,
                shift_mean=options.shift_mean,
                # in place where the advantages are an array of their own (not the returns)
                out=None if advantages is returns else advantages,
                backend=options.backend,
            )
    outputs = {
        names[0]: _list_column(_on_tokens(advantages, ex), ex.layout),
        names[1]: _list_column(_on_tokens(returns, ex), ex.layout),
    }
    for name, column in outputs.items():
        index = batch.schema.get_field_index(name)
        if index >= 0:
            batch = batch.set_column(index, name, column)
        else:
            batch = batch.append_column(name, column)
    return batch, int(ex.layout.cu_seqlens[-1])
