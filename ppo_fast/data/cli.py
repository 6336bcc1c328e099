"""``ppo-fast advantages INPUT -o OUTPUT``: the advantages and returns of a rollout dataset.

    ppo-fast advantages rollouts.parquet -o out.parquet                 gae, ppo_fast's names
    ppo-fast advantages rollouts.parquet -o out.parquet --preset verl --kl-coef 0.05
    ppo-fast advantages rollouts.arrow -o out.arrow --estimator grpo --batch-rows 8192 --json
    ppo-fast advantages --example rollouts.parquet                      write a tiny example

INPUT is Parquet, an Arrow IPC file or stream, or JSON lines (told by its first bytes); OUTPUT
ends in .parquet or .arrow. OUTPUT is the input's columns plus ``advantages`` and ``returns``,
rows in the same order; it is written to a temporary file in its folder and renamed at the end,
so an interrupted run (Ctrl-C, SIGTERM, kill -9) never leaves a partial OUTPUT. A progress bar
(rows, tokens, tokens/s) goes to stderr when it is a terminal; ``--json`` prints a summary.
Importing this module imports no pyarrow: the command does, when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from .._spec import ESTIMATORS as KL_ESTIMATORS
from ._names import DEFAULT_BATCH_ROWS, ESTIMATORS, PRESETS, ROW_FIELDS, TOKEN_FIELDS

# The tiny example dataset (``--example``, ``ppo-fast trace --dataset``): row 0 is the worked
# example of shared/seeds/000 (score 0.7); two prompts, the second sampled twice, one row with
# a masked tool token.
EXAMPLE = {
    "uid": ["q-1", "q-2", "q-2"],
    "score": [0.7, 1.0, 0.0],
    "logprobs": [[-0.9, -1.4, -0.6], [-0.5, -0.2, -1.1, -0.3], [-2.0, -0.7]],
    "ref_logprobs": [[-1.2, -0.8, -0.7], [-0.6, -0.2, -0.9, -0.4], [-1.5, -0.9]],
    "values": [[0.3, 0.5, 0.6], [0.4, 0.6, 0.2, 0.8], [0.1, 0.2]],
    "mask": [[1, 1, 1], [1, 0, 1, 1], [1, 1]],
}
EXAMPLE_OPTIONS = {"kl_coef": 0.2, "gamma": 1.0, "lam": 0.95}


def example_table() -> Any:
    """``EXAMPLE`` as a pyarrow Table (float64 token columns, an int8 mask)."""
    import pyarrow as pa

    types = {"mask": pa.list_(pa.int8()), "uid": pa.string(), "score": pa.float64()}
    return pa.table(
        {k: pa.array(v, types.get(k, pa.list_(pa.float64()))) for k, v in EXAMPLE.items()}
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", nargs="?", metavar="INPUT", help="Parquet, Arrow IPC or JSONL")
    parser.add_argument("-o", "--output", metavar="OUTPUT", help="a .parquet or .arrow file")
    parser.add_argument(
        "--example", metavar="FILE", help="write the tiny example dataset to FILE and stop"
    )
    parser.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="ppo_fast",
        help="column names (default: %(default)s)",
    )
    for field in (*TOKEN_FIELDS, *ROW_FIELDS):
        parser.add_argument(
            f"--{field.replace('_', '-')}-column",
            metavar="NAME",
            help=f"the {field} column ('' for none; default: the preset's)",
        )
    parser.add_argument(
        "--estimator",
        choices=ESTIMATORS,
        default="gae",
        help="gae (default: needs values), reinforce_plus_plus, remax (needs --baseline-column: "
        "each row's greedy reward; not whitened), or a group estimator over --uid-column: grpo, "
        "dr_grpo, rloo, gpg, pass_at_k, reinforce_plus_plus_baseline, opo (the group's mean "
        "score weighted by each row's valid tokens)",
    )
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="KL shaping (default 0)")
    parser.add_argument("--kl-estimator", choices=KL_ESTIMATORS, default="k1")
    parser.add_argument("--kl-clamp", type=float, default=None)
    parser.add_argument(
        "--no-whiten",
        dest="whiten",
        action="store_false",
        help="do not whiten the advantages (gae, reinforce_plus_plus; reinforce_plus_plus_baseline"
        " whitens its own)",
    )
    parser.add_argument("--whiten-eps", type=float, default=1e-8)
    parser.add_argument("--unbiased", action="store_true", help="whiten by the n-1 variance")
    parser.add_argument(
        "--batch-rows",
        type=int,
        default=DEFAULT_BATCH_ROWS,
        metavar="N",
        help="rows per record batch: bounds the memory (default: %(default)s)",
    )
    parser.add_argument(
        "--compression",
        choices=("none", "snappy", "zstd", "lz4", "gzip", "brotli"),
        default=None,
        help="a Parquet OUTPUT's codec for every column (default: each input column's codec, "
        "snappy for the new columns)",
    )
    parser.add_argument("--advantages-column", default="advantages", metavar="NAME")
    parser.add_argument("--returns-column", default="returns", metavar="NAME")
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--backend", choices=("auto", "numba", "cython", "python"), default=None)


@contextlib.contextmanager
def _progress_bar(enabled: bool, total_rows: int | None) -> Iterator[Any]:
    """A callback drawing a rich progress bar on stderr (rows, tokens, tokens/s), or None when
    stderr is not a terminal."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f} rows  {task.fields[tokens]:,} tokens"),
        TextColumn("{task.fields[rate]:,.0f} tokens/s"),
        TimeElapsedColumn(),
    )
    tasks: dict[str, tuple[int, float]] = {}
    with Progress(*columns, console=console, transient=False) as bar:

        def update(phase: str, rows: int, tokens: int) -> None:
            if phase not in tasks:
                tasks[phase] = (
                    bar.add_task(phase, total=total_rows, tokens=0, rate=0.0),
                    time.perf_counter(),
                )
            task, start = tasks[phase]
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.update(task, completed=rows, tokens=tokens, rate=rate)

        yield update


def _fail(message: Any) -> int:
    print(f"ppo-fast advantages: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


# The environment variables by which a user chooses pyarrow's allocator and its settings.
ALLOCATOR_SETTINGS = ("ARROW_DEFAULT_MEMORY_POOL", "MIMALLOC_PURGE_DELAY")


def release_freed_memory() -> bool:
    """Whether the command chooses pyarrow's allocator: in a process that has not loaded pyarrow
    yet, where the user chose none (``ALLOCATOR_SETTINGS``). Then make mimalloc, pyarrow's
    default, give freed memory back to the system at once (by default it keeps freed pages for
    a while, which in bench/data_advantages.py added about 90 MiB to the peak of a 4,096-row
    batch): read when pyarrow's library loads, so only before its first import; and
    ``use_jemalloc`` replaces mimalloc by jemalloc once pyarrow is imported, where it can."""
    if "pyarrow" in sys.modules or any(v in os.environ for v in ALLOCATOR_SETTINGS):
        return False
    os.environ["MIMALLOC_PURGE_DELAY"] = "0"
    return True


def use_jemalloc() -> None:
    """Make jemalloc pyarrow's default allocator where pyarrow was built with it (its Linux and
    macOS wheels are; elsewhere mimalloc stays, releasing at once).

    mimalloc releasing at once maps and zeroes new pages for every page and row group that
    pyarrow's Parquet writer allocates: on the 5.2 M-token file of bench/data_advantages.py
    (whitened GAE, ``--batch-rows 4096``, a 2-core AMD EPYC) a run took 2.7 to 2.8 s of CPU
    against 1.5 to 1.9 s with jemalloc (its default decay), at the same peak memory (136
    against 133 MiB above the imports at 4,096 rows, 54 against 51 at 1,024)."""
    import pyarrow as pa

    with contextlib.suppress(NotImplementedError):
        pa.set_memory_pool(pa.jemalloc_memory_pool())


def run_command(args: argparse.Namespace) -> int:
    """Exit status 0, or 2 with one line on stderr naming the column, the row and the fix."""
    choose_allocator = release_freed_memory()
    try:
        from .. import data
        from . import _stream

        if choose_allocator:
            use_jemalloc()
    except ImportError as error:
        return _fail(error)
    if args.example is not None:
        if args.input is not None or args.output is not None:
            return _fail("--example FILE writes the example and stops: give no INPUT nor -o")
        try:
            kind = _stream.check_paths("", args.example)
            table = example_table()
            with _stream.atomic_path(args.example) as file:
                writer = _stream.Writer(file, kind)
                for batch in table.to_batches():
                    writer.write(batch)
                writer.close()
        except (ValueError, OSError) as error:
            return _fail(error)
        print(f"wrote {args.example}: {table.num_rows} rows", file=sys.stderr)
        return 0
    if args.batch_rows < 1:
        return _fail(f"--batch-rows {args.batch_rows}: give a positive number of rows")
    if args.input is None or args.output is None:
        return _fail("give INPUT and -o OUTPUT (or --example FILE); see ppo-fast advantages --help")
    names = {
        field: getattr(args, f"{field}_column")
        for field in (*TOKEN_FIELDS, *ROW_FIELDS)
        if getattr(args, f"{field}_column") is not None
    }
    options = {
        "estimator": args.estimator,
        "gamma": args.gamma,
        "lam": args.lam,
        "kl_coef": args.kl_coef,
        "kl_estimator": args.kl_estimator,
        "kl_clamp": args.kl_clamp,
        "whiten": args.whiten,
        "whiten_eps": args.whiten_eps,
        "unbiased": args.unbiased,
        "backend": args.backend,
    }
    try:
        columns = data.resolve_columns(args.preset, **names)
        _stream.check_paths(args.input, args.output)
        config = data.Options(**options)
        source = _stream.open_source(args.input, max(args.batch_rows, 1))
    except data.DataError as error:
        where = "" if str(error).startswith("-o ") else f"{args.input}: "
        return _fail(f"{where}{error}")
    except (ValueError, TypeError) as error:
        return _fail(error)
    try:
        with _progress_bar(args.progress, source.num_rows) as progress:
            summary = _stream.advantages_file(
                args.input,
                args.output,
                config,
                columns,
                names=(args.advantages_column, args.returns_column),
                batch_rows=args.batch_rows,
                compression=args.compression,
                **({} if progress is None else {"progress": progress}),
            )
    except (ValueError, TypeError) as error:
        return _fail(f"{args.input}: {error}")
    except OSError as error:
        return _fail(f"-o {args.output}: cannot write it ({error.strerror or error})")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"wrote {args.output}: {summary['rows']:,} rows, {summary['tokens']:,} tokens, "
            f"{summary['estimator']}, {summary['tokens_per_s'] or 0:,.0f} tokens/s",
            file=sys.stderr,
        )
    return 0


TRACE_COLUMNS = ("row", "uid", "t", "mask", "score", "logprob", "ref_logprob", "value")


def trace_dataset(path: str | None = None) -> str:
    """The dataset path on a tiny table: ``EXAMPLE`` (or the file ``path``, read whole, with
    ppo_fast's column names and a ``mask`` column if it has one) through ``ppo_fast.data`` with
    ``EXAMPLE_OPTIONS``, gae whitened over the table; one line per token."""
    from .. import data
    from ..cli import _table
    from . import _stream

    table = example_table() if path is None else _stream.open_source(path, 1 << 30).table()
    out = data.advantages(table, **EXAMPLE_OPTIONS)  # its mask column if it has one (IfPresent)
    rows = out.to_pylist()
    lines = []
    for b, row in enumerate(rows):
        mask = row.get("mask") or [1] * len(row["logprobs"])
        for t in range(len(row["logprobs"])):
            lines.append(
                [b, str(row["uid"]), t + 1, int(mask[t]), float(row["score"])]
                + [float(row[k][t]) for k in ("logprobs", "ref_logprobs", "values")]
                + [float(row["advantages"][t]), float(row["returns"][t])]
            )
    header = (
        f"ppo_fast.data on {path or 'the example dataset (ppo-fast advantages --example FILE)'}: "
        f"{out.num_rows} rows, gae, kl_coef={EXAMPLE_OPTIONS['kl_coef']}, "
        f"gamma={EXAMPLE_OPTIONS['gamma']}, lam={EXAMPLE_OPTIONS['lam']}, advantages whitened "
        "over every valid token of the dataset; masked tokens get 0"
    )
    return header + "\n" + _table((*TRACE_COLUMNS, "advantage", "return"), lines)
