"""The stages' fast paths on packed rows (1-D token arrays and ``cu_seqlens``) against the
general way: the same bits, the same errors.

A stage with a fast path takes packed rows the fast way where ``_validate.common_packed`` accepts
them (exact 1-D arrays of one float dtype, an int64 or int32 C-contiguous cu_seqlens from 0 to N,
never decreasing; no mask or lengths beside it) and its hyperparameters are its common case's:
``gae``, ``shape_rewards``, ``whiten``, ``masked_moments``, ``clipped_surrogate``, ``value_loss``,
the policy family and ``kl_cov_selection``. It calls the backend's packed entry
(``_backend.common(..., packed=True)``: the common-case entry with the rows' starts and spans in the
mask's place, every position valid) or, for the KL rewards and KL-Cov's selection, the table kernel
itself. Each call here runs both ways (the general way with both common-case tests turned off:
``test_fast_path.general_way``) and compares them; that the fast path was taken exactly where it
should be is checked call by call."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import ALL_BACKENDS, COMPILED
from test_fast_path import (
    DTYPES,
    SHIFTS,
    _kernel_way,
    assert_both_ways,
    assert_moments_both_ways,
    general_way,
    outcome,
    same_bits,
    the_stages,
    token_arrays,
)

import ppo_fast
from ppo_fast import _backend, _examples, _validate
from ppo_fast._spec import AGGREGATIONS, FLAGS, GAE_CHUNKS, KERNELS
from ppo_fast.loss import _row_scales

COMMON = [name for name, kernel in KERNELS.items() if kernel.common]

# Row lengths: empty rows among others, one empty row, no rows, the 8 x 128 of the per-call
# figures, many short rows, and (compiled backends) a row long enough for GAE's chunks.
LENGTHS = [[5, 0, 7, 1, 0, 12], [0], [], [128] * 8, [3] * 40, [1]]
LONG = [GAE_CHUNKS.long_row + 100, 3]


def packed(rng, lengths, dtype):
    """The stages' arrays (``token_arrays``) packed: 1-D token arrays of sum(lengths) tokens,
    (B,) scores, and cu_seqlens as int64."""
    n = int(sum(lengths))
    arrays = token_arrays(rng, (1, n), dtype)
    arrays = {k: v.reshape(-1) if v.ndim == 2 else v for k, v in arrays.items()}
    scores = token_arrays(rng, (len(lengths), 1), dtype)
    for name in ("scores", "scores32", "scores_read_only"):
        arrays[name] = scores[name]
    return arrays, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def takes_the_fast_path(call, kwargs, lengths) -> bool:
    """Whether a packed call of ``the_stages`` is a common case: all are but a
    seq-mean-token-sum-norm loss without its loss_scale (packed rows have no T) and ``gae`` on a
    row long enough to run in chunks (the entries run each row whole)."""
    if call is ppo_fast.gae:
        return max(lengths, default=0) <= GAE_CHUNKS.long_row
    return not (kwargs.get("agg") == "seq-mean-token-sum-norm" and "loss_scale" not in kwargs)


@pytest.fixture
def fast_calls(monkeypatch):
    """The stages' calls of the packed entries and table kernels since the last clear."""
    calls: list[str] = []
    common, table_kernel = _backend.common, _backend.table_kernel

    def counted_common(name, backend, n_threads=0, dtype=None, masked=False, packed=False):
        calls.append(name) if packed else None
        return common(name, backend, n_threads, dtype, masked, packed)

    def counted_table_kernel(name, *arguments):
        calls.append(name)
        return table_kernel(name, *arguments)

    monkeypatch.setattr(_backend, "common", counted_common)
    monkeypatch.setattr(_backend, "table_kernel", counted_table_kernel)
    return calls


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_the_packed_fast_path_gives_the_general_ways_bits_or_errors(backend, dtype, fast_calls):
    """Every stage's common cases on packed rows, int64 and int32 cu_seqlens, read-only too, with
    and without preallocated outputs."""
    rng = np.random.default_rng(21)
    lengths_list = LENGTHS + ([LONG] if backend in COMPILED else [])
    calls = 0
    for lengths in lengths_list:
        arrays, cu = packed(rng, lengths, dtype)
        read_only = cu.astype(np.int32)
        read_only.setflags(write=False)
        for cu_seqlens in (cu, read_only):
            for call, kwargs in the_stages(arrays):
                kwargs.update(cu_seqlens=cu_seqlens, backend=backend)
                what = (call.__name__, lengths[:8], cu_seqlens.dtype, kwargs)
                expected = takes_the_fast_path(call, kwargs, lengths)

                def took_the_fast_path_where_expected(what=what, expected=expected):
                    assert bool(fast_calls) == expected, what
                    fast_calls.clear()

                fast_calls.clear()
                shape = arrays["lp"].shape
                assert_both_ways(
                    call, kwargs, shape, dtype, what, took_the_fast_path_where_expected
                )
                calls += 1
    assert calls > 500


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_masked_moments_packed_fast_path_gives_the_general_ways_bits(backend, dtype, fast_calls):
    """``masked_moments`` on packed rows (int64 and int32 cu_seqlens) and every shift of
    SHIFTS: the packed entry, called for each finite real shift, gives the general way's bits."""
    rng = np.random.default_rng(22)
    finite = 0
    for lengths in LENGTHS + ([LONG] if backend in COMPILED else []):
        arrays, cu = packed(rng, lengths, dtype)
        for cu_seqlens, shift in itertools.product((cu, cu.astype(np.int32)), SHIFTS):
            kwargs = dict(x=arrays["a"], cu_seqlens=cu_seqlens, shift=shift, backend=backend)
            assert_moments_both_ways(kwargs, (lengths[:8], cu_seqlens.dtype, shift))
            finite += type(shift) is not str and type(shift) is not bool and np.isfinite(shift)
    assert fast_calls == ["moments"] * finite


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_kl_cov_selections_packed_fast_path_gives_the_general_ways_bits(backend, dtype, fast_calls):
    """``kl_cov_selection`` on packed rows (its table kernel with their starts and spans), over
    ratios that select one token, some, all of them and more than there are."""
    rng = np.random.default_rng(23)
    for lengths in LENGTHS + ([LONG] if backend in COMPILED else []):
        arrays, cu = packed(rng, lengths, dtype)
        for cu_seqlens, ratio in itertools.product(
            (cu, cu.astype(np.int32)), (0.0002, 0.3, 1, 7.0)
        ):
            kwargs = dict(logprobs=arrays["lp"], advantages=arrays["a"], ratio=ratio)
            kwargs.update(cu_seqlens=cu_seqlens, backend=backend)
            fast_calls.clear()
            fast = outcome(ppo_fast.kl_cov_selection, **kwargs)
            assert fast_calls == ["kl_cov_top_k"], (lengths[:8], ratio)
            general = general_way(outcome, ppo_fast.kl_cov_selection, **kwargs)
            assert fast[0] == general[0] == "ok", (lengths[:8], ratio)
            same_bits(fast[1], general[1], f"{lengths[:8]} {ratio}")


def test_packed_rows_the_fast_path_cannot_take_go_the_general_way(fast_calls):
    """cu_seqlens of other dtypes, views, lists and bad values, 2-D token arrays, a mask or
    lengths beside cu_seqlens, and seq-mean-token-sum-norm without loss_scale: the general way,
    its results or its errors."""
    rng = np.random.default_rng(5)
    arrays, cu = packed(rng, [4, 0, 9, 2], np.float32)
    strided = np.zeros(2 * cu.size, np.int64)
    strided[::2] = cu
    others = {
        "int16": cu.astype(np.int16),
        "uint64": cu.astype(np.uint64),
        "list": cu.tolist(),
        "strided": strided[::2],
        "float": cu.astype(np.float64),
        "decreasing": np.array([0, 5, 4, 15]),
        "short": cu[:-1],
        "not from 0": cu + 1,
    }
    policy = dict(logprobs=arrays["lp"], old_logprobs=arrays["old"], advantages=arrays["a"])
    for name, cu_seqlens in others.items():
        for call, kwargs in (
            (ppo_fast.gae, dict(rewards=arrays["r"], values=arrays["v"])),
            (ppo_fast.clipped_surrogate, policy),
            (ppo_fast.whiten, dict(x=arrays["a"])),
        ):
            fast_calls.clear()
            fast = outcome(call, **kwargs, cu_seqlens=cu_seqlens)
            assert not fast_calls, (name, call.__name__)
            general = general_way(outcome, call, **kwargs, cu_seqlens=cu_seqlens)
            assert fast[0] == general[0], (name, call.__name__)
            if fast[0] == "ok":
                same_bits(fast[1], general[1], (name, call.__name__))
            else:
                assert fast[1] == general[1], (name, call.__name__)
        assert (name in ("int16", "uint64", "list", "strided")) == (fast[0] == "ok"), name
    # an output over cu_seqlens' bytes: the general way's error (not written over the input)
    tokens = {k: arrays[k].astype(np.float64) for k in ("r", "v", "lp", "old", "a")}
    for call, kwargs, keyword, count in (
        (ppo_fast.gae, dict(rewards=tokens["r"], values=tokens["v"]), "out", 2),
        (ppo_fast.whiten, dict(x=tokens["a"]), "out", 1),
        (ppo_fast.clipped_surrogate, dict(logprobs=tokens["lp"], old_logprobs=tokens["old"],
                                          advantages=tokens["a"]), "grad_out", 1),
        (ppo_fast.shape_rewards, dict(scores=np.ones(4), logprobs=tokens["lp"], kl_coef=0.1,
                                      ref_logprobs=tokens["old"]), "out", 1),
    ):  # fmt: skip
        buffer = np.zeros(tokens["r"].size)
        shared = buffer.view(np.int64)[: cu.size]
        shared[:] = cu
        outs = (buffer, *(np.zeros_like(buffer) for _ in range(count - 1)))
        fast_calls.clear()
        given = {keyword: outs if count > 1 else buffer}
        result = outcome(call, **kwargs, cu_seqlens=shared, **given)
        assert result[0] == "error" and "cu_seqlens" in result[1][1], call.__name__
        assert not fast_calls and np.array_equal(shared, cu), call.__name__
    beside = [{"mask": np.ones(arrays["lp"].shape, bool)}, {"lengths": np.array([4, 0, 9, 2])}]
    for extra in beside:
        fast_calls.clear()
        fast = outcome(ppo_fast.clipped_surrogate, **policy, cu_seqlens=cu, **extra)
        assert fast[0] == "error" and "at most one" in fast[1][1] and not fast_calls
    two_d = {k: v.reshape(1, -1) for k, v in policy.items()}
    fast_calls.clear()
    assert outcome(ppo_fast.clipped_surrogate, **two_d, cu_seqlens=cu)[0] == "error"
    assert not fast_calls
    norm = outcome(
        ppo_fast.clipped_surrogate, **policy, cu_seqlens=cu, agg="seq-mean-token-sum-norm"
    )
    assert norm[0] == "error" and "loss_scale" in norm[1][1] and not fast_calls


@pytest.mark.numba_dtype("float32")  # its arrays' dtype
@pytest.mark.parametrize("backend", COMPILED)
def test_the_packed_fast_path_gives_the_same_bits_on_one_and_two_threads(backend, monkeypatch):
    """Rows shared among two threads (a batch the thread policy gives two) and run on one: the
    same bits, GAE's long rows in chunks included."""
    from ppo_fast import _threads

    rng = np.random.default_rng(8)
    lengths = [GAE_CHUNKS.long_row + 7, 5000, 0, 40000]
    arrays, cu = packed(rng, lengths, np.float32)
    results = []
    for threads in (1, 2):
        monkeypatch.setattr(_threads, "threads_for", lambda units, n, t=threads: min(units, t))
        results.append(
            [outcome(call, **kwargs, cu_seqlens=cu, backend=backend)
             for call, kwargs in the_stages(arrays)]
        )  # fmt: skip
    for one, two in zip(*results, strict=True):
        assert one[0] == two[0]
        if one[0] == "ok":
            same_bits(one[1], two[1])


# The inputs hold NaN and inf on purpose: NumPy's sums of the row outputs say so.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", COMMON)
def test_every_packed_entry_equals_its_table_kernel_and_numpys_sums(name, dtype, backend):
    """Every aggregation mode over the batch's counts and a given normaliser (seq-mean-token-sum-
    norm without one too, which the stages never pass: the entries agree on it all the same),
    over packed rows with empty ones; and ``packed_scales`` is ``loss._row_scales`` wherever
    the general way has the mode."""
    kernel = KERNELS[name]
    entry = _backend.common(name, backend, 0, np.dtype(dtype), False, True)
    rng = np.random.default_rng(17)
    modes = [(code, normaliser) for normaliser in (0.0, 7.5) for code in range(len(AGGREGATIONS))]
    for lengths in LENGTHS:
        spans = np.array(lengths, dtype=np.int64)
        n = int(spans.sum())
        layout = (np.cumsum(spans) - spans, spans)
        for optional, (agg, normaliser) in itertools.product((False, True), modes):
            if not kernel.aggregates and agg:
                continue
            named = _examples.common_arguments(kernel, (1, n), dtype, rng, optional=optional)
            named = {k: v.reshape(-1) if isinstance(v, np.ndarray) else v for k, v in named.items()}
            named["mask"] = layout
            if kernel.aggregates:
                named["agg"], named["normaliser"] = agg, normaliser
                _, rows = _validate.batch({"x": named[kernel.inputs[0].name]}, cu_seqlens=np.
                                          concatenate([[0], np.cumsum(spans)]))  # fmt: skip
                normalisers = [None, None, None]
                if normaliser:
                    normalisers[(0, 1, 1, 2)[agg]] = normaliser
                if agg != 3 or normaliser:
                    scales, valid = _row_scales(AGGREGATIONS[agg], rows, *normalisers, dtype)
                    expected = _backend.packed_scales(agg, normaliser, spans, n)
                    same_bits((valid, scales), expected, f"{name} packed_scales {agg}")
            for array in kernel.inputs:  # non-finite values
                if named[array.name].size > 4:
                    values = named[array.name]
                    if array.dtype == FLAGS:  # a bool array's bytes (KL-Cov's selection)
                        values.view(np.uint8).flat[rng.integers(0, 4, 2)] = [255, 2]
                    else:
                        values.flat[rng.integers(0, 4, 2)] = [np.nan, np.inf]
            for n_threads in (1, 2):
                expected, expected_totals = _kernel_way(kernel, backend, named, n_threads, spans)
                arguments = [named[argument] for argument in kernel.common_arguments[:-1]]
                totals = entry(*arguments, n_threads)
                what = f"{name} {backend} {np.dtype(dtype)} {lengths} {agg=} {n_threads=}"
                same_bits([named[o] for o in expected], list(expected.values()), what)
                if expected_totals is None:
                    assert totals is None, what
                else:
                    same_bits(totals, expected_totals, what)
