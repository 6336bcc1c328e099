"""The same computation on a ``ray.data.Dataset``: more than one machine.

    import ray.data
    from ppo_fast.data import ray as ppo_ray
    dataset = ray.data.read_parquet("s3://bucket/rollouts/")
    dataset = ppo_ray.advantages(dataset, estimator="gae", kl_coef=0.05, columns="verl")
    dataset.write_parquet("s3://bucket/with_advantages/")

Every batch is computed by ``map_batches(batch_format="pyarrow")`` with the code of
``ppo_fast.data`` (the columns' buffers read in place, the public stages). The statistics of the
whole dataset come first:

- ``gae`` and ``reinforce_plus_plus`` with whitening: a ``map_batches`` over the columns the
  advantages need gives each block's float64 (count, mean, M2); the driver merges them
  (``merge_moments``: Chan's update) into the global mean and variance, and the second
  ``map_batches`` whitens by them. The rows keep the dataset's order.
- the group estimators that need nothing but the group's own rows (``grpo``, ``dr_grpo``,
  ``rloo``, ``pass_at_k``, ``opo``): ``groupby(uid).map_groups`` computes each group where its rows
  meet. The rows come out grouped by uid (Ray's shuffle), not in the input's order: keep an id
  column to sort by.
- the group estimators with a statistic of the whole batch, in two stages: ``gpg``'s alpha =
  n / max(m, 1) (n rows, m of them with a nonzero score) from each block's (n, m), summed on
  the driver, then ``map_groups`` with that alpha; ``reinforce_plus_plus_baseline``: each row's
  s_b - mean_g by ``map_groups`` (kept in float64 with the row's valid-token count), each
  block's token-weighted float64 (count, mean, M2) of those, merged on the driver, then a
  ``map_batches`` that whitens them and writes the columns.

Results equal ``ppo_fast.data.advantages`` on the whole table: bit for bit without whitening
(``gpg`` included: its alpha is a ratio of two integers); with it, to the last bits of the
merged moments (the blocks are merged in another order: about 1e-15 relative on the mean and
variance; the tests hold the results to 1e-12). The row numbers in error
messages count from the first row of the failing block.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import Columns, DataError, Options, resolve_columns

GROUP_LOCAL = ("grpo", "dr_grpo", "rloo", "pass_at_k", "opo")
MOMENT_COLUMNS = ("count", "mean", "m2")
# reinforce_plus_plus_baseline's per-row columns between its stages (dropped at the end).
CENTRED, TOKENS = "__ppo_fast_centred", "__ppo_fast_tokens"


def _block_moments(batch: Any, options: Options, used: dict[str, str]) -> Any:
    """A ``map_batches`` function: one row of float64 (count, mean, M2) of the unwhitened
    advantages of each record batch of ``batch``."""
    from ._arrow import pa
    from ._compute import batch_moments, extract, token_results

    parts = []
    for record_batch in batch.to_batches():
        ex = extract(record_batch, used, 0)
        advantages, _ = token_results(ex, options)
        parts.append(batch_moments(advantages, ex.cu_seqlens, options.backend))
    moments = np.array(parts).reshape(-1, 3)
    return pa.table({name: moments[:, i] for i, name in enumerate(MOMENT_COLUMNS)})


def _with_advantages(
    batch: Any, options: Options, columns: Columns, names: tuple[str, str], statistics: Any
) -> Any:
    """A ``map_batches`` / ``map_groups`` function: the batch (a pyarrow Table) with the
    advantages and returns, by the statistics given (None: the batch's own, for a group)."""
    from ._arrow import pa
    from ._stream import TableSource, run

    out: list[Any] = []
    run(TableSource(batch), out.append, options, columns, names, statistics=statistics)
    return pa.Table.from_batches(out)


def _block_alpha_counts(batch: Any, used: dict[str, str]) -> Any:
    """A ``map_batches`` function for gpg: the rows of ``batch`` and how many have a nonzero
    score (a NaN is nonzero, as in ``outcome.gpg``), one row."""
    from ._arrow import pa
    from ._compute import group_inputs

    scores = group_inputs(batch.to_batches(), used).scores
    return pa.table({"rows": [scores.shape[0]], "nonzero": [int(np.count_nonzero(scores))]})


def _group_centred(batch: Any, options: Options, used: dict[str, str]) -> Any:
    """A ``map_groups`` function for reinforce_plus_plus_baseline: the group's rows with
    s_b - mean_g (float64, unwhitened) and their valid-token counts."""
    import dataclasses

    from ._arrow import pa
    from ._compute import group_advantages, group_inputs

    rows = group_inputs(batch.to_batches(), used)
    centred = group_advantages(dataclasses.replace(options, whiten=False), *rows)
    return batch.append_column(CENTRED, pa.array(centred)).append_column(
        TOKENS, pa.array(rows.token_counts)
    )


def _block_weighted_moments(batch: Any) -> Any:
    """A ``map_batches`` function: float64 (count, mean, M2) of the centred values of the rows
    of ``batch`` weighted by their tokens (rows without a token left out), one row."""
    from ._arrow import pa

    weights = batch.column(TOKENS).to_numpy().astype(np.float64)
    values = batch.column(CENTRED).to_numpy()
    counted = weights > 0
    weights, values = weights[counted], values[counted]
    total = float(weights.sum())
    mean = float(np.sum(weights * values) / total) if total else 0.0
    m2 = float(np.sum(weights * (values - mean) ** 2)) if total else 0.0
    return pa.table({"count": [total], "mean": [mean], "m2": [m2]})


def _whitened_rows(
    batch: Any,
    options: Options,
    columns: Columns,
    names: tuple[str, str],
    mean: float,
    scale: float,
) -> Any:
    """A ``map_batches`` function: the batch with the advantages (s_b - mean_g - mean) / scale
    of every row on its tokens (and as the returns), the stage columns dropped."""
    from ._compute import Statistics

    per_row = (batch.column(CENTRED).to_numpy() - mean) / scale
    batch = batch.drop_columns([CENTRED, TOKENS])
    statistics = Statistics(row_advantages=per_row)
    return _with_advantages(batch, options, columns, names, statistics)


def _whiten_scale(merged: np.ndarray, options: Options) -> tuple[float, float]:
    """The mean and sqrt(variance + whiten_eps) of merged [count, mean, M2], with
    ``outcome.reinforce_plus_plus_baseline``'s errors."""
    count, mean, m2 = (float(v) for v in merged)
    if count == 0 or (options.unbiased and count == 1):
        what = "no valid token" if count == 0 else "a single valid token and unbiased=True"
        raise DataError(
            f"reinforce_plus_plus_baseline whitens over the tokens but the dataset has {what}: "
            "pass whiten=False"
        )
    scale = float(np.sqrt(m2 / (count - 1.0 if options.unbiased else count) + options.whiten_eps))
    if scale == 0.0:
        raise DataError("whiten: the variance is 0 and whiten_eps=0: pass whiten_eps > 0")
    return mean, scale


def advantages(
    dataset: Any,
    *,
    columns: Columns | str | None = None,
    names: tuple[str, str] = ("advantages", "returns"),
    batch_size: int | None = 65_536,
    num_partitions: int | None = None,
    **options: Any,
) -> Any:
    """``dataset`` (a ``ray.data.Dataset``) with ``advantages`` and ``returns`` list columns,
    lazily (the moments of a whitened token estimator are computed now); ``options`` and
    ``columns`` as for ``ppo_fast.data.advantages``; ``batch_size``: rows per ``map_batches``
    batch; ``num_partitions``: of the group estimators' ``groupby`` (Ray's default when None;
    a few per CPU of the cluster is plenty: each partition is a task)."""
    from ._compute import Statistics, as_moments, fields_used, merge_moments

    config = Options(**options)
    fields = resolve_columns(columns)
    used = fields_used(config, fields, dataset.schema().names)
    missing = [name for name in used.values() if name not in dataset.schema().names]
    if missing:
        raise DataError(
            f"no column {missing[0]!r} in the dataset; the columns are "
            f"{', '.join(dataset.schema().names)}: name it (columns=Columns(...)) or choose a "
            "preset"
        )
    if config.grouped:
        return _grouped(dataset, config, fields, used, names, batch_size, num_partitions)
    statistics = Statistics()
    if config.whitens_tokens:
        parts = dataset.select_columns(list(dict.fromkeys(used.values()))).map_batches(
            functools.partial(_block_moments, options=config, used=used),
            batch_format="pyarrow",
            batch_size=batch_size,
        )
        rows = parts.take_all()
        merged = merge_moments(np.array([[row[k] for k in MOMENT_COLUMNS] for row in rows]))
        statistics = Statistics(moments=as_moments(merged))
    compute = functools.partial(
        _with_advantages, options=config, columns=fields, names=names, statistics=statistics
    )
    return dataset.map_batches(
        compute,
        batch_format="pyarrow",
        batch_size=batch_size,
    )


def _grouped(
    dataset: Any,
    options: Options,
    columns: Columns,
    used: dict[str, str],
    names: tuple[str, str],
    batch_size: int | None,
    num_partitions: int | None,
) -> Any:
    """A group estimator: its statistics of the whole dataset first (gpg,
    reinforce_plus_plus_baseline), then ``groupby(uid).map_groups``."""
    import dataclasses

    from ._compute import first_pass_fields, merge_moments

    wanted = first_pass_fields(options, used)
    needed = list(dict.fromkeys(wanted.values()))
    if options.estimator == "gpg" and options.gpg_alpha is None:
        parts = dataset.select_columns(needed).map_batches(
            functools.partial(_block_alpha_counts, used=wanted),
            batch_format="pyarrow",
            batch_size=batch_size,
        )
        counts = parts.sum(["rows", "nonzero"])
        n_rows, nonzero = int(counts["sum(rows)"] or 0), int(counts["sum(nonzero)"] or 0)
        # As outcome.gpg over all rows; an empty dataset (no group to scale) takes 1.
        options = dataclasses.replace(options, gpg_alpha=n_rows / max(nonzero, 1) or 1.0)
    groups = dataset.groupby(used["uid"], num_partitions=num_partitions)
    if options.estimator != "reinforce_plus_plus_baseline" or not options.whiten:
        compute = functools.partial(
            _with_advantages, options=options, columns=columns, names=names, statistics=None
        )
        return groups.map_groups(compute, batch_format="pyarrow")
    centred = groups.map_groups(
        functools.partial(_group_centred, options=options, used=wanted), batch_format="pyarrow"
    ).materialize()  # read by both stages that follow: computed once
    parts = centred.select_columns([CENTRED, TOKENS]).map_batches(
        _block_weighted_moments, batch_format="pyarrow", batch_size=batch_size
    )
    rows = parts.take_all()
    merged = merge_moments(np.array([[row[k] for k in MOMENT_COLUMNS] for row in rows]))
    mean, scale = _whiten_scale(merged, options)
    compute = functools.partial(
        _whitened_rows, options=options, columns=columns, names=names, mean=mean, scale=scale
    )
    return centred.map_batches(compute, batch_format="pyarrow", batch_size=batch_size)
