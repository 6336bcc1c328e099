"""Every kernel x implementation (ours per backend, the peers, the floor) x shape x dtype x
threads, from ppo_fast.bench.KERNELS. Each row checks its output against ppo_fast's first.

The floor's row times the copy that measures the bandwidth (np.copyto over 64 MiB on as many
threads); the summary reports the floor, the kernel's compulsory bytes at that bandwidth.
"""

from __future__ import annotations

import time

import pytest
from conftest import record

from ppo_fast import bench as engine

# A call slower than this is timed over a few rounds only (the Python loops over T).
SLOW_CALL_SECONDS = 0.2
SLOW_ROUNDS = 3


def test_kernel(benchmark, case, batches, threads_restored):
    kernel, implementation, shape, dtype, threads = case
    reason = engine.why_not(implementation, shape[0] * shape[1])
    if reason is not None:
        pytest.skip(reason)
    batch = batches.get(shape, dtype)
    engine.set_threads(threads)
    call = implementation.prepare(batch, threads)
    start = time.perf_counter()
    result = call()  # warm-up: compiles, and gives the output checked
    warm_up = time.perf_counter() - start
    if implementation.outputs is not None:
        mismatch = engine.check(
            kernel, implementation, result, batch, batches.reference(kernel, batch)
        )
        assert mismatch is None, f"{implementation.name} computes something else: {mismatch}"
    del result
    read, written = kernel.traffic(batch)
    benchmark.group = f"{kernel.name} {engine.shape_name(shape)} {dtype} {threads}T"
    benchmark.extra_info.update(
        kernel=kernel.name,
        implementation=implementation.name,
        bytes_read=read,
        bytes_written=written,
        source=implementation.source,
        convention=implementation.convention,
    )
    if warm_up > SLOW_CALL_SECONDS:
        benchmark.pedantic(call, rounds=SLOW_ROUNDS, iterations=1)
    else:
        benchmark(call)
    record(
        benchmark,
        {
            "kernel": kernel.name,
            "implementation": implementation.name,
            "kind": implementation.kind,
            "shape": list(shape),
            "tokens": batch.tokens,
            "dtype": dtype,
            "threads": threads,
            "sweep": "shapes",
            "bytes_read": read,
            "bytes_written": written,
        },
        copy=call if implementation.kind == engine.FLOOR else None,
    )
