"""Whether a row of the comparison table can run here, and whether its output agrees with
ours: ``unavailable`` and ``why_not`` (a backend that does not load, a package that is not
installed or does not import, a batch too large for the oracle), and ``compare`` (every peer's
output against ours, before it is timed). The table itself is ``registry.KERNELS``."""

from __future__ import annotations

import functools
import importlib

import numpy as np

from .. import _backend
from .batch import Batch
from .registry import Implementation, Kernel

BENCH_EXTRA = "pip install 'ppo_fast[bench]'"

# Relative tolerance of a peer against ppo_fast, on the scale of the output (as in tests/).
CHECK_RTOL = {np.dtype(np.float32): 2e-4, np.dtype(np.float64): 1e-9}


@functools.cache
def unavailable(name: str, requires: tuple[str, ...], backend: str | None) -> str | None:
    """Why an implementation cannot run here, or None."""
    if backend is not None:
        try:
            _backend.get_backend(backend)
        except _backend.BackendUnavailableError as error:
            return str(error)
        return None
    for module in requires:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            return f"{error.name} is not installed ({BENCH_EXTRA})"
        except Exception as error:  # a package that installs but does not import
            return f"{module} does not import: {type(error).__name__}: {error}"
    return None


def why_not(implementation: Implementation, tokens: int | None = None) -> str | None:
    """Why ``implementation`` cannot run here, or on a batch of ``tokens`` tokens; or None."""
    reason = unavailable(implementation.name, implementation.requires, implementation.backend)
    if reason is None and tokens is not None and implementation.max_tokens is not None:
        if tokens > implementation.max_tokens:
            reason = f"runs on batches of up to {implementation.max_tokens} tokens only"
    return reason


def compare(
    kernel: Kernel,
    implementation: Implementation,
    outputs: dict[str, np.ndarray],
    reference: dict[str, np.ndarray],
    batch: Batch,
) -> str | None:
    """None when ``outputs`` equal ``reference`` within the tolerance, else what differs."""
    dtype = np.dtype(implementation.check_dtype or batch.dtype)
    rtol = CHECK_RTOL[dtype]
    for name in implementation.compare or kernel.compare:
        expected = np.asarray(reference[name], dtype=np.float64)
        actual = np.asarray(outputs[name], dtype=np.float64)
        if actual.shape != expected.shape:
            return f"{name}: shape {actual.shape}, expected {expected.shape}"
        if kernel.valid_only and expected.shape == batch.shape:
            expected, actual = expected[batch.mask], actual[batch.mask]
        scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
        error = np.abs(actual - expected)
        bad = ~(error <= rtol * scale + rtol * np.abs(expected))
        if np.any(bad):
            where = int(np.flatnonzero(bad)[0])
            return (
                f"{name} differs at {int(bad.sum())} of {bad.size} positions (first: "
                f"{actual.flat[where]!r} against {expected.flat[where]!r}, rtol {rtol:g})"
            )
    return None
