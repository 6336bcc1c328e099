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
  ``rloo``, ``pass_at_k``): ``groupby(uid).map_groups`` computes each group where its rows
  meet. The rows come out grouped by uid (Ray's shuffle), not in the input's order: keep an id
  column to sort by. ``gpg`` (its alpha counts the rows of the whole batch) and
  ``reinforce_plus_plus_baseline`` (whitened over every token) are refused: use
  ``ppo_fast.data.advantages_file`` on one machine.

Results equal ``ppo_fast.data.advantages`` on the whole table: bit for bit without whitening;
with it, to the last bits of the merged moments (the blocks are merged in another order: about
1e-15 relative on the mean and variance; the tests hold them to 1e-12). The row numbers in error
messages count from the first row of the failing block.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import Columns, DataError, Options, resolve_columns

GROUP_LOCAL = ("grpo", "dr_grpo", "rloo", "pass_at_k")
MOMENT_COLUMNS = ("count", "mean", "m2")


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
    used = fields_used(config, fields)
    if config.grouped and config.estimator not in GROUP_LOCAL:
        raise DataError(
            f"{config.estimator} needs statistics of the whole batch, not only of each group; "
            f"on Ray the group estimators are {', '.join(GROUP_LOCAL)}: run "
            "ppo_fast.data.advantages_file on one machine for this one"
        )
    missing = [name for name in used.values() if name not in dataset.schema().names]
    if missing:
        raise DataError(
            f"no column {missing[0]!r} in the dataset; the columns are "
            f"{', '.join(dataset.schema().names)}: name it (columns=Columns(...)) or choose a "
            "preset"
        )
    if config.grouped:
        compute = functools.partial(
            _with_advantages, options=config, columns=fields, names=names, statistics=None
        )
        groups = dataset.groupby(used["uid"], num_partitions=num_partitions)
        return groups.map_groups(compute, batch_format="pyarrow")
    statistics = Statistics()
    if config.whiten:
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
