"""Hostile input: every bad argument gets a ValueError or TypeError that names it.

Each case is (id, call, error type, pattern); the pattern must name the argument. Every case runs
on every backend: validation is shared, and no bad input may reach a kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
from batches import ragged_batches
from conftest import assert_matches_oracle
from hypothesis import given

import ppo_fast
from ppo_fast import _validate

X = np.zeros((2, 3))
X32 = np.zeros((2, 3), dtype=np.float32)
P = np.zeros(5)


def gae(*args, **kwargs):
    return lambda backend: ppo_fast.gae(*args, **kwargs, backend=backend)


def shape(*args, **kwargs):
    return lambda backend: ppo_fast.shape_rewards(*args, **kwargs, backend=backend)


def whiten(*args, **kwargs):
    return lambda backend: ppo_fast.whiten(*args, **kwargs, backend=backend)


def moments(*args, **kwargs):
    return lambda backend: ppo_fast.masked_moments(*args, **kwargs, backend=backend)


def kl(*args, **kwargs):
    return lambda backend: ppo_fast.kl_penalty(*args, **kwargs, backend=backend)


def policy(**kwargs):
    return lambda backend: ppo_fast.clipped_surrogate(X, X, X, **kwargs, backend=backend)


def value(**kwargs):
    return lambda backend: ppo_fast.value_loss(X, X, X, **kwargs, backend=backend)


INF = float("inf")
S2 = np.ones(2)


CASES = [
    ("shape-mismatch", gae(X, np.zeros((2, 4))), ValueError, "values has shape"),
    ("3-d", gae(np.zeros((2, 3, 1)), np.zeros((2, 3, 1))), ValueError, "rewards must be 2-D"),
    ("0-d", gae(np.float64(1.0), np.float64(1.0)), ValueError, "rewards must be 2-D"),
    ("int-dtype", gae(np.zeros((2, 3), int), X), TypeError, "rewards must be float32 or float64"),
    ("complex", gae(X, X.astype(complex)), TypeError, "values must be float32 or float64"),
    ("object", gae(X.astype(object), X), TypeError, "rewards must be float32 or float64"),
    ("float16", gae(X.astype(np.float16), X), TypeError, "rewards must be float32"),
    ("mixed-dtypes", gae(X32, X), TypeError, "values is float64 but rewards is float32"),
    ("none-array", gae(None, X), TypeError, "rewards is required"),
    ("strings", gae([["a"]], [["b"]]), TypeError, "rewards must be float32"),
    ("lengths-negative", gae(X, X, lengths=[-1, 2]), ValueError, r"lengths must lie in \[0, T=3\]"),
    # The message names the first length out of range, whichever side it is out on.
    (
        "lengths-named",
        gae(X, X, lengths=[-1, 4]),
        ValueError,
        r"lengths must lie in \[0, T=3\], got lengths\[0\]=-1",
    ),
    ("lengths-too-long", gae(X, X, lengths=[4, 2]), ValueError, r"lengths\[0\]=4"),
    ("lengths-shape", gae(X, X, lengths=[1, 2, 3]), ValueError, r"lengths must have shape \(2,\)"),
    ("lengths-float", gae(X, X, lengths=[1.0, 2.0]), TypeError, "lengths must hold integers"),
    ("lengths-2d", gae(X, X, lengths=[[1, 2]]), ValueError, "lengths must be 1-D"),
    ("cu-not-zero", gae(P, P, cu_seqlens=[1, 5]), ValueError, "cu_seqlens must start at 0"),
    ("cu-decreasing", gae(P, P, cu_seqlens=[0, 3, 2, 5]), ValueError, "non-decreasing"),
    (
        "cu-short",
        gae(P, P, cu_seqlens=[0, 1, 3]),
        ValueError,
        "end at the number of tokens N=5, got 3",
    ),
    # An empty row is no error: the message names the first decrease, after it.
    (
        "cu-decreasing-after-an-empty-row",
        gae(P, P, cu_seqlens=[0, 2, 2, 1, 5]),
        ValueError,
        r"cu_seqlens\[3\]=1 < cu_seqlens\[2\]=2",
    ),
    ("cu-short", gae(P, P, cu_seqlens=[0, 4]), ValueError, "must end at the number of tokens N=5"),
    ("cu-long", gae(P, P, cu_seqlens=[0, 6]), ValueError, "must end at the number of tokens"),
    ("cu-empty", gae(P, P, cu_seqlens=[]), ValueError, "cu_seqlens must have B\\+1 entries"),
    ("cu-float", gae(P, P, cu_seqlens=[0.0, 5.0]), TypeError, "cu_seqlens must hold integers"),
    ("cu-on-2d", gae(X, X, cu_seqlens=[0, 6]), ValueError, "cu_seqlens describes packed 1-D"),
    ("1d-no-layout", gae(P, P), ValueError, "pass cu_seqlens for packed rows"),
    ("empty-1d", gae(np.zeros(0), np.zeros(0)), ValueError, "pass cu_seqlens"),
    ("mask-values", gae(X, X, mask=np.full((2, 3), 2)), ValueError, "mask must hold only 0 and 1"),
    ("mask-nan", gae(X, X, mask=np.full((2, 3), np.nan)), ValueError, "mask must hold only 0"),
    # The message names the first value that is neither 0 nor 1, not the 0s and 1s before it.
    (
        "mask-value-named",
        gae(X, X, mask=[[0, 1, 0], [1, 3, 2]]),
        ValueError,
        r"found (np\.\w+\()?3\b",
    ),
    (
        "mask-negative",
        gae(X, X, mask=[[1, 0, -1], [0, 0, 0]]),
        ValueError,
        r"found (np\.\w+\()?-1\b",
    ),
    ("mask-shape", gae(X, X, mask=np.ones((2, 4))), ValueError, "mask has shape"),
    ("mask-strings", gae(X, X, mask=np.full((2, 3), "1")), TypeError, "mask must be bool"),
    (
        "two-layouts",
        gae(X, X, mask=np.ones((2, 3)), lengths=[1, 1]),
        ValueError,
        "at most one of mask, lengths and cu_seqlens",
    ),
    ("gamma-above-1", gae(X, X, gamma=1.5), ValueError, r"gamma must lie in \[0, 1\]"),
    ("gamma-negative", gae(X, X, gamma=-0.1), ValueError, "gamma must lie in"),
    ("gamma-nan", gae(X, X, gamma=float("nan")), ValueError, "gamma must be a number, got nan"),
    ("lam-nan", gae(X, X, lam=float("nan")), ValueError, "lam must be a number"),
    ("lam-row-nan", gae(X, X, lam=np.array([0.5, np.nan])), ValueError, r"lam\[1\] must be a"),
    ("lam-shape", gae(X, X, lam=np.ones(3)), ValueError, r"lam must be a scalar or have shape"),
    ("lam-string", gae(X, X, lam="0.9"), TypeError, "lam must be a real number"),
    # per-row data: no scalar offered where a scalar is refused
    ("bootstrap-shape", gae(X, X, bootstrap=np.ones(3)), ValueError, r"bootstrap must have sha"),
    ("bootstrap-scalar", gae(X, X, bootstrap=1.0), ValueError, "bootstrap must have shape"),
    ("scores-shape", shape(np.ones(3), X, X, kl_coef=0.1), ValueError, "scores must have sha"),
    ("scores-scalar", shape(1.0, X, X, kl_coef=0.1), ValueError, "scores must have shape"),
    ("kl-coef-negative", shape(np.ones(2), X, X, kl_coef=-1), ValueError, "kl_coef must lie"),
    ("kl-coef-nan", shape(np.ones(2), X, X, kl_coef=float("nan")), ValueError, "kl_coef"),
    ("kl-coef-string", shape(np.ones(2), X, X, kl_coef="a"), TypeError, "kl_coef must be a real"),
    (
        "estimator",
        shape(np.ones(2), X, X, kl_coef=0.1, estimator="k4"),
        ValueError,
        "estimator must be one of",
    ),
    ("kl-estimator", kl(X, X, "full"), ValueError, "estimator must be one of"),
    ("kl-clamp-zero", kl(X, X, clamp=0.0), ValueError, "clamp must lie in"),
    ("kl-shape", kl(X, np.zeros((3, 2))), ValueError, "ref_logprobs has shape"),
    ("whiten-eps", whiten(X, eps=-1.0), ValueError, "eps must lie in"),
    ("whiten-moments-type", whiten(X, moments=(1, 2, 3)), TypeError, "moments must be"),
    ("whiten-empty", whiten(np.zeros((0, 3))), ValueError, "no valid position"),
    # One rule for every scalar: inf only where the parameter allows it.
    ("kl-coef-inf", shape(S2, X, X, kl_coef=INF), ValueError, "kl_coef must be finite"),
    ("whiten-eps-inf", whiten(X, eps=INF), ValueError, "eps must be finite"),
    ("shift-inf", moments(X, shift=-INF), ValueError, "shift must be finite"),
    ("num-tokens-inf", policy(num_tokens=INF), ValueError, "num_tokens must be finite"),
    (
        "num-seqs-inf",
        value(agg="seq-mean-token-sum", num_seqs=INF),
        ValueError,
        "num_seqs must be finite",
    ),
    (
        "loss-scale-inf",
        value(agg="seq-mean-token-sum-norm", loss_scale=INF),
        ValueError,
        "loss_scale must be finite",
    ),
    ("gamma-inf", gae(X, X, gamma=INF), ValueError, "gamma must be finite"),
    ("bootstrap-object", gae(X, X, bootstrap=[1, "a"]), TypeError, "bootstrap must be a real"),
    ("kl-coef-bool", shape(S2, X, X, kl_coef=True), TypeError, "kl_coef must be a real number"),
    ("gamma-bool", gae(X, X, gamma=True), TypeError, "gamma must be a real number"),
    ("lam-bool-rows", gae(X, X, lam=np.array([True, True])), TypeError, "lam must be a real"),
    ("gamma-0d-bool", gae(X, X, gamma=np.array(True)), TypeError, "gamma must be a real"),
    ("kl-coef-numpy-bool", shape(S2, X, X, kl_coef=np.bool_(1)), TypeError, "kl_coef must be"),
    ("scores-bool", shape(np.ones(2, bool), X, X, kl_coef=0.1), TypeError, "scores must be"),
    ("kl-coef-str-number", shape(S2, X, X, kl_coef="0.1"), TypeError, "kl_coef must be a real"),
    ("gamma-str-number", gae(X, X, gamma="0.9"), TypeError, "gamma must be a real"),
    ("clip-low-str", policy(clip_low="0.2"), TypeError, "clip_low must be a real"),
    ("clip-bytes", value(clip=b"1"), TypeError, "clip must be a real"),
    ("eps-complex", whiten(X, eps=1e-8 + 0j), TypeError, "eps must be a real"),
    ("gamma-complex", gae(X, X, gamma=1 + 0j), TypeError, "gamma must be a real"),
    ("kl-coef-none", shape(S2, X, X, kl_coef=None), TypeError, "kl_coef must be a real"),
    ("shift-none", moments(X, shift=None), TypeError, "shift must be a real"),
    ("clip-low-array", policy(clip_low=np.array([0.2])), TypeError, "clip_low must be a real"),
    ("gamma-huge-int", gae(X, X, gamma=10**400), ValueError, "gamma is too large"),
    ("kl-coef-huge-int", shape(S2, X, X, kl_coef=10**400), ValueError, "kl_coef is too large"),
    ("clip-high-huge-int", policy(clip_high=10**400), ValueError, "clip_high is too large"),
    ("lam-huge-rows", gae(X, X, lam=[10**400, 1]), TypeError, "lam must be a real"),
    ("dual-clip-nan", policy(dual_clip=float("nan")), ValueError, "dual_clip must be a number"),
    # Errors that name the argument.
    ("ragged-tokens", gae([[1.0, 2.0], [1.0]], X), ValueError, "rewards cannot be read"),
    ("ragged-mask", gae(X, X, mask=[[1, 1, 1], [1]]), ValueError, "mask cannot be read"),
    ("ragged-lam", gae(X, X, lam=[[1.0], []]), ValueError, "lam cannot be read"),
    (
        "lengths-uint64-huge",
        gae(X, X, lengths=np.array([2**64 - 1, 1], np.uint64)),
        ValueError,
        r"lengths\[0\]=18446744073709551615 is out of range",
    ),
    (
        "cu-uint64-huge",
        gae(P, P, cu_seqlens=np.array([0, 2**63, 5], np.uint64)),
        ValueError,
        r"cu_seqlens\[1\]=9223372036854775808",
    ),
    ("big-endian", gae(X.astype(">f8"), X), TypeError, r"rewards.astype\('=f8'\)"),
    ("big-endian-f4", kl(X32, X32.astype(">f4")), TypeError, r"ref_logprobs.astype\('=f4'\)"),
    # Only the token arrays are positional: a layout or an option passed by position (is it a
    # mask or lengths?) is refused, not guessed.
    ("moments-positional-mask", moments(X, np.ones((2, 3))), TypeError, "1 positional argument"),
    ("whiten-positional-mask", whiten(X, np.ones((2, 3))), TypeError, "1 positional argument"),
    ("gae-positional-gamma", gae(X, X, 0.9), TypeError, "2 positional arguments"),
    ("shape-positional-coef", shape(np.ones(2), X, X, 0.1), TypeError, "3 positional arguments"),
]


@pytest.mark.parametrize(("case", "call", "error", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(backend, case, call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(backend)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        ppo_fast.gae(X, X, backend="fortran")


def test_inputs_are_never_modified_and_read_only_non_contiguous_inputs_work(backend, dtype):
    rng = np.random.default_rng(0)
    big = rng.normal(size=(4, 12)).astype(dtype)
    rewards, values = big[:, ::2], big[:, 1::2]  # non-contiguous views
    mask = rng.random((4, 6)) < 0.8
    scores = rng.normal(size=4)
    arrays = [big, mask, scores]
    for array in arrays:
        array.flags.writeable = False
    snapshot = [a.copy() for a in arrays]
    shaped = ppo_fast.shape_rewards(
        scores, rewards, values, kl_coef=0.1, mask=mask, backend=backend
    )
    result = ppo_fast.gae(shaped, values, mask=mask, backend=backend)
    expected = ppo_fast.gae(
        np.ascontiguousarray(shaped),
        np.ascontiguousarray(values),
        mask=mask.copy(),
        backend="python",
    )
    assert_matches_oracle(result.advantages, expected.advantages, dtype, "advantages")
    ppo_fast.whiten(values, mask=mask, backend=backend)
    ppo_fast.kl_penalty(rewards, values, "k3", backend=backend)
    ppo_fast.masked_moments(values, mask=mask, backend=backend)
    for array, before in zip(arrays, snapshot, strict=True):
        np.testing.assert_array_equal(array, before)


def test_lists_are_accepted_as_arrays(backend):
    result = ppo_fast.gae([[1.0, 0.0]], [[0.5, 0.5]], gamma=1.0, lam=1.0, backend=backend)
    np.testing.assert_allclose(result.advantages, [[0.5, -0.5]])


@pytest.mark.parametrize(
    "options",
    [{"clip_high": INF}, {"dual_clip": INF}, {"log_ratio_clamp": INF}],
    ids=["clip_high", "dual_clip", "log_ratio_clamp"],
)
def test_inf_is_legal_where_it_means_no_bound(backend, options):
    rng = np.random.default_rng(1)
    logp, old, adv = rng.normal(size=(3, 2, 5))
    expected = {"clip_high": 1e300, "dual_clip": None, "log_ratio_clamp": None}
    unbounded = {name: expected[name] for name in options}
    got = ppo_fast.clipped_surrogate(logp, old, adv, **options, backend=backend)
    want = ppo_fast.clipped_surrogate(logp, old, adv, **unbounded, backend=backend)
    assert got.loss == want.loss
    np.testing.assert_array_equal(got.grad, want.grad)
    kl_inf = ppo_fast.kl_penalty(logp, old, "k3", clamp=INF, backend=backend)
    np.testing.assert_array_equal(kl_inf, ppo_fast.kl_penalty(logp, old, "k3", backend=backend))
    value_inf = ppo_fast.value_loss(logp, old, adv, clip=INF, backend=backend)
    assert value_inf.loss == ppo_fast.value_loss(logp, old, adv, backend=backend).loss


@pytest.mark.parametrize(
    "number",
    [
        0.5,
        1,
        np.float32(0.5),
        np.float64(0.5),
        np.int8(1),
        np.uint64(1),
        np.array(0.5),
        np.array(1, np.int16),
        np.longdouble(0.5),
    ],
    ids=lambda v: f"{type(v).__name__}-{np.asarray(v).dtype}",
)
def test_every_real_number_type_is_a_scalar(number):
    assert ppo_fast.gae(X, X, gamma=number, lam=number).advantages.shape == X.shape
    assert np.isfinite(ppo_fast.shape_rewards(S2, X, X, kl_coef=number)).all()
    ppo_fast.clipped_surrogate(X, X, X, clip_low=number / 2, clip_high=number, dual_clip=3)


def test_kl_penalty_of_0d_arrays_is_0d(backend):
    out = ppo_fast.kl_penalty(np.array(1.0), np.array(0.25), "k2", backend=backend)
    assert out.shape == ()
    assert out == 0.75**2 / 2


def test_nan_and_inf_scores_and_bootstrap_propagate_as_data(backend):
    scores = np.array([np.nan, np.inf])
    rewards = ppo_fast.shape_rewards(scores, X, X, kl_coef=0.1, lengths=[2, 3], backend=backend)
    expected = ppo_fast.shape_rewards(scores, X, X, kl_coef=0.1, lengths=[2, 3], backend="python")
    np.testing.assert_array_equal(rewards, expected)
    assert np.isnan(rewards[0, 1]) and rewards[1, 2] == np.inf
    bootstrap = np.array([np.nan, 1.0])
    result = ppo_fast.gae(X, X, bootstrap=bootstrap, backend=backend)
    oracle = ppo_fast.gae(X, X, bootstrap=bootstrap, backend="python")
    np.testing.assert_array_equal(result.advantages, oracle.advantages)
    assert np.isnan(result.advantages[0]).all() and np.isfinite(result.advantages[1]).all()


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"count": -1, "sum": 0.0, "sum_sq": 0.0}, r"Moments.count must lie in \[0"),
        ({"count": float("nan"), "sum": 0.0, "sum_sq": 0.0}, "Moments.count must be a number"),
        ({"count": INF, "sum": 0.0, "sum_sq": 0.0}, "Moments.count must be finite"),
        ({"count": 2, "sum": 0.0, "sum_sq": -1.0}, r"Moments.sum_sq must lie in \[0"),
        ({"count": 2, "sum": 0.0, "sum_sq": 1.0, "shift": INF}, "Moments.shift must be finite"),
        ({"count": 2, "sum": "1", "sum_sq": 1.0}, "Moments.sum must be a real number"),
        ({"count": True, "sum": 1.0, "sum_sq": 1.0}, "Moments.count must be a real number"),
    ],
)
def test_moments_fields_are_checked_when_built(fields, pattern):
    error = TypeError if "real number" in pattern else ValueError
    with pytest.raises(error, match=pattern):
        ppo_fast.Moments(**fields)


def test_moments_sums_may_be_non_finite_data():
    moments = ppo_fast.Moments(2, float("nan"), float("inf"))
    assert np.isnan(moments.mean)
    assert ppo_fast.Moments.from_array(np.array([2, 1, 1], np.int64)).count == 2.0


@given(batch=ragged_batches(dtypes=(np.float64,)))
def test_rows_describe_exactly_the_valid_positions(batch):
    """An independent reference for the boundary every backend shares: the positions that the
    Rows of a layout call valid are the ones the generator made valid, row by row."""
    rows = _validate.rows(batch.shape, **batch.layout_kwargs)
    assert rows.n_rows == batch.n_rows
    valid = np.zeros(rows.n_positions, dtype=bool)
    row_of = np.full(rows.n_positions, -1)
    for b in range(rows.n_rows):
        for t in range(int(rows.spans[b])):
            i = int(rows.starts[b]) + t
            assert row_of[i] == -1, "rows overlap"
            row_of[i] = b
            valid[i] = t < rows.lengths[b] and (rows.mask.size == 0 or rows.mask[i] != 0)
    np.testing.assert_array_equal(valid, batch.valid.reshape(-1))
    if batch.layout != "packed":  # a padded row b is the b-th row of the (B, T) arrays
        width = batch.shape[1]
        np.testing.assert_array_equal(row_of, np.repeat(np.arange(batch.n_rows), width))


def test_a_torch_tensor_is_refused_with_the_way_to_pass_it(backend):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"values is a torch tensor: use ppo_fast.torch"):
        ppo_fast.gae(X, torch.zeros(2, 3, dtype=torch.float64), backend=backend)


def test_torch_layouts_and_per_row_values_are_taken_as_their_numbers(backend):
    """Token arrays must be numpy; a layout (lengths, cu_seqlens, mask) or per-row gamma may be a
    tensor (one that requires grad too: it is detached), read as the same numbers."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
    mask = np.array([[1, 1, 0], [1, 0, 1]])
    gamma = np.array([0.9, 0.5])
    for layout in ({"lengths": np.array([3, 1])}, {"mask": mask}):
        expected = ppo_fast.gae(rewards, values, gamma=gamma, **layout, backend=backend)
        as_tensors = {k: torch.from_numpy(v) for k, v in layout.items()}
        actual = ppo_fast.gae(
            rewards,
            values,
            gamma=torch.tensor(gamma, requires_grad=True),
            **as_tensors,
            backend=backend,
        )
        np.testing.assert_array_equal(actual.advantages, expected.advantages)
        np.testing.assert_array_equal(actual.returns, expected.returns)
    flat = rewards.reshape(-1)
    cu = np.array([0, 2, 6])
    expected = ppo_fast.gae(flat, flat, cu_seqlens=cu, backend=backend)
    actual = ppo_fast.gae(flat, flat, cu_seqlens=torch.from_numpy(cu), backend=backend)
    np.testing.assert_array_equal(actual.advantages, expected.advantages)


@pytest.mark.parametrize(
    ("bounds", "value", "message"),
    [
        ({"lo": 0.0, "open_lo": True}, 0.0, r"must lie in \(0, inf\), got 0.0"),
        ({"lo": 0.0, "open_lo": True, "allow_inf": True}, -1.0, r"must lie in \(0, inf\], got"),
        ({"lo": 0.0, "hi": 1.0}, 2.0, r"must lie in \[0, 1\], got 2.0"),
        ({"hi": 1.0}, 2.0, r"must lie in \(-inf, 1\], got 2.0"),
    ],
)
def test_a_scalar_out_of_range_names_its_interval(bounds, value, message):
    """An infinite bound is shown open unless infinities are allowed (then "inf]")."""
    with pytest.raises(ValueError, match="tau " + message):
        _validate.scalar("tau", value, **bounds)


def test_a_read_only_input_reaches_the_kernel_as_the_same_memory_and_compiles_nothing_new():
    """numba types read-only arrays apart: passed as they are, they would compile every kernel
    once more (seconds each). They reach the kernels as writeable aliases of the same memory, and
    stay unmodified."""
    pytest.importorskip("numba")
    from ppo_fast import _numba_kernels

    rng = np.random.default_rng(5)
    rewards, values = rng.normal(size=(2, 3, 40)).astype(np.float32)
    mask = rng.random((3, 40)) < 0.7
    writeable = ppo_fast.gae(rewards, values, mask=mask, backend="numba")
    compiled = len(_numba_kernels.gae.whole_rows.serial.signatures)
    frozen = [a.copy() for a in (rewards, values, mask)]
    for array in frozen:
        array.flags.writeable = False
    frozen_result = ppo_fast.gae(*frozen[:2], mask=frozen[2], backend="numba")
    assert len(_numba_kernels.gae.whole_rows.serial.signatures) == compiled
    np.testing.assert_array_equal(frozen_result.advantages, writeable.advantages)
    np.testing.assert_array_equal(frozen_result.returns, writeable.returns)
    for array, original in zip(frozen, (rewards, values, mask), strict=True):
        np.testing.assert_array_equal(array, original)
        assert not array.flags.writeable

    alias = _validate.kernel_array(frozen[0])
    assert alias.flags.carray and np.shares_memory(alias, frozen[0])
    misaligned = np.frombuffer(b"\0" + rewards.tobytes(), np.float32, offset=1)
    assert not misaligned.flags.aligned
    copy = _validate.kernel_array(misaligned)
    assert copy.flags.carray and not np.shares_memory(copy, misaligned)
    np.testing.assert_array_equal(copy, rewards.ravel())
    zero_d = np.array(2.0)
    zero_d.flags.writeable = False
    assert _validate.kernel_array(zero_d).shape == ()


# Options come by keyword: only the data come by position (and a keyword for them works too).
# The exceptions, each deliberate: kl_penalty(logprobs, ref_logprobs, estimator, clamp) keeps
# verl's kl_penalty(logprob, ref_logprob, kl_penalty) order; get_backend and warmup take their
# one setting by position.
POSITIONAL_OPTIONS = {"kl_penalty": {"estimator", "clamp"}, "get_backend": {"name"}}
POSITIONAL_OPTIONS["warmup"] = {"backend", "dtypes"}


def test_every_option_of_a_public_function_is_keyword_only():
    import inspect

    from ppo_fast import covariance

    functions = {n: getattr(ppo_fast, n) for n in ppo_fast.__all__}
    functions = {n: f for n, f in functions.items() if inspect.isfunction(f)}
    functions["valid_positions"] = covariance.valid_positions  # public in its module only
    assert {"grpo", "reinforce_plus_plus", "dppo_loss", "gae"} <= set(functions)
    for name, function in functions.items():
        for parameter in inspect.signature(function).parameters.values():
            assert parameter.kind is not parameter.POSITIONAL_ONLY, (name, parameter.name)
            if parameter.default is parameter.empty:
                continue
            if parameter.name in POSITIONAL_OPTIONS.get(name, ()):
                assert parameter.kind is parameter.POSITIONAL_OR_KEYWORD, (name, parameter.name)
            else:
                assert parameter.kind is parameter.KEYWORD_ONLY, (name, parameter.name)
