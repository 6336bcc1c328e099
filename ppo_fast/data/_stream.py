"""Inputs, outputs and the streaming driver: record batches of at most ``batch_rows`` rows from a
Parquet, Arrow IPC or JSON lines file (or a Table), the two passes of ``_compute``, and the
output written whole or not at all.

Memory: a pass holds one record batch (and, for Parquet, a page of each column being decoded,
whatever the row groups) and its results; between the passes it keeps the statistics (three floats,
or one float64 a row for the group estimators), and, for a Parquet input of no more rows than a
batch, that batch (``run``: the input is then read once). Arrow IPC files are memory-mapped, so
their batches are read in place. JSON lines are parsed whole by ``pyarrow.json`` (there is no
streaming JSON reader in pyarrow), then cut into batches.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import _threads
from .._atomic import atomic_path, output_problem
from . import _columns
from ._arrow import pa
from ._compute import Statistics, fields_used, first_pass, first_pass_fields
from ._compute import second_pass_batch as _second_pass_batch
from ._names import DEFAULT_BATCH_ROWS, Columns, DataError, Options, WriteError

FORMATS = ("parquet", "arrow", "arrow-stream", "jsonl")
COMPRESSIONS = ("none", "snappy", "zstd", "lz4", "gzip", "brotli")  # of ParquetWriter
CODECS = {"UNCOMPRESSED": "none", "LZ4_RAW": "lz4"}  # Parquet metadata -> ParquetWriter
OUTPUT_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow"}
Progress = Callable[[str, int, int], None]  # (pass name, rows, tokens) after each batch
READ_PIECES = 4  # a Parquet batch is decoded in this many pieces (ParquetSource)
READ_BUFFER = 1 << 20  # bytes: the Parquet reader's buffer of each column chunk (ParquetSource)


def _no_progress(phase: str, rows: int, tokens: int) -> None:
    return None


class _Source:
    """Record batches of at most ``batch_rows`` rows, of some ``columns`` or all (None)."""

    schema: Any
    compression: dict[str, str] = {}  # noqa: RUF012 - column -> codec of a Parquet input
    # Whether reading the input again costs a decoding (Parquet), where a second pass over an
    # in-memory table or a memory-mapped Arrow file does not.
    rereading_costs = False

    def batches(self, columns: list[str] | None) -> Iterator[Any]:
        raise NotImplementedError

    def table(self) -> Any:
        """The whole input as one Table (for small inputs: ``ppo-fast trace --dataset``)."""
        return pa.Table.from_batches(list(self.batches(None)), schema=self.schema)


class TableSource(_Source):
    """Record batches of an in-memory Table (its chunks, cut to ``batch_rows``: zero-copy)."""

    format = "table"

    def __init__(self, table: Any, batch_rows: int | None = None) -> None:
        # not ``self.table``: that would hide the ``table()`` method (a JSON lines input, read
        # whole into this source, made ``ppo-fast trace --dataset FILE`` call the Table before
        # 0.8.26)
        self._table = table
        self.schema = table.schema
        self.num_rows = table.num_rows
        self.batch_rows = batch_rows

    def batches(self, columns: list[str] | None) -> Iterator[Any]:
        table = self._table if columns is None else self._table.select(columns)
        yield from table.to_batches(max_chunksize=self.batch_rows)

    def table(self) -> Any:
        return self._table


class ParquetSource(_Source):
    """A Parquet file, read in batches of ``batch_rows / READ_PIECES`` rows (``Writer`` joins
    them again into row groups of ``batch_rows``), whatever its row groups.

    The reader streams each column chunk through a buffer of ``READ_BUFFER`` bytes
    (``pre_buffer=False, buffer_size=READ_BUFFER``) instead of pyarrow's default
    ``pre_buffer=True``, which reads every column chunk of a row group whole before its first
    batch and keeps those reads until the ``iter_batches`` call ends: a row group larger than
    the batch (``datasets``' ``to_parquet`` writes row groups of about 100 MB,
    ``pyarrow.parquet.write_table`` of up to 1 Mi rows) was held whole, and the buffers of
    every row group read stayed allocated (on a file of one 5.2 M-token row group read 256
    rows at a time: 147 MiB allocated by the last batch with pre-buffering, 3 MiB without).
    On a local file streaming reads are as fast (pre-buffering pays on object stores).

    The batches are a quarter batch: while it decodes a batch of list columns, pyarrow's
    reader holds several times the decoded bytes (the pages, the repetition and definition
    levels, the builders), which alone would be more than a whole batch's data (its inputs
    and outputs)."""

    format = "parquet"
    rereading_costs = True

    def __init__(self, path: str, batch_rows: int) -> None:
        import pyarrow.parquet as pq

        self.path, self.batch_rows, self._pq = path, batch_rows, pq
        with self._open() as file:
            self.schema = file.schema_arrow
            self.num_rows = file.metadata.num_rows
            self.compression = _codecs(file.metadata)

    def _open(self) -> Any:
        return self._pq.ParquetFile(self.path, pre_buffer=False, buffer_size=READ_BUFFER)

    def batches(self, columns: list[str] | None) -> Iterator[Any]:
        rows = -(-self.batch_rows // READ_PIECES)
        with self._open() as file:
            yield from file.iter_batches(batch_size=rows, columns=columns)


def _codecs(metadata: Any) -> dict[str, str]:
    """Each top-level column's codec in the first row group (a codec name of
    ``ParquetWriter``: "none", "snappy", "zstd"...; for a nested column, its first leaf's)."""
    if metadata.num_row_groups == 0:
        return {}
    group = metadata.row_group(0)
    codecs: dict[str, str] = {}
    for i in range(group.num_columns):
        chunk = group.column(i)
        codec = CODECS.get(chunk.compression, chunk.compression.lower())
        # LZO and others that pyarrow reads but does not write: snappy.
        codec = codec if codec in COMPRESSIONS else "snappy"
        codecs.setdefault(chunk.path_in_schema.split(".")[0], codec)
    return codecs


def _leaf_paths(schema: Any) -> list[str]:
    """The Parquet leaf columns of ``schema`` ("logprobs.list.element"): what a per-column
    setting of ``ParquetWriter`` is keyed by (a top-level name matches a flat column only)."""
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    parquet_schema = pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema
    return [parquet_schema.column(i).path for i in range(len(parquet_schema))]


class IpcSource(_Source):
    """An Arrow IPC file or stream, memory-mapped: its batches are views of the mapping."""

    def __init__(self, path: str, batch_rows: int, stream: bool) -> None:
        self.path, self.batch_rows, self.stream = path, batch_rows, stream
        self.format = "arrow-stream" if stream else "arrow"
        with self._reader() as reader:
            self.schema = reader.schema
            self.num_rows = (
                None
                if stream
                else sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            )

    @contextlib.contextmanager
    def _reader(self) -> Iterator[Any]:
        with pa.memory_map(self.path) as source:
            yield pa.ipc.open_stream(source) if self.stream else pa.ipc.open_file(source)

    def batches(self, columns: list[str] | None) -> Iterator[Any]:
        with self._reader() as reader:
            stored = (
                iter(reader)
                if self.stream
                else (reader.get_batch(i) for i in range(reader.num_record_batches))
            )
            for batch in stored:
                if columns is not None:
                    batch = batch.select(columns)
                for start in range(0, batch.num_rows, self.batch_rows):
                    yield batch.slice(start, self.batch_rows)


def _kind(path: str) -> str:
    """The file's format from its first bytes (not its name)."""
    with open(path, "rb") as file:
        head = file.read(64)
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1"):
        return "arrow"
    if head.startswith(b"\xff\xff\xff\xff"):
        return "arrow-stream"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    raise DataError(
        f"is not a Parquet, Arrow IPC or JSON lines file (it begins with {head[:8]!r}); give a "
        ".parquet file, an Arrow IPC file or stream, or JSON lines (one object per line)"
    )


def open_source(path: str, batch_rows: int) -> Any:
    """The source reading ``path`` in batches of ``batch_rows``, or a DataError saying why not."""
    if not os.path.exists(path):
        raise DataError("no such file; give the path of a Parquet, Arrow IPC or JSON lines file")
    if os.path.isdir(path):
        raise DataError("is a folder; give a file (a dataset folder: pass one file at a time)")
    try:
        kind = _kind(path)
        if kind == "parquet":
            return ParquetSource(path, batch_rows)
        if kind == "jsonl":
            import pyarrow.json as pj

            return TableSource(pj.read_json(path), batch_rows)
        return IpcSource(path, batch_rows, stream=kind == "arrow-stream")
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"cannot read it: {error}") from None


def output_format(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise DataError(
            f"cannot tell the output format from {suffix or 'no suffix'!r}: end the name with "
            ".parquet (Parquet) or .arrow (an Arrow IPC file)"
        )
    return OUTPUT_SUFFIXES[suffix]


def check_paths(source_path: str, output: str) -> str:
    """The output's format, or a DataError: the output is the input, or cannot be written."""
    kind = output_format(output)
    if os.path.exists(output) and os.path.exists(source_path):
        if os.path.samefile(source_path, output):
            raise DataError(
                f"-o {output} is the input file; write to another path (the input is read "
                "while the output is written, and must stay as it is)"
            )
    problem = output_problem(output)
    if problem is not None:
        raise DataError(f"-o {output}: {problem}")
    return kind


class Writer:
    """Record batches into a file (a path: pyarrow opens it natively; or an open binary file), as
    Parquet or an Arrow IPC file, the writing done in a thread of its own while the caller reads
    and computes the next batch.

    The writer thread: pyarrow encodes and compresses with the GIL released, and writing takes
    most of an ``advantages_file`` run (the output is the input and two more columns), so on two
    cores the reading and the kernels run beside it instead of before it. At most one write is
    in flight, and the caller gathers at most half of the next row group meanwhile (then waits):
    the output held is one and a half batches at most, not two, and little is lost, since
    reading and computing a batch takes less than half the time of writing it (``ppo-fast
    advantages`` on bench/data_advantages.py's rollouts: 0.12-0.17 s against 0.3 s a batch of
    4,096 rows). An error of the thread is raised by the next ``write`` or by ``close``.

    In Parquet, the flat columns (uids, scores) keep pyarrow's default dictionary encoding and the
    list columns (token data: floats that rarely repeat) are written without one: pyarrow would
    try a dictionary and drop it once it outgrows its page, which took more than half of the
    writing time on the rollouts of bench/data_advantages.py. ``compression``: a codec for every
    column, or column -> codec (``advantages_file`` passes the input's codecs, so its columns
    are written compressed as they were, and a codec for the new ones: none for a token
    estimator, snappy for a group estimator). The rest is pyarrow's defaults (snappy,
    statistics). On those rollouts (5.2 M float32 tokens, seven columns, KL-shaped GAE: noise to
    a compressor; a loaded 2-core AMD EPYC, best of 3): the two new columns uncompressed wrote
    in 0.99 s against 1.12 s with snappy, for a file of the same size (snappy finds nothing in
    float noise), BYTE_STREAM_SPLIT on them 1.11 s for a file 4% smaller, on every float column
    1.19 s and 12% smaller, with zstd (level 1) 1.41 s and 18% smaller. A group estimator's
    advantages are one value a row, which snappy compresses well; ``compression="none"``
    (``--compression none``: every column) writes faster."""

    def __init__(
        self,
        file: Any,
        kind: str,
        batch_rows: int = 1,
        compression: str | dict = "snappy",
        name: str | None = None,
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.file, self.kind, self.writer, self.name = file, kind, None, name
        self.batch_rows, self.pending, self.pending_rows = batch_rows, [], 0
        self.compression = compression
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="ppo_fast-writer")
        self.in_flight: Any = None  # the Future of the write being done

    def write(self, batch: Any) -> None:
        """Parquet: ``batch`` joins the pending ones, written as one row group once they hold
        ``batch_rows`` rows (a row group per piece of ``ParquetSource`` would be small)."""
        if self.kind != "parquet":
            return self._hand_over(batch)
        self.pending.append(batch)
        self.pending_rows += batch.num_rows
        if self.pending_rows >= self.batch_rows:
            self._flush()
        elif 2 * self.pending_rows >= self.batch_rows:
            self._wait()  # half a row group gathered: no further ahead of the writer

    def _flush(self) -> None:
        if self.pending:
            self._hand_over(pa.Table.from_batches(self.pending))
            self.pending, self.pending_rows = [], 0

    def _hand_over(self, batch: Any) -> None:
        self._wait()
        self.in_flight = self.thread.submit(self._write, batch)

    def _wait(self) -> None:
        """Wait for the write in flight; raise its error."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        try:
            in_flight.result()
        except Exception as error:  # pyarrow's, or the disk's: not "cannot read it"
            raise WriteError.of(error, self.name) from error

    def _write(self, batch: Any) -> None:
        if self.writer is None:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                flat = [f.name for f in batch.schema if not pa.types.is_nested(f.type)]
                compression = self.compression
                if isinstance(compression, dict):  # by leaf; the columns it does not name: snappy
                    compression = {
                        path: compression.get(path.split(".")[0], "snappy")
                        for path in _leaf_paths(batch.schema)
                    }
                self.writer = pq.ParquetWriter(
                    self.file, batch.schema, use_dictionary=flat or False, compression=compression
                )
            else:
                self.writer = pa.ipc.new_file(self.file, batch.schema)
        if self.kind == "arrow":
            self.writer.write_batch(batch)
        else:  # a Table of the pending batches: one row group, their chunks not concatenated
            self.writer.write_table(batch, row_group_size=max(batch.num_rows, 1))

    def close(self, flush: bool = True) -> None:
        """Write what is pending (unless ``flush`` is False: after an error, when the write in
        flight is waited for and its error dropped) and the footer."""
        try:
            if flush:
                self._flush()
                self._wait()
            else:
                with contextlib.suppress(Exception):
                    self._wait()
        finally:
            self.thread.shutdown(wait=True)
        if self.writer is not None:
            try:
                self.writer.close()  # the footer
            except Exception as error:
                raise WriteError.of(error, self.name) from error


def run(
    source: Any,
    emit: Callable[[Any], None],
    options: Options,
    columns: Columns,
    names: tuple[str, str],
    progress: Progress = _no_progress,
    statistics: Statistics | None = None,
) -> dict[str, Any]:
    """Both passes over ``source``; ``emit`` receives every output batch in order. Returns the
    summary (rows, tokens, batches, passes, reads of the input, and the whitening moments where
    there are some).
    ``statistics`` given (by ``ppo_fast.data.ray``, from the whole dataset): no first pass."""
    used = fields_used(options, columns, source.schema.names)
    _columns.require(source.schema, used)
    if names[0] == names[1]:
        raise DataError(f"the advantages and returns columns have one name {names[0]!r}")
    for name in names:
        if name in used.values():
            raise DataError(
                f"the output column {name!r} is an input column of the computation; name the "
                "outputs otherwise (--advantages-column, --returns-column)"
            )
    passes = reads = 1
    kept = None  # the input's batches, when the first pass read them whole (see below)
    if statistics is None and not options.needs_first_pass:
        statistics = Statistics()
    elif statistics is None:
        wanted = first_pass_fields(options, used)
        order = [n for n in source.schema.names if n in set(wanted.values())]
        totals = [0, 0]

        def counted(rows: int, tokens: int) -> None:
            totals[0] += rows
            totals[1] += tokens
            progress("statistics", *totals)

        if source.rereading_costs and source.num_rows <= source.batch_rows:
            # The whole input is no more than one batch: the first pass reads every column and
            # keeps them for the second, which so does not read the file again (memory: one
            # batch, the bound of any run). Decoding is most of a run's time on Parquet.
            kept = list(source.batches(None))
            first_batches = (batch.select(order) for batch in kept)
        else:
            first_batches = source.batches(order)
            reads = 2
        statistics = first_pass(first_batches, options, wanted, counted)
        passes = 2
    rows = tokens = batches = 0
    for batch in kept if kept is not None else source.batches(None):
        out, batch_tokens = _second_pass_batch(batch, options, used, statistics, rows, names)
        emit(out)
        rows, tokens, batches = rows + batch.num_rows, tokens + batch_tokens, batches + 1
        progress("advantages", rows, tokens)
    if batches == 0:  # an input of no rows still gets its output columns
        empty = pa.RecordBatch.from_pylist([], schema=source.schema)
        emit(_second_pass_batch(empty, options, used, statistics, 0, names)[0])
    summary: dict[str, Any] = {
        "rows": rows,
        "tokens": tokens,
        "batches": batches,
        "passes": passes,
        "reads": reads,
        "estimator": options.estimator,
    }
    if statistics.moments is not None:
        summary["whiten_mean"] = statistics.moments.mean
        summary["whiten_std"] = statistics.moments.var(options.unbiased) ** 0.5
    return summary


def advantages_file(
    input: str | os.PathLike,
    output: str | os.PathLike,
    options: Options,
    columns: Columns,
    *,
    names: tuple[str, str] = ("advantages", "returns"),
    batch_rows: int = DEFAULT_BATCH_ROWS,
    progress: Progress = _no_progress,
    compression: str | None = None,
) -> dict[str, Any]:
    """Read ``input`` in batches of ``batch_rows`` rows, write it with the advantages and returns
    to ``output`` (a temporary file in its folder, renamed at the end: an interrupted run leaves
    no partial output). Returns the summary, with the time and tokens/s.

    ``compression`` (Parquet output): None keeps each input column's codec (from a Parquet
    input's metadata; snappy, pyarrow's default, for other inputs) and writes the two new
    columns uncompressed for a token estimator (gae, reinforce++...: float noise), with snappy
    for a group estimator (one value a row), or a
    codec of ``pyarrow.parquet.ParquetWriter`` for every column ("none", "snappy", "zstd",
    "lz4", "gzip", "brotli")."""
    input, output = os.fspath(input), os.fspath(output)
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise DataError(f"batch_rows must be a positive integer, got {batch_rows!r}")
    kind = check_paths(input, output)
    if compression is not None and compression not in COMPRESSIONS:
        raise DataError(
            f"compression must be one of {', '.join(COMPRESSIONS)} (or None: as the input), "
            f"got {compression!r}"
        )
    source = open_source(input, batch_rows)
    start = time.perf_counter()
    try:
        with atomic_path(output) as file:
            codecs = compression
            if compression is None:
                # Token estimators' outputs are float noise to a compressor: snappy would find
                # nothing in them (the same file size) and cost about an eighth of the writing
                # time; a group estimator's are one value a row, which it compresses well.
                fresh = "snappy" if options.grouped else "none"
                codecs = {**source.compression, names[0]: fresh, names[1]: fresh}
            writer = Writer(file, kind, batch_rows, compression=codecs, name=output)
            try:
                # A core left to the writer's thread; in the first pass, before anything is
                # written, to pyarrow's decoding threads: the kernels on every core were slower
                # there (the OpenMP team's waiting threads spin on the reader's core between
                # calls: 8,192 rows, batches of 4,096, best of 15: 90 ms against 76 ms).
                with _threads.leaving_one_core():
                    summary = run(source, writer.write, options, columns, names, progress)
            except BaseException:
                # Closed now, while its file is open (the temporary file is removed next),
                # rather than by the garbage collector after it is closed.
                with contextlib.suppress(Exception):
                    writer.close(flush=False)
                raise
            writer.close()
    except pa.ArrowException as error:
        raise DataError(f"cannot read it: {error}") from None
    seconds = time.perf_counter() - start
    return {
        "input": input,
        "output": output,
        "input_format": source.format,
        "output_format": kind,
        **summary,
        "seconds": seconds,
        "tokens_per_s": summary["tokens"] / seconds if seconds > 0 else None,
    }
