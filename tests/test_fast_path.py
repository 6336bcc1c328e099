"""The stages' fast paths against the general way: the same bits, the same errors.

``gae``, the KL rewards, ``clipped_surrogate``, ``value_loss``, ``whiten``, ``masked_moments`` and
the policy-loss family (``reinforce_loss`` ... ``dppo_loss``, any aggregation mode over the batch's
own counts, without weights) recognise the common case (``_validate.common_case``: C-contiguous (B,
T) NumPy arrays of one float dtype, no mask or a bool one, real hyperparameters (floats, ints, NumPy
scalars), preallocated outputs apart from the inputs) and call the backend's common-case entries
(``_backend.common``: the Cython kernels' own ``<kernel>_common``, which counts the valid positions,
works out a loss's row scales and totals the row outputs in C; for numba and the oracle, one written
from the table kernel). Turning ``common_case`` off sends every call the general way (``batch``
starts from it too), so each test runs a call both ways and compares: results bit for bit, errors by
type and message. That the fast path was taken is checked, so that no comparison is of the general
way with itself. The entries themselves are compared with their table kernel and NumPy's sums,
kernel by kernel."""

from __future__ import annotations

import importlib
import inspect
import itertools
import os
import subprocess
import sys

import hostile
import numpy as np
import pytest
from conftest import ALL_BACKENDS, COMPILED

import ppo_fast
from ppo_fast import _backend, _examples, _validate
from ppo_fast._spec import AGGREGATIONS, FLAGS, KERNELS, SCALES, TOKEN
from ppo_fast.loss import _row_scales, _totals

DTYPES = [np.float32, np.float64]
COMMON = [name for name, kernel in KERNELS.items() if kernel.common]
# B = 0, T = 0, rows under NumPy's 8 accumulators, over them, and over its pairwise block of 128
# (the totals' order of addition), and the 8 x 128 of the per-call figures.
SHAPES = [(8, 128), (3, 5), (0, 4), (2, 0), (1, 1), (9, 3), (17, 2), (130, 3), (300, 2)]


@pytest.fixture
def fast_calls(monkeypatch):
    """The kernels whose common-case entry a fast path took since the fixture started, or whose
    table kernel it called itself (``_backend.table_kernel``: ``kl_cov_selection``'s)."""
    calls: list[str] = []
    common = _backend.common
    table_kernel = _backend.table_kernel

    def counted(name, backend, n_threads=0, *types):
        calls.append(name)
        return common(name, backend, n_threads, *types)

    def counted_table_kernel(name, backend, n_threads=0, *types):
        calls.append(name)
        return table_kernel(name, backend, n_threads, *types)  # types: dtype, masked[, code]

    monkeypatch.setattr(_backend, "common", counted)
    monkeypatch.setattr(_backend, "table_kernel", counted_table_kernel)
    return calls


def general_way(function, /, *args, **kwargs):
    """``function(*args, **kwargs)`` with the common case turned off: padded, packed, and
    lengths taken as a mask."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_validate, "common_case", lambda arrays, mask: False)
        patch.setattr(_validate, "common_packed", lambda arrays, cu_seqlens: None)
        patch.setattr(_validate, "lengths_mask", lambda arrays, lengths: False)
        return function(*args, **kwargs)


def masks(rng, shape):
    """No mask, right padding with a fully masked row, holes, bool bytes other than 0/1, and no
    valid position at all."""
    n_rows, width = shape
    lengths = rng.integers(0, width + 1, n_rows)
    if n_rows:
        lengths[0] = 0
    padded = np.arange(width)[None, :] < lengths[:, None]
    holes = rng.random(shape) < 0.7
    odd_bytes = (rng.integers(0, 3, shape).astype(np.uint8) * 127).view(bool)
    return [None, padded, holes, odd_bytes, np.zeros(shape, dtype=bool)]


# The shapes whose calls also get masks of numbers and lengths: the conversions are
# shape-blind, the rest of the fast path is the bool mask's (each layout over every shape of
# SHAPES costs the suite about 10 s).
CONVERTED_SHAPES = {(8, 128), (3, 5), (0, 4), (17, 2)}


def stage_layouts(rng, shape):
    """``masks`` as {"mask": ...}, then for CONVERTED_SHAPES 0/1 masks of numbers (verl's int64
    or float ``response_mask``; -0.0 is 0) and lengths (int64 and int32; 0 and T), which a
    stage's fast path takes as a bool mask."""
    none, padded, holes, *others = masks(rng, shape)
    layouts = [{"mask": mask} for mask in (none, padded, holes, *others)]
    if shape not in CONVERTED_SHAPES:
        return layouts
    numbers = [padded.astype(np.int64), holes.astype(np.float32), padded.astype(np.uint8)]
    numbers.append(np.where(holes, 1.0, -0.0))
    n_rows, width = shape
    lengths = rng.integers(0, width + 1, n_rows)
    if n_rows > 1:
        lengths[:2] = (0, width)
    return [
        *layouts,
        *({"mask": mask} for mask in numbers),
        {"lengths": lengths},
        {"lengths": lengths.astype(np.int32)},
    ]


def same_bits(fast, general, what=""):
    """Equal bit for bit (the sign of a zero included), but for the sign and payload of a NaN: an
    operation on two NaNs returns one of them (x86: the first operand), and which is first is the
    compiler's choice, which may differ between two inlinings of one row kernel; a NaN where the
    other has a NaN."""
    for a, b in zip(fast, general, strict=True):
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, what
            nan = np.isnan(a)
            assert np.array_equal(nan, np.isnan(b)), what
            assert a[~nan].tobytes() == b[~nan].tobytes(), what
        else:
            assert type(a) is type(b) is float, (a, b, what)
            assert np.isnan(a) == np.isnan(b), (a, b, what)
            assert np.isnan(a) or np.float64(a).tobytes() == np.float64(b).tobytes(), (a, b, what)


def token_arrays(rng, shape, dtype):
    """The stages' arrays, with NaN, inf and a huge value at a few positions (valid or not)."""
    arrays = {name: rng.normal(size=shape).astype(dtype) for name in ("r", "v", "lp", "a")}
    arrays["old"] = arrays["lp"] + rng.normal(scale=0.3, size=shape).astype(dtype)
    # KL-Cov's selections: 0/1 bools, and bool bytes other than 0/1
    arrays["selected"] = rng.random(shape) < 0.3
    arrays["odd_selected"] = (rng.integers(0, 3, shape).astype(np.uint8) * 127).view(bool)
    if shape[0] * shape[1] > 6:
        for name, value in (("r", np.nan), ("v", np.inf), ("lp", 50.0), ("a", -np.inf)):
            arrays[name].flat[rng.integers(0, arrays[name].size)] = value
    # shape_rewards' (B,) scores: data, so NaN and inf too; float64 and float32, read-only
    scores = rng.normal(size=shape[0])
    scores[: min(2, shape[0])] = (np.nan, np.inf)[: min(2, shape[0])]
    arrays["scores"] = scores
    arrays["scores32"] = scores.astype(np.float32)
    arrays["scores_read_only"] = scores.copy()
    arrays["scores_read_only"].setflags(write=False)
    return arrays


def outcome(function, /, **kwargs):
    """("ok", the result as a list) or ("error", the exception's type and message)."""
    try:
        result = function(**kwargs)
    except (ValueError, TypeError) as error:
        return "error", (type(error), str(error))
    return "ok", [result] if isinstance(result, np.ndarray) else list(result)


# The stages with a fast path: the keyword of their preallocated outputs, and how many.
OUT_KEYWORDS = {
    ppo_fast.gae: ("out", 2),
    ppo_fast.shape_rewards: ("out", 1),
    ppo_fast.clipped_surrogate: ("grad_out", 1),
    ppo_fast.value_loss: ("grad_out", 1),
    ppo_fast.whiten: ("out", 1),
    **{
        loss: ("grad_out", 1)
        for loss in (
            ppo_fast.reinforce_loss,
            ppo_fast.cispo_loss,
            ppo_fast.sapo_loss,
            ppo_fast.gspo_loss,
            ppo_fast.geo_mean_loss,
            ppo_fast.dppo_loss,
            ppo_fast.kl_cov_loss,
        )
    },
}
# The policy-loss family's common cases (an aggregation mode over the batch's counts, no
# weights): each loss's defaults, then hyperparameters at or near their bounds.
FAMILY = [
    (ppo_fast.reinforce_loss, [{}, {"beta": 0.1}]),
    (ppo_fast.cispo_loss, [{}, {"clip_low": 1.0, "clip_high": np.inf, "log_ratio_clamp": 20.0}]),
    (ppo_fast.sapo_loss, [{}, {"tau_pos": 0.1, "tau_neg": 3.0, "log_ratio_clamp": 0.1}]),
    (
        ppo_fast.gspo_loss,
        [{}, {"form": "sequence", "clip_low": 0.2, "dual_clip": 3.0, "log_ratio_max": 0.05}],
    ),
    (ppo_fast.geo_mean_loss, [{}, {"agg": "token-mean", "clip_low": np.inf}]),
    (
        ppo_fast.dppo_loss,
        [{}, {"divergence": "kl", "divergence_low": 0.0, "divergence_high": 0.3, "ratio_cap": 1.0}],
    ),
]


def the_stages(arrays):
    """(stage, keyword arguments, preallocated outputs?): common cases of every stage with a fast
    path, its hyperparameters at and inside their bounds."""
    policy = dict(logprobs=arrays["lp"], old_logprobs=arrays["old"], advantages=arrays["a"])
    value = dict(values=arrays["v"], old_values=arrays["old"], returns=arrays["r"])
    # ints and NumPy scalars too: the fast path reads them as floats, as the general way does
    for gamma, lam in [(0.99, 0.95), (1.0, 1.0), (-0.0, 0.0), (1, np.float64(0.95)), (0, 1)]:
        yield ppo_fast.gae, dict(rewards=arrays["r"], values=arrays["v"], gamma=gamma, lam=lam)
    kl = dict(logprobs=arrays["lp"], ref_logprobs=arrays["old"])
    for scores, kl_coef, estimator, clamp in [
        ("scores", 0.05, "k3", 10.0),
        ("scores32", 0.0, "k1", None),
        ("scores_read_only", 1, "k2", np.inf),
        ("scores", np.float32(0.5), "abs", np.int64(3)),
        ("scores", 1.5, "k3", None),
    ]:
        options = dict(kl_coef=kl_coef, estimator=estimator, clamp=clamp)
        yield ppo_fast.shape_rewards, dict(scores=arrays[scores], **kl, **options)
    for clip_low, clip_high, dual_clip, clamp in [
        (0.2, None, None, None),
        (0.2, 0.28, 3.0, 20.0),
        (0.2, np.inf, np.inf, np.inf),
        (np.float64(0.2), np.float32(0.28), 3, np.int64(20)),
        (0, 1, np.float32(1.5), np.int32(1)),
    ]:
        options = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        yield ppo_fast.clipped_surrogate, dict(**policy, **options, log_ratio_clamp=clamp)
    for clip in [None, 0.2, 0.0, np.inf, 0, np.float64(0.2), np.float32(0.5)]:
        yield ppo_fast.value_loss, dict(**value, clip=clip)
    # every aggregation mode but token-mean (which the rest use: the losses' defaults but
    # geo_mean's) for every loss with a fast path, with its defaults otherwise; then each loss
    # with a mode and its normaliser given (a float, or an int), in turn
    losses = [
        (ppo_fast.clipped_surrogate, policy),
        (ppo_fast.value_loss, value),
        *((loss, policy) for loss, _ in FAMILY),
        (ppo_fast.kl_cov_loss, dict(**policy, selected=arrays["selected"])),
    ]
    for agg in AGGREGATIONS[1:]:
        for loss, inputs in losses:
            yield loss, dict(**inputs, agg=agg)
    normalised = [
        {"agg": "token-mean", "num_tokens": 1000.0},
        {"agg": "seq-mean-token-mean", "num_seqs": 8},
        {"agg": "seq-mean-token-sum", "num_seqs": 3.5},
        {"agg": "seq-mean-token-sum-norm", "loss_scale": 128},
    ]
    for k, (loss, inputs) in enumerate(losses):
        yield loss, dict(**inputs, **normalised[k % len(normalised)])
    for shift_mean, unbiased, eps in [
        (True, False, 1e-8),
        (False, True, 0.0),
        (True, True, 1e30),
        (True, True, 0),
        (False, False, np.float32(1e-5)),
    ]:
        options = dict(shift_mean=shift_mean, unbiased=unbiased, eps=eps)
        yield ppo_fast.whiten, dict(x=arrays["a"], **options)
    for loss, settings in FAMILY:
        for options in settings:
            yield loss, dict(**policy, **options)
    for selected, coef in [("selected", 0.1), ("odd_selected", 1.5), ("selected", 0.0)]:
        yield ppo_fast.kl_cov_loss, dict(**policy, selected=arrays[selected], coef=coef)


def with_outputs(call, kwargs, shape, dtype):
    """``kwargs`` and fresh NaN-filled preallocated outputs for ``call``, and those outputs."""
    keyword, count = OUT_KEYWORDS[call]
    outs = tuple(np.full(shape, np.nan, dtype) for _ in range(count))
    return {**kwargs, keyword: outs if count > 1 else outs[0]}, outs


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_the_fast_path_gives_the_general_ways_bits_or_errors(backend, dtype, fast_calls):
    """Every stage's common cases, with and without preallocated outputs."""
    rng = np.random.default_rng(12)
    shapes = SHAPES if backend != "python" else SHAPES[1:]  # the oracle's loops: small batches
    calls = 0
    for shape in shapes:
        arrays = token_arrays(rng, shape, dtype)
        for layout in stage_layouts(rng, shape):
            for call, kwargs in the_stages(arrays):
                kwargs.update(**layout, backend=backend)
                # Formatted only when an assertion fails: the arrays of every call's keywords
                # formatted for each message took three quarters of this test's time.
                assert_both_ways(call, kwargs, shape, dtype, (call.__name__, shape, kwargs))
                calls += 2
    assert len(fast_calls) - fast_calls.count("whiten") == calls  # each call took the fast way


def assert_both_ways(call, kwargs, shape, dtype, what, after_fast_call=lambda: None):
    """``call(**kwargs)`` the fast way and the general way, without and then with preallocated
    outputs: the same outcome, bit for bit or the same error, and the outputs given are the
    results. ``after_fast_call`` runs after each call the fast way (a check of what it took)."""
    fast = outcome(call, **kwargs)
    after_fast_call()
    general = general_way(outcome, call, **kwargs)
    assert fast[0] == general[0], what
    fast_out, outs = with_outputs(call, kwargs, shape, dtype)
    general_out, general_outs = with_outputs(call, kwargs, shape, dtype)
    filled = outcome(call, **fast_out)
    after_fast_call()
    assert filled[0] == general_way(outcome, call, **general_out)[0], what
    if fast[0] == "error":
        assert fast[1] == general[1], what
        return
    same_bits(fast[1], general[1], what)
    same_bits(outs, general_outs, what)
    same_bits(outs, [a for a in filled[1] if isinstance(a, np.ndarray)], what)
    assert all(any(a is out for a in filled[1]) for out in outs), what


# masked_moments' shifts: reals of each type the fast path reads as floats, a negative zero,
# and what it leaves to the general way's errors (not finite, a string, a bool).
SHIFTS = [0.0, -0.0, 1.5, 1, np.float32(0.25), np.int64(-3), np.inf, np.nan, "1", True]


def moments_outcome(**kwargs):
    """``outcome`` of ``masked_moments``: its Moments' four fields as a list, or the error."""
    result = outcome(lambda **arguments: [ppo_fast.masked_moments(**arguments)], **kwargs)
    if result[0] == "error":
        return result
    (moments,) = result[1]
    return "ok", [moments.count, moments.sum, moments.sum_sq, moments.shift]


def assert_moments_both_ways(kwargs, what):
    """``masked_moments(**kwargs)`` the fast way and the general way: the same bits (floats
    each) or the same error (the callers count the fast way's calls)."""
    fast = moments_outcome(**kwargs)
    general = general_way(moments_outcome, **kwargs)
    assert fast[0] == general[0], what
    if fast[0] == "error":
        assert fast[1] == general[1], what
    else:
        same_bits(fast[1], general[1], what)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_masked_moments_fast_path_gives_the_general_ways_bits_or_errors(backend, dtype, fast_calls):
    """``masked_moments`` over every layout of ``stage_layouts`` (bool masks with holes and odd
    bytes, no valid position, masks of numbers, lengths) and every shift of SHIFTS: the fast
    way, taken for each finite real shift, gives the general way's Moments bit for bit."""
    rng = np.random.default_rng(13)
    shapes = SHAPES if backend != "python" else SHAPES[1:]
    finite = 0
    for shape in shapes:
        x = token_arrays(rng, shape, dtype)["a"]
        for layout, shift in itertools.product(stage_layouts(rng, shape), SHIFTS):
            kwargs = dict(x=x, **layout, shift=shift, backend=backend)
            assert_moments_both_ways(kwargs, (shape, layout, shift))
            finite += type(shift) is not str and type(shift) is not bool and np.isfinite(shift)
    assert fast_calls == ["moments"] * finite


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_kl_cov_selections_fast_path_gives_the_general_ways_bits(backend, dtype, fast_calls):
    """``kl_cov_selection`` on the common case (its table kernel called with the arguments the
    fast path makes) against the general way, over the masks and ratios that select one token,
    some, all of them, and more than there are; ints and NumPy scalars too."""
    rng = np.random.default_rng(13)
    shapes = SHAPES if backend != "python" else SHAPES[1:]
    calls = 0
    for shape in shapes:
        arrays = token_arrays(rng, shape, dtype)
        for layout in stage_layouts(rng, shape):
            for ratio in (0.0002, 0.3, 1.0, 7.0, 1, np.float32(0.25)):
                kwargs = dict(logprobs=arrays["lp"], advantages=arrays["a"], ratio=ratio)
                kwargs.update(**layout, backend=backend)
                fast = outcome(ppo_fast.kl_cov_selection, **kwargs)
                general = general_way(outcome, ppo_fast.kl_cov_selection, **kwargs)
                assert fast[0] == general[0] == "ok", (shape, kwargs)
                same_bits(fast[1], general[1], f"{shape} {kwargs}")
                calls += 1
    assert fast_calls.count("kl_cov_top_k") == calls  # each call took the fast way


# kl_penalty's calls: every estimator, and clamps as floats, ints, NumPy scalars, inf and
# None; with its bad values (0, a negative, NaN, an unknown estimator), which go the general way.
KL_PENALTY_OPTIONS = [
    ("k1", None),
    ("k2", 10.0),
    ("k3", 10),
    ("abs", np.inf),
    ("k3", np.float32(0.3)),
    ("k3", 0.0),
    ("k1", -1.0),
    ("k2", np.nan),
    ("k4", None),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_kl_penaltys_fast_path_gives_the_general_ways_bits_or_errors(backend, dtype, fast_calls):
    """``kl_penalty`` on (B, T) arrays of the common case (its table kernel called with the
    layout the fast path makes), with and without ``out=``, against the general way; arrays of
    other shapes (1-D, 3-D) or order go the general way on both."""
    rng = np.random.default_rng(14)
    shapes = SHAPES if backend != "python" else SHAPES[1:]
    fast_ones = 0
    for shape in shapes:
        arrays = token_arrays(rng, shape, dtype)
        pairs = [(arrays["lp"], arrays["old"], True)]
        pairs.append((arrays["lp"].reshape(-1), arrays["old"].reshape(-1), False))
        pairs.append((arrays["lp"][..., None], arrays["old"][..., None], False))
        pairs.append((np.asfortranarray(arrays["lp"]), arrays["old"], shape[0] * shape[1] <= 1))
        for logprobs, ref_logprobs, common in pairs:
            for estimator, clamp in KL_PENALTY_OPTIONS:
                legal = estimator != "k4" and (clamp is None or clamp > 0)
                kwargs = dict(logprobs=logprobs, ref_logprobs=ref_logprobs, backend=backend)
                kwargs.update(estimator=estimator, clamp=clamp)
                what = (shape, logprobs.shape, estimator, clamp)
                before = len(fast_calls)
                fast = outcome(ppo_fast.kl_penalty, **kwargs)
                assert len(fast_calls) - before == (common and legal), what
                fast_ones += len(fast_calls) - before
                general = general_way(outcome, ppo_fast.kl_penalty, **kwargs)
                assert fast[0] == general[0] == ("ok" if legal else "error"), what
                if not legal:
                    assert fast[1] == general[1], what
                    continue
                same_bits(fast[1], general[1], what)
                out = np.full(logprobs.shape, np.nan, dtype)
                filled = outcome(ppo_fast.kl_penalty, **kwargs, out=out)
                assert filled[0] == "ok" and filled[1][0] is out, what
                same_bits([out], general[1], what)
    assert fast_ones > 0


@pytest.mark.skipif("numba" not in COMPILED, reason="the numba backend does not load here")
@pytest.mark.numba
def test_a_fast_paths_dtype_and_mask_fix_the_numba_type_of_every_argument(monkeypatch, dtype):
    """numba's one-thread entries are called, after their first call, through the compiled
    wrapper of the overload that call ran (``_numba_kernels.exact_entry``), which trusts its
    arguments to be of that overload's types: ``_backend.common`` keys it by the token dtype and
    whether there is a mask (and packed rows or not). So every fast path's call of an entry under
    one key must pass arguments of one set of numba types, whatever else varies: shapes (one row:
    C- and F-contiguous at once), masks, cu_seqlens of int64 and int32, preallocated outputs,
    hyperparameters and normalisers (floats and ints), each stage's own scalars; and those calls
    must go through the exact entry."""
    import numba

    from ppo_fast import _numba_kernels

    types_by_key: dict[tuple, set] = {}

    def typed(entries):
        def typed_entry(name, backend, n_threads=0, dtype=None, masked=False, *code):
            entry = entries(name, backend, n_threads, dtype, masked, *code)

            def call(*arguments):
                if n_threads == 1 and dtype is not None:  # what keys an exact entry
                    types = tuple(numba.typeof(a) for a in arguments)
                    key = (name, dtype, masked, *code)
                    types_by_key.setdefault(key, set()).add(types)
                return entry(*arguments)

            return call

        return typed_entry

    monkeypatch.setattr(_backend, "common", typed(_backend.common))
    monkeypatch.setattr(_backend, "table_kernel", typed(_backend.table_kernel))
    monkeypatch.setattr(_backend, "_commons", {})  # learned anew
    monkeypatch.setattr(_backend, "_serial_tables", {})
    rng = np.random.default_rng(3)
    for shape in [(8, 128), (1, 5), (3, 1), (9, 3), (130, 3)]:
        arrays = token_arrays(rng, shape, dtype)
        for mask in masks(rng, shape)[:3]:
            for call, kwargs in the_stages(arrays):
                kwargs.update(mask=mask, backend="numba")
                for options in (kwargs, with_outputs(call, kwargs, shape, dtype)[0]):
                    outcome(call, **options)
            for ratio in (0.0002, 1, np.float32(0.5)):
                selection = dict(logprobs=arrays["lp"], advantages=arrays["a"], ratio=ratio)
                outcome(ppo_fast.kl_cov_selection, **selection, mask=mask, backend="numba")
        # the same rows packed (cu_seqlens int64 and int32, empty rows among them)
        lengths = rng.integers(0, shape[1] + 1, shape[0])
        valid = np.arange(shape[1])[None, :] < lengths[:, None]
        flat = {k: v[valid] if v.shape == shape else v for k, v in arrays.items()}
        flat.update({k: arrays[k] for k in ("scores", "scores32", "scores_read_only")})
        cu = np.concatenate([[0], np.cumsum(lengths)])
        for cu_seqlens in (cu, cu.astype(np.int32)):
            for call, kwargs in the_stages(flat):
                kwargs.update(cu_seqlens=cu_seqlens, backend="numba")
                outcome(call, **kwargs)
                outcome(call, **with_outputs(call, kwargs, flat["lp"].shape, dtype)[0])
        for estimator, clamp in KL_PENALTY_OPTIONS:
            kl = dict(logprobs=arrays["lp"], ref_logprobs=arrays["old"], backend="numba")
            outcome(ppo_fast.kl_penalty, **kl, estimator=estimator, clamp=clamp)
            out = np.empty(shape, dtype)
            outcome(ppo_fast.kl_penalty, **kl, estimator=estimator, clamp=clamp, out=out)
    assert {key[0] for key in types_by_key} == {
        *COMMON,
        "kl_cov_top_k",
        "shape_rewards",
        "kl_penalty",
    }
    assert {key[1] for key in types_by_key} == {np.dtype(dtype)}
    # shape_rewards' one-thread builds: one per estimator that the stages ask for
    for name in ("shape_rewards", "kl_penalty"):
        assert {key[3] for key in types_by_key if key[0] == name} == {0, 1, 2, 3}
    for key, seen in types_by_key.items():
        assert len(seen) == 1, (key, seen)
    packed_entries = 0
    for (name, _, _, _, one_thread, dtype, _, packed), entry in _backend._commons.items():
        if one_thread and dtype is not None:
            dispatcher = (_numba_kernels.serial_packed if packed else _numba_kernels.serial_common)(
                name
            )
            assert entry in {o.entry_point for o in dispatcher.overloads.values()}, name
            packed_entries += packed
    assert packed_entries >= len(COMMON)  # each kernel's
    assert _backend._serial_tables
    for (name, *_, code), entry in _backend._serial_tables.items():
        dispatcher = _numba_kernels.serial_table_kernel(name, code)
        assert entry in {o.entry_point for o in dispatcher.overloads.values()}, name


@pytest.mark.numba_dtype("float32")  # its arrays' dtype
@pytest.mark.parametrize("backend", COMPILED)
def test_gae_rows_long_enough_to_run_in_chunks_go_the_general_way(backend, fast_calls):
    """The common entries run each row whole: a row longer than GAE_CHUNKS.long_row runs in
    chunks (other bits), so those batches take the general way, and one position shorter the
    fast path, with the general way's bits."""
    from ppo_fast._spec import GAE_CHUNKS

    rng = np.random.default_rng(5)
    for width in (GAE_CHUNKS.long_row, GAE_CHUNKS.long_row + 1):
        arrays = token_arrays(rng, (2, width), np.float32)
        mask = rng.random((2, width)) < 0.9
        kwargs = dict(rewards=arrays["r"], values=arrays["v"], gamma=0.99, mask=mask)
        calls = len(fast_calls)
        fast = ppo_fast.gae(backend=backend, **kwargs)
        assert len(fast_calls) - calls == (width == GAE_CHUNKS.long_row)
        same_bits(fast, general_way(ppo_fast.gae, backend=backend, **kwargs))


def _both_stages(arrays, mask, backend):
    gae = ppo_fast.gae(arrays["r"], arrays["v"], gamma=0.99, mask=mask, backend=backend)
    loss = ppo_fast.clipped_surrogate(
        arrays["lp"], arrays["old"], arrays["a"], mask=mask, backend=backend
    )
    return [*gae, *loss]


@pytest.mark.numba_dtype("float32")  # its arrays' dtype
@pytest.mark.parametrize("backend", COMPILED)
def test_the_fast_path_gives_the_same_bits_on_one_and_two_threads(backend, fast_calls):
    rng = np.random.default_rng(5)
    shape = (16, 1 << 14)  # 4 x MIN_POSITIONS_PER_THREAD: parallel on 2 threads
    arrays = token_arrays(rng, shape, np.float32)
    mask = rng.random(shape) < 0.9
    results = []
    try:
        for n_threads in (1, 2):
            ppo_fast.set_num_threads(n_threads)
            results.append(_both_stages(arrays, mask, backend))
    finally:
        ppo_fast.set_num_threads(None)
    assert fast_calls == ["gae", "clipped_surrogate"] * 2
    same_bits(*results)
    same_bits(results[0], general_way(_both_stages, arrays=arrays, mask=mask, backend=backend))
    assert len(fast_calls) == 4


def _kernel_way(kernel, backend, named, n_threads, spans=None):
    """What a common-case entry must give, from the table kernel itself: the flat arrays, the
    padded layout (or, with ``spans``, packed rows of those spans), each row input repeated for
    every row (a loss's scales the general way's, ``loss._row_scales``, for the aggregation mode
    ``agg``; packed: ``_backend.packed_scales``', which tests/test_fast_path_packed.py holds to
    it), then the row outputs summed by NumPy as the general way sums them (``loss._totals``)."""
    first = named[kernel.inputs[0].name]
    if spans is None:
        n_rows, width = first.shape
        mask = named["mask"]
        flat_mask = np.zeros(0, np.uint8) if mask is None else mask.reshape(-1).view(np.uint8)
        starts = np.arange(n_rows, dtype=np.int64) * width
        spans = np.full(n_rows, width, dtype=np.int64)
    else:
        n_rows, flat_mask, starts = len(spans), np.zeros(0, np.uint8), np.cumsum(spans) - spans
    scales = valid = None
    if kernel.aggregates and type(named["mask"]) is tuple:
        valid, scales = _backend.packed_scales(named["agg"], named["normaliser"], spans, first.size)
    elif kernel.aggregates:
        _, rows = _validate.batch({"x": first}, mask=named["mask"])
        normalisers = [None, None, None]  # num_tokens, num_seqs, loss_scale
        if named["normaliser"]:
            normalisers[(0, 1, 1, 2)[named["agg"]]] = named["normaliser"]
        scales, valid = _row_scales(AGGREGATIONS[named["agg"]], rows, *normalisers, first.dtype)
    arguments = {a.name: named[a.name].reshape(-1) for a in kernel.inputs}
    for a in kernel.inputs:  # flags as the table kernel takes them: bytes
        if a.dtype == FLAGS:
            arguments[a.name] = arguments[a.name].view(np.uint8)
    arguments.update(starts=starts, spans=spans, lengths=spans, mask=flat_mask)
    for array in kernel.row_inputs:
        dtype = first.dtype if array.dtype == TOKEN else np.float64
        if array.name == SCALES:
            arguments[array.name] = scales.astype(dtype)
        else:
            arguments[array.name] = np.full(n_rows, named[array.name], dtype=dtype)
    arguments.update({s.name: named[s.name] for s in kernel.scalars})
    outputs = {a.name: np.empty_like(first) for a in kernel.outputs}
    arguments.update({name: output.reshape(-1) for name, output in outputs.items()})
    row_outputs = np.empty((len(kernel.row_outputs), n_rows))
    arguments.update(zip((a.name for a in kernel.row_outputs), row_outputs, strict=True))
    arguments["n_threads"] = n_threads
    getattr(_backend.resolve(backend), kernel.name)(*kernel.bind(arguments))
    if not kernel.row_outputs:
        return outputs, None
    if kernel.aggregates:
        return outputs, (valid, *_totals(row_outputs, scales))
    return outputs, tuple(row_outputs.sum(axis=1).tolist())


# The inputs hold NaN and inf on purpose: NumPy's sums of the row outputs say so.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", COMMON)
def test_every_common_entry_equals_its_table_kernel_and_numpys_sums(name, dtype, backend):
    kernel = KERNELS[name]
    entry = _backend.common(name, backend)
    rng = np.random.default_rng(7)
    # every aggregation mode over the batch's own counts (normaliser 0.0) and a given one
    agg_codes = itertools.cycle(
        [(code, normaliser) for normaliser in (0.0, 7.5) for code in range(len(AGGREGATIONS))]
    )
    for shape in SHAPES if backend != "python" else SHAPES[1:]:
        for mask in masks(rng, shape):
            # a loss: every aggregation mode, in turn over the masks and optional inputs
            for optional in (False, True):
                named = _examples.common_arguments(kernel, shape, dtype, rng, optional=optional)
                named["mask"] = mask
                if kernel.aggregates:
                    named["agg"], named["normaliser"] = next(agg_codes)
                for array in kernel.inputs:  # non-finite values, at valid positions or not
                    if named[array.name].size > 4:  # flags: bytes other than 0 and 1
                        values = named[array.name]
                        if array.dtype == FLAGS:  # a bool array's bytes (KL-Cov's selection)
                            values.view(np.uint8).flat[rng.integers(0, 4, 2)] = [255, 2]
                        else:
                            values.flat[rng.integers(0, 4, 2)] = [np.nan, np.inf]
                # numba: one thread, its compiled entry (serial_common); two, the entry around
                # its parallel build (parallel_common)
                for n_threads in (1, 2):
                    expected, expected_totals = _kernel_way(kernel, backend, named, n_threads)
                    arguments = [named[argument] for argument in kernel.common_arguments[:-1]]
                    totals = entry(*arguments, n_threads)
                    what = f"{name} {backend} {np.dtype(dtype)} {shape} {optional=} {n_threads=}"
                    outputs = [named[output] for output in expected]
                    same_bits(outputs, list(expected.values()), what)
                    if expected_totals is None:
                        assert totals is None, what
                    else:
                        same_bits(totals, expected_totals, what)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("name", COMMON)
def test_every_common_entry_takes_the_tables_common_arguments(name, backend):
    entry = _backend.common(name, backend)
    assert list(inspect.signature(entry).parameters) == list(KERNELS[name].common_arguments)
    if backend == "cython":
        assert entry is getattr(_backend.resolve("cython"), f"{name}_common")


@pytest.mark.numba
@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numbas_entries_of_several_threads_are_compiled_and_give_way_to_a_running_parallel_call(
    monkeypatch,
):
    """On several threads numba's common case runs one compiled entry around the parallel build
    (``_numba_kernels.parallel_common``), padded and packed, not the table kernel from Python;
    while another call runs a parallel build (the lock held), it runs on one thread, without
    calling its parallel entry: the same bits."""
    from ppo_fast import _numba_builds, _numba_kernels

    float64 = np.dtype(np.float64)
    for name in COMMON:
        for packed in (False, True):
            entry = _backend.common(name, "numba", 2, float64, not packed, packed)
            assert entry is _numba_kernels.parallel_common(name, packed), (name, packed)
    rng = np.random.default_rng(11)
    for name in ("gae", "clipped_surrogate"):
        kernel = KERNELS[name]
        named = _examples.common_arguments(kernel, (9, 263), float64, rng, optional=True)
        named["mask"] = rng.random((9, 263)) < 0.8
        entry = _backend.common(name, "numba", 2, float64, True)
        parallel, threads = entry.__globals__["parallel"], []  # _numba_builds._locked's source

        def counted(*arguments, parallel=parallel, threads=threads):
            threads.append(arguments[-1])
            return parallel(*arguments)

        monkeypatch.setitem(entry.__globals__, "parallel", counted)
        results = []
        for held in (False, True):
            outputs = {a.name: np.empty((9, 263)) for a in kernel.outputs}
            arguments = [{**named, **outputs}[a] for a in kernel.common_arguments[:-1]]
            if held:
                with _numba_builds._parallel_lock:
                    totals = entry(*arguments, 2)
            else:
                totals = entry(*arguments, 2)
            results.append([*outputs.values(), *(totals or ())])
        same_bits(results[1], results[0], name)
        assert threads == [2], name  # the parallel entry ran once: not with the lock held


@pytest.mark.skipif("cython" not in COMPILED, reason="the Cython backend is not built here")
@pytest.mark.parametrize("name", COMMON)
def test_every_cython_build_gives_the_common_entries_the_same_bits(name):
    from ppo_fast import _cython_backend, _cython_kernels

    builds = []
    for build in _cython_kernels.CPU_BUILDS:  # the builds this CPU runs, widest first
        try:
            builds.append(importlib.import_module(f"ppo_fast.{_cython_backend.MODULES[build]}"))
        except ModuleNotFoundError:
            continue  # not built here (setup.py's x86-64 builds are optional)
    kernel = KERNELS[name]
    rng = np.random.default_rng(9)
    for dtype in DTYPES:
        for shape in [(8, 128), (9, 263), (130, 3)]:
            for mask in masks(rng, shape)[:4]:
                named = _examples.common_arguments(kernel, shape, dtype, rng, optional=True)
                named["mask"] = mask
                results = []
                for module in builds:
                    outputs = {a.name: np.empty(shape, dtype) for a in kernel.outputs}
                    arguments = [{**named, **outputs}[a] for a in kernel.common_arguments[:-1]]
                    totals = getattr(module, f"{name}_common")(*arguments, 1)
                    results.append([*outputs.values(), *(totals or ())])
                for result, module in zip(results[1:], builds[1:], strict=True):
                    same_bits(result, results[0], f"{module.BUILD} {shape} {np.dtype(dtype)}")


@pytest.mark.skipif("cython" not in COMPILED, reason="the Cython backend is not built here")
def test_the_cython_common_entries_refuse_what_they_cannot_read():
    """The stages check the common case first; called on anything else, an entry raises (never
    reads past an array)."""
    entry = _backend.resolve("cython").clipped_surrogate_common
    logp = np.zeros((2, 3))
    grad = np.empty((2, 3))
    bounds = (0.8, 1.2, np.inf, np.inf)  # after the mask, agg and normaliser (token-mean)
    no_weights = np.zeros(0)
    with pytest.raises(ValueError, match="logprobs must be 2-D"):
        flat = logp.ravel()
        entry(flat, flat, flat, no_weights, None, 0, 0.0, *bounds, grad.ravel(), 1)
    with pytest.raises(ValueError, match="old_logprobs must have the shape of the first token"):
        entry(logp, logp[:1], logp, no_weights, None, 0, 0.0, *bounds, grad, 1)
    with pytest.raises(ValueError, match="mask must have the"):
        entry(logp, logp, logp, no_weights, np.ones(5, bool), 0, 0.0, *bounds, grad, 1)
    with pytest.raises(TypeError, match="mask must be a C-contiguous array of bool or uint8"):
        entry(logp, logp, logp, no_weights, np.ones((2, 3)), 0, 0.0, *bounds, grad, 1)
    with pytest.raises(TypeError, match="old_logprobs must be a C-contiguous array of float32"):
        entry(logp, logp.astype(np.float32), logp, no_weights, None, 0, 0.0, *bounds, grad, 1)
    with pytest.raises(ValueError, match="not C-contiguous"):
        entry(logp, logp, logp, no_weights, None, 0, 0.0, *bounds, np.empty((2, 6))[:, ::2], 1)
    # packed rows: (N,) arrays, and the rows' (starts, spans) in the mask's place
    flat, grad = logp.ravel(), grad.ravel()
    starts, spans = np.array([0, 2]), np.array([2, 4])
    assert entry(flat, flat, flat, no_weights, (starts, spans), 0, 0.0, *bounds, grad, 1)[0] == 6
    for layout, error, match in [
        ((starts, spans, spans), ValueError, r"packed rows are \(starts, spans\)"),
        (
            (starts.astype(np.int32), spans),
            TypeError,
            "starts must be a C-contiguous array of int64",
        ),
        ((starts, spans[:1]), ValueError, "one entry a row"),
        ((starts, np.array([2, 5])), ValueError, r"row 1 \(start 2, span 5\) lies outside the 6"),
        ((np.array([-1, 2]), spans), ValueError, "row 0"),
        ((starts, np.array([2, -1])), ValueError, "row 1"),
    ]:
        with pytest.raises(error, match=match):
            entry(flat, flat, flat, no_weights, layout, 0, 0.0, *bounds, grad, 1)
    with pytest.raises(ValueError, match=r"logprobs must be 1-D \(N,\) with packed rows"):
        entry(logp, logp, logp, no_weights, (starts, spans), 0, 0.0, *bounds, grad, 1)


def _fast_targets():
    """Hostile-input targets whose valid call is a common case: gae without a bootstrap, the
    clipped surrogate without weights (tests/hostile.py's own target takes them, which the fast
    path leaves to the general way), the value loss (with num_tokens), whiten, masked_moments,
    KL-Cov's selection and the policy family (the geometric mean with num_seqs)."""

    def gae(rng):
        arrays = hostile._tokens(rng, "rewards", "values")
        return {**arrays, "gamma": 0.99, "lam": 0.95, "mask": hostile.MASK.copy()}

    policy_scalars = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "log_ratio_clamp": 20.0}

    def policy(rng):
        arrays = hostile._tokens(rng, "logprobs", "old_logprobs", logp=True)
        arrays.update(hostile._tokens(rng, "advantages"))
        return {**arrays, **policy_scalars, "mask": hostile.MASK.copy()}

    def selection(rng):
        arrays = hostile._tokens(rng, "logprobs", logp=True)
        arrays.update(hostile._tokens(rng, "advantages"))
        return {**arrays, "ratio": 0.3, "mask": hostile.MASK.copy()}

    value_scalars = {"clip": 0.2, "num_tokens": 50.0}  # token-mean over a given count

    def value(rng):
        arrays = hostile._tokens(rng, "values", "old_values", "returns")
        return {**arrays, **value_scalars, "mask": hostile.MASK.copy()}

    def whiten(rng):
        return {**hostile._tokens(rng, "x"), "eps": 1e-8, "mask": hostile.MASK.copy()}

    rows = {"mask": "mask", "layouts": True}
    return [
        hostile.Target(
            "gae[common]",
            ppo_fast.gae,
            gae,
            ("rewards", "values"),
            scalars={"gamma": 0.99, "lam": 0.95},
            per_row=("gamma", "lam"),
            **rows,
        ),
        hostile.Target(
            "clipped_surrogate[common]",
            ppo_fast.clipped_surrogate,
            policy,
            ("logprobs", "old_logprobs", "advantages"),
            scalars=policy_scalars,
            **rows,
        ),
        hostile.Target(
            "value_loss[common]",
            ppo_fast.value_loss,
            value,
            ("values", "old_values", "returns"),
            scalars=value_scalars,
            **rows,
        ),
        hostile.Target(
            "whiten[common]", ppo_fast.whiten, whiten, ("x",), scalars={"eps": 1e-8}, **rows
        ),
        *(
            hostile.Target(
                f"{loss.__name__}[common]",
                loss,
                _family_builder(policy, scalars),
                ("logprobs", "old_logprobs", "advantages"),
                scalars=scalars,
                **rows,
            )
            for loss, scalars in FAMILY_SCALARS
        ),
        # their valid calls are common cases: float64 (B, T) arrays, k3 and a clamp (and for
        # shape_rewards float64 scores and a bool mask); masked_moments' a bool mask and a shift
        *(
            t
            for t in hostile._numpy_targets()
            if t.name in ("kl_penalty", "shape_rewards", "masked_moments")
        ),
        hostile.Target(
            "kl_cov_selection[common]",
            ppo_fast.kl_cov_selection,
            selection,
            ("logprobs", "advantages"),
            scalars={"ratio": 0.3},
            **rows,
        ),
        hostile.Target(
            "kl_cov_loss[common]",
            ppo_fast.kl_cov_loss,
            _family_builder(policy, {"coef": 0.5}, selected=True),
            ("logprobs", "old_logprobs", "advantages", "selected"),
            scalars={"coef": 0.5},
            **rows,
        ),
    ]


# Each family loss's hyperparameters (legal values, some at a bound) for the hostile cases.
FAMILY_SCALARS = [
    (ppo_fast.reinforce_loss, {"beta": 0.1}),
    (ppo_fast.cispo_loss, {"clip_low": 0.2, "clip_high": 0.28, "log_ratio_clamp": 20.0}),
    (ppo_fast.sapo_loss, {"tau_pos": 1.0, "tau_neg": 1.05, "log_ratio_clamp": 20.0}),
    (ppo_fast.gspo_loss, {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}),
    (ppo_fast.dppo_loss, {"divergence_low": 0.2, "divergence_high": 0.28, "ratio_cap": 20.0}),
    # its default seq-mean-token-mean over a given count of sequences (verl's call)
    (ppo_fast.geo_mean_loss, {"clip_low": 0.2, "num_seqs": 8}),
]


def _family_builder(policy, scalars, selected=False):
    """A valid call of a family loss: the clipped surrogate's arrays, the loss's scalars, and a
    bool token selection for KL-Cov when ``selected``."""

    def build(rng):
        arrays = {k: v for k, v in policy(rng).items() if k not in _SURROGATE_SCALARS}
        if selected:
            arrays["selected"] = rng.random(arrays["logprobs"].shape) < 0.3
        return {**arrays, **scalars}

    return build


_SURROGATE_SCALARS = ("clip_low", "clip_high", "dual_clip", "log_ratio_clamp")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Casting complex values to real:UserWarning")
@pytest.mark.parametrize("target", _fast_targets(), ids=lambda t: t.name)
def test_hostile_inputs_get_the_same_answer_or_error_both_ways(target, fast_calls):
    backend = COMPILED[0] if COMPILED else "python"
    for case in [hostile.Case("valid", "", hostile._plain), *hostile.cases(target)]:
        kwargs = case.mutate(target.build(np.random.default_rng(3)))
        fast = hostile.run(target, kwargs, backend)
        general = general_way(hostile.run, target=target, kwargs=kwargs, backend=backend)
        assert fast[0] == general[0], case.id(target)
        if fast[0] == "ok":
            for a, b in zip(fast[1], general[1], strict=True):
                assert a.tobytes() == b.tobytes(), case.id(target)
        else:
            assert type(fast[1]) is type(general[1]), case.id(target)
            assert str(fast[1]) == str(general[1]), case.id(target)
    # the valid call, at least, went the fast way (a family loss's kernel: its name less _loss;
    # KL-Cov's selection: its table kernel; masked_moments: the moments' entry)
    kernels = {"kl_cov_selection": "kl_cov_top_k", "masked_moments": "moments"}
    name = kernels.get(target.call.__name__, target.call.__name__)
    assert name in fast_calls or name.removesuffix("_loss") in fast_calls


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numbas_row_totals_sum_as_numpy_does():
    """numba's ``_pairwise_sum`` (the common entries' totals) against ``0.0 + x.sum()``: blocks
    under 8, under 128, and halves down to them, at an offset too."""
    from ppo_fast._numba_core import _pairwise_sum

    rng = np.random.default_rng(4)
    for n in [*range(0, 300), 511, 512, 513, 1000, 4096, 10_007, 1 << 17]:
        x = rng.standard_normal(n + 3) * 10.0 ** rng.integers(-8, 8, n + 3)
        for first in (0, 3):
            expected = 0.0 + x[first : first + n].sum()
            assert np.float64(_pairwise_sum(x, first, n)).tobytes() == expected.tobytes(), n


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numbas_row_totals_load_from_its_on_disk_cache(tmp_path):
    """Compiled in one process with numba's on-disk cache on, loaded from it in the next (a
    recursive ``_pairwise_sum`` crashed there: numba issue #6061)."""
    script = (
        "import numpy as np; from ppo_fast._numba_core import _row_totals; "
        "print(_row_totals(np.arange(600.0).reshape(2, 300)).tolist())"
    )
    env = {**os.environ, "PPO_FAST_NUMBA_CACHE": "1", "NUMBA_CACHE_DIR": str(tmp_path)}
    for _ in ("cold", "warm"):
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", script], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "[44850.0, 134850.0]"
    assert any(tmp_path.rglob("*_pairwise_sum*.nbi"))  # it was cached, and read back


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numbas_compiled_entries_stay_off_with_its_on_disk_cache(tmp_path):
    """With the on-disk cache on, the common case runs the table kernels from Python (the
    compiled entries call the serial builds by address, which numba cannot cache), with the
    same bits as the compiled entry of a process without the cache."""
    script = (
        "import numpy as np, ppo_fast; from ppo_fast import _numba_kernels as k; "
        "rng = np.random.default_rng(3); r, v = rng.normal(size=(2, 4, 37)).astype(np.float32); "
        "m = rng.random((4, 37)) < 0.8; "
        "out = ppo_fast.gae(r, v, gamma=0.99, mask=m, backend='numba'); "
        "loss = ppo_fast.clipped_surrogate(r, v, r, mask=m, backend='numba'); "
        "print(k.serial_common('gae') is None, out.advantages.tobytes().hex()[:64], "
        "np.float64(loss.loss).tobytes().hex(), loss.grad.tobytes().hex()[-64:])"
    )
    outputs = []
    for cache in ("1", "0"):
        env = {**os.environ, "PPO_FAST_NUMBA_CACHE": cache, "NUMBA_CACHE_DIR": str(tmp_path)}
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", script], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout.split())
    assert outputs[0][0] == "True" and outputs[1][0] == "False"
    assert outputs[0][1:] == outputs[1][1:]


def test_the_fast_paths_read_ints_masks_of_numbers_and_lengths_as_the_general_way_does():
    """``fast_real`` makes floats of what ``scalar`` reads as float(value) and leaves the rest
    (a bool, an int past float64, None, a string) to the general way; ``converted_mask`` makes
    the bool mask of a 0/1 mask of numbers or of lengths beside arrays of the common case, and
    refuses what it cannot read so."""
    for value in (3, np.int64(-2), np.float32(0.1), np.float64(0.2), 2**60 + 1):
        got = _validate.fast_real(value)
        assert type(got) is float and got == _validate.scalar("x", value)
    for value in (True, 10**400, None, "0.2", np.float16(0.5), 0.2):
        assert _validate.fast_real(value) is value
    x = np.zeros((2, 3), np.float32)
    ints = np.array([[1, 0, 1], [0, 0, 1]])
    for mask in (ints, ints.astype(np.float64), ints.astype(np.uint16), np.where(ints, 1.0, -0.0)):
        got = _validate.converted_mask((x,), mask)
        assert got.dtype == np.bool_ and got.shape == x.shape
        np.testing.assert_array_equal(got, ints == 1)
    refused = [
        ints * 2,
        np.where(ints, np.nan, 0.0),
        ints.astype(">i8"),  # byte-swapped: NumPy's way
        np.asfortranarray(ints),
        ints[:, :2].copy(),
        ints.astype(np.float16),
        ints.astype(bool),  # bool: common_case's, not this
        ints.tolist(),
    ]
    for mask in refused:
        assert _validate.converted_mask((x,), mask) is False
    assert (
        _validate.converted_mask((np.asfortranarray(np.zeros((3, 2), np.float32)),), ints.T.copy())
        is False
    )
    # lengths: the mask of t < lengths[b]; refused with a mask, out of [0, T], of another dtype
    # or shape, and past LENGTHS_AS_MASK_POSITIONS positions (the general way's there)
    lengths = np.array([3, 0])
    for given in (lengths, lengths.astype(np.int32)):
        got = _validate.converted_mask((x,), None, given)
        np.testing.assert_array_equal(got, [[True, True, True], [False, False, False]])
    for given in (lengths + 1, lengths - 1, lengths.astype(np.float64), lengths.astype(np.uint64)):
        assert _validate.converted_mask((x,), None, given) is False
    for given in (lengths[:1], lengths[None, :], lengths.tolist()):
        assert _validate.converted_mask((x,), None, given) is False
    assert _validate.converted_mask((x,), ints, lengths) is False
    width = _validate.LENGTHS_AS_MASK_POSITIONS // 2
    for n_rows, fits in ((2, True), (3, False)):
        wide = np.zeros((n_rows, width), np.float32)
        got = _validate.converted_mask((wide,), None, np.full(n_rows, 5))
        assert (got is not False) == fits
