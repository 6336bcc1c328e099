"""Time against tokens, 1e3 to 1e8 (``--max-tokens``), for our compiled kernels and the
memory floor; each row checks its output against ppo_fast's reference (the oracle where the batch
is small enough for it) before it is timed. The terminal summary fits the exponent k of
time ~ tokens^k (log-log least squares)."""

from __future__ import annotations

import pytest
from conftest import record

from ppo_fast import bench as engine

DTYPE = "float32"


def test_scaling(benchmark, scaling_case, batches, threads_restored):
    kernel, implementation, tokens, threads = scaling_case
    reason = engine.why_not(implementation, tokens)
    if reason is not None:
        pytest.skip(reason)
    batch = batches.get(engine.scaling_shape(tokens), DTYPE)
    engine.set_threads(threads)
    call = implementation.prepare(batch, threads)
    result = call()  # warm-up (compiles), and the output checked
    mismatch = engine.check(kernel, implementation, result, batch, batches.reference(kernel, batch))
    assert mismatch is None, f"{implementation.name} computes something else: {mismatch}"
    del result
    read, written = kernel.traffic(batch)
    benchmark.group = f"scaling {kernel.name} {DTYPE} {threads}T"
    benchmark.extra_info.update(tokens=tokens, bytes_read=read, bytes_written=written)
    benchmark(call)
    record(
        benchmark,
        {
            "kernel": kernel.name,
            "implementation": implementation.name,
            "kind": implementation.kind,
            "shape": list(batch.shape),
            "tokens": batch.tokens,
            "dtype": DTYPE,
            "threads": threads,
            "sweep": "scaling",
            "bytes_read": read,
            "bytes_written": written,
        },
        copy=call if implementation.kind == engine.FLOOR else None,
    )
