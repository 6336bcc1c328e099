"""The benchmarks cannot rot: every peer computes what ppo_fast computes, the bench/ suites run
once as tests, and ``ppo-fast bench`` writes a row for every kernel x implementation.

No test here asserts a time: only that things run, what they compute, and what they report.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import NUMBA_PARALLEL

import ppo_fast
from ppo_fast import bench as engine
from ppo_fast import cli

ROOT = Path(__file__).resolve().parents[1]

# The kernels of ppo_fast's kernel table: becomes tuple(ppo_fast._spec.KERNELS) once it lands.
TABLE_KERNELS = engine.TABLE_KERNELS


def _case(kernel: engine.Kernel, implementation: engine.Implementation):
    """A case that runs, or one skipped with the reason it cannot run here, naming it."""
    case_id = f"{kernel.name}-{implementation.name}".replace(" ", "_")
    reason = engine.why_not(implementation)
    if reason is None:
        return pytest.param(kernel, implementation, id=case_id)
    skip = pytest.mark.skip(reason=f"{implementation.name} does not run here: {reason}")
    return pytest.param(kernel, implementation, id=case_id, marks=skip)


def reference_implementation(kernel: engine.Kernel) -> engine.Implementation:
    """The oracle where the kernel runs one (the pure-Python backend always loads); for the
    outcome estimators, which run no kernel of the table, ppo_fast's NumPy code, which
    tests/test_outcome.py holds to its own plain-Python loop."""
    names = [implementation.name for implementation in kernel.implementations]
    return kernel.implementation("ppo_fast[python]" if "ppo_fast[python]" in names else "ppo_fast")


CASES = [
    _case(kernel, implementation)
    for kernel in engine.KERNELS.values()
    for implementation in kernel.implementations
    # the reference every other row is compared with is not compared with itself
    if implementation.kind != engine.FLOOR
    and implementation is not reference_implementation(kernel)
]
UNAVAILABLE = [
    (implementation, reason)
    for kernel in engine.KERNELS.values()
    for implementation in kernel.implementations
    if (reason := engine.why_not(implementation)) is not None
]


def reference(kernel: engine.Kernel, batch: engine.Batch) -> dict[str, np.ndarray]:
    oracle = reference_implementation(kernel)
    return oracle.outputs(oracle.prepare(batch, 1)())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("kernel", "implementation"), CASES)
def test_every_implementation_computes_what_ppo_fast_computes(kernel, implementation, dtype):
    """The check every benchmark row makes before timing, on a ragged batch (lengths T/2..T).
    An implementation that cannot run here is skipped, and the skip names it and says why."""
    batch = engine.Batch((6, 40), dtype, seed=3)
    outputs = implementation.outputs(implementation.prepare(batch, 1)())
    assert set(implementation.compare or kernel.compare) <= set(outputs)
    mismatch = engine.compare(kernel, implementation, outputs, reference(kernel, batch), batch)
    assert mismatch is None, f"{kernel.name} / {implementation.name}: {mismatch}"


PEERS = [
    implementation
    for kernel in engine.KERNELS.values()
    for implementation in kernel.implementations
    if implementation.requires
]


@pytest.mark.parametrize("implementation", PEERS, ids=[i.name.replace(" ", "_") for i in PEERS])
def test_a_missing_peer_says_how_to_install_it(implementation, monkeypatch):
    """Every peer with a requirement, as if it were not installed (None in sys.modules is what
    importing a missing module raises): the report must say how to install it."""
    for module in implementation.requires:
        monkeypatch.setitem(sys.modules, module, None)
    engine.unavailable.cache_clear()  # availability is cached per process
    try:
        reason = engine.why_not(implementation)
    finally:
        engine.unavailable.cache_clear()
    assert reason is not None and engine.BENCH_EXTRA in reason, (implementation.name, reason)


def test_what_cannot_run_here_says_why():
    """What is really missing on this machine (often nothing): our backends say why they cannot
    load, peers how to install them."""
    for implementation, reason in UNAVAILABLE:
        expected = "cannot be used" if implementation.kind == engine.OURS else engine.BENCH_EXTRA
        assert expected in reason or "does not import" in reason, (implementation.name, reason)


def test_the_gpu_benchmark_says_it_needs_a_cuda_device(monkeypatch, capsys):
    """bench/cuda_losses.py (run on a GPU machine: README, "On a GPU") parses its arguments and,
    where torch sees no CUDA device, says so and exits 2 rather than timing the CPU."""
    torch = pytest.importorskip("torch")
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuda_losses", ROOT / "bench" / "cuda_losses.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert module.main(["--shape", "8x16", "--repeats", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_every_kernel_of_the_table_has_a_benchmark_entry():
    exercised = {name for kernel in engine.KERNELS.values() for name in kernel.table_kernels}
    assert set(TABLE_KERNELS) <= exercised, set(TABLE_KERNELS) - exercised
    assert exercised <= set(TABLE_KERNELS), exercised - set(TABLE_KERNELS)
    for name in TABLE_KERNELS:
        assert name in engine.table_entry(name).table_kernels
    assert engine.FIRST_CALL_KERNELS == tuple(
        dict.fromkeys(engine.table_entry(name).name for name in TABLE_KERNELS)
    )


def test_the_check_catches_a_different_computation():
    kernel = engine.KERNELS["gae"]
    implementation = kernel.implementation("ppo_fast[python]")
    batch = engine.Batch((3, 10), "float64")
    expected = reference(kernel, batch)
    assert engine.compare(kernel, implementation, expected, expected, batch) is None
    lam_zero = {name: array.copy() for name, array in expected.items()}
    lam_zero["advantages"][0, 0] += 1e-6
    assert "advantages differs at 1 of" in engine.compare(
        kernel, implementation, lam_zero, expected, batch
    )
    # Past a row's end nothing is compared for GAE (verl does not zero it) ...
    past_end = {name: array.copy() for name, array in expected.items()}
    past_end["returns"][~batch.mask] = 7.0
    assert engine.compare(kernel, implementation, past_end, expected, batch) is None
    # ... but a kernel compared everywhere sees it.
    kl = engine.KERNELS["kl_penalty"]
    values = reference(kl, batch)
    shifted = {"kl": values["kl"] + 1e-3}
    assert "kl differs" in engine.compare(kl, implementation, shifted, values, batch)


def test_the_batch_is_right_padded_with_zeros_and_deterministic():
    batch = engine.Batch((5, 12), "float32")
    assert batch.lengths.min() >= 6 and batch.lengths.max() <= 12
    np.testing.assert_array_equal(batch.mask, np.arange(12) < batch.lengths[:, None])
    for name in ("logprobs", "ref_logprobs", "old_logprobs", "rewards", "values", "advantages"):
        array = getattr(batch, name)
        assert array.dtype == np.float32
        assert not np.any(array[~batch.mask])
    assert np.all(batch.logprobs <= 0)
    again = engine.Batch((5, 12), "float32")
    np.testing.assert_array_equal(batch.rewards, again.rewards)


def test_floor_is_the_compulsory_bytes_at_the_copy_bandwidth():
    kernel = engine.KERNELS["gae"]
    batch = engine.Batch((4, 16), "float32")
    read, written = kernel.traffic(batch)
    assert read == 2 * 64 * 4 + 64  # rewards and values, float32, and the bool mask at one byte
    assert written == 2 * 64 * 4  # advantages and returns
    assert engine.floor_seconds(read, written, 1e9) == pytest.approx((read + written) / 1e9)
    # A copy reads and writes every byte: its bandwidth is 2 x bytes / time.
    copy = engine.Copy(nbytes=3 << 20)
    assert copy.bandwidth(1e-3) == pytest.approx(2 * (3 << 20) / 1e-3)
    assert len(copy.slices) == 1
    copy()
    np.testing.assert_array_equal(copy.target, copy.source)
    threaded = engine.Copy(threads=2, nbytes=3 << 20)
    assert len(threaded.slices) == 2
    threaded()
    np.testing.assert_array_equal(threaded.target, threaded.source)
    assert engine.COPY_BYTES >= 64 << 20
    assert engine.copy_bandwidth(1) > 0
    row = engine.floor_row(kernel, kernel.implementation("floor"), batch, 1)
    assert row["median"] == pytest.approx((read + written) / row["bandwidth"])


def test_each_tables_floor_is_the_copy_bandwidth_measured_around_its_rows(monkeypatch):
    """A VM's copy bandwidth moves within seconds, so each table's floor comes from copies
    taken just before and just after ppo_fast's rows of that table are timed."""
    from ppo_fast.bench import roofline, timing

    log = []
    # the seconds of the copies before and after each table's rows, tables in the plan's order
    best = {((4, 16), 1): 0.02, ((4, 16), 2): 0.1, ((4, 32), 1): 0.01, ((4, 32), 2): 0.05}
    first_shape = [[0.04, 0.02], [0.05, 0.03], [0.2, 0.1], [0.1, 0.3]]
    second_shape = [[0.03, 0.02], [0.01, 0.04], [0.06, 0.06], [0.05, 0.07]]
    copy_seconds = iter([*first_shape, *second_shape])

    def copy_times(threads, repeats, evict=None):
        assert evict is None  # a warm run: no eviction
        log.append(("copies", threads, repeats))
        return next(copy_seconds)

    time_ours = timing.time_ours

    def logged_time_ours(ours, budget, min_repeats, evict=None):
        assert evict is None
        log.append(("ours", [row["implementation"] for row, _ in ours]))
        time_ours(ours, budget, min_repeats)

    monkeypatch.setattr(roofline, "copy_times", copy_times)
    monkeypatch.setattr(timing, "time_ours", logged_time_ours)
    plan = engine.Plan(
        kernels=("gae",),
        shapes=((4, 16), (4, 32)),
        threads=(1, 2),
        budget=0.001,
        implementations=("ppo_fast out=", "floor"),
    )
    rows = engine.run(plan)
    half = engine.COPY_REPEATS // 2
    rest = engine.COPY_REPEATS - half
    assert log == [
        entry
        for _ in plan.shapes
        for threads in (1, 2)
        for entry in [
            ("copies", threads, half),
            ("ours", ["ppo_fast out="]),
            ("copies", threads, rest),
        ]
    ]
    floors = {
        (tuple(row["shape"]), row["threads"]): row for row in rows if row["kind"] == engine.FLOOR
    }
    assert floors.keys() == best.keys()
    for (shape, threads), seconds in best.items():  # the best copy around the table's rows
        read, written = engine.KERNELS["gae"].traffic(engine.Batch(shape, "float32"))
        bandwidth = 2 * engine.COPY_BYTES / seconds
        floor = floors[shape, threads]
        assert floor["bandwidth"] == pytest.approx(bandwidth) and floor["sweep"] == "shapes"
        assert floor["median"] == pytest.approx((read + written) / bandwidth)
        ours = next(
            r for r in rows
            if tuple(r["shape"]) == shape and r["threads"] == threads and r["kind"] == engine.OURS
        )  # fmt: skip
        assert ours["x_floor"] == pytest.approx(ours["median"] / floor["median"])
    # The report states each thread count's range over the tables.
    gb = {key: 2 * engine.COPY_BYTES / seconds / 1e9 for key, seconds in best.items()}
    low, high = gb[(4, 16), 1], gb[(4, 32), 1]
    median = (low + high) / 2
    assert f"1 thread {low:.3g}-{high:.3g} GB/s (median {median:.3g})" in engine.format_report(rows)


def test_time_calls_batches_fast_calls_and_samples_slow_ones_a_few_times():
    calls = []
    samples, number = engine.time_calls(lambda: calls.append(1), budget=0.01, min_repeats=3)
    assert len(samples) >= 3
    # The first call calibrates; it is a sample of its own only when one call fills a sample.
    assert len(calls) == (0 if number == 1 else 1) + number * len(samples)
    slow_calls = []

    def slow():
        slow_calls.append(1)
        time.sleep(engine.SAMPLE_SECONDS * 2)

    samples, number = engine.time_calls(slow, budget=0.0, min_repeats=3)
    assert number == 1 and len(samples) == 3 and len(slow_calls) == 3


def test_time_interleaved_takes_the_calls_samples_in_turn_and_ours_are_timed_together():
    log = []

    def tagged(tag, seconds):
        def call():
            log.append(tag)
            time.sleep(seconds)

        return call

    # Each call fills a sample (number 1), so the log is the order of the samples: in turn,
    # each round reversed from the last, the first the calibration's (a, b, b, a, a, b, ...),
    # never one call's block first.
    timed = engine.time_interleaved(
        [tagged("a", engine.SAMPLE_SECONDS), tagged("b", engine.SAMPLE_SECONDS)],
        budget=0.0,
        min_repeats=4,
    )
    assert [number for _, number in timed] == [1, 1]
    assert [len(samples) for samples, _ in timed] == [4, 4]
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a"]
    # time_ours: a call that raises gets an error row, the others their times.
    rows = [{"status": "ok"}, {"status": "ok"}]

    def broken():
        raise RuntimeError("no luck")

    engine.time_ours([(rows[0], broken), (rows[1], lambda: None)], budget=0.001, min_repeats=3)
    assert rows[0]["status"] == "error" and "RuntimeError: no luck" in rows[0]["reason"]
    assert rows[1]["status"] == "ok" and len(rows[1]["times"]) >= 3
    assert rows[1]["median"] == pytest.approx(float(np.median(rows[1]["times"])))


def test_the_oracle_is_timed_in_a_block_not_interleaved_with_the_compiled_backends(monkeypatch):
    """Each call of the oracle is milliseconds of Python: taken in turn with the compiled
    backends' samples, it left each next one cold (the clipped surrogate's 8x128 medians 1.5-2x
    their best). Only the compiled rows are timed together; the oracle is timed as a peer."""
    from ppo_fast.bench import timing

    interleaved = []
    time_ours = timing.time_ours

    def logged_time_ours(ours, budget, min_repeats, evict=None):
        interleaved.append([row["implementation"] for row, _ in ours])
        time_ours(ours, budget, min_repeats, evict)

    monkeypatch.setattr(timing, "time_ours", logged_time_ours)
    names = ("ppo_fast[numba]", "ppo_fast[cython]", "ppo_fast[python]", "ppo_fast out=", "floor")
    plan = engine.Plan(
        kernels=("gae",), shapes=((4, 16),), threads=(1,), budget=0.001, implementations=names
    )
    rows = {row["implementation"]: row for row in engine.run(plan)}
    gae = engine.KERNELS["gae"]
    compiled = [name for name in names[:2] if engine.why_not(gae.implementation(name)) is None]
    assert len(interleaved) == 1 and sorted(interleaved[0]) == sorted([*compiled, "ppo_fast out="])
    oracle = rows["ppo_fast[python]"]
    assert oracle["status"] == "ok" and len(oracle["times"]) >= 3


def test_the_largest_cache_is_what_the_os_reports(monkeypatch, tmp_path):
    from ppo_fast.bench import roofline

    sizes = {"index0": "48K", "index2": "2048K", "index3": "491520K"}
    for name, text in sizes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(text + "\n")
    paths = [str(tmp_path / name / "size") for name in sizes]
    monkeypatch.setattr(roofline.glob, "glob", lambda _: paths)
    monkeypatch.setattr(roofline.os, "sysconf", lambda name: 0)
    assert roofline.largest_cache_bytes() == 480 << 20
    assert roofline.evict_bytes() == 960 << 20
    # none in sysfs: glibc's sysconf; none at all: None, and the eviction's least buffer
    monkeypatch.setattr(roofline.glob, "glob", lambda _: [])
    monkeypatch.setattr(roofline.os, "sysconf", lambda name: 32 << 20 if "LEVEL3" in name else 0)
    assert roofline.largest_cache_bytes() == 32 << 20
    assert roofline.evict_bytes() == roofline.EVICT_MIN_BYTES
    monkeypatch.setattr(roofline.os, "sysconf", lambda name: -1)
    assert roofline.largest_cache_bytes() is None
    assert roofline.evict_bytes() == roofline.EVICT_MIN_BYTES


def test_a_cold_run_evicts_before_every_sample_and_every_copy(monkeypatch):
    """--cold: each sample is one call after an eviction, whose time the budget does not count;
    the floor's copies are each made after one too, and every row says how much was read."""
    from ppo_fast.bench import roofline

    log = []

    class Evict:
        nbytes = 3 << 20

        def __call__(self):
            log.append("evict")
            time.sleep(0.01)  # longer than the budget: it must not count

    def tagged(tag, seconds=0.0):
        def call():
            log.append(tag)
            time.sleep(seconds)

        return call

    timed = engine.time_interleaved(
        [tagged("a", 0.001), tagged("b", 0.001)], budget=0.001, min_repeats=3, evict=Evict()
    )
    assert [number for _, number in timed] == [1, 1]
    assert [len(samples) for samples, _ in timed] == [3, 3]
    calls = ["a", "b", "b", "a", "a", "b"]  # the calibrations (first samples), two rounds
    assert log == [entry for call in calls for entry in ("evict", call)]
    # the budget counts the calls' time, not the evictions': 0.05 s of 1 ms calls is more
    # than COLD_MAX_REPEATS samples of each (counting the 10 ms evictions, about 5), and a
    # call gets at most COLD_MAX_REPEATS, unless more are asked for
    timed = engine.time_interleaved(
        [tagged("a", 0.001), tagged("b", 0.001)], budget=0.05, evict=Evict()
    )
    assert [len(samples) for samples, _ in timed] == [engine.COLD_MAX_REPEATS] * 2
    samples, number = engine.time_calls(tagged("a"), 0.0, min_repeats=30, evict=Evict())
    assert number == 1 and len(samples) == 30
    # copies: each after an eviction
    log.clear()
    assert len(roofline.copy_times(1, 2, Evict())) == 2 and log == ["evict", "evict"]
    # a whole run: the copies around our rows after evictions, every row marked
    copies = []
    copy_times = roofline.copy_times

    def counted_copy_times(threads, repeats, evict=None):
        copies.append(type(evict).__name__)
        return copy_times(threads, repeats, evict)

    monkeypatch.setattr(roofline, "copy_times", counted_copy_times)
    monkeypatch.setattr(roofline, "evict_bytes", lambda: 1 << 20)
    plan = engine.Plan(
        kernels=("gae",),
        shapes=((4, 16),),
        threads=(1,),
        budget=0.001,
        implementations=("ppo_fast out=", "floor"),
        cold=True,
    )
    rows = engine.run(plan)
    assert copies == ["Evict", "Evict"]
    assert [row["evicted_bytes"] for row in rows] == [1 << 20, 1 << 20]
    ours = next(row for row in rows if row["kind"] == engine.OURS)
    assert ours["number"] == 1 and 3 <= len(ours["times"]) <= engine.COLD_MAX_REPEATS
    assert "after a read of 1 MiB (twice the largest CPU cache): from memory" in (
        engine.format_report(rows)
    )
    warm = [{k: v for k, v in row.items() if k != "evicted_bytes"} for row in rows]
    assert "from memory" not in engine.format_report(warm)
    # eviction reads its whole buffer: a cache line at a time, every line
    evict = engine.Evict(1 << 20)
    assert evict.nbytes == 1 << 20 and evict() == (1 << 20) // 64


def test_fit_exponent():
    tokens = np.array([1e3, 1e4, 1e5, 1e6])
    assert engine.fit_exponent(tokens, 3e-9 * tokens**0.8) == pytest.approx(0.8)
    assert engine.fit_exponent(tokens, 2e-7 * tokens) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="two different token counts"):
        engine.fit_exponent([1e3, 1e3], [1.0, 2.0])


def test_importing_the_benchmark_loads_no_peer():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
                import sys
                import ppo_fast.bench, ppo_fast.cli
                heavy = ("torch", "scipy", "matplotlib", "torchrl", "numba", "rich")
                print(sorted(m for m in heavy if m in sys.modules))
            """),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``ppo-fast bench`` on a tiny workload, every kernel, both thread counts, float32, run
    once for the tests that read it: the JSON document's path and what the command printed.
    Those tests share an xdist group, so that one worker runs it, once (its batches are too
    small for a second thread: it compiles numba's serial builds, not the parallel ones)."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    # One shape: a second one recompiles every torch.compile peer (a minute) and tests nothing
    # the scaling sweep's shapes do not. One dtype: float64 compiles every peer and numba kernel
    # again (a third of this run's time), and what each implementation computes in float64 is
    # checked by test_every_implementation_computes_what_ppo_fast_computes.
    argv = ["bench", "--shapes", "4x16", "--threads", "1,2", "--dtype", "float32"]
    argv += ["--budget", "0.001", "--repeats", "1", "--scaling", "1e4", "--no-progress"]
    argv += ["--json", str(path)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(argv) == 0
    return path, printed.getvalue()


@NUMBA_PARALLEL
def test_cli_bench_writes_every_row(tiny_run):
    path, out = tiny_run
    document = json.loads(path.read_text())
    rows = document["rows"]
    by_key = {
        (
            r["kernel"],
            r["implementation"],
            tuple(r["shape"]),
            r["dtype"],
            r["threads"],
            r["sweep"],
        ): r
        for r in rows
    }
    for kernel in engine.KERNELS.values():
        for implementation in kernel.implementations:
            for shape in ((4, 16),):
                for dtype in ("float32",):
                    for threads in (1, 2):
                        key = (kernel.name, implementation.name, shape, dtype, threads, "shapes")
                        row = by_key[key]
                        if engine.why_not(implementation) is None:
                            assert row["status"] == "ok", row
                            assert row["min"] <= row["median"] <= row["max"]
                            if implementation.kind != engine.FLOOR:
                                assert row["checked"] or row["reference"], row
                            assert row["x_floor"] > 0
                        else:
                            assert row["status"] == "skipped" and row["reason"]
                            assert row["implementation"] in out.split("not run:")[1]
            for tokens in (1000, 10000):
                if implementation.kind == engine.PEER or implementation.backend == "python":
                    continue
                shape = engine.scaling_shape(tokens)
                assert (kernel.name, implementation.name, shape, "float32", 2, "scaling") in by_key
    fitted = {(f["kernel"], f["implementation"]) for f in document["exponents"]}
    assert ("gae", "ppo_fast[numba]") in fitted and ("gae", "floor") in fitted
    assert document["environment"]["versions"]["numpy"] == np.__version__
    assert f"summary: speed-up of ours (ppo_fast[{ppo_fast.get_backend()}], ppo_fast)" in out
    assert "scaling: time ~ tokens^k" in out
    for kernel in engine.KERNELS:
        assert f"\n{kernel}  4x16 float32, 1 thread" in out


@NUMBA_PARALLEL
def test_cli_bench_plot(tiny_run, tmp_path):
    path, _ = tiny_run
    rows = json.loads(path.read_text())["rows"]
    target = tmp_path / "bench.png"
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(RuntimeError, match=r"ppo_fast\[bench\]"):
            engine.plot(rows, str(target))
        return
    engine.plot(rows, str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shapes", "4by16"], "a shape is BxT"),
        (["--dtype", "float16"], "--dtype takes float32 and/or float64"),
        (["--kernels", "gea"], "unknown kernel(s) gea"),
        (["--threads", "0"], "--threads takes positive integers"),
        (["--scaling", "lots"], "--scaling takes a token count"),
    ],
)
def test_cli_bench_rejects_bad_options(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_report_lists_what_did_not_run_and_how_to_install_it():
    kernel = engine.KERNELS["gae"]
    batch = engine.Batch((4, 16), "float32")
    peer = kernel.implementation("torchrl gae")
    rows = [
        engine.make_row(
            kernel, peer, batch, 1, "shapes", status="skipped", reason=engine.BENCH_EXTRA
        ),
    ]
    report = engine.format_report(rows)
    assert f"not run:\n  torchrl gae: skipped: {engine.BENCH_EXTRA}" in report


def test_memory_and_first_call_probes_run_in_fresh_processes():
    args = ["gae", "ppo_fast[python]", [4, 16], "float32"]
    memory = engine.run_probe("memory_probe", args, engine.MALLOC_ENV)
    assert memory["status"] == "ok" and memory["extra_peak_bytes"] >= 0
    assert "VmHWM" in memory["method"] or "ru_maxrss" in memory["method"]
    first = engine.run_probe("first_call_probe", ["python"])
    assert set(first["calls"]) == set(engine.FIRST_CALL_KERNELS)
    # On two threads, the batch that takes the parallel builds (nothing to compile in Cython).
    if engine.why_not(engine.KERNELS["gae"].implementation("ppo_fast[cython]")) is None:
        threaded = engine.run_probe("first_call_probe", ["cython", 2])
        assert set(threaded["calls"]) == set(engine.FIRST_CALL_KERNELS)
    assert engine.import_seconds("ppo_fast") > 0


def test_the_memory_probe_counts_a_calls_results_on_fresh_memory():
    """The probe turns result reuse off (ppo_fast.set_result_cache(0)): with it on, the warm-up
    call's freed results stay resident and the call's two 2 MiB results would not count."""
    args = ["gae", "ppo_fast[cython]", [512, 1024], "float32"]
    memory = engine.run_probe("memory_probe", args, engine.MALLOC_ENV)
    assert memory["status"] == "ok", memory
    assert "VmHWM" in memory["method"]  # Linux: the peak resets, so the figure is the call's
    assert memory["extra_peak_bytes"] >= 4 << 20


@pytest.mark.slow  # installs, or runs fresh processes: the fast lane (-m "not slow") skips it
def test_bench_suites_run_once_as_tests():
    """pytest-benchmark's suites in bench/, once with timing off, on tiny batches: every kind of
    row, for three kernels (every row of every kernel runs, and is checked, in tiny_run)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "bench",
            "-q",
            "-p",
            "no:cacheprovider",
            "--benchmark-disable",
            "--shapes",
            "4x16",
            # A recursion, a loss with torch.compile peers and a group estimator: the suites'
            # code for every kind of implementation, without compiling every kernel again in
            # this fresh process.
            "--kernels",
            "gae,clipped_surrogate,grpo",
            # float32 only: every implementation's float64 output is checked by
            # test_every_implementation_computes_what_ppo_fast_computes above.
            "--dtypes",
            "float32",
            # one thread: the two-thread builds are compared bit for bit in tests/test_kernels.py
            "--threads",
            "1",
            "--max-tokens",
            "1000",
            "--memory-shape",
            "4x16",
            # A fresh process per memory row: GAE's rows exercise the probe on our compiled
            # backends, NumPy-only code, SciPy and torch peers; every row of every kernel is
            # still run (and checked) by bench/test_kernels.py.
            "--memory-kernels",
            "gae",
            # numba's first calls compile every kernel in a fresh process (the parallel builds
            # too on two threads: half a minute and more each), which test_warmup_compiles_ahead_
            # of_time and the numba cache's test do already; the probe and its row are the same
            # for every backend, and the cython row runs them.
            "--deselect",
            "bench/test_startup.py::test_first_call[numba]",
            "--deselect",
            "bench/test_startup.py::test_first_call[numba_cold]",
            "--deselect",
            "bench/test_startup.py::test_first_call[numba_warm]",
            "--deselect",
            "bench/test_startup.py::test_first_call[numba_2_threads]",
            # TorchRL's import takes seconds in each fresh process; the torch peers' rows run
            # the same probes.
            "--deselect",
            "bench/test_memory.py::test_peak_memory[gae-torchrl_gae]",
            "--deselect",
            "bench/test_memory.py::test_peak_memory[gae-torchrl_vec_gae]",
            "--deselect",
            "bench/test_startup.py::test_import_time[torchrl]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary


@pytest.mark.slow  # fresh processes: the fast lane (-m "not slow") skips it
def test_the_dataset_benchmark_runs_and_checks_against_verl(tmp_path):
    """bench/data_advantages.py (the README's dataset figures) on a tiny file: every row runs,
    ppo_fast's advantages equal verl's, and the peak-memory rows come out."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("torch")
    out = subprocess.run(
        [
            *(sys.executable, "bench/data_advantages.py", "--rows", "64", "--repeats", "1"),
            *("--batch-rows", "16", "--memory-batch-rows", "16"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BENCH_DIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("  ")[0] for line in out.stdout.splitlines() if "tokens/s" in line]
    for name in ("floor (pyarrow read + write)", "ppo_fast's first pass alone", "lists + verl"):
        assert name in rows, out.stdout
    difference = float(out.stdout.split("largest |ppo_fast - verl| advantage: ")[1].split()[0])
    assert difference < 1e-5  # float32
    assert out.stdout.count("ppo_fast, whole file") == 1, out.stdout


def test_the_call_overhead_script_times_the_kernel_within_the_public_call():
    """bench/call_overhead.py (the README's public-call table) on a tiny batch: for each kernel
    asked for, both rows' public time and the time inside the backend's entries in the same
    calls, which is positive (the entries were wrapped) and below the public time."""
    out = _bench_script(
        "call_overhead.py", "--samples", "3", "--backend", "python", "--shape", "8x64",
        "--kernels", "gae,gae+whiten,clipped_surrogate",
    )  # fmt: skip
    for name, has_out in (("gae", True), ("gae+whiten", False), ("clipped_surrogate", False)):
        row = next(r for r in out.splitlines() if r.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.split("|")[2:-1]]
        if not has_out:  # the bench has no out= row for it
            assert cells[3:] == ["-", "-", "-"], row
        for public, inside, ratio in (cells[:3], cells[3:]) if has_out else (cells[:3],):
            public_ms, inside_ms = float(public.split()[0]), float(inside.split()[0])
            assert 0 < inside_ms <= public_ms, row
            assert float(ratio.rstrip("x")) >= 1.0, row


def _bench_script(script: str, *arguments: str) -> str:
    """The standard output of bench/<script> run with ``arguments``, which must succeed."""
    out = subprocess.run(
        (sys.executable, f"bench/{script}", *arguments),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_compute_floor_script_prints_both_tables(tmp_path):
    """bench/compute_floor.py (the README's compute-floor tables) on tiny batches: a row of
    each table for every kernel and backend asked for, the two-thread one's compute floor
    half the one-thread one's (the same measurement, halved)."""
    out = _bench_script(
        "compute_floor.py", "--two-threads", "--samples", "1", "--backends", "python",
        "--kernels", "gae,clipped_surrogate", "--shape", "8x64", "--small", "4x64",
    )  # fmt: skip
    one, two = out.split("two threads\n")
    for table, columns in ((one, 8), (two, 7)):  # the cells and the two ends
        rows = [line for line in table.splitlines() if line.startswith("| gae |")]
        rows += [line for line in table.splitlines() if line.startswith("| clipped_surrogate |")]
        assert len(rows) == 2, table
        assert all(len(row.split("|")) == columns for row in rows), rows
        # each kernel's floor at the bandwidth of the copies around its own large batch
        assert all(re.fullmatch(r" \d+\.\d\d ms \(\d+\.\d GB/s\) ", r.split("|")[3]) for r in rows)
    for name in ("gae", "clipped_surrogate"):
        compute = next(r for r in one.splitlines() if r.startswith(f"| {name} |")).split("|")[4]
        halved = next(r for r in two.splitlines() if r.startswith(f"| {name} |")).split("|")[4]
        full, half = float(compute.split(" ms")[0]), float(halved.split(" ms")[0])
        assert half == pytest.approx(full / 2, abs=0.01), (compute, halved)
