"""Probes in fresh processes: the extra peak memory of one call, import times, first calls.

tracemalloc does not see numba's or torch's allocations, and a first call is first only once
per process: each probe runs ``python -c`` in a new interpreter and reads back one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from .._result_arrays import set_result_cache
from .._threads import MIN_POSITIONS_PER_THREAD
from .batch import Batch
from .checks import unavailable, why_not
from .registry import KERNELS, PEER, TABLE_KERNELS, table_entry
from .timing import Plan, Progress, check, reference_outputs, set_threads

_PROBE = """
import json, sys
from ppo_fast.bench import probes
print("PPO_FAST_PROBE " + json.dumps(probes.{function}(*json.loads(sys.argv[1]))))
"""

# Imports are timed in an interpreter that has imported nothing else (not even ppo_fast).
_IMPORT_PROBE = """
import json, sys, time
start = time.perf_counter()
__import__(sys.argv[1])
print("PPO_FAST_PROBE " + json.dumps({"seconds": time.perf_counter() - start}))
"""

# glibc adapts its mmap threshold upward as large blocks are freed, and then keeps freed blocks
# resident: with a fixed threshold every large buffer is mapped on allocation and unmapped on
# release, so the resident set follows what is alive.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def run_probe(function: str, args: list, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``probes.function(*args)`` in a fresh interpreter and return its JSON answer."""
    return _answer(
        [sys.executable, "-c", _PROBE.format(function=function), json.dumps(args)], function, env
    )


def import_seconds(module: str) -> float:
    """Seconds to import ``module`` in a fresh interpreter that imports nothing before it."""
    return _answer([sys.executable, "-c", _IMPORT_PROBE, module], f"import {module}")["seconds"]


def _answer(command: list[str], what: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )
    for line in out.stdout.splitlines():
        if line.startswith("PPO_FAST_PROBE "):
            return json.loads(line.removeprefix("PPO_FAST_PROBE "))
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"the {what} probe failed: {' | '.join(tail)}")


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field_name}")


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where Linux does not let."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def memory_probe(kernel_name: str, name: str, shape: list[int], dtype: str) -> dict[str, Any]:
    """Extra peak memory of one call, measured in this (fresh) process.

    The inputs are built and put in the implementation's layout, and one warm-up call compiles
    (numba, torch.compile) and loads what it needs; a peer's result is checked against ours, then
    freed. Then the peak resident
    set size (VmHWM) is reset through /proc/self/clear_refs and read after one more call: the
    extra peak is that peak over the resident size before the call. Run it with ``MALLOC_ENV``
    so that freed buffers leave the resident set. Where the peak cannot be reset, the increase
    of getrusage's ru_maxrss stands in (a lower bound: an earlier, higher peak hides the call's).
    """
    import resource

    kernel = KERNELS[kernel_name]
    implementation = kernel.implementation(name)
    reason = why_not(implementation, shape[0] * shape[1])
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    set_threads(1)
    # ppo_fast's results on fresh memory: with reuse, the warm-up call's freed result would
    # already be resident, and the call's own memory would not count
    set_result_cache(0)
    batch = Batch(shape, dtype)
    # a peer's output is checked against ours first, as every timed row is
    reference = reference_outputs(kernel, batch) if implementation.kind == PEER else None
    call = implementation.prepare(batch, 1)
    result = call()
    mismatch = check(kernel, implementation, result, batch, reference)
    if mismatch is not None:
        return {"status": "mismatch", "reason": mismatch}
    del result, reference
    gc.collect()
    if _reset_peak():
        method = "peak RSS (VmHWM, reset through /proc/self/clear_refs) over RSS before the call"
        before = _status_kib("VmRSS")
        result = call()
        peak = _status_kib("VmHWM")
    else:
        method = "increase of getrusage ru_maxrss (a lower bound)"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = call()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del result
    return {"status": "ok", "extra_peak_bytes": max(0, peak - before) * 1024, "method": method}


def measure_memory(plan: Plan, shape: tuple[int, int], progress: Progress | None = None):
    """One fresh process per (kernel, implementation) at ``shape``, the plan's first dtype."""
    rows = []
    for kernel_name in plan.kernels:
        kernel = KERNELS[kernel_name]
        for implementation in kernel.implementations:
            if plan.implementations is not None and implementation.name not in plan.implementations:
                continue
            batch = Batch(shape, plan.dtypes[0])
            read, written = kernel.traffic(batch)
            row = {
                "kernel": kernel.name,
                "implementation": implementation.name,
                "kind": implementation.kind,
                "shape": list(shape),
                "dtype": batch.dtype.name,
                "bytes_read": read,
                "bytes_written": written,
            }
            reason = why_not(implementation, batch.tokens)
            if reason is not None:
                row.update(status="skipped", reason=reason)
            else:
                args = [kernel.name, implementation.name, list(shape), batch.dtype.name]
                try:
                    row.update(run_probe("memory_probe", args, MALLOC_ENV))
                except RuntimeError as error:
                    row.update(status="error", reason=str(error))
            rows.append(row)
            if progress is not None:
                progress.update(f"memory {kernel.name} {implementation.name}")
    return rows


# The calls whose first-call time is measured: the entry of each kernel of the kernel table that
# exercises the fewest others, on an 8x128 batch, in the table's order (whiten reuses the moments
# kernel: it comes after masked_moments, which compiles it).
FIRST_CALL_KERNELS = tuple(dict.fromkeys(table_entry(name).name for name in TABLE_KERNELS))


def first_call_probe(backend: str, n_threads: int = 1, dtype: str = "float32") -> dict[str, Any]:
    """Seconds of the first and the second call of each stage in this (fresh) process: on 8x128
    on one thread, or on ``n_threads`` rows of ``MIN_POSITIONS_PER_THREAD`` positions each
    on that many threads (the smallest batch that takes the parallel build)."""
    start = time.perf_counter()
    import ppo_fast

    ppo_fast.get_backend(backend)
    load = time.perf_counter() - start
    set_threads(n_threads)
    shape = (8, 128) if n_threads == 1 else (n_threads, MIN_POSITIONS_PER_THREAD)
    batch = Batch(shape, dtype)
    calls = {}
    for kernel_name in FIRST_CALL_KERNELS:
        call = KERNELS[kernel_name].implementation(f"ppo_fast[{backend}]").prepare(batch, n_threads)
        start = time.perf_counter()
        call()
        first = time.perf_counter() - start
        start = time.perf_counter()
        call()
        calls[kernel_name] = {"first": first, "second": time.perf_counter() - start}
    return {"import_and_load": load, "calls": calls}


# (what, module, the backend it loads or None, the modules it needs)
IMPORTS = (
    ("ppo_fast", "ppo_fast", None, ()),
    ("ppo_fast numba backend", "ppo_fast._numba_kernels", "numba", ()),
    ("ppo_fast cython backend", "ppo_fast._cython_backend", "cython", ()),
    ("torch", "torch", None, ("torch",)),
    ("scipy.signal", "scipy.signal", None, ("scipy.signal",)),
    (
        "torchrl",
        "torchrl.objectives.value.functional",
        None,
        ("torchrl.objectives.value.functional",),
    ),
)


def import_unavailable(what: str, backend: str | None, requires: tuple[str, ...]) -> str | None:
    if backend is not None:
        return why_not(KERNELS["gae"].implementation(f"ppo_fast[{backend}]"))
    return unavailable(what, requires, None)


def first_call_modes(cache_dir: str) -> list[tuple[str, str, dict[str, str], int]]:
    """(backend, mode, environment, threads) of the first-call probes, in the order they must
    run: numba with its cache off, then cold (filling ``cache_dir``), then warm (reading it);
    numba with its cache off on two threads (the serial build and the parallel one); cython."""
    cached = {"PPO_FAST_NUMBA_CACHE": "1", "NUMBA_CACHE_DIR": cache_dir}
    return [
        ("numba", "cache off", {"PPO_FAST_NUMBA_CACHE": ""}, 1),
        ("numba", "cache cold", cached, 1),
        ("numba", "cache warm", cached, 1),
        ("numba", "cache off, 2 threads", {"PPO_FAST_NUMBA_CACHE": ""}, 2),
        ("cython", "", {}, 1),
    ]


def measure_startup(progress: Progress | None = None) -> dict[str, Any]:
    """Import times, and first-call times of numba (cache off, cache cold, cache warm), cython."""
    imports = []
    for what, module, backend, requires in IMPORTS:
        row = {"what": what, "module": module}
        reason = import_unavailable(what, backend, requires)
        if reason is not None:
            row.update(status="skipped", reason=reason)
        else:
            try:
                row.update(status="ok", seconds=import_seconds(module))
            except RuntimeError as error:
                row.update(status="error", reason=str(error))
        imports.append(row)
        if progress is not None:
            progress.update(f"import {what}")
    first_calls = []
    with tempfile.TemporaryDirectory(prefix="ppo_fast-numba-cache-") as cache_dir:
        for backend, mode, env, n_threads in first_call_modes(cache_dir):
            row = {"backend": backend, "mode": mode, "threads": n_threads}
            reason = why_not(KERNELS["gae"].implementation(f"ppo_fast[{backend}]"))
            if reason is not None:
                row.update(status="skipped", reason=reason)
            else:
                try:
                    probe = run_probe("first_call_probe", [backend, n_threads], env)
                    row.update(status="ok", **probe)
                except RuntimeError as error:
                    row.update(status="error", reason=str(error))
            first_calls.append(row)
            if progress is not None:
                progress.update(f"first call {backend} {mode}")
    return {"imports": imports, "first_calls": first_calls}
