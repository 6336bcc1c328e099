"""Extra peak memory of one call per kernel x implementation, at ``--memory-shape`` in float32.

tracemalloc does not see numba's or torch's allocations, so each row runs in a fresh process
(``ppo_fast.bench.memory_probe``, with glibc's mmap threshold fixed so that freed buffers
leave the resident set): the inputs are built and converted, a warm-up call compiles, the peak
resident set size (VmHWM) is reset through /proc/self/clear_refs and read after one more call.
The probe's wall time is what pytest-benchmark shows; the memory is in ``extra_info`` and in the
summary printed at the end of the module.
"""

from __future__ import annotations

import pytest

from ppo_fast import bench as engine

MEMORY: list[dict] = []


def test_peak_memory(benchmark, memory_case, request):
    kernel, implementation = memory_case
    shape = engine.parse_shape(request.config.getoption("--memory-shape"))
    reason = engine.why_not(implementation, shape[0] * shape[1])
    if reason is not None:
        pytest.skip(reason)
    measured: dict = {}

    def probe():
        args = [kernel.name, implementation.name, list(shape), "float32"]
        measured.update(engine.run_probe("memory_probe", args, engine.MALLOC_ENV))

    benchmark.group = f"peak memory {engine.shape_name(shape)} float32"
    benchmark.pedantic(probe, rounds=1, iterations=1)
    assert measured["status"] == "ok", measured
    assert measured["extra_peak_bytes"] >= 0
    benchmark.extra_info.update(measured)
    read, written = kernel.traffic(engine.Batch(shape, "float32"))
    MEMORY.append(
        {
            "kernel": kernel.name,
            "implementation": implementation.name,
            "kind": implementation.kind,
            "shape": list(shape),
            "dtype": "float32",
            "bytes_read": read,
            "bytes_written": written,
            **measured,
        }
    )


def teardown_module():
    for line in engine.render(engine.format_memory(MEMORY)).splitlines():
        print(line)
