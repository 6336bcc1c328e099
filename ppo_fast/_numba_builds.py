"""The numba backend's kernel builders: each kernel of the table compiled serial, and in
parallel as a loop over ranges of rows that calls the serial build's compiled code
(``_Kernel``, ``_Specialised``; the conventions: ``_numba_core``'s docstring)."""

from __future__ import annotations

import itertools
import threading

import numba
import numpy as np
from llvmlite import binding as llvm
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba_core import _CACHE, _common_scales_into, _packed_scales_into, _pairwise_sum
from ._numba_memory import _heap_bytes, _heap_free, _stack_array
from ._spec import FLAGS, FLOAT64, GROUPS, SCALES, Kernel

_parallel_lock = threading.Lock()


@numba.njit(nogil=True, cache=_CACHE)
def _parts(weights, n_parts):
    """Bounds of at most ``n_parts`` consecutive ranges of units (rows, or groups) of about equal
    total weight (a unit's positions, plus one so that empty units count): ``bounds[p]`` to
    ``bounds[p + 1]`` is part p. The split only shares work: each unit is computed on its own,
    so results do not depend on it."""
    n_units = weights.shape[0]
    n_parts = max(1, min(n_parts, n_units))
    total = 0.0
    for u in range(n_units):
        total += weights[u] + 1.0
    bounds = np.empty(n_parts + 1, dtype=np.int64)
    bounds[0] = 0
    part = 1
    so_far = 0.0
    for u in range(n_units):
        so_far += weights[u] + 1.0
        while part < n_parts and so_far >= total * part / n_parts:
            bounds[part] = u + 1
            part += 1
    while part <= n_parts:
        bounds[part] = n_units
        part += 1
    return bounds


@numba.njit(nogil=True, cache=_CACHE)
def _group_weights(spans, group_rows, group_starts):
    """Each group's positions (its rows' spans), the weights of its range (``_parts``)."""
    weights = np.zeros(group_starts.shape[0] - 1, dtype=np.int64)
    for g in range(weights.shape[0]):
        for j in range(group_starts[g], group_starts[g + 1]):
            weights[g] += spans[group_rows[j]]
    return weights


_symbols = itertools.count()


def _compiled_caller(serial, arguments):
    """An intrinsic ``call(*arguments)`` calling the build ``serial`` compiled for their types,
    through its address.

    A plain call of one jitted function from another links the callee's code into the caller's
    module, and LLVM then optimizes and generates machine code for all of it again (for the
    clipped surrogate, seconds: as long as the serial build itself). Called by address, the
    serial build is compiled once, and its code, the one a serial call runs, is the code every
    thread runs. The address is given to LLVM as a symbol of the process (``add_symbol``, as
    numba does for its own helpers), under a name of its own."""

    symbols = {}  # by argument types: the symbol of the serial build compiled for them

    def typer(*types_):
        serial.compile(types_)  # the overload is compiled and held by the dispatcher
        result = serial.overloads[types_]
        if types_ not in symbols:
            address = result.library.get_pointer_to_function(result.fndesc.llvm_func_name)
            symbols[types_] = f"ppo_fast_serial_{next(_symbols)}"
            llvm.add_symbol(symbols[types_], address)
        symbol = symbols[types_]
        signature = result.signature

        def codegen(context, builder, sig, args):
            function_type = context.call_conv.get_function_type(
                signature.return_type, signature.args
            )
            function = cgutils.get_or_insert_function(builder.module, function_type, symbol)
            status, value = context.call_conv.call_function(
                builder, function, signature.return_type, signature.args, args
            )
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return value

        return signature, codegen

    names = ", ".join(arguments)
    namespace = {"typer": typer}
    exec(f"def call(typingctx, {names}):\n    return typer({names})", namespace)
    return intrinsic(namespace["call"])


def _parallel_build(serial, kernel: Kernel, row_chunks=None):
    """The parallel build of a row kernel, with the kernel's arguments and then the number of
    threads: a prange over that many ranges of rows (of groups, for the "groups" layout), each
    run by the serial build on its slice of the per-row arrays (the layout's, the row inputs and
    the row outputs; the token arrays are indexed through ``starts``, so they pass whole).

    Every row is computed by the serial build's own code (``_compiled_caller``), so the bits
    equal a serial call's by construction, and the build compiles in about a second, where a
    ``parallel=True`` build of the kernel's source took 1.7-3x the serial build's compile time
    (numba's parfor passes run over the whole inlined body). A kernel with ``chunks`` returns
    its number of chunks (``row_chunks(span, length)``, a jitted function, counts a row's)
    without running when it has a long row, as its serial build does (_numba_gae._GAE)."""
    arguments = kernel.arguments[:-1]  # the backend's signature without n_threads
    if kernel.layout == GROUPS:
        sliced = {"group_starts": "group_starts[first : end + 1]"}
        weights = "_group_weights(spans, group_rows, group_starts)"
    else:
        per_row = (*kernel.layout_arguments, *(a.name for a in kernel.row_inputs))
        per_row += tuple(a.name for a in kernel.row_outputs)
        sliced = {name: f"{name}[first:end]" for name in per_row if name != "mask"}
        weights = "spans"
    call = ", ".join(sliced.get(name, name) for name in arguments)
    # numba's thread count (a thread-local of the calling thread) is set here, compiled: from
    # Python, numba.set_num_threads costs about 1 us a call
    lines = [
        f"def {kernel.name}_parallel({', '.join(arguments)}, n_threads):",
        "    numba.set_num_threads(n_threads)",
    ]
    if kernel.chunks is not None:
        lines += [
            "    n_chunks = np.uint64(0)",
            "    for b in range(starts.shape[0]):",
            "        n_chunks += row_chunks(np.uint64(spans[b]), np.uint64(lengths[b]))",
            "    if n_chunks != 0:",
            "        return n_chunks",
        ]
    lines += [
        f"    bounds = _parts({weights}, n_threads)",
        "    for p in prange(bounds.shape[0] - 1):",
        "        first = bounds[p]",
        "        end = bounds[p + 1]",
        f"        serial({call})",
    ]
    if kernel.chunks is not None:
        lines.append("    return n_chunks")
    namespace = {
        "__name__": __name__,  # the function's module: _numba_core._LLVMOptions tells by it
        "np": np,
        "numba": numba,
        "prange": numba.prange,
        "serial": _compiled_caller(serial, arguments),
        "row_chunks": row_chunks,
        "_parts": _parts,
        "_group_weights": _group_weights,
    }
    exec("\n".join(lines), namespace)  # the source is made from the kernel table
    function = namespace[f"{kernel.name}_parallel"]
    return numba.njit(nogil=True, parallel=True)(function)


# The common entries' scales (valid counts and each row's scale), called by address
# (``_compiled_caller``): compiled once, not linked into each entry and optimized with it again
# (a second entry of a loss, float32: 0.86-0.93 -> 0.65-0.71 s, LLVM 0.55-0.59 -> 0.32-0.36 s,
# AMD EPYC; the same 8 x 128 call time within its noise). The totals' pairwise sums stay linked.
_common_scales_caller = _compiled_caller(
    _common_scales_into, ("agg", "normaliser", "flat_mask", "has_mask", "width", "counts", "scales")
)
_packed_scales_caller = _compiled_caller(
    _packed_scales_into, ("agg", "normaliser", "spans", "scales")
)


# A batch of at most this many rows keeps its layout, scales and row outputs in the common
# entry's stack frame (``_common_entry_build``): 9 KiB at most.
_STACK_ROWS = 128


def _common_entry_build(serial, kernel: Kernel, packed: bool = False, parallel=None):
    """numba's entry for the common case of ``kernel`` on one thread (``Kernel.common_arguments``,
    n_threads 1), or on several with ``parallel`` (below): what ``_backend._common_from_kernel``
    does around a serial call, compiled into one function that calls the serial build by
    address (``_compiled_caller``), so that a
    small call pays one dispatch of a few arguments instead of the table kernel's (gae at 8 x 128:
    2.8 us -> about 1 us; the Cython entries are C for the same reason). Same arrays, same serial
    code, same totals (``_pairwise_sum``, as ``_row_totals``): the same bits as the general way.
    ``_backend.common`` gives it to a stage that calls on one thread as it is, with no Python
    function around it.

    Like the C entries, it is compiled without numba's reference counting (``_nrt=False``):
    numba then takes each array argument as it is, instead of wrapping it in a counted record
    (a malloc, a free and two atomic instructions), and counts none of the views it makes. So it
    allocates no array through NRT: the rows' starts and spans, a loss's valid counts and
    scales, the row inputs and the row outputs are slices of one block of bytes, in the stack
    frame for up to _STACK_ROWS rows (``_stack_array``) and from malloc above that
    (``_heap_bytes``, given back before it returns). With NRT, its arguments and eight
    allocations were about 0.4 us of the clipped surrogate's 2 us entry at 8 x 128.

    ``packed``: the entry for packed rows (1-D token arrays), whose ``mask`` argument is their
    (starts, spans) (``_validate.common_packed``), every position valid, the scales
    ``_packed_scales_into``'s.

    ``parallel``: the kernel's parallel build (``_parallel_build``), for the entry of several
    threads: the same steps around a call of that build by address with the entry's n_threads,
    which share the rows among that many threads as the table kernel's parallel call does
    (``_locked`` guards it), where ``_backend._common_from_kernel`` made them in Python, with a
    dispatch of the parallel build that types its twenty-odd arguments (about 10 us of a 0.12 ms
    call at 256 x 1024, numba's two-thread losses 1.10-1.11x Cython's time)."""
    first = kernel.inputs[0].name
    arguments = kernel.common_arguments  # n_threads last: 1, but for the parallel entry
    floats = [a.name for a in kernel.row_inputs if a.name != SCALES]  # gae's gammas, ...
    if kernel.aggregates:
        floats.insert(0, "scales")
    floats += [a.name for a in kernel.row_outputs]
    n_ints = 3 if kernel.aggregates else 2  # starts, spans, a loss's valid counts
    # bytes a row: int64s, float64s, and a loss's scales in the token dtype (at most 8 bytes)
    row_bytes = 8 * (n_ints + len(floats)) + (8 if kernel.aggregates else 0)
    float_bytes = 8 * n_ints
    token_bytes = 8 * (n_ints + len(floats))
    threads = "serial" if parallel is None else "parallel"
    entry = f"{kernel.name}_{threads}_{'packed' if packed else 'common'}"
    lines = [
        f"def {entry}({', '.join(arguments)}):",
        f"    n_rows, width = {first}.shape",
        "    if n_rows <= STACK_ROWS:",
        f"        space = _stack_array(({row_bytes * _STACK_ROWS},), np.uint8)",
        "    else:",
        f"        space = _heap_bytes({row_bytes} * n_rows)",
        f"    ints = space[: {float_bytes} * n_rows].view(np.int64)",
        "    starts = ints[:n_rows]",
        "    spans = ints[n_rows : 2 * n_rows]",
        "    for b in range(n_rows):",
        "        starts[b] = b * width",
        "        spans[b] = width",
        "    if mask is None:",
        "        flat_mask = _stack_array((8,), np.uint8)[:0]",
        "    else:",
        "        flat_mask = mask.reshape(mask.size).view(np.uint8)",
    ]
    if packed:  # the rows' starts and spans given, and no mask
        lines[1:2] = ["    starts, spans = mask", "    n_rows = starts.shape[0]"]
        lines[8:] = ["    flat_mask = _stack_array((8,), np.uint8)[:0]"]
    if floats:
        lines.append(
            f"    floats = space[{float_bytes} * n_rows : {token_bytes} * n_rows].view(np.float64)"
        )
    for k, name in enumerate(floats):
        lines.append(f"    {name}_rows = floats[{k} * n_rows : {k + 1} * n_rows]")
    if kernel.aggregates:
        lines += [
            f"    tokens = space[{token_bytes} * n_rows :][: {first}.itemsize * n_rows].view("
            f"{first}.dtype)",
            "    valid = _packed_scales_into(agg, normaliser, spans, scales_rows)"
            if packed
            else "    valid = _common_scales_into(agg, normaliser, flat_mask, mask is not None, "
            "width, ints[2 * n_rows :], scales_rows)",
            # loops, not array assignments: numba's compiles a shape check that raises, which
            # took seconds of a first call
            "    for b in range(n_rows):",
            "        tokens[b] = scales_rows[b]",
        ]
    for a in kernel.row_inputs:
        if a.name != SCALES:
            assert a.dtype == FLOAT64, a  # a row input of the token dtype: only the scales
            lines += ["    for b in range(n_rows):", f"        {a.name}_rows[b] = {a.name}"]
    flat = [
        f"{a.name}.reshape({a.name}.size)" + (".view(np.uint8)" if a.dtype == FLAGS else "")
        for a in kernel.inputs
    ]
    call = [
        *flat,
        "starts, spans, spans, flat_mask",
        *("tokens" if a.name == SCALES else f"{a.name}_rows" for a in kernel.row_inputs),
        *(s.name for s in kernel.scalars),
        *(f"{a.name}.reshape({a.name}.size)" for a in kernel.outputs),
        *(f"{a.name}_rows" for a in kernel.row_outputs),
    ]
    if parallel is None:
        lines.append(f"    serial({', '.join(call)})")
    else:
        lines.append(f"    parallel({', '.join(call)}, n_threads)")
    # np.int64(0), not the literal 0: numba would compile _pairwise_sum and _block_sum for it too
    totals = ", ".join(
        f"0.0 + _pairwise_sum({a.name}_rows, np.int64(0), n_rows)" for a in kernel.row_outputs
    )
    if kernel.aggregates:  # the general way's row_outputs[0] *= scales
        lines += [
            "    for b in range(n_rows):",
            f"        {kernel.row_outputs[0].name}_rows[b] *= scales_rows[b]",
            f"    result = (valid, {totals})",
        ]
    elif kernel.row_outputs:
        lines.append(f"    result = ({totals},)")
    else:
        lines.append("    result = None")
    lines += ["    if n_rows > STACK_ROWS:", "        _heap_free(space)", "    return result"]
    namespace = {
        "__name__": __name__,  # as _parallel_build's
        "np": np,
        "serial": _compiled_caller(serial, kernel.arguments[:-1]),
        "parallel": parallel and _compiled_caller(parallel, kernel.arguments),
        "STACK_ROWS": _STACK_ROWS,
        "_common_scales_into": _common_scales_caller,
        "_packed_scales_into": _packed_scales_caller,
        "_heap_bytes": _heap_bytes,
        "_heap_free": _heap_free,
        "_pairwise_sum": _pairwise_sum,
        "_stack_array": _stack_array,
    }
    exec("\n".join(lines), namespace)  # the source is made from the kernel table
    function = namespace[entry]
    # The entry of several threads keeps numba's reference counting: the parallel build it
    # calls allocates (its ranges of rows), and compiled first from within an entry compiled
    # without (its first call), it was typed without too, which refuses that allocation.
    return numba.njit(nogil=True, _nrt=parallel is not None, error_model="numpy")(function)


def _locked(parallel_entry, serial_entry, arguments):
    """A common entry of several threads, of the common ``arguments`` (n_threads last):
    ``parallel_entry`` with numba's thread count capped at NUMBA_NUM_THREADS, under
    ``_parallel_lock`` as ``_Kernel.__call__`` runs the parallel build, else (one thread, or
    another call holds the lock) ``serial_entry``: the same bits. Its source names the
    arguments, as the entries' signatures do (tests/test_fast_path.py)."""
    names = ", ".join(arguments[:-1])
    lines = [
        f"def common({names}, n_threads):",
        "    threads = min(n_threads, maximum)",
        "    if threads > 1 and lock.acquire(blocking=False):",
        "        try:",
        f"            return parallel({names}, threads)",
        "        finally:",
        "            lock.release()",
        f"    return serial({names}, n_threads)",
    ]
    namespace = {
        "maximum": numba.config.NUMBA_NUM_THREADS,
        "lock": _parallel_lock,
        "parallel": parallel_entry,
        "serial": serial_entry,
    }
    exec("\n".join(lines), namespace)  # the source is made from the kernel table
    return namespace["common"]


class _Kernel:
    """A row kernel built serial and parallel, compiled on first use: the serial build from its
    source, the parallel build over ranges of rows calling the serial one (``_parallel_build``),
    or, without a table ``kernel`` (a kernel with passes of its own, as GAE's long rows), with
    ``parallel=True`` from its source, whose prange loops then share the work; for a kernel that
    ``splits_groups`` (KL-Cov's selection), with ``parallel=True`` from ``shared``.

    The serial build is compiled without numba's reference counting (``_nrt=False``) unless
    the kernel ``allocates`` arrays (the optimal token baseline's buffer, GAE's long rows'
    chunk tables): numba then takes each array argument as it is, without wrapping it in a
    counted record (a malloc, a free and two atomic instructions; 0.1-0.6 us of a general-way
    call at 8 x 128: discounted returns 7.8 -> 7.4 us, Cython 7.3). A kernel so built cannot
    allocate: numba refuses to compile it (at its first call, which every kernel's tests make)
    if it or a helper it calls makes a new array, so nothing can leak."""

    def __init__(
        self, function, kernel: Kernel | None = None, row_chunks=None, shared=None, allocates=False
    ):
        self.function = function  # the Python source, for the interface test
        self.kernel = kernel
        self._serial_common = None
        self._serial_packed = None
        self._parallel_commons = {}  # by packed
        # Both parallel builds take the threads last: the one made from the table cuts the rows
        # into ranges itself, one a thread; a kernel that ``splits_groups`` has the source
        # ``shared`` of a group's work in a given number of ranges of rows, built with
        # parallel=True, and its serial build is ``function`` itself, a Python function with
        # the table's arguments that runs ``shared``'s own serial build with one range (a
        # jitted wrapper would link that build into its module and compile it a second time).
        self.takes_threads = kernel is not None
        self.sets_threads = False  # whether the parallel build sets numba's thread count
        parallel = numba.njit(nogil=True, cache=_CACHE, parallel=True)
        if kernel is not None and kernel.splits_groups:
            self.serial = function
            self.parallel = parallel(shared)
            return
        self.serial = numba.njit(nogil=True, cache=_CACHE, _nrt=allocates)(function)
        if kernel is not None:
            self.parallel = _parallel_build(self.serial, kernel, row_chunks)
            self.sets_threads = True
        else:
            self.parallel = parallel(function)

    def serial_common(self):
        """The one-thread entry of the common case (``_common_entry_build``), built once."""
        if self._serial_common is None:
            self._serial_common = _common_entry_build(self.serial, self.kernel)
        return self._serial_common

    def serial_packed(self):
        """The one-thread entry of packed rows (``_common_entry_build``), built once."""
        if self._serial_packed is None:
            self._serial_packed = _common_entry_build(self.serial, self.kernel, packed=True)
        return self._serial_packed

    def parallel_common(self, packed: bool = False):
        """The entry of the common case on several threads (``_common_entry_build`` with the
        parallel build, behind ``_locked``), built once; None without a parallel build made
        from the table."""
        if not self.sets_threads:
            return None
        if packed not in self._parallel_commons:
            build = _common_entry_build(self.serial, self.kernel, packed, self.parallel)
            serial = self.serial_packed() if packed else self.serial_common()
            self._parallel_commons[packed] = _locked(build, serial, self.kernel.common_arguments)
        return self._parallel_commons[packed]

    def __call__(self, *args):
        """The kernel's result (None for most: they write their outputs). The backend signature
        ends with n_threads; one thread, the small batch's case, takes the fewest steps in
        Python (each step here is about 0.1 us of a 2 us call at 8 x 128). The parallel build
        made from the table sets numba's thread count itself (``_parallel_build``)."""
        if args[-1] > 1:
            n_threads = min(args[-1], numba.config.NUMBA_NUM_THREADS)
            if n_threads > 1 and _parallel_lock.acquire(blocking=False):
                try:
                    if self.sets_threads:
                        return self.parallel(*args[:-1], n_threads)
                    numba.set_num_threads(n_threads)
                    if self.takes_threads:
                        return self.parallel(*args[:-1], n_threads)
                    return self.parallel(*args[:-1])
                finally:
                    _parallel_lock.release()
        return self.serial(*args[:-1])


class _Specialised:
    """A row kernel built once per value of a code argument, which the kernel sees as a constant
    (the table's ``specialise``: the KL estimator).

    A switch on a run-time estimator inside the token loop keeps LLVM from vectorizing it (k1
    ran 12 times slower). The argument stays in the signature, common to all backends.
    """

    def __init__(self, make_rows, kernel):
        self.kernel = kernel
        self.position = kernel.arguments.index(kernel.specialise)
        codes = range(len(kernel.scalar(kernel.specialise).choices))
        self.kernels = [_Kernel(make_rows(code), kernel) for code in codes]
        self.function = self.kernels[0].function
        self._serial_tables = {}

    def serial_table(self, code):
        """The one-thread build for ``code`` as one compiled function of the table's arguments,
        n_threads (1) last, built once: the serial build called by address
        (``_compiled_caller``: compiled once, not linked in again), the code and the threads
        taken as given. A fast path calls it through its exact entry
        (``_backend.table_kernel``), where the table kernel, a Python call around the builds,
        types every argument on each call (shape_rewards at 8 x 128: about 0.5 us)."""
        if code not in self._serial_tables:
            arguments = self.kernel.arguments[:-1]
            names = ", ".join(arguments)
            namespace = {"serial": _compiled_caller(self.kernels[code].serial, arguments)}
            exec(f"def serial_table({names}, n_threads):\n    serial({names})", namespace)
            build = numba.njit(nogil=True, _nrt=False)(namespace["serial_table"])
            self._serial_tables[code] = build
        return self._serial_tables[code]

    def __call__(self, *args):
        self.kernels[args[self.position]](*args)
