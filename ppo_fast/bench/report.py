"""The report of a run: the tables ``ppo-fast bench`` prints (rich), and the plot.

Text goes to stdout as plain text when it is not a terminal (no colour; tables as markdown-like
boxes), coloured on a terminal. rich and matplotlib are imported only when a report is made.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import io
import math
import os
import platform
import statistics
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from .. import _threads
from .._atomic import atomic_write
from .batch import shape_name
from .checks import BENCH_EXTRA
from .probes import FIRST_CALL_KERNELS
from .registry import FLOOR, KERNELS, OURS, PEER, PYTHON_MAX_TOKENS
from .timing import exponents


def environment() -> dict[str, Any]:
    """Date, machine and versions, for the JSON and the table's header."""
    versions = {"python": platform.python_version()}
    for module in ("numpy", "numba", "Cython", "torch", "scipy", "torchrl", "matplotlib"):
        try:
            versions[module] = importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            continue
    from .. import __version__

    versions["ppo_fast"] = __version__
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_name(),
        "cores": _threads._cpu_count(),
        "platform": platform.platform(),
        "versions": versions,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", ""),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.3g}x" if ratio < 1000 else f"{ratio:,.0f}x"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]):
    """A rich table: the first column left-aligned, the others right-aligned, never wrapped."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.MARKDOWN, header_style="bold", pad_edge=True)
    for index, name in enumerate(header):
        table.add_column(name, justify="left" if index == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*map(str, row))
    return table


def _console(file, terminal: bool):
    try:
        from rich.console import Console
    except ModuleNotFoundError:
        raise RuntimeError(f"ppo-fast bench needs rich: {BENCH_EXTRA}") from None
    if terminal:
        return Console(file=file, highlight=False, markup=False, emoji=False)
    # Plain text: no colour, and as wide as the tables (a pipe has no width).
    return Console(
        file=file,
        width=100_000,
        color_system=None,
        force_terminal=False,
        highlight=False,
        markup=False,
        emoji=False,
    )


def render(items: list) -> str:
    """The report as plain text: no colour, tables as markdown-like boxes."""
    lines = []
    for item in items:
        if isinstance(item, str):
            lines.append(item)
            continue
        buffer = io.StringIO()
        _console(buffer, terminal=False).print(item)
        # a markdown table's first and last lines are blank
        lines.append(
            "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()).strip("\n")
        )
    return "\n".join(lines).rstrip() + "\n"


def print_report(items: list, file=None) -> None:
    """Print the report: coloured on a terminal, the plain text of ``render`` elsewhere."""
    file = file if file is not None else sys.stdout
    if not getattr(file, "isatty", lambda: False)():
        file.write(render(items))
        return
    console = _console(file, terminal=True)
    for item in items:
        console.print(item)


def format_report(
    rows: list[dict[str, Any]],
    env: dict[str, Any] | None = None,
    memory: list[dict[str, Any]] | None = None,
    startup: dict[str, Any] | None = None,
) -> str:
    """The tables ``ppo-fast bench`` prints, as plain text."""
    return render(report_items(rows, env, memory, startup))


def report_items(
    rows: list[dict[str, Any]],
    env: dict[str, Any] | None = None,
    memory: list[dict[str, Any]] | None = None,
    startup: dict[str, Any] | None = None,
) -> list:
    """The report: lines of text and rich tables, in order."""
    lines: list = []
    if env is not None:
        versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
        lines += [
            f"ppo-fast bench  {env['date']}  {env['cpu']} ({env['cores']} cores)",
            f"  {versions}; OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY') or 'unset'}",
        ]
    lines += [
        "  median / min / max: seconds per call over n samples; x floor: median over the memory",
        "  floor (the kernel's compulsory bytes, each input read and each output written once, at",
        "  the copy bandwidth of np.copyto over 64 MiB on as many threads, best of 10 copies",
        "  around ppo_fast's rows of the table; 1.0x = the floor);",
        "  speed-up: the row's median over ppo_fast's, one run. ppo_fast's rows of a table are",
        "  timed together, their samples taken in turn (a, b, b, a, ...); each peer's in a block.",
    ]
    bandwidths: dict[int, list[float]] = {}
    for row in rows:
        if row["kind"] == FLOOR and row["status"] == "ok":
            bandwidths.setdefault(row["threads"], []).append(row["bandwidth"] / 1e9)
    if bandwidths:
        measured = ", ".join(
            f"{threads} thread{'s' * (threads > 1)} "
            + (
                f"{min(values):.3g}-{max(values):.3g} GB/s (median {statistics.median(values):.3g})"
                if min(values) != max(values)
                else f"{values[0]:.3g} GB/s"
            )
            for threads, values in sorted(bandwidths.items())
        )
        lines.append(f"  copy bandwidth (2 x bytes / best time; over the tables): {measured}")
    evicted = next((row["evicted_bytes"] for row in rows if "evicted_bytes" in row), None)
    if evicted is not None:
        lines.append(
            f"  cold (--cold): every sample one call, and every copy, after a read of "
            f"{evicted / 2**20:,.0f} MiB (twice the largest CPU cache): from memory"
        )
    lines.append("")
    # The speed-up columns: our compiled backends, then our implementations that run no kernel
    # of the table (the outcome estimators); the oracle is there to be checked, not raced.
    ours = [
        name
        for name in dict.fromkeys(
            row["implementation"]
            for row in rows
            if row["kind"] == OURS and row["status"] == "ok" and not row.get("preallocated")
        )
        if name != "ppo_fast[python]"
    ]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row["sweep"] == "shapes":
            key = (row["kernel"], tuple(row["shape"]), row["dtype"], row["threads"])
            groups.setdefault(key, []).append(row)
    for (kernel, shape, dtype, threads), group in groups.items():
        timed = [row for row in group if row["status"] == "ok"]
        if not timed:
            continue
        read, written = group[0]["bytes_read"], group[0]["bytes_written"]
        lines.append(
            f"{kernel}  {shape_name(shape)} {dtype}, {threads} thread{'s' * (threads > 1)}"
            f"  ({KERNELS[kernel].summary}; {(read + written) / 1e6:.3g} MB moved)"
        )
        here = [name for name in ours if any(row["implementation"] == name for row in timed)]
        header = ["implementation", "median", "min", "max", "n", "x floor"]
        header += [f"{name} speed-up" for name in here]
        table = []
        for row in timed:
            cells = [
                row["implementation"],
                format_seconds(row["median"]),
                format_seconds(row["min"]),
                format_seconds(row["max"]),
                str(len(row["times"])),
                format_ratio(row.get("x_floor")),
            ]
            cells += [format_ratio(row.get("speedup", {}).get(name)) for name in here]
            table.append(cells)
        lines += [_table(header, table), ""]
    lines += _format_summary(rows, ours)
    fits = exponents(rows)
    if fits:
        lines.append("scaling: time ~ tokens^k, k by least squares on log-log")
        table = [
            [
                fit["kernel"],
                fit["implementation"],
                fit["dtype"],
                str(fit["threads"]),
                f"{fit['exponent']:.2f}",
                f"{fit['tokens'][0]:.0e}..{fit['tokens'][-1]:.0e}",
                format_seconds(fit["median"][-1]),
            ]
            for fit in fits
        ]
        header = ["kernel", "implementation", "dtype", "threads", "k", "tokens", "largest"]
        lines += [_table(header, table), ""]
    if memory:
        lines += format_memory(memory)
    if startup:
        lines += _format_startup(startup)
    skipped = _skipped(rows)
    if skipped:
        lines.append("not run:")
        lines += [f"  {name}: {reason}" for name, reason in skipped]
    return lines


def _format_summary(rows: list[dict[str, Any]], ours: list[str]) -> list:
    """One table: for each kernel, the speed-up of our first implementation that ran it (our
    first compiled backend) over every peer, by shape (and threads)."""
    if not ours:
        return []
    shapes = [row for row in rows if row["sweep"] == "shapes" and row["status"] == "ok"]
    mine = {}
    for name in reversed(ours):  # the first of ours that ran a kernel wins
        mine.update({row["kernel"]: name for row in shapes if row["implementation"] == name})
    columns = sorted(
        {(tuple(r["shape"]), r["dtype"], r["threads"]) for r in rows if r["sweep"] == "shapes"},
        key=lambda c: (c[1], c[0][0] * c[0][1], c[2]),
    )
    entries: dict[tuple[str, str], dict[tuple, str]] = {}
    for row in shapes:
        column = (tuple(row["shape"]), row["dtype"], row["threads"])
        name = mine.get(row["kernel"])
        if name is None:
            continue
        if row["kind"] == FLOOR:
            mine_row = next(
                (
                    r
                    for r in shapes
                    if r["implementation"] == name
                    and r["kernel"] == row["kernel"]
                    and (tuple(r["shape"]), r["dtype"], r["threads"]) == column
                ),
                None,
            )
            mine_rows = [mine_row] if mine_row is not None else []
            mine_rows += [  # ours into preallocated outputs: set against the floor too
                r
                for r in shapes
                if r.get("preallocated")
                and r["kernel"] == row["kernel"]
                and (tuple(r["shape"]), r["dtype"], r["threads"]) == column
            ]
            for mine_row in mine_rows:
                key = (row["kernel"], f"{mine_row['implementation']} x floor")
                entries.setdefault(key, {})[column] = format_ratio(mine_row["x_floor"])
        elif row["kind"] == PEER and name in row.get("speedup", {}):
            key = (row["kernel"], row["implementation"])
            entries.setdefault(key, {})[column] = format_ratio(row["speedup"][name])
    if not entries:
        return []
    header = ["kernel", "compared with"] + [
        f"{shape_name(shape)} f{dtype[-2:]} {threads}T" for shape, dtype, threads in columns
    ]
    table = [
        [k, name] + [cells.get(c, "") for c in columns] for (k, name), cells in entries.items()
    ]
    first = ", ".join(name for name in ours if name in mine.values())
    return [
        f"summary: speed-up of ours ({first}) over each implementation (its median / ours), and",
        "ours over the memory floor (its median / the floor's); columns: shape, dtype, threads",
        _table(header, table),
        "",
    ]


def format_memory(memory: list[dict[str, Any]]) -> list:
    done = [row for row in memory if row.get("status") == "ok"]
    if not done:
        return []
    method = done[0]["method"]
    shape, dtype = done[0]["shape"], done[0]["dtype"]
    table = [
        [
            row["kernel"],
            row["implementation"],
            f"{row['extra_peak_bytes'] / 2**20:.1f}",
            f"{row['bytes_written'] / 2**20:.1f}",
            format_ratio(row["extra_peak_bytes"] / row["bytes_written"])
            if row["bytes_written"] and row["kind"] != FLOOR
            else "",
        ]
        for row in done
    ]
    header = ["kernel", "implementation", "extra peak MiB", "outputs MiB", "over outputs"]
    return [
        f"extra peak memory of one call, {shape_name(shape)} {dtype}: {method}, one fresh "
        "process per row",
        _table(header, table),
        "",
    ]


def _format_startup(startup: dict[str, Any]) -> list:
    lines = [
        "import time, in a fresh interpreter each (with what the module imports: numpy, numba)"
    ]
    table = [
        [row["what"], format_seconds(row["seconds"]) if row["status"] == "ok" else row["reason"]]
        for row in startup["imports"]
    ]
    lines += [_table(["import", "seconds"], table), ""]
    lines.append("first and second call, float32, on 8x128 on one thread and on 2x65,536 on two")
    lines.append("(fresh process each; numba cache in a temporary NUMBA_CACHE_DIR with")
    lines.append("PPO_FAST_NUMBA_CACHE=1)")
    header = ["backend", "load", *FIRST_CALL_KERNELS]
    table = []
    for row in startup["first_calls"]:
        label = f"{row['backend']} {row['mode']}".strip()
        if row["status"] != "ok":
            table.append([label, row["reason"][:60]] + [""] * len(FIRST_CALL_KERNELS))
            continue
        cells = [
            f"{format_seconds(row['calls'][k]['first'])}/{format_seconds(row['calls'][k]['second'])}"
            for k in FIRST_CALL_KERNELS
        ]
        table.append([label, format_seconds(row["import_and_load"]), *cells])
    return [*lines, _table(header, table), ""]


def _skipped(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for row in rows:
        if row["status"] in ("skipped", "mismatch", "error"):
            name = f"{row['kernel']} / {row['implementation']}"
            if row["status"] == "skipped" and "tokens only" in row["reason"]:
                name = f"{row['implementation']} above {PYTHON_MAX_TOKENS} tokens"
            elif row["status"] == "skipped":
                name = row["implementation"]
            seen.setdefault(name, f"{row['status']}: {row['reason']}")
    return sorted(seen.items())


def _matplotlib():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise RuntimeError(f"--plot needs matplotlib: {BENCH_EXTRA}") from None
    return matplotlib


def plot_target(path: str) -> tuple[str, str]:
    """(the file ``plot`` writes, its format): as matplotlib's savefig, a path without an
    extension gets savefig.format's (.png). RuntimeError without matplotlib, ValueError for an
    extension matplotlib cannot write."""
    matplotlib = _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    extension = os.path.splitext(path)[1][1:]
    if not extension:
        extension = matplotlib.rcParams["savefig.format"]
        path = f"{path}.{extension}"
    supported = FigureCanvasBase.get_supported_filetypes()
    if extension.lower() not in supported:
        raise ValueError(
            f"matplotlib cannot write .{extension} files; end the name with one of "
            + ", ".join(f".{name}" for name in sorted(supported))
        )
    return path, extension.lower()


def plot(rows: list[dict[str, Any]], path: str, dtype: str | None = None, threads=None) -> None:
    """Time against tokens (log-log), one panel per kernel, one line per implementation.

    The file is written whole or not at all (``atomic_write``)."""
    matplotlib = _matplotlib()
    target, file_format = plot_target(path)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [row for row in rows if row["status"] == "ok"]
    if not ok:
        raise RuntimeError("nothing was measured: there is nothing to plot")
    dtype = dtype or ok[0]["dtype"]
    threads = threads or max(row["threads"] for row in ok)
    kernels = [k for k in KERNELS if any(r["kernel"] == k for r in ok)]
    columns = min(4, len(kernels))
    lines_of = (len(kernels) + columns - 1) // columns
    figure, axes = plt.subplots(
        lines_of, columns, figsize=(4.2 * columns, 3.6 * lines_of), squeeze=False
    )
    for axis in axes.flat[len(kernels) :]:
        axis.set_visible(False)
    for axis, kernel in zip(axes.flat, kernels, strict=False):
        series: dict[str, dict[int, float]] = {}
        for row in ok:
            if row["kernel"] == kernel and row["dtype"] == dtype and row["threads"] == threads:
                points = series.setdefault(row["implementation"], {})
                points[row["tokens"]] = min(points.get(row["tokens"], math.inf), row["median"])
        for name, points in series.items():
            tokens = sorted(points)
            style = {"color": "black", "linestyle": "--", "linewidth": 2} if name == "floor" else {}
            if name.startswith("ppo_fast"):
                style = {"linewidth": 2.5}
            axis.plot(
                tokens, [points[t] for t in tokens], marker="o", markersize=3, label=name, **style
            )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_title(kernel, fontsize=10)
        axis.set_xlabel("tokens (B x T)")
        axis.set_ylabel("seconds per call")
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(fontsize=6, loc="upper left")
    figure.suptitle(f"ppo_fast and peers, {dtype}, {threads} thread{'s' * (threads > 1)}")
    figure.tight_layout()
    try:
        with atomic_write(target, "wb") as file:
            figure.savefig(file, dpi=110, format=file_format)
    finally:
        plt.close(figure)
