"""Backend registry and selection, and the call of a kernel by its table entry.

A backend is a module exposing one function per kernel of the table, ``_spec.KERNELS``, with the
table's arguments (tests/test_kernels.py checks it for every backend that loads). ``python`` is
the oracle; ``numba`` and ``cython`` are compiled.
``auto`` picks cython, then numba, then python. Cython first: it is compiled at install, so its
first call costs under 0.1 ms, where numba compiles each kernel at its first call (0.1-0.9 s each
in a fresh process, seconds when several processes share a cold cache), which every short-lived
process and every spawned worker would pay; and it is as fast as numba or faster on every kernel
but the float32 policy loss (README, benchmarks). A backend that is asked for by name and cannot
load raises with the reason; it never silently falls back.

Selection, in order of precedence: the per-call ``backend=`` argument, ``set_backend``, the
environment variable ``PPO_FAST_BACKEND``, then ``auto``. Each call reads the variable (its raw
value, in a dict lookup) and resolves a combination of the three once (``_cached_resolve``).

The stages run a kernel by name (``run``), or, in their common case, through the backend's
common-case entry for it (``common``; ``Kernel.common_arguments``), which costs a fraction of the
general way's microseconds on a small batch.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from types import ModuleType

import numpy as np

from . import _rows, _threads
from ._spec import FLAGS, KERNELS, SCALES, TOKEN, Kernel

BACKENDS = ("cython", "numba", "python")  # the order auto tries them
_MODULES = {
    "python": "ppo_fast._reference",
    "numba": "ppo_fast._numba_kernels",
    "cython": "ppo_fast._cython_backend",
}

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}
_failed: dict[str, str] = {}
_selected: str | None = None
_environment_backend = _threads._environ_reader("PPO_FAST_BACKEND")
# The module each (backend=, set_backend, raw PPO_FAST_BACKEND) resolves to: the selection is
# worked out once per combination, not on every call (a failure is never cached: it repeats).
_resolved: dict[tuple[str | None, str | None, object], ModuleType] = {}


class BackendUnavailableError(ImportError):
    """A backend was asked for by name and cannot be loaded here."""


def _load(name: str) -> ModuleType:
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _failed:
            raise BackendUnavailableError(f"the {name} backend cannot be used: {_failed[name]}")
        try:
            module = importlib.import_module(_MODULES[name])
        except Exception as error:  # any failure to load makes the backend unavailable
            _failed[name] = f"{type(error).__name__}: {error}"
            raise BackendUnavailableError(
                f"the {name} backend cannot be used: {_failed[name]}"
            ) from error
        _loaded[name] = module
        return module


def _check_name(name: str, source: str) -> str:
    if name not in (*BACKENDS, "auto"):
        raise ValueError(
            f"{source} must be one of 'auto', {', '.join(map(repr, BACKENDS))}; got {name!r}"
        )
    return name


def available_backends() -> list[str]:
    """The backends that load on this machine, in the order ``auto`` tries them."""
    names = []
    for name in BACKENDS:
        try:
            _load(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names


def set_backend(name: str | None) -> None:
    """Select the default backend for this process ('auto', 'numba', 'cython', 'python').

    ``None`` goes back to ``PPO_FAST_BACKEND`` or ``auto``. A named backend is loaded now, so
    that a backend which cannot load fails here rather than at the first call.
    """
    global _selected
    if name is not None:
        _check_name(name, "backend")
        if name != "auto":
            _load(name)
    _selected = name


def _requested(name: str | None) -> str:
    if name is not None:
        return _check_name(name, "backend")
    if _selected is not None:
        return _selected
    env = os.environ.get("PPO_FAST_BACKEND", "").strip()
    return _check_name(env, "PPO_FAST_BACKEND") if env else "auto"


def get_backend(name: str | None = None) -> str:
    """The name of the backend a call with ``backend=name`` would use."""
    requested = _requested(name)
    if requested != "auto":
        _load(requested)
        return requested
    for candidate in BACKENDS:
        try:
            _load(candidate)
        except BackendUnavailableError:
            continue
        return candidate
    raise AssertionError("unreachable: the python backend always loads")


def resolve(name: str | None = None) -> ModuleType:
    """The backend module a call with ``backend=name`` uses."""
    return _load(get_backend(name))


def _cached_resolve(name: str | None) -> ModuleType:
    """``resolve(name)``, once per combination of the settings it depends on."""
    key = (name, _selected, _environment_backend())
    module = _resolved.get(key)
    if module is None:
        module = resolve(name)
        if len(_resolved) > 64:  # bounded: a program that keeps changing the variable
            _resolved.clear()
        _resolved[key] = module
    return module


def table_kernel(
    name: str,
    backend: str | None,
    n_threads: int = 0,
    dtype: np.dtype | None = None,
    masked: bool = False,
    code: int | None = None,
) -> Callable:
    """Kernel ``name`` of the table on ``backend``, to be called with every argument in the
    table's order (``Kernel.arguments``), ``n_threads`` last: for a stage's fast path, which
    makes them itself (``run`` makes them from names).

    As with ``common``'s entries, a fast path that calls on one thread (``n_threads`` 1) and
    names the token ``dtype`` and whether it passes a mask (``masked``), which then fix the type
    of every argument it passes, gets a backend's one-thread build with the table's arguments
    (numba's ``serial_table_kernel``), through its exact entry after the first call
    (``_learned``): numba's table kernel is a Python callable around its builds that types every
    argument on each call (KL-Cov's selection at 8 x 128: about 1.5 us of a 6.8 us call). A
    kernel built per estimator (the table's ``specialise``) is asked for with the estimator's
    ``code`` that every call will pass: numba's one-thread build is that estimator's."""
    if n_threads != 1 or dtype is None:
        return getattr(_cached_resolve(backend), name)
    key = (name, backend, _selected, _environment_backend(), dtype, masked, code)
    function = _serial_tables.get(key)
    if function is None:
        module = _cached_resolve(backend)
        function = getattr(module, name)
        serial = getattr(module, "serial_table_kernel", None)
        serial = serial and (serial(name) if code is None else serial(name, code))
        exact_entry = getattr(module, "exact_entry", None)
        if serial is not None and exact_entry is not None:
            function = _learned(serial, exact_entry, _serial_tables, key)
        if len(_serial_tables) > 256:  # bounded, as _resolved
            _serial_tables.clear()
        _serial_tables[key] = function
    return function


def run(name: str, backend: str | None, **arguments) -> None:
    """Run kernel ``name`` of the table on ``backend``, its arguments given by name.

    Every argument but ``n_threads`` is required (``Kernel.bind`` raises on a missing one, so a
    stage cannot pass them out of order); the threads follow the thread policy for the batch.
    """
    kernel = KERNELS[name]
    n_positions = arguments[kernel.inputs[0].name].size
    units = kernel.parallel_units(arguments["starts"].shape[0], n_positions)
    arguments["n_threads"] = _threads.threads_for(units, n_positions)
    getattr(_cached_resolve(backend), name)(*kernel.bind(arguments))


def _numpy_totals(row_outputs: np.ndarray) -> list[float]:
    """The totals of a common case's (k, B) row outputs, as the general way sums them
    (``loss._totals``, after its weighting of the first by the row scales)."""
    return row_outputs.sum(axis=1).tolist()


def common_scales(
    agg: int, normaliser: float, flat_mask: np.ndarray | None, n_rows: int, width: int
) -> tuple[float, np.ndarray]:
    """(valid positions, row scales) of a loss's common case with aggregation mode ``agg`` (a
    code of ``_spec.AGGREGATIONS``) and ``normaliser`` (num_tokens, num_seqs or loss_scale, > 0;
    0.0: none, the batch's own count) over (B, T) = (``n_rows``, ``width``) padded rows: what
    ``loss._row_scales`` gives, counted as it counts (mask != 0).
    Twins: src/totals.h ppo_common_scales, ppo_fast/_numba_core.py _common_scales."""
    if agg == 0 or agg == 3:  # the batch's count alone
        valid = float(n_rows * width if flat_mask is None else np.count_nonzero(flat_mask))
        # token-mean; seq-mean-token-sum-norm: T is the loss scale
        fallback = valid if agg == 0 else float(width)
        return valid, _batch_scales(n_rows, normaliser if normaliser > 0 else fallback)
    if flat_mask is None:
        counts = np.full(n_rows, width, dtype=np.int64)
    else:
        counts = _rows.count_by_row(flat_mask.reshape(n_rows, width))
    return _row_count_scales(agg, normaliser, counts)


def packed_scales(
    agg: int, normaliser: float, spans: np.ndarray, n_positions: int
) -> tuple[float, np.ndarray]:
    """``common_scales`` for packed rows of ``n_positions`` tokens in all (no mask: a row's
    valid positions are its span, and every token is valid). Packed rows have no T:
    seq-mean-token-sum-norm comes here only with its loss_scale (the fast paths send a call
    without one the general way, which says so)."""
    if agg == 0 or agg == 3:
        valid = float(n_positions)
        return valid, _batch_scales(spans.shape[0], normaliser if normaliser > 0 else valid)
    return _row_count_scales(agg, normaliser, spans)


def _batch_scales(n_rows: int, divisor: float) -> np.ndarray:
    return np.full(n_rows, 1.0 / divisor if divisor else 0.0)


def _row_count_scales(agg: int, normaliser: float, counts: np.ndarray) -> tuple[float, np.ndarray]:
    """``common_scales`` of the modes over each row's valid positions (int64 ``counts``)."""
    valid = float(counts.sum())
    divisor = normaliser if normaliser > 0 else float(np.count_nonzero(counts))
    if not divisor:
        return valid, np.zeros(counts.shape[0])
    if agg == 2:  # seq-mean-token-sum
        return valid, np.full(counts.shape[0], 1.0 / divisor)
    with np.errstate(divide="ignore"):  # seq-mean-token-mean
        return valid, np.where(counts > 0, 1.0 / (divisor * counts), 0.0)


def _common_from_kernel(
    kernel: Kernel,
    function: Callable,
    totals: Callable,
    serial: Callable | None = None,
    scales: Callable = common_scales,
    packed: bool = False,
) -> Callable:
    """A backend's entry for the common case of ``kernel`` (``Kernel.common_arguments``) made from
    its table ``function``, for a backend without its own (the oracle; numba with its on-disk
    cache on, or on several threads where it has no ``parallel_common``): the flat arrays,
    the padded layout, each row input repeated over the rows and the row outputs, as the general
    way makes them, the row scales by ``scales`` (``common_scales``, or the backend's compiled
    twin: numba's), and the row outputs totalled by ``totals`` (numba's ``row_totals``, which
    sums as NumPy does, or NumPy's own). A call on one thread goes to ``serial`` where the
    backend has one (numba's ``serial_common``: the same steps, compiled).

    Its source is written from the table, one line a step, and compiled once per kernel and
    backend: a loop over the table's arguments on every call cost 1.5 to 2 times these straight
    lines (gae at 8 x 128: about 2.4 us against 1.2 to 1.6, around numba's 2 us kernel call).

    ``packed``: the entry for packed rows (1-D token arrays): ``mask`` is then their (starts,
    spans) (``_validate.common_packed``), every position of a row is valid, and ``scales`` is
    ``packed_scales``.
    """
    first = kernel.inputs[0].name
    lines = [
        f"def {kernel.name}_common({', '.join(kernel.common_arguments)}):",
        f"    n_rows, width = {first}.shape",
        "    starts, spans = padded_layout(n_rows, width)",
        "    flat_mask = EMPTY_MASK if mask is None else mask.ravel().view(UINT8)",
    ]
    if packed:
        lines[1:] = [
            "    starts, spans = mask",
            "    n_rows = starts.shape[0]",
            "    flat_mask = EMPTY_MASK",
        ]
    if serial is not None:
        arguments = ", ".join(kernel.common_arguments)
        lines[1:1] = ["    if n_threads == 1:", f"        return serial({arguments})"]
    if kernel.aggregates:
        lines.append(
            f"    valid, scales = common_scales(agg, normaliser, spans, {first}.shape[0])"
            if packed
            else "    valid, scales = common_scales(agg, normaliser, None if mask is None else "
            "flat_mask, n_rows, width)"
        )
    row_inputs = [
        f"scales.astype({first}.dtype)"
        if a.name == SCALES
        else f"constant_rows({a.name}, n_rows, "
        f"{first + '.dtype' if a.dtype == TOKEN else 'FLOAT64'})"
        for a in kernel.row_inputs
    ]
    n_row_outputs = len(kernel.row_outputs)
    if n_row_outputs:
        lines.append(f"    row_outputs = empty(({n_row_outputs}, n_rows))")
    arguments = [
        *(
            f"{a.name}.ravel()" + (".view(UINT8)" if a.dtype == FLAGS else "")
            for a in kernel.inputs
        ),
        "starts, spans, spans, flat_mask",
        *row_inputs,
        *(s.name for s in kernel.scalars),
        *(f"{a.name}.ravel()" for a in kernel.outputs),
        *(["*row_outputs"] if n_row_outputs else []),
        "n_threads",
    ]
    lines.append(f"    function({', '.join(arguments)})")
    if kernel.aggregates:  # the general way's row_outputs[0] *= scales
        lines += ["    row_outputs[0] *= scales", "    return (valid, *totals(row_outputs))"]
    elif n_row_outputs:
        lines.append("    return tuple(totals(row_outputs))")
    namespace = {
        "function": function,
        "totals": totals,
        "padded_layout": _rows.padded_layout,
        "constant_rows": _rows.constant_rows,
        "EMPTY_MASK": _rows.EMPTY_MASK,
        "UINT8": np.dtype(np.uint8),
        "FLOAT64": np.dtype(np.float64),
        "common_scales": scales,
        "empty": np.empty,
        "serial": serial,
    }
    exec("\n".join(lines), namespace)
    return namespace[f"{kernel.name}_common"]


# The common-case entry each (kernel, backend=, set_backend, raw PPO_FAST_BACKEND, one thread,
# token dtype, mask or not, packed or not) resolves to (as ``_resolved``; a failure is never
# cached).
_commons: dict[tuple[str, str | None, str | None, object, bool, object, bool, bool], Callable] = {}
# table_kernel's one-thread builds, by (name, backend, _selected, the variable, dtype, masked,
# the estimator's code or None).
_serial_tables: dict[
    tuple[str, str | None, str | None, object, object, bool, int | None], Callable
] = {}


def common(
    name: str,
    backend: str | None,
    n_threads: int = 0,
    dtype: np.dtype | None = None,
    masked: bool = False,
    packed: bool = False,
) -> Callable:
    """The entry of ``backend`` for the common case of kernel ``name`` (a kernel with
    ``common``), with ``Kernel.common_arguments``: the backend's own ``<name>_common`` (the
    Cython kernels', which count the valid positions and total the row outputs in C), else one
    made from its table kernel (``_common_from_kernel``). The stages' fast paths call it with
    the threads of the thread policy (``_threads.threads_for``), and name them here: for one
    thread, a backend's one-thread entry (numba's ``serial_common``) is the entry itself, not
    called from a Python function that tests the threads (0.15 us of a 4-6 us call at 8 x 128);
    for more, its entry of several threads where it has one (numba's ``parallel_common``: the
    same steps compiled around its parallel build, where the entry made from the table kernel
    dispatched that build from Python, about 10 us of a 0.1 ms call at 256 x 1024).

    A fast path also names the token ``dtype`` and whether it passes a mask (``masked``): with
    the checks of ``_validate.common_case`` and ``common_outputs`` (exact NumPy arrays, 2-D,
    C-contiguous, aligned and writeable) and its scalars made as the table's types (a token
    scalar by ``dtype.type``, a float by ``float``, a small int code), those two fix the type of
    every argument it passes. Then a backend's ``exact_entry`` (numba's) may give, after the
    first call, an entry that skips typing the arguments (``_learned``).

    ``packed``: the entry for packed rows, whose ``mask`` argument is their (starts, spans)
    (``_validate.common_packed``): the backend's own ``<name>_common`` where it takes them (the
    Cython kernels'), else, as for padded rows, a one-thread entry (numba's ``serial_packed``)
    or one made from its table kernel. The compiled ones run each row whole, as the padded
    entries do: gae's rows long enough for chunks go the general way (the stage decides).
    """
    one_thread = n_threads == 1
    key = (name, backend, _selected, _environment_backend(), one_thread, dtype, masked, packed)
    function = _commons.get(key)
    if function is None:
        module = _cached_resolve(backend)
        totals = getattr(module, "row_totals", _numpy_totals)
        function = getattr(module, f"{name}_common", None)  # the Cython one takes both layouts
        if function is None:
            serial = getattr(module, "serial_packed" if packed else "serial_common", None)
            serial = serial and serial(name)
            parallel = getattr(module, "parallel_common", None)
            parallel = not one_thread and parallel and parallel(name, packed)
            if one_thread and serial is not None:
                function = serial
                exact_entry = getattr(module, "exact_entry", None)
                if dtype is not None and exact_entry is not None:
                    function = _learned(serial, exact_entry, _commons, key)
            elif parallel:
                function = parallel
            else:
                function = _common_from_kernel(
                    KERNELS[name],
                    getattr(module, name),
                    totals,
                    serial,
                    packed_scales if packed else getattr(module, "common_scales", common_scales),
                    packed=packed,
                )
        if len(_commons) > 256:  # bounded, as _resolved
            _commons.clear()
        _commons[key] = function
    return function


def packed_common(
    name: str,
    backend: str | None,
    dtype: np.dtype,
    layout: tuple[np.ndarray, np.ndarray],
    n_positions: int,
) -> tuple[Callable, int]:
    """The entry of ``backend`` for packed rows (``common(..., packed=True)``) of kernel
    ``name``, for a fast path's ``layout`` (the rows' starts and spans) over ``n_positions``
    tokens, and the threads ``run`` would give the general way's call."""
    units = KERNELS[name].parallel_units(len(layout[0]), n_positions)
    n_threads = _threads.threads_for(units, n_positions)
    return common(name, backend, n_threads, dtype, False, True), n_threads


def _learned(entry: Callable, exact_entry: Callable, cache: dict, key: tuple) -> Callable:
    """``entry``, which on its first call also puts in its place in ``cache`` (``_commons`` or
    ``_serial_tables``, under ``key``, which fixes its arguments' types: ``common``,
    ``table_kernel``) what ``exact_entry(entry, arguments)`` gives for those arguments: numba's
    compiled wrapper of the overload the call ran, which unboxes them by their known types
    instead of typing each (0.4 us of a 5-6 us call at 8 x 128), or None (``entry`` stays).
    tests/test_fast_path.py checks that the key fixes the types."""

    def first_call(*arguments):
        result = entry(*arguments)
        cache[key] = exact_entry(entry, arguments) or entry
        return result

    return first_call
