"""Batch advantages over rollout datasets: Arrow tables, Parquet and Arrow IPC files, Ray Data.

    from ppo_fast import data
    table = data.advantages(table, estimator="gae", gamma=1.0, lam=0.95, kl_coef=0.05,
                            columns="verl")                     # a pyarrow Table or RecordBatch
    data.advantages_file("rollouts.parquet", "out.parquet", batch_rows=65536)  # streaming
    dataset = data.ray.advantages(dataset, estimator="grpo")   # a ray.data.Dataset

The input holds one row per response: per-token list columns (token rewards, log-probabilities,
reference log-probabilities, values, a mask) and per-row columns (score, group uid, bootstrap),
named by ``Columns`` or a preset (``PRESETS``: ``ppo_fast``, ``verl``, ``openrlhf``; see
``_columns``). The output is the input with ``advantages`` and ``returns`` list columns (of the
token columns' float type, sharing their offsets), rows in the same order.

The list columns are read as ppo_fast's packed layout without a copy: a column's offsets are the
``cu_seqlens`` and its values buffer is the packed token array (DESIGN.md section 2); the stages
are the public ones (``shape_rewards``, ``gae``, ``discounted_returns``, ``whiten`` with global
``Moments``, the group estimators of ``ppo_fast.outcome``). Statistics over the whole input (the
whitening moments, merged in float64; the groups) come from a first pass that reads only the
columns they need (every column of a Parquet input of no more rows than a batch, kept for the
second pass, which then does not read the file again), so results do not depend on
``batch_rows``: they equal one call of the stages
on the whole input, to the last bits of the merged moments (about 1e-15 relative, see
``_compute.merge_moments``).

Needs the ``data`` extra (pyarrow, rich for the progress bar; ``ray[data]`` for ``data.ray``):
``pip install "ppo_fast[data]"``. ``import ppo_fast`` and ``import ppo_fast.data`` do not
import pyarrow: the functions do, when called.
"""

from __future__ import annotations

from typing import Any

from ._names import (
    DEFAULT_BATCH_ROWS,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    PRESETS,
    TOKEN_ESTIMATORS,
    Columns,
    DataError,
    IfPresent,
    Options,
    WriteError,
)

__all__ = [
    "DEFAULT_BATCH_ROWS",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "PRESETS",
    "TOKEN_ESTIMATORS",
    "Columns",
    "DataError",
    "IfPresent",
    "Options",
    "WriteError",
    "advantages",
    "advantages_file",
    "resolve_columns",
]


def resolve_columns(columns: Columns | str | None = None, **names: str | None) -> Columns:
    """``columns`` (a ``Columns``, a preset name, or None for ``ppo_fast``'s names) with the
    column names in ``names`` (field=name; "" or None: no such column) replaced."""
    if columns is None:
        columns = PRESETS["ppo_fast"]
    elif isinstance(columns, str):
        if columns not in PRESETS:
            raise ValueError(
                f"columns must be one of {', '.join(PRESETS)} or a Columns, got {columns!r}"
            )
        columns = PRESETS[columns]
    elif not isinstance(columns, Columns):
        raise TypeError(f"columns must be a Columns or a preset name, got {type(columns).__name__}")
    return columns.replace(**names) if names else columns


def advantages(
    data: Any,
    *,
    columns: Columns | str | None = None,
    names: tuple[str, str] = ("advantages", "returns"),
    batch_rows: int | None = None,
    **options: Any,
) -> Any:
    """``data`` (a ``pyarrow.Table`` or ``RecordBatch``) with ``advantages`` and ``returns``
    list columns (``names``; columns of those names are replaced), the same type back.

    ``options`` are the fields of ``Options`` (estimator, gamma, lam, kl_coef, kl_estimator,
    kl_clamp, whiten, whiten_eps, unbiased, shift_mean, backend); ``columns`` names the input
    columns (``resolve_columns``). The table's chunks are computed one by one (cut to
    ``batch_rows`` rows when given); whitening and the groups are over the whole table.
    """
    from ._arrow import pa
    from ._stream import TableSource, run

    config = Options(**options)
    fields = resolve_columns(columns)
    if isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, pa.Table):
        table = data
    else:
        raise TypeError(
            f"data must be a pyarrow.Table or RecordBatch, got {type(data).__name__}: "
            "pyarrow.Table.from_pandas / from_pydict build one"
        )
    out: list[Any] = []
    run(TableSource(table, batch_rows), out.append, config, fields, names)
    result = pa.Table.from_batches(out)
    if isinstance(data, pa.RecordBatch):
        return result.combine_chunks().to_batches()[0] if result.num_rows else out[0]
    return result


def advantages_file(
    input: Any,
    output: Any,
    *,
    columns: Columns | str | None = None,
    names: tuple[str, str] = ("advantages", "returns"),
    batch_rows: int = DEFAULT_BATCH_ROWS,
    progress: Any = None,
    compression: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Stream ``input`` (Parquet, Arrow IPC file or stream, JSON lines: told by its first bytes)
    to ``output`` (``.parquet`` or ``.arrow``) with the advantages and returns, ``batch_rows``
    rows at a time; ``output`` appears whole at the end or not at all. ``progress(pass, rows,
    tokens)`` is called after each batch. ``compression`` (a Parquet output): None writes each
    column of a Parquet input with its codec and the new ones uncompressed for a token
    estimator (float noise), with snappy for a group estimator; or one codec for every column
    ("none", "snappy", "zstd", "lz4", "gzip", "brotli"). Returns the summary (rows, tokens,
    tokens_per_s...)."""
    from ._stream import advantages_file as stream

    config = Options(**options)
    fields = resolve_columns(columns)
    extra = {} if progress is None else {"progress": progress}
    return stream(
        input,
        output,
        config,
        fields,
        names=names,
        batch_rows=batch_rows,
        compression=compression,
        **extra,
    )
