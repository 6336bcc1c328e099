"""Shared pieces of the numba backend: LLVM intrinsics, mask words, prefetches and the row totals.
The vectorizable exp and log are in ``_numba_math.py``, the float64 lanes of the block scans in
``_numba_lanes.py``, the serial/parallel kernel builders (``_Kernel``, ``_Specialised``) in
``_numba_builds.py``.

The kernels themselves live in ``_numba_kernels.py`` (rewards, returns, moments),
``_numba_gae.py``, ``_numba_losses.py`` (the per-token policy losses), ``_numba_value_loss.py``,
``_numba_sequence_losses.py`` (GSPO, the geometric mean) and ``_numba_covariance.py`` (KL-Cov's
selection); ``_numba_kernels`` is the backend's interface (one callable per kernel of the
table). Conventions that keep them fast and exact:

- Compiled lazily at first call (no eager signatures), ``nogil``. Each kernel is written over
  rows (a ``prange`` that the serial build runs as a plain loop) and reduces each row on its
  own. Its parallel build (``_numba_builds._parallel_build``) is a ``parallel=True`` loop over
  a few ranges of rows, each run by the serial build's compiled code, called by address: results
  are the serial build's bit for bit on any number of threads, and the parallel build compiles
  in about a second where numba's parfor passes over the kernel's own body took 1.7-3x the
  serial build's time. Numba's default threading layer must not be entered from two Python
  threads at once (it aborts the process), so the parallel build runs under a lock and a call
  that finds the lock taken runs the serial build on its own thread instead. A kernel of the
  "groups" layout runs over ranges of groups, each reduced on its own in row order: the same
  guarantee.
- A kernel's scratch rows (a chunk of ratios, loss terms, ...) are made once per call,
  before its loop over rows, in the stack frame of the function that loops (``_stack_array``,
  as the C twins keep theirs): the serial build runs every row of a call on one thread (the
  parallel build calls it once per range of rows), so no two threads share them. Allocated
  per row, they cost about a fifth of the clipped surrogate's time on (1024, 4096) float32
  rows (four allocations a row: 5.4 ms, hoisted 4.4-4.7 ms, one thread); allocated by NRT
  once per call, a third of a small call's fixed cost.
- The loss kernels are written in lanes (``_numba_lanes``): 8 tokens a step in LLVM vectors of
  the input dtype, their C twin's operations in the same order, sums in float64 lanes added
  up in the twin's tree, so that numba and Cython give the same bits. Written as scalar loops
  for LLVM's loop vectorizer they took 1.1-1.9x the twins' time: a run-time check that the
  outputs do not overlap the inputs at every loop, terms stored to scratch rows for their
  sums, 8 tokens a step at most. A kernel's row and chunk functions are compiled apart
  (``_without_refcounts``), without reference counting: a call that numba counts runs two
  atomic instructions per array, each a full fence on x86. The loss kernels' loop over rows is
  inside that function too (``rows_of``, ``_value_rows``, ``_gspo_rows``, ...), not a call a
  row: numba passes each array to a function it does not inline field by field (about 90 moves
  a call), 20-45 ns a row, most of a short row's time (the clipped surrogate at 1024 x 8: 2.4x
  its twin's time, 1.2x with the loop inside). numba's inlining of a row function into such a
  loop (``inline="always"``) gave the same speed but a first call about 25% longer.
- The serial builds (``_numba_builds._Kernel``) and the one-thread common entries are compiled
  without reference counting too, but for the two kernels that allocate: numba then takes
  their array arguments as they are, as the C entries do, instead of wrapping each in a
  counted record (a malloc, a free and two atomic instructions). Their scratch is on the
  stack (``_stack_array``) or, in the common entries above 128 rows, from malloc
  (``_heap_bytes``).
- In a scalar loop, validity is tested inline with `has_mask` hoisted: through a helper
  function the short-circuit control flow stops LLVM from vectorizing the loop (the loss
  kernels, before they ran in lanes: 9x slower).
- Rows that skip their padding prefetch ahead of their work, across the padding into the next
  row (``_ahead``, ``_prefetch_ahead``; backwards rows: GAE's and the returns' blocks), as the
  C twins do: at every row the hardware prefetchers start again, which cost the loss kernels
  up to 1.6x their time on float32 (1024, 4096) rows with lengths in [T/2, T] (the clipped
  surrogate, one thread: 4.4 -> 3.3 ms), and GAE, which runs backwards, about 1.3x.
  Prefetches go in their own short loop once per _PREFETCH_BLOCK positions, outside the
  vectorized loops; GSPO's passes prefetch a chunk's lines at once before its loops (cutting its
  float64 sums into blocks of _PREFETCH_BLOCK cost more than the prefetches gained). Only the
  arrays a pass reads: an absent one (weights of shape (0,)) has no lines to fetch.
- Positions are indexed with unsigned integers, which removes numba's negative-index
  wrap-around check from the inner loops (worth about 1.3x on GAE).
- Multiply-adds on a dependency chain use an explicit ``llvm.fma``: one rounding, half the
  latency of a multiply then an add, and the same result whatever LLVM decides elsewhere
  (implicit contraction via fastmath could differ between the serial and parallel builds).
- A kernel tests its cases (a mask or not, weights or not) in its loops, and LLVM copies each
  loop once per outcome with the test outside it (loop unswitching), as the C twins' compiler
  does with their cases: the package raises LLVM's size threshold for that while numba compiles
  its functions (``_LLVMOptions``), and puts LLVM's default back after; without AVX-512 it also
  has the loops of DPPO-KL's binary KL and SAPO's sigmoids interleaved twice, as their C twins
  run them (``_INTERLEAVED``).
- The on-disk cache is off by default: numba issues #4807 and #7518 (cache races between
  processes; the README says what they do). ``PPO_FAST_NUMBA_CACHE=1`` turns it on, with a
  warning naming them.
"""

from __future__ import annotations

import os
import warnings

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import event, types
from numba.extending import intrinsic, overload

from ._numba_memory import _stack_array

_CACHE = os.environ.get("PPO_FAST_NUMBA_CACHE", "") == "1"
if _CACHE:
    warnings.warn(
        "PPO_FAST_NUMBA_CACHE=1: processes that compile at once race on numba's on-disk cache "
        "(numba issues #4807 and #7518): they drop each other's index entries, and where their "
        "writes interleave a signature can load another's compiled code; fill the cache from one "
        "process before others start",
        RuntimeWarning,
        stacklevel=2,
    )


# LLVM's loop unswitching: a loop that tests a condition which does not change in it (a mask or
# weights or not, REINFORCE's KL penalty or not) is copied, once for each outcome, with the test
# outside, as far as the loop's size is within the threshold (LLVM's default: 50). The C twins
# get these copies from the compiler (their cases: one a mask and weights case); numba's
# kernels test in every block of 8 tokens, and with the default threshold their loops were not
# unswitched. At 400, float32 (256, 1000) rows, one thread, kernel against its C twin: REINFORCE
# 1.27 -> 1.04x the twin's time, the geometric mean 1.21 -> 0.98, the clipped surrogate 1.06 ->
# 0.95, CISPO 1.08 -> 0.96, DPPO 1.10 -> 1.04, GSPO 1.03 -> 0.93, the value loss 0.93 -> 0.84;
# first calls compile 5-15% longer. The option is LLVM's, for the whole process: it is raised
# while numba compiles a function of this package (and what that compiles) and put back to
# LLVM's default after, so that other numba code compiles as it would without ppo_fast.
_LLVM_UNSWITCH_THRESHOLD = 50


def _compiles_for_avx512() -> bool:
    """Whether numba compiles for a CPU with AVX-512 (NUMBA_CPU_FEATURES where it is set, as
    numba does, else the host's features)."""
    features = numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")


# Where numba compiles for AVX-512 its kernels are as they were measured on the Intel Xeon of the
# README's runs; without it (AVX2: 16 vector registers, masks held as vectors) three things
# differ, each so that the code LLVM makes there is nearer the C twin's: this threshold (below),
# exp's constants (_numba_math.exp_constants) and a mask's bytes (_numba_lanes._valid_bytes). On
# the AMD EPYC of 0.8.31's runs the per-token policy losses' loops with a mask and no weights,
# each over 8 tokens, were not unswitched at 400 (AVX2's instructions count twice for a lane op
# in float64): a test of the mask in every block made its lanes a phi that LLVM held as 8 16-bit
# lanes and widened again for each use. 800 unswitches them (0.8.31 took 1600: as fast, measured
# at 400, 800, 1200 and 1600, and first calls 10-25% longer than at 800). At 1600 for every
# kernel, first calls compiled 1.5-2.7x longer (the optimal token baseline 5.1 -> 13.9 s, no
# faster); so the raised threshold only for those losses (the functions of _LOSS_MODULE).
_AVX512 = _compiles_for_avx512()
_UNSWITCH_THRESHOLD = 400
_LOSS_UNSWITCH_THRESHOLD = 400 if _AVX512 else 800
_LOSS_MODULE = __package__ + "._numba_losses"


# LLVM's loop vectorizer runs a loop of _binary_kls (DPPO-KL's binary KL: two float64 divisions
# and a 10-term log polynomial per token, one dependent chain) as one 4-lane float64 vector a trip
# without AVX-512; its C twin takes two independent 4-lane vectors a trip (ppo_f64x8: two
# __m256d), so that one's divisions and polynomial run while the other's wait. LLVM's
# -force-vector-interleave=2 is that for the functions named here, only where numba compiles
# without AVX-512 (with it, one 8-lane vector already is): DPPO-KL 1.21-1.27 -> 1.12-1.24x
# Cython's time (float32 32x2048, AMD EPYC). SAPO's sigmoids likewise, as the twin's
# ppo_sapo_sigmoids_pair (16 tokens a trip): 1.12-1.21 -> 1.08-1.12x (four rounds alternated).
# Not the other loops of exps: the ratios and _exps measured no faster so (within the noise).
_INTERLEAVED = (
    frozenset()
    if _AVX512
    else frozenset({_LOSS_MODULE + "._binary_kls", _LOSS_MODULE + "._sapo_sigmoids"})
)
_LLVM_DEFAULTS = {"unswitch-threshold": _LLVM_UNSWITCH_THRESHOLD, "force-vector-interleave": 0}


class _LLVMOptions(event.Listener):
    """Sets LLVM's unswitch threshold (and the interleave count of _INTERLEAVED's functions)
    around the compilation of this package's jitted functions (numba's "numba:compile" events,
    which numba sends under its compiler lock, one compilation at a time, nested for what a
    compilation compiles): each of ours compiles with its own, whatever compiles it, and what it
    compiles of others' with the same; after the outermost, LLVM's defaults again. An option is
    set only where it changes."""

    def __init__(self):
        self.opened = []  # the options of the compilations open since one of this package's began
        self.current = dict(_LLVM_DEFAULTS)

    def on_start(self, compilation):
        function = getattr(compilation.data["dispatcher"], "py_func", None)
        module = str(getattr(function, "__module__", ""))
        if module.startswith(__package__ + "."):
            loss = module == _LOSS_MODULE
            name = module + "." + str(getattr(function, "__qualname__", ""))
            options = {
                "unswitch-threshold": _LOSS_UNSWITCH_THRESHOLD if loss else _UNSWITCH_THRESHOLD,
                "force-vector-interleave": 2 if name in _INTERLEAVED else 0,
            }
        elif self.opened:
            options = self.opened[-1]
        else:
            return
        self.opened.append(options)
        self._set(options)

    def on_end(self, compilation):
        if not self.opened:
            return
        self.opened.pop()
        self._set(self.opened[-1] if self.opened else _LLVM_DEFAULTS)

    def _set(self, options):
        for option, value in options.items():
            if self.current[option] != value:
                llvm.set_option(__package__, f"-{option}={value}")
                self.current[option] = value


event.register("numba:compile", _LLVMOptions())


_U1 = np.uint64(1)
_U8 = np.uint64(8)


def _prefetch_codegen(write):
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        prefetch = builder.module.declare_intrinsic(
            "llvm.prefetch",
            fnty=ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
        )
        # (address, read 0 / write 1, locality 3: keep in every level, data 1)
        flags = [ir.Constant(i32, int(write)), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        builder.call(prefetch, [address, *flags])
        return context.get_dummy_value()

    return codegen


@intrinsic
def _prefetch(typingctx, array, index):
    """A hint to fetch the cache line of ``array[index]`` (llvm.prefetch, the twins'
    src/lanes.h ppo_prefetch): an address only, never a load, so ``index`` may lie outside the
    array (an unsigned index below 0 wraps to the same address)."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None
    return types.none(array, index), _prefetch_codegen(write=False)


@intrinsic
def _prefetch_for_write(typingctx, array, index):
    """The same for a line about to be written (src/lanes.h ppo_prefetch_for_write)."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None
    return types.none(array, index), _prefetch_codegen(write=True)


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c with a single rounding (llvm.fma), in float32 or float64."""
    if not (a == b == c and a in (types.float32, types.float64)):
        return None
    signature = a(a, b, c)
    ir_type = ir.FloatType() if a == types.float32 else ir.DoubleType()

    def codegen(context, builder, sig, args):
        function = builder.module.declare_intrinsic(
            "llvm.fma", [ir_type], ir.FunctionType(ir_type, [ir_type] * 3)
        )
        return builder.call(function, args)

    return signature, codegen


@intrinsic
def _as_int_bits(typingctx, x):
    """The bits of a float as a signed integer of the same width."""
    if x not in (types.float32, types.float64):
        return None
    integer = types.int32 if x == types.float32 else types.int64

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(integer.bitwidth))

    return integer(x), codegen


@intrinsic
def _as_float_bits(typingctx, n):
    """The float whose bits are the integer n (int32 -> float32, int64 -> float64)."""
    if n not in (types.int32, types.int64):
        return None
    real = types.float32 if n == types.int32 else types.float64

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType() if n == types.int32 else ir.DoubleType())

    return real(n), codegen


def _jit(function):
    return numba.njit(nogil=True, cache=_CACHE, inline="always")(function)


def _called(function):
    """A helper left to LLVM to inline, not inlined into the caller's numba IR as _jit's: a
    large helper inside a prange body makes the parallel build's analysis of it slow (GAE's
    chunk summary: seconds of compilation)."""
    return numba.njit(nogil=True, cache=_CACHE)(function)


def _without_refcounts(function):
    """A helper of a kernel called once per row or per chunk (its passes, its rows in lanes),
    left to LLVM to inline, compiled without numba's reference counting (``_nrt=False``; it
    allocates nothing) and with numpy's error model (a division by zero is inf or NaN, not an
    exception: a branch on every divisor). Compiled with reference counting, a call that LLVM
    does not inline increfs and decrefs each array argument, each an atomic instruction, which
    x86 runs as a full fence: it waits until every store in flight has reached the cache. Once a
    row, that held the value loss to 1.25x the C twin's time on rows in memory (float32 (1024,
    4096), one thread; equal in cache)."""
    return numba.njit(nogil=True, cache=_CACHE, error_model="numpy", _nrt=False)(function)


@intrinsic
def _mask_word(typingctx, mask, index):
    """The 8 bytes of a uint8 array from ``index`` on, as one uint64 (an unaligned load)."""
    if not (isinstance(mask, types.Array) and mask.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        address = builder.gep(array.data, [args[1]])
        return builder.load(builder.bitcast(address, ir.IntType(64).as_pointer()), align=1)

    return types.uint64(mask, index), codegen


@intrinsic
def _nonzero_bytes64(typingctx, mask, index):
    """How many of the 64 bytes of a uint8 array from ``index`` on are nonzero (uint64): one
    vector compare, its lanes as the bits of an i64, and their popcount."""
    if not (isinstance(mask, types.Array) and mask.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        address = builder.gep(array.data, [args[1]])
        bytes_type = ir.VectorType(ir.IntType(8), 64)
        data = builder.load(builder.bitcast(address, bytes_type.as_pointer()), align=1)
        nonzero = builder.icmp_unsigned("!=", data, bytes_type(None))
        return builder.ctpop(builder.bitcast(nonzero, ir.IntType(64)))

    return types.uint64(mask, index), codegen


_BYTE_ONES = np.uint64(0x0101010101010101)
_BYTE_HIGHS = np.uint64(0x8080808080808080)


@_jit
def _all_valid(mask, i):
    """Whether the 8 mask bytes from position i on are all nonzero: a word has a zero byte
    exactly when (word - 0x01..01) & ~word & 0x80..80 is nonzero (Hacker's Delight 6-1)."""
    word = _mask_word(mask, i)
    return ((word - _BYTE_ONES) & ~word & _BYTE_HIGHS) == 0


@_jit
def _mask_stop(mask, start, low, stop):
    """stop, less the mask's trailing words of 8 invalid bytes down to low, positions from the
    row at start (twin: src/rows.h ppo_mask_stop)."""
    while stop - low >= _U8 and _mask_word(mask, start + stop - _U8) == 0:
        stop -= _U8
    return stop


# Positions a row's prefetches run ahead of its work: the twins' PPO_CHUNK (src/rows.h ppo_ahead
# and ppo_prefetch_behind say why they are there), and how many a forward pass prefetches at a
# time (_prefetch_ahead).
_PREFETCH_DISTANCE = np.uint64(256)
_PREFETCH_BLOCK = np.uint64(64)
# How far ahead, in bytes, a pass with little work per token prefetches (twin: src/rows.h
# PPO_STREAM_AHEAD_BYTES, which says why).
_STREAM_AHEAD_BYTES = 8192
_U3 = np.uint64(3)


def _blocks_per_line(array):
    """How many blocks of 8 positions of ``array`` fill a 64-byte cache line, less 1: the
    backward rows prefetch at a block whose end t has (t >> 3) & this == 0 (once a line)."""
    return np.uint64(64 // 8 // array.itemsize - 1)


@overload(_blocks_per_line, inline="always")
def _blocks_per_line_overload(array):
    value = np.uint64(64 // 8 // (array.dtype.bitwidth // 8) - 1)
    return lambda array: value


def _positions_per_line(array):
    """How many items of ``array`` fill a 64-byte cache line."""
    return np.uint64(64 // array.itemsize)


@overload(_positions_per_line, inline="always")
def _positions_per_line_overload(array):
    value = np.uint64(64 // (array.dtype.bitwidth // 8))
    return lambda array: value


@_jit
def _ahead_by(i, start, span, valid_end, distance):
    """Twin: src/rows.h ppo_ahead_by: the position ``distance`` positions of work ahead of
    position ``i`` of the row at ``start`` whose computed positions end at start + valid_end;
    past them, as far into the next row (at start + span)."""
    ahead = i + distance
    if ahead >= start + valid_end:
        ahead += span - valid_end
    return ahead


@_jit
def _ahead(i, start, span, valid_end):
    """Twin: src/rows.h ppo_ahead (its comment says why): _ahead_by at _PREFETCH_DISTANCE."""
    return _ahead_by(i, start, span, valid_end, _PREFETCH_DISTANCE)


@_jit
def _prefetch_ahead(a, b, c, d, has_d, mask, has_mask, at):
    """Twin: src/rows.h ppo_prefetch_ahead, for _PREFETCH_BLOCK positions at once: the cache
    lines of positions at .. at + _PREFETCH_BLOCK - 1 (``at`` from _ahead) of three token arrays,
    a fourth where ``has_d``, and the mask where ``has_mask``. Called once per _PREFETCH_BLOCK
    positions of a pass, outside its vectorized loop: a prefetch inside it keeps LLVM from
    vectorizing the loop, and a whole chunk's lines at once left float32 (1024, 4096) rows
    slower, not faster (the fill buffers fill up). One loop for every array: a loop per array
    measured 1.4 times the clipped surrogate's time on rows without padding."""
    for k in range(np.uint64(0), _PREFETCH_BLOCK, _positions_per_line(a)):
        _prefetch(a, at + k)
        _prefetch(b, at + k)
        _prefetch(c, at + k)
        if has_d:
            _prefetch(d, at + k)
    if has_mask:
        _prefetch(mask, at)


@_jit
def _count_nonzero(mask, start, n):
    """How many of the ``n`` bytes of a uint8 array from ``start`` on are nonzero (uint64), 64 a
    step (twin: src/totals.h ppo_count_nonzero). A loop of ``count += mask[i] != 0`` runs in
    int64 lanes, 4 bytes a vector: the row scales of a 256 x 1024 mask took 13.8 us that way,
    4.45 us this way, and were most of what numba's loss entries added to their kernels."""
    count = np.uint64(0)
    i = np.uint64(0)
    while i + np.uint64(64) <= n:
        count += _nonzero_bytes64(mask, start + i)
        i += np.uint64(64)
    for j in range(start + i, start + n):
        count += np.uint64(mask[j] != 0)
    return count


@_jit
def _valid_count(start, span, length, mask, has_mask):
    """The number of valid positions of a row."""
    valid_end = min(length, span)
    if not has_mask:
        return valid_end
    return _count_nonzero(mask, start, valid_end)


@intrinsic
def _select(typingctx, condition, a, b):
    """a if condition else b, as one LLVM select, in a's type (b is converted, as numba's
    conditional expression unifies float32 and float64 to float64): a conditional expression at
    a store becomes two predicated stores, and blocks the vectorizer."""
    if not (
        isinstance(condition, types.Boolean)
        and isinstance(a, types.Float)
        and isinstance(b, types.Float)
        and a.bitwidth >= b.bitwidth
    ):
        return None

    def codegen(context, builder, sig, args):
        other = context.cast(builder, args[2], sig.args[2], sig.args[1])
        return builder.select(args[0], args[1], other)

    return a(condition, a, b), codegen


@intrinsic
def _one_like(typingctx, x):
    """1 in the type of the float x (numba's `x - x + 1` is float64: its 1 is an integer)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return context.get_constant(sig.return_type, 1.0)

    return x(x), codegen


@intrinsic
def _rounded_like(typingctx, x, like):
    """The float64 x rounded to the type of the float ``like`` (as a C cast, or a store): numba's
    arithmetic on a float32 and a float64 is float64."""
    if x != types.float64 or not isinstance(like, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return context.cast(builder, args[0], types.float64, sig.return_type)

    return like(x, like), codegen


@intrinsic
def _half_like(typingctx, x):
    """0.5 in the type of the float x."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return context.get_constant(sig.return_type, 0.5)

    return x(x), codegen


@intrinsic
def _prefer_wide_vectors(typingctx):
    """Lets LLVM vectorize the calling function at 512 bits where the CPU has them: the
    function attribute "prefer-vector-width"="512" (LLVM prefers 256 bits on AVX-512 CPUs,
    for the clock; these kernels are bound by memory). numba has no option for a function
    attribute and llvmlite accepts only a list of known ones: this adds it to the set directly.
    Called inside the prange body, so that it lands on the function that runs the rows in both
    builds (the parallel build outlines the body)."""

    def codegen(context, builder, sig, args):
        try:
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        except TypeError:  # llvmlite's attributes are no longer a set: a hint only, so skip it
            pass
        return context.get_dummy_value()

    return types.none(), codegen


@numba.njit(nogil=True, cache=_CACHE)
def _block_sum(values, first, n):
    """NumPy's sum of a block of at most 128 values (eight accumulators from 8 values on)."""
    if n < 8:
        total = 0.0
        for i in range(first, first + n):
            total += values[i]
        return total
    r0, r1, r2, r3 = values[first], values[first + 1], values[first + 2], values[first + 3]
    r4, r5, r6, r7 = values[first + 4], values[first + 5], values[first + 6], values[first + 7]
    i = first + 8
    whole_end = first + n - n % 8
    while i < whole_end:
        r0 += values[i]
        r1 += values[i + 1]
        r2 += values[i + 2]
        r3 += values[i + 3]
        r4 += values[i + 4]
        r5 += values[i + 5]
        r6 += values[i + 6]
        r7 += values[i + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < first + n:
        total += values[i]
        i += 1
    return total


# Frames of _pairwise_sum's stack: each halves its count, so 64 hold any int64 count.
_PAIRWISE_DEPTH = 64


@numba.njit(nogil=True, cache=_CACHE)
def _pairwise_sum(values, first, n):
    """NumPy's pairwise sum of values[first : first + n]: blocks of at most 128 values, and above
    that the sum of the two halves (the first a multiple of 8), each summed so. Twin: src/totals.h
    ppo_pairwise_sum, a recursion; here the recursion runs on a stack of its own, since numba
    crashes loading a cached recursive function from its on-disk cache (numba issue #6061: a
    segmentation fault on the first call in a process with ``PPO_FAST_NUMBA_CACHE=1``).
    Each half's sum is complete before they are added: the recursion's bits. Up to 128 values
    (a batch of up to 128 rows) it is one block, with no stack: its four arrays, allocated for
    each of a loss's four row outputs, were a fifth of the loss's call at 8 x 128 (they are in
    the stack frame now, ``_stack_array``)."""
    if n <= 128:
        return _block_sum(values, first, n)
    firsts = _stack_array((_PAIRWISE_DEPTH,), np.int64)
    counts = _stack_array((_PAIRWISE_DEPTH,), np.int64)
    lefts = _stack_array((_PAIRWISE_DEPTH,), np.float64)  # a frame's first half's sum, once known
    left_done = _stack_array((_PAIRWISE_DEPTH,), np.bool_)
    left_done[:] = False
    firsts[0], counts[0] = first, n
    depth = 1
    while True:
        while counts[depth - 1] > 128:  # down the first halves to a block
            top = depth - 1
            half = counts[top] // 2
            half -= half % 8
            firsts[depth], counts[depth], left_done[depth] = firsts[top], half, False
            depth += 1
        value = _block_sum(values, firsts[depth - 1], counts[depth - 1])
        depth -= 1
        while depth > 0 and left_done[depth - 1]:  # up while this was a second half
            value = lefts[depth - 1] + value
            depth -= 1
        if depth == 0:
            return value
        top = depth - 1  # this was the first half of frame top: its second half is next
        lefts[top], left_done[top] = value, True
        half = counts[top] // 2
        half -= half % 8
        firsts[depth], counts[depth] = firsts[top] + half, counts[top] - half
        left_done[depth] = False
        depth += 1


@numba.njit(nogil=True, cache=_CACHE)
def _common_scales(agg, normaliser, flat_mask, has_mask, n_rows, width):
    """(valid positions, row scales) of a loss's common case: the twin of
    ``_backend.common_scales`` (which says what they are) and src/totals.h ppo_common_scales."""
    scales = np.empty(n_rows)
    valid = _common_scales_into(
        agg, normaliser, flat_mask, has_mask, width, np.empty(n_rows, dtype=np.int64), scales
    )
    return valid, scales


@numba.njit(nogil=True, cache=_CACHE)
def _common_scales_into(agg, normaliser, flat_mask, has_mask, width, counts, scales):
    """``_common_scales`` into given arrays of the rows' valid counts and scales (one each a
    row): returns the valid positions."""
    n_rows = scales.shape[0]
    total = 0
    seqs = 0.0
    for b in range(n_rows):
        count = width
        if has_mask:
            count = np.int64(_count_nonzero(flat_mask, np.uint64(b * width), np.uint64(width)))
        counts[b] = count
        total += count
        if count > 0:
            seqs += 1.0
    valid = float(total)
    if agg == 0:  # token-mean
        divisor = normaliser if normaliser > 0 else valid
    elif agg == 3:  # seq-mean-token-sum-norm: T is the loss scale
        divisor = normaliser if normaliser > 0 else float(width)
    else:
        divisor = normaliser if normaliser > 0 else seqs
    _scales_from_counts(agg, divisor, counts, scales)
    return valid


@numba.njit(nogil=True, cache=_CACHE)
def _packed_scales_into(agg, normaliser, spans, scales):
    """``_common_scales_into`` for packed rows of ``spans`` (every position valid; no T, so
    seq-mean-token-sum-norm without its loss_scale divides by the valid positions): twin of
    ppo_fast/_backend.py packed_scales and src/totals.h ppo_common_scales with spans."""
    total = 0
    seqs = 0.0
    for b in range(scales.shape[0]):
        total += spans[b]
        if spans[b] > 0:
            seqs += 1.0
    valid = float(total)
    divisor = normaliser if normaliser > 0 else (seqs if agg == 1 or agg == 2 else valid)
    _scales_from_counts(agg, divisor, spans, scales)
    return valid


@numba.njit(nogil=True, cache=_CACHE)
def _scales_from_counts(agg, divisor, counts, scales):
    """Each row's scale from its valid count and the aggregation's divisor (the second loop of
    src/totals.h ppo_common_scales): one for every row, but seq-mean-token-mean's 1 / (divisor x
    the row's count); 0 for a divisor of 0 and for an empty row of seq-mean-token-mean."""
    for b in range(scales.shape[0]):
        scale = 0.0
        if agg != 1:  # one scale for every row
            scale = 1.0 / divisor if divisor else 0.0
        elif divisor and counts[b] > 0:  # seq-mean-token-mean
            scale = 1.0 / (divisor * counts[b])
        scales[b] = scale


@numba.njit(nogil=True, cache=_CACHE)
def _row_totals(row_outputs):
    n_rows = row_outputs.shape[1]
    totals = np.empty(row_outputs.shape[0])
    for k in range(row_outputs.shape[0]):
        totals[k] = 0.0 + _pairwise_sum(row_outputs[k], np.int64(0), n_rows)  # as _numba_builds
    return totals
