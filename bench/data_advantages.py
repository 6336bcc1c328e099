"""``ppo-fast advantages`` on a generated rollout file, against the I/O floor and today's code.

    python bench/data_advantages.py                       5.2 M tokens, 3 repeats (~4 min)
    python bench/data_advantages.py --rows 2048 --repeats 1   a quick look
    BENCH_DIR=/some/disk python bench/data_advantages.py  its files there (default: $TMPDIR)

The file: ``--rows`` responses of 64 .. 1,216 tokens (uniform), 8 per prompt, float32 per-token
columns (logprobs, ref_logprobs, values, verl's names) and a score and uid per row, written by
``pyarrow.parquet.write_table`` with its defaults: row groups of up to 1 Mi rows, so one row
group (HF ``datasets``' ``to_parquet`` writes row groups of about 100 MB: one too);
``--row-group-rows`` for smaller ones. Every row of the result (best of ``--repeats``, the runs
interleaved, each writing a new file) is end to end from the file to a new file, verl's
computation: rewards = score on the last token - 0.05 * KL (k1), GAE (gamma 1, lambda 0.95),
advantages whitened over the whole dataset (unbiased variance, verl's ``masked_whiten``):

- ``floor``: pyarrow alone, ``read_table`` (its defaults: the whole file, every core) and
  ``write_table`` back with the Parquet settings ``ppo-fast advantages`` writes with by default
  (pyarrow's: snappy, statistics, format 2.6; no dictionary for the list columns) in row groups
  of ``--batch-rows`` rows, as ppo_fast's: what no pipeline beats;
- ``floor, pyarrow's default writer``: the same with a dictionary tried on every column;
- ``floor, streamed in batches``: ``iter_batches(--batch-rows)`` and a ``ParquetWriter``, pyarrow's
  bounded-memory way (its reader pre-buffers each row group whole, though);
- ``floor, fsync'd and renamed``: the floor written as ppo_fast writes (a temporary file in the
  folder, fsync, rename: the output is whole or absent, also after a crash);
- ``floor + the 2 output columns``: the floor writing two more float32 list columns (the bytes
  ``ppo_fast`` writes, uncompressed as it writes a token estimator's);
- ``floor + the 2 output columns, fsync'd``: both (what a run reading the file once must do at
  least);
- ``ppo_fast's first pass alone``: the statistics of the whitened run (reading the four token
  columns, GAE, moments), which must end before its first byte of output: writes no file;
- ``ppo_fast``: ``ppo_fast.data.advantages_file`` (what ``ppo-fast advantages`` runs), warm, in
  this process (so with this process's allocator: the command sets its own, see its cold run);
  it reads the file twice (the statistics, then the advantages);
- ``ppo_fast, no whitening (1 pass)``: the same without whitening: no first pass;
- ``ppo-fast advantages (cold)``: the command in a fresh process: imports and first compiles;
- ``lists + verl``: what a user writes today: the table to Python lists, padded torch tensors,
  verl 0.9.1's ``compute_gae_advantage_return`` (the verbatim copy in ``ppo_fast._peers``),
  back to lists and a Parquet file. Its output is checked against ppo_fast's.

Peak memory: the peak resident set of ``advantages_file(batch_rows=N)`` in a fresh process, minus
that of the same code on an 8-row file (the interpreter, numpy, numba, pyarrow), against the bytes
of one batch (its input and output columns), for each N of ``--memory-batch-rows``, on the whole
file and on half of it (bounded by the batch, whatever the file size), and the same for the
streamed floor (pyarrow's reader and writer hold row groups and pages of their own). Ratios of
one run; the machine is shared, so run it on a quiet one and repeat.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# The ppo_fast of this checkout, not an installed one (``python bench/...`` puts bench/ first on
# sys.path, not the working folder), here and in the fresh processes it starts.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CHILD_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
}

from ppo_fast import data  # noqa: E402
from ppo_fast.data import _stream  # noqa: E402

OPTIONS = {"estimator": "gae", "kl_coef": 0.05, "gamma": 1.0, "lam": 0.95, "unbiased": True}
COLUMNS = data.resolve_columns("verl", mask="")  # the rows hold only response tokens
CLI_OPTIONS = ["--preset", "verl", "--mask-column", "", "--kl-coef", "0.05", "--unbiased"]


def generate(path: str, n_rows: int, seed: int = 0, row_group_rows: int | None = None) -> int:
    """A verl-named rollout file (token_level_scores: the score on the last token), written by
    ``pyarrow.parquet.write_table`` with its defaults (row groups of up to 1 Mi rows: one row
    group here) unless ``row_group_rows`` is given; its tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 1217, n_rows)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    n = int(offsets[-1])
    scores = np.zeros(n, dtype=np.float32)
    scores[offsets[1:] - 1] = rng.random(n_rows) < 0.5

    def tokens(x):
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(x.astype(np.float32)))

    table = pa.table(
        {
            "uid": pa.array([f"prompt-{i // 8}" for i in range(n_rows)]),
            "token_level_scores": tokens(scores),
            "old_log_probs": tokens(rng.normal(-1.0, 0.5, n)),
            "ref_log_prob": tokens(rng.normal(-1.0, 0.5, n)),
            "values": tokens(rng.normal(0.0, 1.0, n)),
        }
    )
    pq.write_table(
        table, path, **({} if row_group_rows is None else {"row_group_size": row_group_rows})
    )
    return n


def _writer_options(schema: pa.Schema) -> dict:
    """The Parquet settings ``ppo-fast advantages`` writes with by default: pyarrow's (snappy,
    statistics, format 2.6), except no dictionary for the list columns."""
    return {"use_dictionary": [f.name for f in schema if not pa.types.is_nested(f.type)]}


def floor(source: str, output: str, batch_rows: int) -> None:
    """pyarrow alone: read the whole file (``read_table``, its defaults) and write it back with
    ppo_fast's Parquet settings, in one row group per ``batch_rows`` rows, as ppo_fast does."""
    table = pq.read_table(source)
    pq.write_table(table, output, row_group_size=batch_rows, **_writer_options(table.schema))


def floor_default(source: str, output: str, batch_rows: int) -> None:
    """The floor with pyarrow's default writer (a dictionary tried on every column)."""
    pq.write_table(pq.read_table(source), output, row_group_size=batch_rows)


def floor_streamed(source: str, output: str, batch_rows: int) -> None:
    """The floor in bounded memory: ``iter_batches`` of ``batch_rows`` rows (pyarrow's default
    reader), a row group per batch."""
    with pq.ParquetFile(source) as file:
        schema = file.schema_arrow
        with pq.ParquetWriter(output, schema, **_writer_options(schema)) as writer:
            for batch in file.iter_batches(batch_size=batch_rows):
                writer.write_batch(batch)


def floor_durable(source: str, output: str, batch_rows: int) -> None:
    """The floor written as ppo_fast writes its output: to a temporary file in the folder,
    flushed to the disk (fsync) and renamed."""
    from ppo_fast._atomic import atomic_write

    table = pq.read_table(source)
    with atomic_write(output, "wb") as file:
        pq.write_table(table, file, row_group_size=batch_rows, **_writer_options(table.schema))


def _write_with_outputs(source: str, where, batch_rows: int) -> None:
    table = pq.read_table(source)
    values = table["values"]
    table = table.append_column("advantages", values).append_column("returns", values)
    compression = {
        leaf: "none" if leaf.split(".")[0] in ("advantages", "returns") else "snappy"
        for leaf in _stream._leaf_paths(table.schema)
    }
    pq.write_table(
        table,
        where,
        row_group_size=batch_rows,
        compression=compression,
        **_writer_options(table.schema),
    )


def floor_with_outputs(source: str, output: str, batch_rows: int) -> None:
    """The floor writing two more float32 list columns (the size of ppo_fast's output), with
    ppo_fast's settings for them (uncompressed, as for a token estimator's results)."""
    _write_with_outputs(source, output, batch_rows)


def floor_of_the_output(source: str, output: str, batch_rows: int) -> None:
    """Both: the two more columns, fsync'd and renamed (the least a one-pass run must do)."""
    from ppo_fast._atomic import atomic_path

    with atomic_path(output) as temporary:
        _write_with_outputs(source, temporary, batch_rows)


def ours(source: str, output: str, batch_rows: int) -> None:
    data.advantages_file(source, output, columns=COLUMNS, batch_rows=batch_rows, **OPTIONS)


def first_pass_alone(source: str, output: str, batch_rows: int) -> None:
    """What the whitened run does before its first byte of output: the first pass (reading the
    four token columns, KL-shaped GAE and the moments of every batch), as ``advantages_file``
    runs it. It writes nothing."""
    from ppo_fast import _threads
    from ppo_fast.data import _compute
    from ppo_fast.data._names import Options

    options = Options(**OPTIONS)
    reader = _stream.open_source(source, batch_rows)
    used = _compute.fields_used(options, COLUMNS, reader.schema.names)
    wanted = _compute.first_pass_fields(options, used)
    order = [n for n in reader.schema.names if n in set(wanted.values())]
    with _threads.leaving_one_core():
        _compute.first_pass(reader.batches(order), options, wanted, lambda rows, tokens: None)


def one_pass(source: str, output: str, batch_rows: int) -> None:
    """ppo_fast without whitening: no statistics, so one read of the file."""
    options = {**OPTIONS, "whiten": False}
    data.advantages_file(source, output, columns=COLUMNS, batch_rows=batch_rows, **options)


def cold(source: str, output: str, batch_rows: int) -> None:
    command = [sys.executable, "-m", "ppo_fast.cli", "advantages", source, "-o", output]
    arguments = [*command, *CLI_OPTIONS, "--batch-rows", str(batch_rows)]
    subprocess.run(arguments, check=True, env=CHILD_ENV)


def lists_and_verl(source: str, output: str, batch_rows: int) -> None:
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from ppo_fast._peers import verl_0_9_1 as verl

    table = pq.read_table(source)
    rows = {k: table[k].to_pylist() for k in ("token_level_scores", "old_log_probs")}
    rows |= {k: table[k].to_pylist() for k in ("ref_log_prob", "values")}

    def padded(key):
        return pad_sequence([torch.tensor(r) for r in rows[key]], batch_first=True)

    lengths = torch.tensor([len(r) for r in rows["values"]])
    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).float()
    kl = verl.kl_penalty(padded("old_log_probs"), padded("ref_log_prob"), "kl")
    rewards = padded("token_level_scores") - 0.05 * kl
    advantages, returns = verl.compute_gae_advantage_return(
        rewards, padded("values"), mask, torch.tensor(1.0), torch.tensor(0.95)
    )
    as_lists = {
        "advantages": [a[:n].tolist() for a, n in zip(advantages, lengths.tolist(), strict=True)],
        "returns": [r[:n].tolist() for r, n in zip(returns, lengths.tolist(), strict=True)],
    }
    for name, values in as_lists.items():
        table = table.append_column(name, pa.array(values, pa.list_(pa.float32())))
    pq.write_table(table, output)


def timings(runs: dict, source: str, folder: str, repeats: int, batch_rows: int) -> dict:
    """The best wall time of each run (name -> function), the runs interleaved ``repeats``
    times (the machine's load then weighs on each alike); each writes a new file, the last
    repeat's kept (``check`` reads them)."""
    best = dict.fromkeys(runs, float("inf"))
    first = first_pass_alone  # writes no file
    for repeat in range(repeats):
        for name, run in runs.items():
            if repeat and run in (cold, lists_and_verl):
                continue  # one run of each: they are slow and far from the floor
            output = os.path.join(folder, f"{run.__name__}-{repeat}.parquet")
            start = time.perf_counter()
            run(source, output, batch_rows)
            best[name] = min(best[name], time.perf_counter() - start)
            if repeat < repeats - 1 and run not in (cold, lists_and_verl) and run is not first:
                os.unlink(output)
    return best


def peak_rss_mib(run: str, source: str, output: str, batch_rows: int) -> float:
    """Peak resident set (MiB) of ``run`` ("floor" or "ours") in a fresh process: VmHWM, which
    starts again at exec (ru_maxrss would carry this process's peak over into the child)."""
    command = [sys.executable, __file__, "--child", run, source, output, str(batch_rows)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=CHILD_ENV)
    return int(out.stdout.split()[-1]) / 1024


def child(run: str, source: str, output: str, batch_rows: str) -> None:
    {"floor": floor_streamed, "ours": ours}[run](source, output, int(batch_rows))
    with open("/proc/self/status") as status:
        print(next(line.split()[1] for line in status if line.startswith("VmHWM")))


def check(folder: str, repeats: int) -> float:
    """The largest difference between ppo_fast's and verl's advantages (float32)."""
    ours_table = pq.read_table(os.path.join(folder, f"ours-{repeats - 1}.parquet"))
    theirs = pq.read_table(os.path.join(folder, "lists_and_verl-0.parquet"))
    a = ours_table["advantages"].combine_chunks().flatten().to_numpy()
    b = theirs["advantages"].combine_chunks().flatten().to_numpy()
    return float(np.abs(a - b).max())


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-rows", type=int, default=4096)
    parser.add_argument(
        "--row-group-rows",
        type=int,
        default=None,
        help="rows per row group of the generated file (default: pyarrow's, one row group)",
    )
    parser.add_argument("--memory-batch-rows", type=int, nargs="*", default=[1024, 2048, 4096])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as folder:
        source = os.path.join(folder, "rollouts.parquet")
        tokens = generate(source, args.rows, row_group_rows=args.row_group_rows)
        size = os.path.getsize(source) / 2**20
        groups = pq.ParquetFile(source).num_row_groups
        pool = pa.default_memory_pool().backend_name
        print(f"{cpu_name()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, {pool}")
        print(f"ppo_fast from {os.path.dirname(data.__file__)}")
        print(
            f"file: {args.rows:,} rows, {tokens:,} tokens, {size:.0f} MiB Parquet in {groups} "
            f"row group(s); --batch-rows {args.batch_rows}"
        )
        ours(source, os.path.join(folder, "warm.parquet"), args.batch_rows)  # compiles
        runs = {
            "floor (pyarrow read + write)": floor,
            "floor, pyarrow's default writer": floor_default,
            "floor, streamed in batches": floor_streamed,
            "floor, fsync'd and renamed": floor_durable,
            "floor + the 2 output columns": floor_with_outputs,
            "floor + the 2 output columns, fsync'd": floor_of_the_output,
            "ppo_fast's first pass alone": first_pass_alone,
            "ppo_fast (warm)": ours,
            "ppo_fast, no whitening (1 pass)": one_pass,
            "ppo-fast advantages (cold)": cold,
            "lists + verl": lists_and_verl,
        }
        times = timings(runs, source, folder, args.repeats, args.batch_rows)
        base = times["floor (pyarrow read + write)"]
        for name, seconds in times.items():
            print(
                f"{name:32s} {tokens / seconds / 1e6:8.2f} M tokens/s  {seconds / base:6.2f}x floor"
            )
        print(f"ppo_fast vs lists + verl: {times['lists + verl'] / times['ppo_fast (warm)']:.1f}x")
        print(f"largest |ppo_fast - verl| advantage: {check(folder, args.repeats):.2e} (float32)")
        half = os.path.join(folder, "half.parquet")
        generate(half, args.rows // 2, seed=1, row_group_rows=args.row_group_rows)
        tiny = os.path.join(folder, "tiny.parquet")
        generate(tiny, 8, seed=2)
        per_token = 4 * 4 + 2 * 4  # four float32 columns in, two out
        print("peak RSS above the same code on an 8-row file (the interpreter and the imports),")
        print("against one batch's data (its input and output columns):")
        for rows in args.memory_batch_rows:
            batch_mib = rows * (tokens / args.rows) * per_token / 2**20
            for run, name, path in (
                ("floor", "floor, streamed, whole file", source),
                ("ours", "ppo_fast, whole file", source),
                ("ours", "ppo_fast, half the file", half),
            ):
                base = peak_rss_mib(run, tiny, os.path.join(folder, "m0.parquet"), rows)
                peak = peak_rss_mib(run, path, os.path.join(folder, "m.parquet"), rows)
                print(
                    f"  --batch-rows {rows:5d} ({batch_mib:3.0f} MiB) {name:28s} "
                    f"{peak - base:5.0f} MiB ({(peak - base) / batch_mib:.1f} batches; "
                    f"{peak:.0f} MiB in all)"
                )


if __name__ == "__main__":
    main()
