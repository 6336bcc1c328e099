"""GAE: every backend equals the oracle; the oracle obeys the identities of DESIGN.md section 6."""

from __future__ import annotations

import numpy as np
import pytest
from batches import ragged_batches
from conftest import assert_matches_oracle
from hypothesis import given
from hypothesis import strategies as st

import ppo_fast


def compressed_rows(batch, array):
    """Row b's valid entries, in order: what the recursion sees once holes are skipped."""
    if batch.layout == "packed":
        cu = batch.layout_kwargs["cu_seqlens"]
        return [array[cu[b] : cu[b + 1]] for b in range(batch.n_rows)]
    return [array[b][batch.valid[b]] for b in range(batch.n_rows)]


def scatter_rows(batch, rows, dtype):
    """Inverse of compressed_rows, with 0 where positions are not valid."""
    out = np.zeros(batch.shape, dtype=dtype)
    if batch.layout == "packed":
        cu = batch.layout_kwargs["cu_seqlens"]
        for b, row in enumerate(rows):
            out[cu[b] : cu[b + 1]] = row
    else:
        for b, row in enumerate(rows):
            out[b][batch.valid[b]] = row
    return out


def textbook_gae(rewards, values, gamma, lam, bootstrap):
    """GAE on one compressed row, as in the papers, in float64."""
    advantages = np.zeros(len(rewards))
    running, next_value = 0.0, bootstrap
    for k in range(len(rewards) - 1, -1, -1):
        delta = float(rewards[k]) + gamma * next_value - float(values[k])
        running = delta + gamma * lam * running
        advantages[k] = running
        next_value = float(values[k])
    return advantages


hyper = st.fixed_dictionaries(
    {
        "per_row": st.booleans(),
        "bootstrap": st.booleans(),
        "gamma": st.sampled_from([1.0, 0.99, 0.5, 0.0]),
        "lam": st.sampled_from([1.0, 0.95, 0.3, 0.0]),
    }
)


def draw_arguments(batch, params):
    rewards, values = batch.tokens(), batch.tokens()
    kwargs = dict(batch.layout_kwargs)
    if params["per_row"]:
        kwargs["gamma"] = batch.rng.uniform(0.0, 1.0, batch.n_rows)
        kwargs["lam"] = batch.rng.uniform(0.0, 1.0, batch.n_rows)
    else:
        kwargs["gamma"], kwargs["lam"] = params["gamma"], params["lam"]
    if params["bootstrap"]:
        kwargs["bootstrap"] = batch.row_values()
    return rewards, values, kwargs


@given(batch=ragged_batches(), params=hyper)
def test_backends_equal_oracle(compiled_backend, batch, params):
    rewards, values, kwargs = draw_arguments(batch, params)
    before = (rewards.copy(), values.copy())
    result = ppo_fast.gae(rewards, values, **kwargs, backend=compiled_backend)
    oracle = ppo_fast.gae(rewards, values, **kwargs, backend="python")
    for name in ("advantages", "returns"):
        assert_matches_oracle(
            getattr(result, name),
            getattr(oracle, name),
            batch.dtype,
            f"{name}, {batch.layout}, {params}",
        )
        assert not np.isnan(getattr(result, name)).any(), "NaN stored off the rows leaked"
    np.testing.assert_array_equal(rewards, before[0])
    np.testing.assert_array_equal(values, before[1])


@given(batch=ragged_batches(), params=hyper)
def test_oracle_is_textbook_gae_on_compressed_rows(backend, batch, params):
    """Skipping positions that are not valid is the same as deleting them from the row."""
    rewards, values, kwargs = draw_arguments(batch, params)
    result = ppo_fast.gae(rewards, values, **kwargs, backend=backend)
    gammas = np.broadcast_to(kwargs["gamma"], (batch.n_rows,))
    lams = np.broadcast_to(kwargs["lam"], (batch.n_rows,))
    bootstrap = kwargs.get("bootstrap", np.zeros(batch.n_rows))
    rows = [
        textbook_gae(r, v, gammas[b], lams[b], bootstrap[b])
        for b, (r, v) in enumerate(
            zip(compressed_rows(batch, rewards), compressed_rows(batch, values), strict=True)
        )
    ]
    expected = scatter_rows(batch, rows, batch.dtype)
    assert_matches_oracle(result.advantages, expected, batch.dtype, "advantages")
    expected_returns = scatter_rows(
        batch,
        [
            a + v.astype(np.float64)
            for a, v in zip(rows, compressed_rows(batch, values), strict=True)
        ],
        batch.dtype,
    )
    assert_matches_oracle(result.returns, expected_returns, batch.dtype, "returns")


@given(batch=ragged_batches())
def test_lam_zero_gives_one_step_td_errors(backend, batch):
    rewards, values = batch.tokens(), batch.tokens()
    gamma = 0.9
    result = ppo_fast.gae(
        rewards, values, gamma=gamma, lam=0.0, **batch.layout_kwargs, backend=backend
    )
    rows = []
    for r, v in zip(compressed_rows(batch, rewards), compressed_rows(batch, values), strict=True):
        v64 = v.astype(np.float64)
        next_values = np.append(v64[1:], 0.0)
        rows.append(r.astype(np.float64) + gamma * next_values - v64)
    assert_matches_oracle(result.advantages, scatter_rows(batch, rows, batch.dtype), batch.dtype)


@given(batch=ragged_batches())
def test_gamma_lam_one_gives_reward_to_go_minus_values(backend, batch):
    rewards, values = batch.tokens(), batch.tokens()
    bootstrap = batch.row_values()
    result = ppo_fast.gae(
        rewards,
        values,
        gamma=1.0,
        lam=1.0,
        bootstrap=bootstrap,
        **batch.layout_kwargs,
        backend=backend,
    )
    rows = []
    for b, (r, v) in enumerate(
        zip(compressed_rows(batch, rewards), compressed_rows(batch, values), strict=True)
    ):
        reward_to_go = np.cumsum(r.astype(np.float64)[::-1])[::-1]
        rows.append(reward_to_go + bootstrap[b] - v.astype(np.float64))
    assert_matches_oracle(result.advantages, scatter_rows(batch, rows, batch.dtype), batch.dtype)
    returns = [
        rtg + v.astype(np.float64)
        for rtg, v in zip(rows, compressed_rows(batch, values), strict=True)
    ]
    assert_matches_oracle(result.returns, scatter_rows(batch, returns, batch.dtype), batch.dtype)


@given(batch=ragged_batches(layouts=("mask", "lengths", "none")))
def test_padded_and_packed_layouts_agree(backend, batch):
    """The same rows, padded (holes and all) or packed without the holes, give equal numbers."""
    rewards, values = batch.tokens(), batch.tokens()
    padded = ppo_fast.gae(
        rewards, values, gamma=0.97, lam=0.9, **batch.layout_kwargs, backend=backend
    )
    lengths = batch.valid.sum(axis=1)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    packed = ppo_fast.gae(
        rewards[batch.valid],
        values[batch.valid],
        gamma=0.97,
        lam=0.9,
        cu_seqlens=cu,
        backend=backend,
    )
    np.testing.assert_array_equal(padded.advantages[batch.valid], packed.advantages)
    np.testing.assert_array_equal(padded.returns[batch.valid], packed.returns)
    assert not padded.advantages[~batch.valid].any() and not padded.returns[~batch.valid].any()


def test_float32_state_does_not_drift(backend):
    """gamma * lam = 1 over a long row: a float32 running state would drift by T * 1e-7."""
    n = 20_000 if backend != "python" else 5_000
    rng = np.random.default_rng(1)
    rewards = rng.uniform(0.0, 1.0, (1, n)).astype(np.float32)
    values = np.zeros((1, n), dtype=np.float32)
    result = ppo_fast.gae(rewards, values, gamma=1.0, lam=1.0, backend=backend)
    exact = np.cumsum(rewards[0].astype(np.float64)[::-1])[::-1]
    # Only the final rounding to float32 remains: half an ulp, 6e-8 relative.
    np.testing.assert_allclose(result.advantages[0], exact, rtol=1e-7)


def test_bootstrap_is_the_value_after_the_last_valid_token(backend):
    rewards = np.array([[1.0, 0.0, np.nan]])
    values = np.array([[0.5, 0.25, np.nan]])
    mask = np.array([[1, 1, 0]])
    result = ppo_fast.gae(
        rewards, values, gamma=0.5, lam=1.0, mask=mask, bootstrap=np.array([2.0]), backend=backend
    )
    # A_1 = 0 + 0.5 * 2 - 0.25 = 0.75; A_0 = 1 + 0.5 * 0.25 - 0.5 + 0.5 * 0.75 = 1.0
    np.testing.assert_allclose(result.advantages, [[1.0, 0.75, 0.0]], rtol=1e-15)
    np.testing.assert_allclose(result.returns, [[1.5, 1.0, 0.0]], rtol=1e-15)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches(backend, shape, dtype):
    x = np.zeros(shape, dtype=dtype)
    result = ppo_fast.gae(x, x, backend=backend)
    assert result.advantages.shape == shape and result.advantages.dtype == dtype
    packed = ppo_fast.gae(np.zeros(0, dtype), np.zeros(0, dtype), cu_seqlens=[0], backend=backend)
    assert packed.returns.shape == (0,)
