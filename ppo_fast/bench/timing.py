"""The timing engine: what to measure (``Plan``), how (``time_calls``), and ``run``.

Every row runs on one synthetic ``Batch``; rows of one (kernel, shape, dtype, threads) run
together, our first backend first, so that its output is the reference every other row is
checked against before it is timed. A row that does not run here says why.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _threads
from .batch import DEFAULT_SHAPES, Batch, scaling_shape, shape_name
from .checks import compare, unavailable, why_not
from .registry import FLOOR, KERNELS, OURS, Implementation, Kernel
from .roofline import Evict, copies_around, copy_bandwidth, floor_seconds

DEFAULT_THREADS = (1, 2)


def quiet_openmp() -> str:
    """Make OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the user chose; the
    policy in force is returned. It must run before torch or the cython backend load libgomp.

    torch's OpenMP team, the cython backend's (the same libgomp) and numba's workers share two
    cores here: by default an idle OpenMP thread spins, and the next parallel call of another
    pool then waits for the scheduler's tick (4 ms multiples were measured: 8 ms for a 1 ms
    kernel). Sleeping idle threads cost a wake-up per parallel region instead.
    """
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def start_torch_threads(threads: int) -> None:
    """Create torch's thread team at ``threads`` now, with a parallel operation.

    Measured with torch 2.13.0 and llvmlite 0.50 in one process: when torch's team first grows
    past one thread after llvmlite is loaded, every later call on two threads takes about 8 ms
    (a 13 us call included); a team started at full size first does not.
    """
    import torch

    torch.set_num_threads(threads)
    torch.ones(1 << 22).exp_()


def set_threads(threads: int) -> None:
    """The thread count of ppo_fast and, when it is loaded, torch."""
    _threads.set_num_threads(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


SAMPLE_SECONDS = 2e-3  # calls are batched so that one sample lasts about this long
COLD_MAX_REPEATS = 25  # samples of a call at most, each from memory (``--cold``)


def time_calls(
    call: Callable[[], Any],
    budget: float,
    min_repeats: int = 3,
    max_repeats: int = 200,
    evict: Evict | None = None,
) -> tuple[list[float], int]:
    """Seconds per call, one value per sample, and the number of calls per sample.

    The garbage collector is off while timing (as in timeit). A call slower than a sample is
    its own sample; samples continue until the timed calls have taken ``budget`` seconds and at
    least ``min_repeats`` samples were taken. With ``evict`` (``--cold``), every sample is one
    call, made after ``evict()`` (not timed): a call from memory.
    """
    return time_interleaved([call], budget, min_repeats, max_repeats, evict)[0]


def time_interleaved(
    calls: Sequence[Callable[[], Any]],
    budget: float,
    min_repeats: int = 3,
    max_repeats: int = 200,
    evict: Evict | None = None,
) -> list[tuple[list[float], int]]:
    """``time_calls`` for several calls at once: each call's (samples, number), its samples taken
    in turn with the others', the order of each round reversed from the last's, so that a
    machine whose speed drifts, or a call that slows the next, weighs on all of them alike and
    their ratios are those of one moment. ``budget`` is each call's (the evictions' time not
    counted in it)."""
    if evict is not None:  # each sample costs an eviction too (about 50 ms of a 960 MiB read)
        max_repeats = max(min_repeats, min(max_repeats, COLD_MAX_REPEATS))
    enabled = gc.isenabled()
    gc.disable()
    try:
        numbers, samples = [], []
        for call in calls:
            if evict is not None:
                evict()
            start = time.perf_counter()
            call()
            first = time.perf_counter() - start
            number = 1 if evict is not None else max(1, int(SAMPLE_SECONDS / max(first, 1e-9)))
            numbers.append(number)
            samples.append([first] if number == 1 else [])
        spent, allowed = 0.0, budget * len(calls)  # seconds of timed calls
        order = list(range(len(calls)))[::-1]  # the calibration's calls went forwards
        while any(len(taken) < max_repeats for taken in samples) and (
            any(len(taken) < min_repeats for taken in samples) or spent < allowed
        ):
            for k in order:
                if len(samples[k]) >= max_repeats:
                    continue
                call, number = calls[k], numbers[k]
                if evict is not None:
                    evict()
                start = time.perf_counter()
                for _ in range(number):
                    call()
                seconds = time.perf_counter() - start
                spent += seconds
                samples[k].append(seconds / number)
            order.reverse()
    finally:
        if enabled:
            gc.enable()
    return list(zip(samples, numbers, strict=True))


@dataclass
class Plan:
    """What to measure."""

    kernels: tuple[str, ...] = tuple(KERNELS)
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES
    dtypes: tuple[str, ...] = ("float32",)
    threads: tuple[int, ...] = DEFAULT_THREADS
    budget: float = 0.08
    min_repeats: int = 3
    scaling_tokens: tuple[int, ...] = ()
    scaling_budget: float = 0.04
    implementations: tuple[str, ...] | None = None  # None: all
    cold: bool = False  # every sample and every copy of the floor from memory (roofline.Evict)

    def rows(self) -> list[tuple[str, str, tuple[int, int], str, int, str]]:
        """(kernel, implementation, shape, dtype, threads, sweep) in the order they run."""
        rows = []
        for dtype in self.dtypes:
            for shape in self.shapes:
                for kernel in self.kernels:
                    for threads in self.threads:
                        rows += [
                            (kernel, implementation.name, shape, dtype, threads, "shapes")
                            for implementation in KERNELS[kernel].implementations
                            if self.implementations is None
                            or implementation.name in self.implementations
                        ]
        # The sweep runs our compiled kernels and the floor, at the largest thread count.
        for tokens in self.scaling_tokens:
            shape, dtype, threads = scaling_shape(tokens), self.dtypes[0], max(self.threads)
            for kernel in self.kernels:
                rows += [
                    (kernel, implementation.name, shape, dtype, threads, "scaling")
                    for implementation in KERNELS[kernel].implementations
                    if implementation.kind in (OURS, FLOOR) and implementation.backend != "python"
                ]
        return rows


class Progress:
    """A progress bar on stderr (rich): redrawn on a terminal, a line every 10% elsewhere."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done = max(1, total), 0
        self.enabled = enabled
        self.last_tenth = -1
        self.start = time.perf_counter()
        self.console = self.bar = self.task = None
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(
            file=stream if stream is not None else sys.stderr, highlight=False, markup=False
        )
        if self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as Bar

            self.bar = Bar(
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=self.console,
                transient=False,
            )
            self.task = self.bar.add_task("", total=self.total)
            self.bar.start()

    def update(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=label)
            if self.done >= self.total:
                self.close()
            return
        tenth = int(10 * self.done / self.total)
        if tenth != self.last_tenth:
            self.last_tenth = tenth
            elapsed = time.perf_counter() - self.start
            self.console.print(f"{self.done}/{self.total} {elapsed:5.0f}s  {label}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def make_row(
    kernel: Kernel,
    implementation: Implementation,
    batch: Batch,
    threads: int,
    sweep: str,
    **fields: Any,
) -> dict[str, Any]:
    read, written = kernel.traffic(batch)
    row = {
        "kernel": kernel.name,
        "implementation": implementation.name,
        "kind": implementation.kind,
        "preallocated": implementation.preallocated,
        "shape": list(batch.shape),
        "tokens": batch.tokens,
        "dtype": batch.dtype.name,
        "threads": threads,
        "sweep": sweep,
        "bytes_read": read,
        "bytes_written": written,
        "source": implementation.source,
        "convention": implementation.convention,
        "status": "ok",
        "reason": "",
    }
    row.update(fields)
    return row


def run(plan: Plan, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Measure every row of ``plan``; returns one dict per row (see ``make_row``)."""
    planned = plan.rows()
    progress = progress or Progress(len(planned), enabled=False)
    quiet_openmp()
    needs_torch = {
        name
        for kernel, name, *_ in planned
        if "torch" in KERNELS[kernel].implementation(name).requires
    }
    if needs_torch and unavailable("torch", ("torch",), None) is None:
        start_torch_threads(max(plan.threads))
    results: list[dict[str, Any]] = []
    batches: dict[tuple, Batch] = {}
    evict = Evict() if plan.cold else None
    # Group the rows by batch and thread count so that the reference output is computed first.
    groups: dict[tuple, list[str]] = {}
    for kernel, name, shape, dtype, threads, sweep in planned:
        groups.setdefault((kernel, shape, dtype, threads, sweep), []).append(name)
    try:
        for (kernel_name, shape, dtype, threads, sweep), names in groups.items():
            key = (shape, dtype)
            if key not in batches:
                batches.clear()  # one batch alive at a time: large sweeps stay within memory
                batches[key] = Batch(shape, dtype)
            batch = batches[key]
            kernel = KERNELS[kernel_name]
            set_threads(threads)
            reference = None
            budget = plan.scaling_budget if sweep == "scaling" else plan.budget
            # (row, call) of our compiled rows, checked: timed together, interleaved, below. The
            # oracle is timed in a block of its own, as a peer: interleaved, each of its calls
            # (milliseconds of Python) left the next sample of a compiled row cold, and the
            # clipped surrogate's 8x128 medians at 5.6 and 7.6 us against 3.5-3.9 us alone.
            ours = []
            for name in names:
                implementation = kernel.implementation(name)
                label = f"{kernel.name} {shape_name(shape)} {dtype} {threads}T {name}"
                compiled = implementation.kind == OURS and implementation.backend != "python"
                row, outputs, call = measure(
                    kernel, implementation, batch, threads, budget, plan, reference,
                    defer=compiled, evict=evict,
                )  # fmt: skip
                row["sweep"] = sweep
                if reference is None and implementation.kind == OURS and outputs is not None:
                    reference = outputs
                if call is not None:
                    ours.append((row, call))
                results.append(row)
                progress.update(label)
            floors = [
                k for k in range(len(results) - len(names), len(results))
                if results[k]["kind"] == FLOOR and results[k]["status"] == "ok"
            ]  # fmt: skip
            if floors:  # the floor of this table, at this moment's copy bandwidth (roofline)
                timed = functools.partial(time_ours, ours, budget, plan.min_repeats, evict)
                bandwidth = copies_around(threads, timed, evict)
                for k in floors:
                    implementation = kernel.implementation(results[k]["implementation"])
                    results[k] = floor_row(kernel, implementation, batch, threads, bandwidth)
                    results[k]["sweep"] = sweep
            else:
                time_ours(ours, budget, plan.min_repeats, evict)
            del ours  # the prepared calls' inputs go before the next group's batch is made
    finally:
        set_threads_default()
    if evict is not None:
        for row in results:
            row["evicted_bytes"] = evict.nbytes
    add_ratios(results)
    return results


def set_threads_default() -> None:
    _threads.set_num_threads(None)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(_threads.get_num_threads())


def measure(
    kernel: Kernel,
    implementation: Implementation,
    batch: Batch,
    threads: int,
    budget: float,
    plan: Plan,
    reference: dict[str, np.ndarray] | None,
    defer: bool = False,
    evict: Evict | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray] | None, Callable[[], Any] | None]:
    """The row of one implementation, its outputs (for the reference) and, with ``defer``, its
    call, checked and not yet timed: ``time_ours`` times it (the row's times are then missing
    until it does); otherwise None, the row timed here (each sample after ``evict``, if any)."""
    reason = why_not(implementation, batch.tokens)
    if reason is not None:
        row = make_row(kernel, implementation, batch, threads, "", status="skipped", reason=reason)
        return row, None, None
    if implementation.kind == FLOOR:  # its time: ``run`` measures the copies around our rows
        return make_row(kernel, implementation, batch, threads, ""), None, None
    try:
        call = implementation.prepare(batch, threads)
        result = call()  # the warm-up call: compiles, and gives the output checked
        outputs = implementation.outputs(result) if implementation.outputs else None
        del result
        if outputs is not None and reference is not None:
            mismatch = compare(kernel, implementation, outputs, reference, batch)
            if mismatch is not None:
                row = make_row(kernel, implementation, batch, threads, "", status="mismatch")
                row["reason"] = mismatch
                return row, None, None
        if not defer:
            samples, number = time_calls(call, budget, plan.min_repeats, evict=evict)
    except Exception as error:  # a peer that breaks is reported, the run goes on
        row = make_row(kernel, implementation, batch, threads, "", status="error")
        row["reason"] = f"{type(error).__name__}: {error}"
        return row, None, None
    row = make_row(
        kernel,
        implementation,
        batch,
        threads,
        "",
        checked=outputs is not None and reference is not None,
        # the first of our backends gives the outputs the others are checked against
        reference=implementation.kind == OURS and reference is None,
    )
    if defer:
        return row, outputs, call
    add_times(row, samples, number)
    return row, outputs, None


def add_times(row: dict[str, Any], samples: list[float], number: int) -> None:
    row.update(
        times=samples,
        number=number,
        min=min(samples),
        median=float(np.median(samples)),
        max=max(samples),
    )


def time_ours(
    ours: list[tuple[dict[str, Any], Callable[[], Any]]],
    budget: float,
    min_repeats: int,
    evict: Evict | None = None,
) -> None:
    """Times our rows of one batch together (``time_interleaved``): the ratios between our
    backends are what the README judges them by, and a machine whose speed moves within seconds
    (a shared VM) moved them by up to 2x when each was timed in a block of its own. A call that
    raises makes its row an error; the others are timed again without it."""
    while ours:
        try:
            timed = time_interleaved([call for _, call in ours], budget, min_repeats, evict=evict)
        except Exception as error:  # a call that breaks is reported, the run goes on
            failed = []
            for k, (row, call) in enumerate(ours):
                try:
                    call()
                except Exception as failure:
                    row.update(status="error", reason=f"{type(failure).__name__}: {failure}")
                    failed.append(k)
            if not failed:  # none fails alone: the error is the interleaving's, for all of them
                for row, _ in ours:
                    row.update(status="error", reason=f"{type(error).__name__}: {error}")
                return
            ours = [entry for k, entry in enumerate(ours) if k not in failed]
            continue
        for (row, _), (samples, number) in zip(ours, timed, strict=True):
            add_times(row, samples, number)
        return


def reference_outputs(kernel: Kernel, batch: Batch) -> dict[str, np.ndarray] | None:
    """ppo_fast's outputs on ``batch``: those of the first of our backends that runs here."""
    for implementation in kernel.implementations:
        if implementation.kind == OURS and why_not(implementation, batch.tokens) is None:
            return implementation.outputs(implementation.prepare(batch, 1)())
    return None


def check(
    kernel: Kernel,
    implementation: Implementation,
    result: Any,
    batch: Batch,
    reference: dict[str, np.ndarray] | None,
) -> str | None:
    """What differs between ``result`` (an implementation's return value) and ``reference``, or
    None; an implementation without outputs (the floor) or a missing reference passes."""
    if implementation.outputs is None or reference is None:
        return None
    return compare(kernel, implementation, implementation.outputs(result), reference, batch)


def floor_row(
    kernel: Kernel,
    implementation: Implementation,
    batch: Batch,
    threads: int,
    bandwidth: float | None = None,
) -> dict[str, Any]:
    """The floor's row: its time is computed from the copy ``bandwidth`` on ``threads`` threads
    (bytes per second; None: ``copy_bandwidth``'s, measured once a process; ``run`` gives each
    table's its own, measured around ppo_fast's rows)."""
    if bandwidth is None:
        bandwidth = copy_bandwidth(threads)
    seconds = floor_seconds(*kernel.traffic(batch), bandwidth)
    return make_row(
        kernel,
        implementation,
        batch,
        threads,
        "",
        times=[seconds],
        number=1,
        min=seconds,
        median=seconds,
        max=seconds,
        bandwidth=bandwidth,
        checked=False,
        reference=False,
    )


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's median over its floor (``x_floor``), and each of our backends' speed-up."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["kernel"], tuple(row["shape"]), row["dtype"], row["threads"], row["sweep"])
        groups.setdefault(key, []).append(row)
    for group in groups.values():
        timed = {row["implementation"]: row for row in group if row["status"] == "ok"}
        floor = next((row for row in timed.values() if row["kind"] == FLOOR), None)
        ours = {
            name: row
            for name, row in timed.items()
            if row["kind"] == OURS and not row.get("preallocated")
        }
        for row in timed.values():
            if floor is not None:
                row["x_floor"] = row["median"] / floor["median"]
            row["speedup"] = {
                name: row["median"] / mine["median"]
                for name, mine in ours.items()
                if name != row["implementation"] and row["kind"] != FLOOR
            }


def fit_exponent(tokens: Sequence[float], seconds: Sequence[float]) -> float:
    """k in seconds ~ tokens^k: the least-squares slope of log(seconds) against log(tokens)."""
    x, y = np.log10(np.asarray(tokens, float)), np.log10(np.asarray(seconds, float))
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("fitting an exponent needs at least two different token counts")
    slope, _ = np.polyfit(x, y, 1)
    return float(slope)


def exponents(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fitted exponent of each (kernel, implementation, dtype, threads) of the sweep."""
    series: dict[tuple, list[tuple[int, float]]] = {}
    for row in rows:
        if row["sweep"] == "scaling" and row["status"] == "ok":
            key = (row["kernel"], row["implementation"], row["dtype"], row["threads"])
            series.setdefault(key, []).append((row["tokens"], row["median"]))
    fits = []
    for (kernel, name, dtype, threads), points in series.items():
        points.sort()
        if len({tokens for tokens, _ in points}) < 2:
            continue
        fits.append(
            {
                "kernel": kernel,
                "implementation": name,
                "dtype": dtype,
                "threads": threads,
                "exponent": fit_exponent(*zip(*points, strict=True)),
                "tokens": [tokens for tokens, _ in points],
                "median": [seconds for _, seconds in points],
            }
        )
    return fits
