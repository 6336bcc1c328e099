"""The kernel table against every backend: the interface, and one generic differential test.

Every kernel of ``_spec.KERNELS``, on every backend that loads, in every layout, float32 and
float64, against the oracle; and the compiled backends bit for bit on one and two threads. Stage
tests (test_gae.py, test_loss.py, ...) hold the identities, seeds and hostile inputs of each stage.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
from batches import Batch, ragged_batches
from conftest import COMPILED, COMPILED_NUMBA_PARALLEL, NUMBA_PARALLEL, RTOL
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import cases

import ppo_fast
from ppo_fast import _backend, _reference
from ppo_fast._spec import FLAGS, KERNELS, ROWS, TOKEN


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def _backend_parameters(backend: str, name: str) -> list[str]:
    kernel = getattr(_backend.resolve(backend), name)
    if backend == "numba":
        # The Python source of the compiled kernel; n_threads is the wrapper's.
        return [*_parameters(kernel.function), "n_threads"]
    return _parameters(kernel)


@pytest.mark.parametrize("backend", ppo_fast.available_backends())
@pytest.mark.parametrize("name", KERNELS)
def test_every_backend_exposes_the_table_kernel_with_its_arguments(backend, name):
    assert _backend_parameters(backend, name) == list(KERNELS[name].arguments)


def test_the_table_and_the_stage_modules_agree():
    # Each argument is declared once; codes are positions in their choices.
    for kernel in KERNELS.values():
        assert len(set(kernel.arguments)) == len(kernel.arguments), kernel.name
        for name, source in kernel.gradients.items():
            assert name in {a.name for a in kernel.outputs}, (kernel.name, name)
            assert source in {a.name for a in kernel.inputs}, (kernel.name, source)
        if kernel.specialise is not None:
            assert kernel.scalar(kernel.specialise).choices, kernel.name
        if kernel.common:  # a common case is padded rows, one value of each row input
            assert kernel.layout == ROWS and kernel.specialise is None, kernel.name
            # and token arrays in the token dtype, or input flags (a token selection: the common
            # entries take a bool or uint8 array for it), never output flags
            assert all(a.dtype in (TOKEN, FLAGS) for a in kernel.inputs), kernel.name
            assert all(a.dtype == TOKEN for a in kernel.outputs), kernel.name
        # flags are token arrays: an input or an output, never a row's
        for array in (*kernel.row_inputs, *kernel.row_outputs):
            assert array.dtype != FLAGS, (kernel.name, array.name)


def test_binding_a_kernel_without_an_argument_names_it():
    with pytest.raises(TypeError, match="kernel gae needs argument 'values'"):
        KERNELS["gae"].bind({"rewards": None})


def _assert_outputs_equal_oracle(actual, expected, case, dtype, backend):
    rtol = RTOL[np.dtype(dtype)]
    for name, want in expected.items():
        with case.described(f"backend={backend} dtype={np.dtype(dtype)} output={name}"):
            got = actual[name]
            assert got.dtype == want.dtype
            nonfinite = ~np.isfinite(want)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(got[nonfinite], want[nonfinite])
            finite = np.abs(want[~nonfinite])
            # Per-row sums cancel: judge them on the scale of the row's terms, bounded here by
            # the largest magnitude times the row length.
            scale = max(1.0, float(finite.max())) if finite.size else 1.0
            if name in {a.name for a in case.kernel.row_outputs}:
                spans = case.arguments["spans"]
                scale *= max(1, int(spans.max())) if spans.size else 1
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


# One dtype a test (the ``dtype`` fixture's), drawn inside it: numba's tests of one dtype share
# a worker (tests/conftest.py), which compiles that dtype's kernels for all of them.
@pytest.mark.parametrize("backend", COMPILED)
@settings(max_examples=20)
@given(data=st.data())
def test_every_kernel_equals_the_oracle(backend, dtype, data):
    batch = data.draw(ragged_batches(dtypes=(dtype,), max_rows=5, max_len=24, long_rows=False))
    kernels = _backend.resolve(backend)
    for case in cases(batch):
        expected = case.run(_reference)
        actual = case.run(kernels)
        _assert_outputs_equal_oracle(actual, expected, case, batch.dtype, backend)
        _assert_same_bits_wherever_the_arrays_lie(case, kernels, actual, backend)


@pytest.mark.parametrize("backend", COMPILED)
@settings(max_examples=20)
@given(data=st.data())
def test_every_kernel_keeps_the_oracles_nan_and_inf_at_valid_positions(backend, dtype, data):
    batch = data.draw(ragged_batches(dtypes=(dtype,), max_rows=4, max_len=20, long_rows=False))
    kernels = _backend.resolve(backend)
    for case in cases(batch, nonfinite=True):
        expected = case.run(_reference)
        _assert_outputs_equal_oracle(case.run(kernels), expected, case, batch.dtype, backend)


# A row's last valid position by its mask, which the compiled kernels find from the row's end
# (src/rows.h ppo_mask_stop: a right-padded row's trailing invalid words of 8 bytes): on either
# side of a word's and a cache line's bounds from the end, after a long invalid run, none
# (ragged_batches' rows, at most 24 positions, never end in a long invalid run).
@pytest.mark.parametrize("backend", COMPILED)
def test_every_kernel_finds_the_last_valid_position_of_a_masked_row(backend, dtype):
    width = 200
    lasts = [width - k for k in (1, 8, 9, 63, 64, 65, 129)] + [70, None, 0]  # None: no valid
    rng = np.random.default_rng(11)
    valid = np.zeros((len(lasts), width), dtype=bool)
    for row, last in enumerate(lasts):
        if last is not None:
            # invalid from a third of the way to the last, and at 0: a step that read one byte
            # past the row would find the next row's first byte invalid too
            valid[row, 1 : last // 3] = rng.random(max(0, last // 3 - 1)) < 0.8
            valid[row, last] = True
    batch = Batch("mask", np.dtype(dtype), valid, len(valid), {"mask": valid}, rng)
    kernels = _backend.resolve(backend)
    for case in cases(batch):
        _assert_outputs_equal_oracle(case.run(kernels), case.run(_reference), case, dtype, backend)


@pytest.mark.parametrize("backend", COMPILED_NUMBA_PARALLEL)
@settings(max_examples=15)
# float32 only: numba's parallel builds of every kernel in both dtypes took 80-120 s of the suite;
# the split into threads is the same code for either dtype (Cython's builds are checked in both
# by tests/test_cython.py, and numba's float64 GAE rows on any threads by tests/test_gae.py).
@given(batch=ragged_batches(dtypes=(np.float32,), max_rows=6, max_len=300, long_rows=False))
def test_every_kernel_gives_the_same_bits_on_one_and_two_threads(backend, batch):
    kernels = _backend.resolve(backend)
    for case in cases(batch):
        serial, parallel = case.run(kernels, 1), case.run(kernels, 2)
        for name, output in serial.items():
            with case.described(f"{backend} {name}"):
                np.testing.assert_array_equal(parallel[name], output)


# numba and Cython give the same bits on every kernel of the table: the losses' numba builds are
# written in their C twins' lanes (ppo_fast/_numba_lanes.py: the same operations in the same
# order, the sums in the same float64 lanes added up in the same tree), and every other kernel
# computes the same operations in the same order in both.


@pytest.mark.skipif(not {"numba", "cython"} <= set(COMPILED), reason="needs both compiled backends")
@pytest.mark.numba
@settings(max_examples=10)
@given(data=st.data(), nonfinite=st.booleans())
def test_numba_and_cython_give_the_same_bits(dtype, data, nonfinite):
    batch = data.draw(ragged_batches(dtypes=(dtype,), max_rows=5, max_len=40, long_rows=False))
    numba_kernels, cython_kernels = _backend.resolve("numba"), _backend.resolve("cython")
    for case in cases(batch, nonfinite=nonfinite):
        numba_outputs, cython_outputs = case.run(numba_kernels), case.run(cython_kernels)
        for name, output in cython_outputs.items():
            with case.described(name):
                np.testing.assert_array_equal(numba_outputs[name], output)


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
@settings(max_examples=60)
@given(
    weights=st.lists(st.integers(0, 1000), max_size=40).map(lambda w: np.array(w, np.int64)),
    n_parts=st.integers(1, 9),
)
def test_numba_parallel_builds_split_the_units_into_ranges_of_about_equal_weight(weights, n_parts):
    """The ranges a parallel build shares among its threads (``_numba_builds._parts``): every unit
    once, in order, at most one range per thread and per unit, none heavier than its share of
    the total (a unit's positions plus one) by more than one unit."""
    from ppo_fast._numba_builds import _parts

    bounds = _parts(weights, n_parts)
    n_units = len(weights)
    assert bounds[0] == 0 and bounds[-1] == n_units
    assert np.all(np.diff(bounds) >= 0)
    assert len(bounds) - 1 == max(1, min(n_parts, n_units))
    cost = np.concatenate([[0], np.cumsum(weights + 1)])
    share = cost[-1] / (len(bounds) - 1)
    heaviest = (weights + 1).max(initial=0)
    assert np.all(np.diff(cost[bounds]) <= share + heaviest)


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numbas_partial_blocks_read_and_write_only_their_first_items(dtype):
    """A row's last partial block in the numba losses (``_numba_losses._tail_fill``): the
    masked loads give the first ``count`` items and 0 after them, the masked store writes the
    first ``count`` lanes and nothing after them, and the mask's lanes past ``count`` are not
    valid, for every count and with the block ending where the array ends."""
    import numba

    from ppo_fast._numba_lanes import (
        _lanes_of,
        _lanes_of_first,
        _lanes_put,
        _lanes_put_first,
        _valid_bytes_first,
        _valid_put,
    )

    @numba.njit
    def partial(values, mask, i, count, lanes_out, valid_out, stored):
        _lanes_put(lanes_out, 0, _lanes_of_first(values, i, count))
        _valid_put(valid_out, 0, _valid_bytes_first(mask, i, count))
        _lanes_put_first(stored, i, _lanes_of(lanes_out, 0), count)

    rng = np.random.default_rng(0)
    for count in range(9):
        for i, size in ((3, 3 + count), (3, 3 + count + 5)):  # at the array's end, and inside
            values = rng.standard_normal(size).astype(dtype)
            mask = rng.integers(0, 3, size).astype(np.uint8)
            lanes, valid = np.full(8, np.nan, dtype), np.full(8, 7, np.uint8)
            stored = np.full(size, -1.0, dtype)
            before = values.copy(), mask.copy()
            partial(values, mask, i, count, lanes, valid, stored)
            block = slice(i, i + count)
            np.testing.assert_array_equal(lanes[:count], values[block])
            np.testing.assert_array_equal(lanes[count:], 0)
            np.testing.assert_array_equal(valid[:count], mask[block] != 0)
            np.testing.assert_array_equal(valid[count:], 0)
            np.testing.assert_array_equal(stored[block], values[block])
            np.testing.assert_array_equal(np.delete(stored, np.arange(i, i + count)), -1.0)
            np.testing.assert_array_equal(values, before[0])
            np.testing.assert_array_equal(mask, before[1])


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numba_sets_llvms_options_only_while_it_compiles_this_package(monkeypatch):
    """``_numba_core._LLVMOptions``: a function of ppo_fast compiled (here a new signature of
    its mask count) raises LLVM's unswitch threshold at the start (a policy loss's function by
    the instruction set numba compiles for; DPPO-KL's binary KL also interleaved without
    AVX-512) and puts LLVM's defaults back at the end; a function of someone else's is compiled
    with the options left alone."""
    import numba

    from ppo_fast import _numba_core

    options = []
    monkeypatch.setattr(_numba_core.llvm, "set_option", lambda name, option: options.append(option))

    @numba.njit
    def elsewhere(x):
        return x + 1

    elsewhere(1)
    assert options == []
    mask = np.ones(100, np.uint8)
    signatures = len(_numba_core._count_nonzero.signatures)
    assert _numba_core._count_nonzero(mask, np.int32(3), np.int32(90)) == 90
    assert len(_numba_core._count_nonzero.signatures) == signatures + 1  # it compiled
    assert options == ["-unswitch-threshold=400", "-unswitch-threshold=50"]
    # the per-token policy losses' functions: 800 where numba compiles without AVX-512
    from ppo_fast import _numba_losses

    options.clear()
    assert _numba_losses._select_bool(np.bool_(True), np.int16(1), np.int16(2)) == 1
    raised = 400 if _numba_core._AVX512 else 800
    assert options == [f"-unswitch-threshold={raised}", "-unswitch-threshold=50"]
    # DPPO-KL's binary KL: its vector loop interleaved twice where numba compiles without AVX-512
    # (signatures of int16, then int32 inputs, which no call of the package compiles; the first
    # may compile helpers it calls, each at its own options, after which the binary KL's are
    # set again, as the second's list shows whole)
    expected = (
        ["-unswitch-threshold=400", "-unswitch-threshold=50"]
        if _numba_core._AVX512
        else [
            "-unswitch-threshold=800",
            "-force-vector-interleave=2",
            "-unswitch-threshold=50",
            "-force-vector-interleave=0",
        ]
    )
    probs = np.exp(-np.arange(1.0, 4.0))
    for dtype in (np.int16, np.int32):
        options.clear()
        logprobs = np.array([-1, -2, -3], dtype)
        within = np.empty(3)
        _numba_losses._binary_kls(
            logprobs, logprobs, logprobs, 0, probs, probs, within, 3, 0.1, 0.1
        )
        np.testing.assert_array_equal(within, 1.0)  # a distribution is within any bound of itself
        assert options[:2] == expected[:2] and options[-2:] == expected[-2:], options
    assert options == expected


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numbas_mask_count_equals_numpys_for_every_start_and_length():
    """numba's count of nonzero mask bytes (``_numba_core._count_nonzero``, 64 bytes a step,
    then one at a time), which the losses' one-thread entries scale their rows by: every
    length across two steps and a tail, at aligned and unaligned starts, with mask bytes other
    than 0 and 1, and a count that ends where the array ends."""
    from ppo_fast._numba_core import _count_nonzero

    rng = np.random.default_rng(0)
    for start in (0, 1, 7, 63, 64, 65):
        for n in range(0, 200):
            mask = rng.integers(0, 4, start + n).astype(np.uint8)
            mask[rng.random(start + n) < 0.5] = 0
            expected = np.count_nonzero(mask[start:])
            assert _count_nonzero(mask, np.uint64(start), np.uint64(n)) == expected, (start, n)
    full = np.full(1000, 255, np.uint8)
    assert _count_nonzero(full, np.uint64(0), np.uint64(1000)) == 1000


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numbas_stack_arrays_are_c_contiguous_aligned_and_apart():
    """``_numba_memory._stack_array``, the kernels' scratch rows and the common entries' row
    arrays: the shape and dtype asked for, C-contiguous, 64-byte aligned, each array its own
    memory (filled one after another, each keeps its values); a shape known only at run time,
    or a dtype that is not one, does not compile."""
    import numba

    from ppo_fast._numba_memory import _stack_array

    @numba.njit
    def fill(value):
        rows = _stack_array((3, 5), np.float32)
        flags = _stack_array((7,), np.uint8)
        counts = _stack_array((2,), np.int64)
        rows[:] = value
        flags[:] = 2
        counts[:] = -1
        addresses = (rows.ctypes.data, flags.ctypes.data, counts.ctypes.data)
        return rows.copy(), flags.copy(), counts.copy(), rows.strides, addresses

    for value in (1.5, -3.0):
        rows, flags, counts, strides, addresses = fill(value)
        assert rows.dtype == np.float32 and rows.shape == (3, 5) and strides == (20, 4)
        np.testing.assert_array_equal(rows, value)
        np.testing.assert_array_equal(flags, np.full(7, 2, np.uint8))
        np.testing.assert_array_equal(counts, [-1, -1])
        assert all(address % 64 == 0 for address in addresses)
        assert len(set(addresses)) == 3

    @numba.njit
    def sized_at_run_time(n):
        return _stack_array((n,), np.float64).sum()

    @numba.njit
    def of_a_string():
        return _stack_array((3,), "float64").sum()

    for bad in (lambda: sized_at_run_time(3), of_a_string):
        with pytest.raises(numba.core.errors.TypingError, match="_stack_array"):
            bad()


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numbas_heap_bytes_hold_what_is_written_and_say_when_memory_runs_out():
    """``_numba_memory._heap_bytes`` and ``_heap_free``, the row arrays of numba's one-thread
    common entries above _STACK_ROWS rows (compiled without NRT): the size asked for (none
    too), written and read back through views of other dtypes, given back; a size malloc
    cannot give raises MemoryError instead of writing through a null pointer."""
    import numba

    from ppo_fast._numba_memory import _heap_bytes, _heap_free

    @numba.njit(_nrt=False)
    def round_trip(n_bytes):
        space = _heap_bytes(n_bytes)
        values = space[: n_bytes // 8 * 8].view(np.float64)
        for i in range(values.shape[0]):
            values[i] = 0.5 * i
        total = 0.0
        for i in range(values.shape[0]):
            total += values[i]
        size = space.shape[0]
        _heap_free(space)
        return size, total

    for n_bytes in (0, 8, 1000, 1 << 20):
        n = n_bytes // 8
        assert round_trip(n_bytes) == (n_bytes, 0.25 * n * (n - 1))
    with pytest.raises(MemoryError, match="out of memory"):
        round_trip(1 << 62)


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
@NUMBA_PARALLEL
def test_numba_runs_its_parallel_build_on_two_threads_and_its_serial_build_on_one(monkeypatch):
    """Every kernel: the build that must not run is replaced by one that fails. On two threads
    the call sets numba's thread count of the calling thread to two (the parallel builds made
    from the table set it themselves, compiled), whatever it was before."""
    import numba
    from batches import Batch

    from ppo_fast import _numba_kernels

    def refuse(*args):
        raise AssertionError("the wrong build ran")

    rng = np.random.default_rng(3)
    valid = rng.random((4, 50)) < 0.8
    # float32, as test_every_kernel_gives_the_same_bits_on_one_and_two_threads and the tiny
    # bench run of the same xdist group: the worker compiles each parallel build once for the
    # three (in float64 this test alone compiled every kernel's builds again, about 70 s).
    batch = Batch("mask", np.dtype(np.float32), valid, 4, {"mask": valid}, rng)
    for case in cases(batch):
        kernel = getattr(_numba_kernels, case.kernel.name)
        builds = getattr(kernel, "kernels", [kernel])
        for n_threads, unwanted in ((2, "serial"), (1, "parallel")):
            numba.set_num_threads(1)
            with monkeypatch.context() as patch:
                for build in builds:
                    patch.setattr(build, unwanted, refuse)
                case.run(_numba_kernels, n_threads)
            if n_threads == 2:
                assert numba.get_num_threads() == 2, case.kernel.name


def _run_placed(case, kernels, placed):
    """``case`` on ``kernels`` with some arrays replaced by ``placed`` (name: array), its
    outputs NaN-filled in place first (Case.run's junk), one thread; the outputs written."""
    arguments = {**case.arguments, **placed}
    written = [a.name for a in (*case.kernel.outputs, *case.kernel.row_outputs)]
    for name in written:
        if name not in placed:
            arguments[name] = np.full_like(arguments[name], np.nan)
        else:
            arguments[name].fill(0xAB if arguments[name].dtype == np.uint8 else np.nan)
    arguments["n_threads"] = 1
    getattr(kernels, case.kernel.name)(*case.kernel.bind(arguments))
    return {name: arguments[name].copy() for name in written}


def _assert_same_bits_wherever_the_arrays_lie(case, kernels, expected, backend):
    """An input that ends just before an output in memory (small arrays side by side) must not
    change a bit. LLVM vectorizes numba's loops behind a run-time check that the outputs do not
    overlap the inputs, which also fails for an input that starts less than a vector loop's
    step before an output, and then runs the loop's scalar copy: a sum in that loop added in
    another order (numba's REINFORCE and value loss until 0.8.14: the fast path and the general
    way, whose arrays lay elsewhere, differed in the loss's last bit). Each token input of the
    case in turn, 0, 5 and 13 positions before the first token output, where it is short
    enough to be that close."""
    outputs = [a.name for a in case.kernel.outputs if a.dtype == TOKEN]
    inputs = [a.name for a in case.kernel.inputs if a.dtype == TOKEN]
    if not outputs:
        return
    output = outputs[0]
    for name in inputs:
        source = case.arguments[name]
        for gap in (0, 5, 13):
            if not source.size or source.size + gap > 32:  # beyond any vector loop's step
                continue
            size = case.arguments[output].size
            buffer = np.empty(source.size + gap + size, source.dtype)
            buffer[: source.size] = source
            placed = {name: buffer[: source.size], output: buffer[source.size + gap :]}
            got = _run_placed(case, kernels, placed)
            for out_name, want in expected.items():
                where = f"{backend} {out_name}: {name} ends {gap} positions before {output}"
                with case.described(where):
                    np.testing.assert_array_equal(got[out_name], want)


_AVX2_PATH = """
import sys

import numpy as np
import ppo_fast
from ppo_fast import _numba_core
from ppo_fast.loss import clipped_surrogate, value_loss
from ppo_fast.policy import cispo_loss, dppo_loss, gspo_loss, kl_cov_loss, sapo_loss

assert not _numba_core._AVX512 and _numba_core._LOSS_UNSWITCH_THRESHOLD == 800
rng = np.random.default_rng(7)
for dtype in (np.dtype(sys.argv[1]).type,):  # float64: every loss's lanes and exp in float64 too
    B, T = 5, 300
    lengths = rng.integers(0, T + 1, B)
    mask = (np.arange(T) < lengths[:, None]) & (rng.random((B, T)) < 0.9)
    logp = (rng.standard_normal((B, T)) * 0.5 - 1).astype(dtype)
    old = (logp + rng.standard_normal((B, T)) * 0.3).astype(dtype)
    adv = rng.standard_normal((B, T)).astype(dtype)
    selected = rng.random((B, T)) < 0.1
    weights = rng.random((B, T)).astype(dtype) * 2
    scores = rng.standard_normal(B).astype(dtype)
    logp[0, 3], old[1, 5], adv[2, 7] = np.nan, np.inf, -np.inf
    logp[3, 9] = -800.0  # k3's exp past 708: the row redone with its correction
    groups = np.array([0, 0, 1, 1, 1])
    calls = [
        lambda b: clipped_surrogate(logp, old, adv, mask=mask, dual_clip=3.0, backend=b),
        lambda b: value_loss(logp, old, adv, mask=mask, clip=0.2, backend=b),
        lambda b: cispo_loss(logp, old, adv, mask=mask, backend=b),
        lambda b: sapo_loss(logp, old, adv, mask=mask, backend=b),
        lambda b: dppo_loss(logp, old, adv, mask=mask, backend=b),
        lambda b: dppo_loss(logp, old, adv, mask=mask, divergence="kl", backend=b),  # interleaved
        lambda b: kl_cov_loss(logp, old, adv, selected, mask=mask, backend=b),
        lambda b: gspo_loss(logp, old, adv, mask=mask, weights=weights, backend=b),  # log
        lambda b: (ppo_fast.kl_penalty(logp, old, "k3", backend=b),),
        lambda b: (ppo_fast.shape_rewards(scores, logp, old, kl_coef=0.1, estimator="k3",
                                          mask=mask, backend=b),),
        lambda b: ppo_fast.optimal_token_baseline(adv, old, weights, groups, mask=mask, backend=b),
    ]
    for call in calls:
        ours, twin = call("numba"), call("cython")
        for name, a, b in zip(getattr(ours, "_fields", ["result"]), ours, twin):
            np.testing.assert_equal(a, b, err_msg=name)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(
    "numba" not in COMPILED or "cython" not in COMPILED, reason="numba and Cython both needed"
)
# One process a dtype: each compiles for about 50 s, two tests that two workers can share (one
# process for both dtypes was the suite's longest test, 100 s, and left its worker last).
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numba_kernels_built_for_avx2_equal_the_cython_twins(dtype):
    """Where numba compiles for a CPU without AVX-512 its loss kernels take other forms
    (``_numba_core._AVX512``: exp's constants made opaque, a mask's bytes compared as 32-bit
    lanes, a larger unswitch threshold for the policy losses): compiled so in a fresh process
    (NUMBA_CPU_FEATURES without AVX-512, as on an AMD EPYC), on any x86-64 CPU with AVX2 and FMA,
    every masked loss with NaN and inf inputs gives the Cython build's bits, float32 and
    float64 (a process each), and so do k3's KL and shaped rewards and the optimal token baseline
    (exp's constants made so) and GSPO's log of weights. Where numba compiles so in this process
    already (a CPU without AVX-512), the whole suite checks these forms against the oracle and
    Cython."""
    from llvmlite import binding as llvm

    from ppo_fast import _numba_core

    if not _numba_core._AVX512:  # a second compile of what this process runs (a minute and more)
        pytest.skip("numba compiles without AVX-512 here: every test of the suite checks the forms")
    host = llvm.get_host_cpu_features()
    if not (host.get("avx2") and host.get("fma")):
        pytest.skip("the CPU has no AVX2 and FMA")
    features = ",".join(f"+{name}" for name in ("sse4.2", "avx", "avx2", "fma", "f16c", "bmi2"))
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES=features)
    out = subprocess.run(
        [sys.executable, "-c", _AVX2_PATH, dtype],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
