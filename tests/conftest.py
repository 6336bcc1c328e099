"""Fixtures over backends and dtypes, and the tolerance every backend is held to."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import ppo_fast

settings.register_profile(
    "default",
    deadline=None,
    # 40: the whole suite measured 655 s in a fresh-clone CI run with 60 (2026-12-03), over its
    # ten minutes; the long profile below keeps ten times as many.
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The long property runs, behind an option: `python -m pytest --hypothesis-profile=long` (ten
# times the examples of every property that does not set its own count; tens of minutes). CI
# runs the default profile, so that the whole suite stays within its ten minutes.
settings.register_profile("long", parent=settings.get_profile("default"), max_examples=400)
# Few examples per property: what tests/mutation/run.sh runs once per mutant.
settings.register_profile("mutation", parent=settings.get_profile("default"), max_examples=10)
settings.load_profile("default")

# tests/mutation holds the mutation-testing configs and scripts, not tests.
collect_ignore = ["mutation"]

COMPILED = [name for name in ppo_fast.available_backends() if name != "python"]  # auto's order
ALL_BACKENDS = [*COMPILED, "python"]

# The tests that compile numba's parallel builds of every kernel (and the tiny bench run, which
# runs them on two threads) join the float32 tests' xdist group (pytest_collection_modifyitems):
# on two workers one worker compiles those builds (numba compiles each build per process, 1-5 s
# a kernel and dtype), not each worker its own.
NUMBA_PARALLEL = pytest.mark.numba_parallel
COMPILED_NUMBA_PARALLEL = [
    pytest.param(name, marks=NUMBA_PARALLEL) if name == "numba" else name for name in COMPILED
]


def numba_dtype(item) -> str | None:
    """The float dtype a test runs numba's kernels at, None for a test that does not run them
    or runs them at both dtypes. A test runs them where a parameter names the numba backend or
    the test is marked ``numba`` (it runs numba itself, beside Cython) or ``numba_parallel``; at
    the float dtype its parameters name, else at its ``numba_dtype`` marker's, else at float32
    for ``numba_parallel``'s tests and float64 for the others: NumPy's default dtype, which a
    test that names none makes its arrays of."""
    values = getattr(getattr(item, "callspec", None), "params", {}).values()
    # a backend's name, or a benchmark's implementation of ppo_fast (its .backend)
    backends = [getattr(value, "backend", value) for value in values]
    named = any(isinstance(backend, str) and backend == "numba" for backend in backends)
    parallel = item.get_closest_marker("numba_parallel") is not None
    if not (named or parallel or item.get_closest_marker("numba")):
        return None
    names = set()
    for value in values:
        if isinstance(value, str):
            names.add(value)
        elif isinstance(value, np.dtype) or (
            isinstance(value, type) and issubclass(value, np.generic)
        ):
            names.add(np.dtype(value).name)
    floats = names & {"float32", "float64"}
    if floats:
        return floats.pop() if len(floats) == 1 else None
    marker = item.get_closest_marker("numba_dtype")
    if marker is not None:
        return marker.args[0]
    # the parallel builds' tests at float32 (the tiny bench run compiles every float32 kernel)
    return "float32" if parallel else "float64"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Groups of numba's tests by dtype, for ``--dist loadgroup``.

    numba compiles a kernel once per process and dtype, 1-10 s each: compiling was half of the
    suite's time on two cores (633 of 1,235 s of tests in a run that recorded every compile, AMD
    EPYC, 2026-12-07), and each worker compiled most kernels at both dtypes. The tests that run
    numba at float32 share a group, those at float64 another (``numba_dtype``), and one worker
    compiles a dtype's kernels for all of them; the parallel builds' tests (NUMBA_PARALLEL) that
    name no dtype are float32's, as the tiny bench run among them compiles every float32 kernel.
    There, two workers: compiles 633 -> 499 s, the suite 656-675 -> 591 s; with the tests that
    name no dtype grouped too (float64, or their ``numba_dtype`` marker's), the property tests
    that ran both dtypes split by dtype and the hostile inputs in float64's group, 364 s and 491
    s (the two workers' tests 460 s each). On more than two workers a dtype's tests make one
    group a test file (of workers // 2), so that every worker has work: that run's tests and
    compiles replayed on 8 workers took 334 s with a group a dtype, 209 s so, as without
    groups."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    parts = max(1, workers // 2)
    for item in items:
        if item.get_closest_marker("xdist_group"):  # a group of its own (the Ray clusters')
            continue
        dtype = numba_dtype(item)
        if dtype is None:
            continue
        group = f"numba_{dtype}"
        if parts > 1:
            group += f"_{zlib.crc32(item.path.name.encode()) % parts}"
        item.add_marker(pytest.mark.xdist_group(group))


# Relative tolerance of a backend against the oracle (DESIGN.md section 5).
RTOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}


@pytest.fixture(params=COMPILED, scope="session")
def compiled_backend(request) -> str:
    """Each compiled backend in turn; the oracle is what they are compared with."""
    return request.param


@pytest.fixture(params=ALL_BACKENDS, scope="session")
def backend(request) -> str:
    return request.param


@pytest.fixture(params=[np.float32, np.float64], ids=["float32", "float64"], scope="session")
def dtype(request):
    return request.param


def assert_matches_oracle(actual, expected, dtype, what=""):
    """Equal to the oracle within the dtype's tolerance, scaled by the magnitude of the row.

    Near-zero entries that come out of cancellation are judged on the scale of the whole
    array, so that a large intermediate sum cannot make a correct kernel fail.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    rtol = RTOL[np.dtype(dtype)]
    finite = np.abs(expected[np.isfinite(expected)])
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)
