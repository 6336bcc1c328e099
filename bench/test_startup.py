"""Import time of ppo_fast, its backends and the peers' packages, and the first-call time of
each stage: numba without its cache, with a cold cache and a warm one (PPO_FAST_NUMBA_CACHE=1,
NUMBA_CACHE_DIR a temporary directory), numba without its cache on two threads (the serial and
the parallel builds), and cython. Every probe is a fresh process; the seconds
it measures inside are in ``extra_info`` (pytest-benchmark's own time includes Python's start)."""

from __future__ import annotations

import pytest

from ppo_fast import bench as engine


@pytest.mark.parametrize(
    ("what", "module", "backend", "requires"),
    engine.IMPORTS,
    ids=[what.replace(" ", "_") for what, *_ in engine.IMPORTS],
)
def test_import_time(benchmark, what, module, backend, requires):
    reason = engine.import_unavailable(what, backend, requires)
    if reason is not None:
        pytest.skip(reason)
    seconds: list[float] = []
    benchmark.group = "import"
    benchmark.pedantic(lambda: seconds.append(engine.import_seconds(module)), rounds=3)
    assert seconds and min(seconds) >= 0
    benchmark.extra_info.update(import_seconds=seconds)


@pytest.fixture(scope="module")
def modes(tmp_path_factory):
    return engine.first_call_modes(str(tmp_path_factory.mktemp("numba-cache")))


@pytest.mark.parametrize(
    "index", range(5), ids=["numba", "numba_cold", "numba_warm", "numba_2_threads", "cython"]
)
def test_first_call(benchmark, modes, index):
    backend, mode, env, n_threads = modes[index]
    reason = engine.why_not(engine.KERNELS["gae"].implementation(f"ppo_fast[{backend}]"))
    if reason is not None:
        pytest.skip(reason)
    measured: dict = {}
    benchmark.group = "first call"
    benchmark.pedantic(
        lambda: measured.update(engine.run_probe("first_call_probe", [backend, n_threads], env)),
        rounds=1,
    )
    assert set(measured["calls"]) == set(engine.FIRST_CALL_KERNELS)
    benchmark.extra_info.update(backend=backend, mode=mode, threads=n_threads, **measured)
