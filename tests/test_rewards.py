"""KL estimators and KL-shaped rewards: formulas, clamps, score placement, oracle equality."""

from __future__ import annotations

import math

import numpy as np
import pytest
from batches import ragged_batches
from conftest import assert_matches_oracle
from hypothesis import given
from hypothesis import strategies as st

import ppo_fast

FORMULAS = {
    "k1": lambda r: r,
    "k2": lambda r: 0.5 * r * r,
    "k3": lambda r: np.expm1(-r) + r,
    "abs": np.abs,
}


@pytest.mark.parametrize("estimator", sorted(FORMULAS))
def test_kl_estimators_match_their_formulas(backend, estimator, dtype):
    rng = np.random.default_rng(0)
    logp = rng.uniform(-5, 0, (4, 33)).astype(dtype)
    ref = rng.uniform(-5, 0, (4, 33)).astype(dtype)
    expected = FORMULAS[estimator](logp.astype(np.float64) - ref.astype(np.float64))
    actual = ppo_fast.kl_penalty(logp, ref, estimator, backend=backend)
    assert actual.dtype == dtype and actual.shape == logp.shape
    # k3 = exp(-r) - 1 + r loses digits to cancellation near r = 0; expm1 does not.
    np.testing.assert_allclose(
        actual, expected, rtol=1e-5 if dtype == np.float32 else 1e-9, atol=1e-12
    )


@pytest.mark.parametrize("log_ratio", [-707.5, -708.0, -708.25, -708.5, -709.0, -709.5, -709.75])
def test_k3_past_the_saturation_of_exp_is_exp(backend, log_ratio):
    """The compiled kernels' exp saturates at exp(709), so k3 takes e * exp(-r - 1) below
    r = -708: still exp(-r) - 1 + r (libm's exp as the reference) to float64 rounding."""
    actual = ppo_fast.kl_penalty(np.array([log_ratio]), np.zeros(1), "k3", backend=backend)
    np.testing.assert_allclose(actual, [math.exp(-log_ratio) - 1.0 + log_ratio], rtol=1e-13)


@pytest.mark.parametrize("layout", ["mask", "lengths"])
def test_k3_rewards_past_the_saturation_of_exp_in_a_long_row(compiled_backend, layout):
    """A row with one token past exp(708) among ordinary ones: the kernels compute a row without
    the correction past 708 and redo the rows that needed it. Every reward, the corrected one
    and the row's others, equals the oracle's; a row without such a token is untouched. The
    third row's NaN log-ratios, of either sign, may flag it to be redone (numba's flag is the
    max of -log_ratio's bits): its rewards are the oracle's too."""
    rng = np.random.default_rng(7)
    logp = rng.uniform(-3.0, 0.0, (3, 40))
    ref = logp + rng.normal(0.0, 0.3, (3, 40))
    ref[0, 17] = logp[0, 17] + 709.5  # -log_ratio = 709.5: past the saturation
    ref[1, 3] = logp[1, 3] + 708.5
    ref[2, 8], ref[2, 9] = np.nan, -np.nan
    scores = np.array([1.0, -2.0, 0.5])
    layout_kwargs = (
        {"mask": np.arange(40)[None, :] < np.array([[30], [40], [25]])}
        if layout == "mask"
        else {"lengths": np.array([30, 40, 25])}
    )
    if layout == "mask":
        layout_kwargs["mask"][0, 5] = False  # a hole before the corrected token
    for estimator in ("k3", "k1"):
        arguments = (scores, logp, ref)
        options = {"kl_coef": 0.1, "estimator": estimator, **layout_kwargs}
        actual = ppo_fast.shape_rewards(*arguments, **options, backend=compiled_backend)
        oracle = ppo_fast.shape_rewards(*arguments, **options, backend="python")
        np.testing.assert_allclose(actual, oracle, rtol=1e-13, atol=0.0)
        if estimator == "k3":
            expected = -0.1 * (math.exp(709.5) - 1.0 - 709.5)
            np.testing.assert_allclose(actual[0, 17], expected, rtol=1e-13)
    kl = ppo_fast.kl_penalty(logp, ref, "k3", backend=compiled_backend)
    np.testing.assert_allclose(
        kl, ppo_fast.kl_penalty(logp, ref, "k3", backend="python"), rtol=1e-13
    )


@pytest.mark.parametrize("log_ratio", [-709.79, -710.0, -1000.0])
def test_k3_is_inf_where_exp_overflows(backend, log_ratio):
    with pytest.raises(OverflowError):
        math.exp(-log_ratio)  # the reference: past float64's range
    actual = ppo_fast.kl_penalty(np.array([log_ratio]), np.zeros(1), "k3", backend=backend)
    assert actual[0] == np.inf


def test_k3_is_non_negative_and_clamped(backend):
    log_ratio = np.array([-1000.0, -30.0, -1e-9, 0.0, 1e-9, 30.0, 1000.0])
    zeros = np.zeros_like(log_ratio)
    unclamped = ppo_fast.kl_penalty(log_ratio, zeros, "k3", backend=backend)
    assert np.all(unclamped >= 0)
    assert unclamped[0] == np.inf
    clamped = ppo_fast.kl_penalty(log_ratio, zeros, "k3", clamp=10.0, backend=backend)
    np.testing.assert_allclose(clamped, [10, 10, 0, 0, 0, 10, 10], atol=1e-12)
    k1 = ppo_fast.kl_penalty(log_ratio, zeros, "k1", clamp=20.0, backend=backend)
    np.testing.assert_array_equal(k1, [-20, -20, -1e-9, 0, 1e-9, 20, 20])


def test_kl_penalty_is_elementwise_over_any_shape(backend):
    logp = np.linspace(-3, 0, 24).reshape(2, 3, 4)
    ref = np.full_like(logp, -1.0)
    out = ppo_fast.kl_penalty(logp, ref, "k2", backend=backend)
    np.testing.assert_allclose(out, 0.5 * (logp + 1.0) ** 2, rtol=1e-15)


def test_large_kl_penalty_uses_threads_and_matches_oracle(compiled_backend):
    rng = np.random.default_rng(3)
    logp = rng.normal(size=300_001)
    ref = rng.normal(size=300_001)
    actual = ppo_fast.kl_penalty(logp, ref, "k3", backend=compiled_backend)
    expected = ppo_fast.kl_penalty(logp, ref, "k3", backend="python")
    assert_matches_oracle(actual, expected, np.float64)


@given(
    batch=ragged_batches(),
    estimator=st.sampled_from(["k1", "k2", "k3", "abs"]),
    clamp=st.sampled_from([None, 10.0, 0.5]),
)
def test_shape_rewards_backends_equal_oracle(compiled_backend, batch, estimator, clamp):
    logp, ref = batch.tokens(-4, 0), batch.tokens(-4, 0)
    scores = batch.row_values(-3, 3)
    kwargs = dict(kl_coef=0.05, estimator=estimator, clamp=clamp, **batch.layout_kwargs)
    actual = ppo_fast.shape_rewards(scores, logp, ref, **kwargs, backend=compiled_backend)
    expected = ppo_fast.shape_rewards(scores, logp, ref, **kwargs, backend="python")
    assert_matches_oracle(actual, expected, batch.dtype, f"{batch.layout} {estimator}")
    assert np.isfinite(actual).all()


@given(batch=ragged_batches(layouts=("mask", "lengths", "packed")))
def test_score_lands_on_each_rows_last_valid_token(backend, batch):
    logp = batch.tokens(-4, 0)
    scores = batch.row_values(1, 3)
    rewards = ppo_fast.shape_rewards(
        scores, logp, logp, kl_coef=0.3, **batch.layout_kwargs, backend=backend
    )
    # logp == ref: every KL is 0, so the only nonzero reward of a row is its score.
    if batch.layout == "packed":
        cu = batch.layout_kwargs["cu_seqlens"]
        expected = np.zeros(batch.shape)
        for b in range(batch.n_rows):
            if cu[b + 1] > cu[b]:
                expected[cu[b + 1] - 1] = scores[b]
    else:
        expected = np.zeros(batch.shape)
        for b in range(batch.n_rows):
            positions = np.flatnonzero(batch.valid[b])
            if positions.size:
                expected[b, positions[-1]] = scores[b]
    np.testing.assert_array_equal(rewards, expected.astype(batch.dtype))


def test_shaped_reward_formula(backend, dtype):
    logp = np.array([[-1.0, -2.0, -0.5, 0.0]], dtype=dtype)
    ref = np.array([[-1.5, -1.0, -0.5, 7.0]], dtype=dtype)
    rewards = ppo_fast.shape_rewards(
        [2.0], logp, ref, kl_coef=0.1, estimator="k2", lengths=[3], backend=backend
    )
    log_ratio = np.array([0.5, -1.0, 0.0])
    expected = -0.1 * 0.5 * log_ratio**2
    expected[2] += 2.0
    np.testing.assert_allclose(rewards[0, :3], expected, rtol=1e-6)
    assert rewards[0, 3] == 0


def test_integer_scores_are_accepted(backend):
    logp = np.zeros((2, 3))
    rewards = ppo_fast.shape_rewards(np.array([1, 0]), logp, logp, kl_coef=0.1, backend=backend)
    np.testing.assert_array_equal(rewards, [[0, 0, 1], [0, 0, 0]])
