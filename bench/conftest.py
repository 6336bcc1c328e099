"""pytest-benchmark suites over ppo_fast.bench's comparison table.

    pytest bench/                                   the full matrix (minutes)
    pytest bench/ --shapes 256x1024 --threads 2     a slice of it
    pytest bench/ --kernels gae,whiten              the rows of some kernels
    pytest bench/ --benchmark-disable --shapes 4x16 --max-tokens 1000 --memory-shape 4x16
                                                    every row once, as a test

Every row checks its output against ppo_fast's before it is timed. Rows are grouped by kernel,
shape, dtype and threads, so pytest-benchmark's table shows each implementation relative to the
others of its group; ``--benchmark-json`` keeps the raw numbers, and the terminal summary adds
the ratios to the memory floor, the speed-ups and the fitted scaling exponents.
"""

from __future__ import annotations

import pytest

from ppo_fast import bench as engine


def pytest_configure(config):
    engine.quiet_openmp()  # before torch or the cython backend load libgomp


@pytest.fixture(scope="session", autouse=True)
def torch_threads(request):
    """torch's thread team at its largest size first (see engine.start_torch_threads)."""
    if engine.unavailable("torch", ("torch",), None) is None:
        threads = [int(t) for t in _csv(request.config, "--threads")]
        engine.start_torch_threads(max(threads))


def pytest_addoption(parser):
    group = parser.getgroup("ppo_fast bench")
    group.addoption(
        "--shapes",
        default=",".join(map(engine.shape_name, engine.ALL_SHAPES)),
        help="comma-separated BxT shapes (default: %(default)s)",
    )
    group.addoption(
        "--kernels",
        default="",
        help="comma-separated kernels of the timing and scaling rows (default: every kernel)",
    )
    group.addoption("--dtypes", default="float32,float64", help="(default: %(default)s)")
    group.addoption("--threads", default="1,2", help="(default: %(default)s)")
    group.addoption(
        "--max-tokens",
        default="1e8",
        help="the scaling sweep times our kernels at 1e3, 1e4, ... up to this (%(default)s)",
    )
    group.addoption(
        "--memory-kernels",
        default="",
        help="comma-separated kernels of the peak-memory rows, one fresh process each "
        "(default: every kernel)",
    )
    group.addoption(
        "--memory-shape",
        default="1024x4096",
        help="the batch of the peak-memory rows (default: %(default)s)",
    )


def _csv(config, name: str) -> list[str]:
    return [part.strip() for part in config.getoption(name).split(",") if part.strip()]


def _chosen_kernels(config, option: str) -> list:
    """The kernels an option names (every kernel when it names none), in the table's order."""
    chosen = set(_csv(config, option)) or set(engine.KERNELS)
    unknown = chosen - set(engine.KERNELS)
    if unknown:
        raise pytest.UsageError(
            f"{option}: unknown {', '.join(sorted(unknown))}; the kernels are "
            f"{', '.join(engine.KERNELS)}"
        )
    return [kernel for kernel in engine.KERNELS.values() if kernel.name in chosen]


def pytest_generate_tests(metafunc):
    config = metafunc.config
    kernels = _chosen_kernels(config, "--kernels")
    shapes = [engine.parse_shape(s) for s in _csv(config, "--shapes")]
    dtypes = _csv(config, "--dtypes")
    threads = [int(t) for t in _csv(config, "--threads")]
    if "case" in metafunc.fixturenames:
        cases = [
            (kernel, implementation, shape, dtype, n)
            for dtype in dtypes
            for shape in shapes
            for kernel in kernels
            for n in threads
            for implementation in kernel.implementations
        ]
        metafunc.parametrize(
            "case",
            cases,
            ids=[
                f"{k.name}-{i.name}-{engine.shape_name(s)}-{d}-{n}T".replace(" ", "_")
                for k, i, s, d, n in cases
            ],
        )
    if "compat_shape" in metafunc.fixturenames:
        metafunc.parametrize("compat_shape", shapes, ids=[engine.shape_name(s) for s in shapes])
    if "scaling_case" in metafunc.fixturenames:
        largest = float(config.getoption("--max-tokens"))
        cases = [
            (kernel, implementation, 10**power, n)
            for power in range(3, 9)
            if 10**power <= largest
            for kernel in kernels
            for n in threads
            for implementation in kernel.implementations
            if implementation.kind != engine.PEER and implementation.backend != "python"
        ]
        metafunc.parametrize(
            "scaling_case",
            cases,
            ids=[f"{k.name}-{i.name}-{t:.0e}-{n}T".replace(" ", "_") for k, i, t, n in cases],
        )
    if "memory_case" in metafunc.fixturenames:
        cases = [
            (kernel, implementation)
            for kernel in _chosen_kernels(config, "--memory-kernels")
            for implementation in kernel.implementations
        ]
        metafunc.parametrize(
            "memory_case",
            cases,
            ids=[f"{k.name}-{i.name}".replace(" ", "_") for k, i in cases],
        )


class Batches:
    """The batch of the current shape and dtype (one at a time: large ones are large)."""

    def __init__(self):
        self.key = None
        self.batch = None
        self.references: dict = {}

    def get(self, shape, dtype) -> engine.Batch:
        if self.key != (tuple(shape), dtype):
            self.key = (tuple(shape), dtype)
            self.batch = engine.Batch(shape, dtype)
            self.references.clear()
        return self.batch

    def reference(self, kernel: engine.Kernel, batch: engine.Batch):
        """ppo_fast's outputs: the first of our backends that runs here on this batch."""
        if kernel.name not in self.references:
            self.references[kernel.name] = engine.reference_outputs(kernel, batch)
        assert self.references[kernel.name] is not None, (
            f"no backend of ppo_fast runs {kernel.name}"
        )
        return self.references[kernel.name]


@pytest.fixture(scope="session")
def batches() -> Batches:
    return Batches()


@pytest.fixture
def threads_restored():
    yield
    engine.set_threads_default()


RESULTS: list[dict] = []


def record(benchmark, row: dict, copy: engine.Copy | None = None) -> None:
    """Keep the row for the terminal summary (its stats exist only when benchmarking). The floor's
    row (``copy`` given) gets the floor time at the bandwidth of the copy's best time."""
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is None:
        return
    times = list(stats.data)
    row.update(times=times, min=min(times), median=stats.median, max=max(times), status="ok")
    if copy is not None:
        bandwidth = copy.bandwidth(min(times))
        floor = engine.floor_seconds(row["bytes_read"], row["bytes_written"], bandwidth)
        row.update(times=[floor], min=floor, median=floor, max=floor, bandwidth=bandwidth)
    RESULTS.append(row)


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    rows = [dict(row) for row in RESULTS]
    engine.add_ratios(rows)
    write = terminalreporter.write_line
    write("")
    for line in engine.format_report(rows).splitlines():
        write(line)
