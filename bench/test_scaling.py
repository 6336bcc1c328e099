"""Time against tokens, 1e3 to 1e8 (``--max-tokens``), for our compiled kernels and the
roofline; the terminal summary fits the exponent k of time ~ tokens^k (log-log least squares)."""

from __future__ import annotations

import pytest
from conftest import record

from ppo_fast import benchmark as engine

DTYPE = "float32"


def test_scaling(benchmark, scaling_case, batches, threads_restored):
    kernel, implementation, tokens, threads = scaling_case
    reason = engine.why_not(implementation)
    if reason is not None:
        pytest.skip(reason)
    batch = batches.get(engine.scaling_shape(tokens), DTYPE)
    engine.set_threads(threads)
    call = implementation.prepare(batch, threads)
    call()  # warm-up (compiles)
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
    )
