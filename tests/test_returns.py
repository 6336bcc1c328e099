"""The critic-free estimators: every backend equals the oracle on generated ragged batches; the
oracle obeys the identities of the module docstring and equals verl 0.9.1's functions."""

from __future__ import annotations

import functools
import types
import uuid

import numpy as np
import pytest
from batches import Batch, ragged_batches
from conftest import RTOL, assert_matches_oracle
from hypothesis import given
from hypothesis import strategies as st
from test_gae import compressed_rows, scatter_rows

import ppo_fast
from ppo_fast import _groups

hyper = st.fixed_dictionaries(
    {
        "per_row": st.booleans(),
        "bootstrap": st.booleans(),
        "gamma": st.sampled_from([1.0, 0.99, 0.5, 0.0]),
    }
)


def draw_kwargs(batch: Batch, params: dict) -> dict:
    """The layout, gamma (scalar or per row) and bootstrap (or none) of a call."""
    kwargs = dict(batch.layout_kwargs)
    if params["per_row"]:
        kwargs["gamma"] = batch.rng.uniform(0.0, 1.0, batch.n_rows)
    else:
        kwargs["gamma"] = params["gamma"]
    if params["bootstrap"]:
        kwargs["bootstrap"] = batch.row_values()
    return kwargs


def labels(batch: Batch) -> np.ndarray:
    """Random group labels: uneven groups, not adjacent, some of one row."""
    return batch.rng.integers(0, max(1, (batch.n_rows + 1) // 2), batch.n_rows)


def policy_arrays(batch: Batch) -> dict[str, np.ndarray]:
    """old_logprobs and sum_pi_squared with sum_pi_squared >= pi**2, as a softmax gives."""
    old_logprobs = batch.tokens(-3.0, 0.0)
    pi_squared = np.exp(2.0 * old_logprobs.astype(np.float64))
    with np.errstate(invalid="ignore"):  # the junk at masked positions
        sum_pi_squared = pi_squared + batch.rng.uniform(0.0, 1.0, batch.shape) * (1 - pi_squared)
    sum_pi_squared[~batch.valid] = np.nan  # nothing stored at a masked position may count
    return {"old_logprobs": old_logprobs, "sum_pi_squared": sum_pi_squared.astype(batch.dtype)}


def per_row_values(kwargs: dict, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    gammas = np.broadcast_to(kwargs["gamma"], (n_rows,)).astype(np.float64)
    return gammas, np.asarray(kwargs.get("bootstrap", np.zeros(n_rows)), dtype=np.float64)


def textbook_returns(rewards, gamma, bootstrap) -> np.ndarray:
    """G on one compressed row, as in the papers, in float64."""
    returns = np.zeros(len(rewards))
    running = bootstrap
    for k in range(len(rewards) - 1, -1, -1):
        running = float(rewards[k]) + gamma * running
        returns[k] = running
    return returns


def _copies(*arrays):
    return [np.array(a, copy=True) for a in arrays]


def _assert_unchanged(before, after):
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new)


# ---- every backend against the oracle -----------------------------------------------------------


def _assert_results_match(result, oracle, batch, what):
    for name, got, want in zip(("advantages", "returns"), result, oracle, strict=True):
        assert_matches_oracle(got, want, batch.dtype, f"{name}, {batch.layout}, {what}")
        assert not np.isnan(got).any(), f"{name}: NaN stored off the rows leaked"


@given(batch=ragged_batches(), params=hyper)
def test_discounted_returns_equal_the_oracle(compiled_backend, batch, params):
    rewards, kwargs = batch.tokens(), draw_kwargs(batch, params)
    before = _copies(rewards)
    result = ppo_fast.discounted_returns(rewards, **kwargs, backend=compiled_backend)
    oracle = ppo_fast.discounted_returns(rewards, **kwargs, backend="python")
    assert_matches_oracle(result, oracle, batch.dtype, f"{batch.layout}, {params}")
    assert not np.isnan(result).any(), "NaN stored off the rows leaked"
    _assert_unchanged(before, [rewards])


@given(batch=ragged_batches(), params=hyper)
def test_remax_equals_the_oracle(compiled_backend, batch, params):
    rewards, kwargs = batch.tokens(), draw_kwargs(batch, params)
    baselines = batch.row_values()
    before = _copies(rewards, baselines)
    result = ppo_fast.remax(rewards, baselines, **kwargs, backend=compiled_backend)
    oracle = ppo_fast.remax(rewards, baselines, **kwargs, backend="python")
    _assert_results_match(result, oracle, batch, params)
    _assert_unchanged(before, [rewards, baselines])


@given(batch=ragged_batches(), params=hyper, whiten=st.booleans(), unbiased=st.booleans())
def test_reinforce_plus_plus_equals_the_oracle(compiled_backend, batch, params, whiten, unbiased):
    rewards, kwargs = batch.tokens(), draw_kwargs(batch, params)
    options = {**kwargs, "whiten": whiten, "unbiased": unbiased}
    n_valid = int(batch.valid.sum())
    if whiten and n_valid < 1 + unbiased:
        for backend in (compiled_backend, "python"):
            with pytest.raises(ValueError, match="pass whiten=False"):
                ppo_fast.reinforce_plus_plus(rewards, **options, backend=backend)
        return
    before = _copies(rewards)
    result = ppo_fast.reinforce_plus_plus(rewards, **options, backend=compiled_backend)
    oracle = ppo_fast.reinforce_plus_plus(rewards, **options, backend="python")
    _assert_results_match(result, oracle, batch, options)
    _assert_unchanged(before, [rewards])


@given(
    batch=ragged_batches(),
    params=hyper,
    zero_tail=st.booleans(),
    eps=st.sampled_from([1e-8, 0.0, 0.5]),
    weighted=st.booleans(),
)
def test_optimal_token_baseline_equals_the_oracle(
    compiled_backend, batch, params, zero_tail, eps, weighted
):
    rewards, kwargs = batch.tokens(), draw_kwargs(batch, params)
    arrays = policy_arrays(batch)
    if weighted:
        arrays["is_weights"] = batch.tokens(0.0, 2.0)
    groups = labels(batch)
    options = {**kwargs, **arrays, "zero_tail": zero_tail, "eps": eps}
    before = _copies(rewards, groups, *arrays.values())
    result = ppo_fast.optimal_token_baseline(
        rewards, groups=groups, **options, backend=compiled_backend
    )
    oracle = ppo_fast.optimal_token_baseline(rewards, groups=groups, **options, backend="python")
    for name, got, want in zip(("advantages", "returns"), result, oracle, strict=True):
        # A group's baseline is a ratio of sums over its rows: judged on the scale of the result.
        assert_matches_oracle(got, want, batch.dtype, f"{name}, {batch.layout}, {params}")
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
    _assert_unchanged(before, [rewards, groups, *arrays.values()])


# ---- identities ---------------------------------------------------------------------------------


@given(batch=ragged_batches(), params=hyper)
def test_returns_are_the_textbook_recursion_on_compressed_rows(backend, batch, params):
    """Skipping positions that are not valid is the same as deleting them from the row."""
    rewards, kwargs = batch.tokens(), draw_kwargs(batch, params)
    result = ppo_fast.discounted_returns(rewards, **kwargs, backend=backend)
    gammas, bootstrap = per_row_values(kwargs, batch.n_rows)
    rows = [
        textbook_returns(row, gammas[b], bootstrap[b])
        for b, row in enumerate(compressed_rows(batch, rewards))
    ]
    assert_matches_oracle(result, scatter_rows(batch, rows, batch.dtype), batch.dtype)


@given(batch=ragged_batches())
def test_gamma_one_gives_the_masked_reverse_cumulative_sum(backend, batch):
    rewards, bootstrap = batch.tokens(), batch.row_values()
    result = ppo_fast.discounted_returns(
        rewards, bootstrap=bootstrap, **batch.layout_kwargs, backend=backend
    )
    rows = [
        np.cumsum(row.astype(np.float64)[::-1])[::-1] + bootstrap[b]
        for b, row in enumerate(compressed_rows(batch, rewards))
    ]
    assert_matches_oracle(result, scatter_rows(batch, rows, batch.dtype), batch.dtype)


@given(batch=ragged_batches(), params=hyper)
def test_discounted_returns_are_gae_with_zero_values_and_lam_one(backend, batch, params):
    """With V = 0 and lam = 1, GAE's advantages and returns are the discounted returns. The
    oracle does the same operations in both (r + gamma * 0 - 0 is r exactly): the same bits.
    The compiled kernels associate the sums per block of 8 valid positions
    (_numba_kernels._returns_row): equal to the tolerance."""
    rewards, kwargs = batch.tokens(), draw_kwargs(batch, params)
    returns = ppo_fast.discounted_returns(rewards, **kwargs, backend=backend)
    values = np.zeros_like(rewards)
    gae = ppo_fast.gae(rewards, values, lam=1.0, **kwargs, backend=backend)
    for name, result in gae._asdict().items():
        if backend == "python":
            np.testing.assert_array_equal(returns, result, err_msg=name)
        else:
            assert_matches_oracle(returns, result, batch.dtype, name)


@given(batch=ragged_batches(), params=hyper)
def test_remax_advantages_are_the_returns_minus_the_baselines(backend, batch, params):
    rewards, kwargs = batch.tokens(), draw_kwargs(batch, params)
    baselines = batch.row_values()
    result = ppo_fast.remax(rewards, baselines, **kwargs, backend=backend)
    np.testing.assert_array_equal(
        result.returns, ppo_fast.discounted_returns(rewards, **kwargs, backend=backend)
    )
    rows = [
        row.astype(np.float64) - baselines[b]
        for b, row in enumerate(compressed_rows(batch, result.returns))
    ]
    assert_matches_oracle(result.advantages, scatter_rows(batch, rows, batch.dtype), batch.dtype)


@given(batch=ragged_batches(), params=hyper, unbiased=st.booleans())
def test_reinforce_plus_plus_whitens_the_discounted_returns(backend, batch, params, unbiased):
    rewards, kwargs = batch.tokens(), draw_kwargs(batch, params)
    returns = ppo_fast.discounted_returns(rewards, **kwargs, backend=backend)
    plain = ppo_fast.reinforce_plus_plus(rewards, **kwargs, whiten=False, backend=backend)
    np.testing.assert_array_equal(plain.returns, returns)
    np.testing.assert_array_equal(plain.advantages, returns)
    if batch.valid.sum() < 2:
        return
    result = ppo_fast.reinforce_plus_plus(
        rewards, **kwargs, unbiased=unbiased, eps=1e-6, backend=backend
    )
    np.testing.assert_array_equal(result.returns, returns)
    whitened = ppo_fast.whiten(
        returns, **batch.layout_kwargs, unbiased=unbiased, eps=1e-6, backend=backend
    )
    np.testing.assert_array_equal(result.advantages, whitened)


@pytest.mark.parametrize("n_rows", [2, 3, 7])
def test_optimal_token_baseline_of_identical_rows_is_zero_up_to_eps(backend, dtype, n_rows):
    """B_k = n G W / (n W + eps) for n identical rows: A_k = G_k eps / (n W_k + eps)."""
    rng = np.random.default_rng(n_rows)
    width = 9
    row = rng.normal(size=width)
    old_logprobs = -np.abs(rng.normal(size=width))
    sum_pi_squared = np.exp(2 * old_logprobs) + 0.1
    tile = lambda x: np.tile(x, (n_rows, 1)).astype(dtype)  # noqa: E731
    arguments = (tile(row), tile(old_logprobs), tile(sum_pi_squared), np.zeros(n_rows))
    exact = ppo_fast.optimal_token_baseline(*arguments, eps=0.0, backend=backend)
    returns = exact.returns.astype(np.float64)
    # G - B with B = G up to the rounding of n-term sums and a quotient: a few ulp of G.
    scale = float(np.abs(returns).max())
    np.testing.assert_allclose(exact.advantages, 0.0, atol=1e-14 * scale)
    eps = 1e-3
    result = ppo_fast.optimal_token_baseline(*arguments, eps=eps, backend=backend)
    old, squares = arguments[1].astype(np.float64), arguments[2].astype(np.float64)
    weights = 1 - 2 * np.exp(old) + squares
    expected = returns * eps / (n_rows * np.cumsum(weights, axis=1) + eps)
    rtol = RTOL[np.dtype(dtype)]
    np.testing.assert_allclose(result.advantages, expected, rtol=rtol, atol=rtol * scale)


def test_optimal_token_baseline_of_a_row_alone_is_its_returns(backend, dtype):
    """A group of one row, or of one row with valid tokens and rows without: B = 0."""
    rng = np.random.default_rng(5)
    rewards = rng.normal(size=(4, 6)).astype(dtype)
    old_logprobs = -np.abs(rng.normal(size=(4, 6))).astype(dtype)
    sum_pi_squared = np.full((4, 6), 0.5, dtype)
    for zero_tail in (True, False):
        result = ppo_fast.optimal_token_baseline(
            rewards,
            old_logprobs,
            sum_pi_squared,
            ["alone", "pair", "pair", "with-empty"],
            lengths=[6, 4, 5, 3],
            zero_tail=zero_tail,
            backend=backend,
        )
        np.testing.assert_array_equal(result.advantages[0], result.returns[0])
        np.testing.assert_array_equal(result.advantages[3], result.returns[3])
        assert np.all(result.advantages[1:3, :4] != result.returns[1:3, :4])
        empty = ppo_fast.optimal_token_baseline(
            rewards[2:],
            old_logprobs[2:],
            sum_pi_squared[2:],
            ["g", "g"],
            lengths=[5, 0],
            zero_tail=zero_tail,
            backend=backend,
        )
        np.testing.assert_array_equal(empty.advantages, empty.returns)


def test_optimal_token_baseline_by_hand(backend):
    """Two rows of one group, the second with a hole: the k-th valid tokens are compared."""
    rewards = np.array([[1.0, 0.0, 2.0], [3.0, np.nan, 1.0]])
    mask = np.array([[1, 1, 1], [1, 0, 1]])
    old_logprobs = np.log(np.array([[0.5, 0.5, 0.5], [0.5, np.nan, 0.25]]))
    sum_pi_squared = np.array([[0.5, 0.5, 0.5], [0.5, np.nan, 0.25]])
    result = ppo_fast.optimal_token_baseline(
        rewards, old_logprobs, sum_pi_squared, [7, 7], mask=mask, eps=0.0, backend=backend
    )
    # G: row 0 = [3, 2, 2], row 1 = [4, 1] at positions 0 and 2.
    # w = 1 - 2 pi + sum_pi_squared: row 0 = [0.5, 0.5, 0.5], row 1 = [0.5, 0.75]; W = cumsum:
    # row 0 = [0.5, 1, 1.5], row 1 = [0.5, 1.25].
    # B_1 = (3 * 0.5 + 4 * 0.5) / 1 = 3.5; B_2 = (2 * 1 + 1 * 1.25) / 2.25 = 13 / 9.
    # Row 0's third token is past row 1's length: no baseline there (zero_tail).
    np.testing.assert_allclose(result.returns, [[3.0, 2.0, 2.0], [4.0, 0.0, 1.0]], rtol=1e-15)
    expected = [[3.0 - 3.5, 2.0 - 13 / 9, 2.0], [4.0 - 3.5, 0.0, 1.0 - 13 / 9]]
    np.testing.assert_allclose(result.advantages, expected, rtol=1e-15)
    without = ppo_fast.optimal_token_baseline(
        rewards,
        old_logprobs,
        sum_pi_squared,
        [7, 7],
        mask=mask,
        eps=0.0,
        zero_tail=False,
        backend=backend,
    )
    # Without zero_tail, row 0 alone at its third token is its own baseline: advantage 0.
    assert without.advantages[0, 2] == 0.0


@given(batch=ragged_batches(layouts=("mask", "lengths")))
def test_zero_tail_leaves_the_unique_longest_row_its_returns_past_the_second(backend, batch):
    rewards = batch.tokens()
    arrays = policy_arrays(batch)
    groups = labels(batch)
    result = ppo_fast.optimal_token_baseline(
        rewards, groups=groups, **arrays, **batch.layout_kwargs, backend=backend
    )
    counts = batch.valid.sum(axis=1)
    for group in np.unique(groups):
        members = np.flatnonzero(groups == group)
        ordered = np.sort(counts[members])[::-1]
        if len(ordered) < 2 or ordered[0] == ordered[1]:
            continue
        longest = members[np.argmax(counts[members])]
        tail = np.flatnonzero(batch.valid[longest])[ordered[1] :]
        np.testing.assert_array_equal(
            result.advantages[longest, tail], result.returns[longest, tail]
        )


@given(batch=ragged_batches(layouts=("mask", "lengths", "none")), weighted=st.booleans())
def test_optimal_token_baseline_does_not_depend_on_row_order_or_labels(backend, batch, weighted):
    """Shuffling the rows shuffles the results (each group's sums in row order may round
    differently), and any labels naming the same groups give the same bits."""
    rewards = batch.tokens()
    arrays = policy_arrays(batch)
    if weighted:
        arrays["is_weights"] = batch.tokens(0.0, 2.0)
    ids = labels(batch)
    result = ppo_fast.optimal_token_baseline(
        rewards, groups=ids, **arrays, **batch.layout_kwargs, backend=backend
    )
    names = np.array([f"prompt-{i}" for i in ids])
    uids = [uuid.UUID(int=int(i) * 7919) for i in ids]
    factorised = _groups.factorize(ids, batch.n_rows)
    for same in (names, uids, factorised, ids + 10**12):
        again = ppo_fast.optimal_token_baseline(
            rewards, groups=same, **arrays, **batch.layout_kwargs, backend=backend
        )
        np.testing.assert_array_equal(again.advantages, result.advantages)
    order = batch.rng.permutation(batch.n_rows)
    shuffled_layout = {name: value[order] for name, value in batch.layout_kwargs.items()}
    shuffled = ppo_fast.optimal_token_baseline(
        rewards[order],
        groups=ids[order],
        **{name: value[order] for name, value in arrays.items()},
        **shuffled_layout,
        backend=backend,
    )
    assert_matches_oracle(shuffled.advantages, result.advantages[order], batch.dtype)
    np.testing.assert_array_equal(shuffled.returns, result.returns[order])


def test_is_weights_of_one_change_nothing(backend, dtype):
    rng = np.random.default_rng(2)
    rewards = rng.normal(size=(5, 7)).astype(dtype)
    old_logprobs = -np.abs(rng.normal(size=(5, 7))).astype(dtype)
    sum_pi_squared = (np.exp(2.0 * old_logprobs) + 0.1).astype(dtype)  # w > 0: W grows
    arguments = (rewards, old_logprobs, sum_pi_squared, [0, 1, 0, 0, 1])
    plain = ppo_fast.optimal_token_baseline(*arguments, backend=backend)
    ones = np.ones_like(rewards)
    weighted = ppo_fast.optimal_token_baseline(*arguments, is_weights=ones, backend=backend)
    np.testing.assert_array_equal(plain.advantages, weighted.advantages)
    twos = np.full_like(rewards, 2.0)
    doubled = ppo_fast.optimal_token_baseline(*arguments, is_weights=twos, backend=backend)
    # w scaled by 4 in every row: B = sum(G W) / sum(W) is the same ratio, but for eps.
    np.testing.assert_allclose(doubled.advantages, plain.advantages, rtol=1e-5, atol=1e-5)
    twos[0] = 1.0  # row 0 weighs less in its group's baseline: the other rows' change
    reweighted = ppo_fast.optimal_token_baseline(*arguments, is_weights=twos, backend=backend)
    assert np.all(np.abs(reweighted.advantages[[2, 3]] - plain.advantages[[2, 3]]) > 1e-4)


def _estimators(arrays: dict, groups: np.ndarray, n_rows: int, **layout) -> dict:
    """Every estimator's token outputs on ``arrays`` (rewards, old_logprobs, sum_pi_squared)."""
    rewards = arrays["rewards"]
    return {
        "discounted_returns": (ppo_fast.discounted_returns(rewards, gamma=0.9, **layout),),
        "remax": ppo_fast.remax(rewards, np.arange(n_rows), gamma=0.9, **layout),
        "optimal_token_baseline": ppo_fast.optimal_token_baseline(
            groups=groups, **arrays, **layout
        ),
    }


@given(batch=ragged_batches(layouts=("mask", "lengths", "none")))
def test_padded_and_packed_layouts_agree(backend, batch):
    """The same rows, padded (holes and all) or packed without the holes, give equal numbers:
    the same bits, except where the compiled kernels' blocks of 8 positions (valid or not in a
    padded row, all valid once packed) associate the returns' sums differently."""
    arrays = {"rewards": batch.tokens(), **policy_arrays(batch)}
    groups = labels(batch)
    padded = _estimators(arrays, groups, batch.n_rows, **batch.layout_kwargs, backend=backend)
    lengths = batch.valid.sum(axis=1)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    packed_arrays = {name: array[batch.valid] for name, array in arrays.items()}
    packed = _estimators(packed_arrays, groups, batch.n_rows, cu_seqlens=cu, backend=backend)
    for name, outputs in padded.items():
        for padded_output, packed_output in zip(outputs, packed[name], strict=True):
            if backend == "python" or name == "optimal_token_baseline":
                np.testing.assert_array_equal(padded_output[batch.valid], packed_output, name)
            else:
                assert_matches_oracle(padded_output[batch.valid], packed_output, batch.dtype, name)
            assert not padded_output[~batch.valid].any(), name


def test_float32_state_does_not_drift(backend):
    """gamma = 1 over a long row: a float32 running return would drift by T * 1e-7."""
    n = 20_000 if backend != "python" else 5_000
    rewards = np.random.default_rng(1).uniform(0.0, 1.0, (1, n)).astype(np.float32)
    result = ppo_fast.discounted_returns(rewards, backend=backend)
    exact = np.cumsum(rewards[0].astype(np.float64)[::-1])[::-1]
    # Only the final rounding to float32 remains: half an ulp, 6e-8 relative.
    np.testing.assert_allclose(result[0], exact, rtol=1e-7)


def test_bootstrap_is_the_value_after_the_last_valid_token(backend):
    rewards = np.array([[1.0, np.inf, 2.0, np.nan]])
    mask = np.array([[1, 0, 1, 0]])
    result = ppo_fast.discounted_returns(
        rewards, gamma=0.5, mask=mask, bootstrap=np.array([4.0]), backend=backend
    )
    # G_2 = 2 + 0.5 * 4 = 4; G_1 = 1 + 0.5 * 4 = 3: the masked inf is skipped.
    np.testing.assert_array_equal(result, [[3.0, 0.0, 4.0, 0.0]])


@pytest.mark.parametrize("holes", [False, True], ids=["whole", "holes"])
def test_blocks_where_a_sum_would_overflow_take_the_recursion(compiled_backend, holes):
    """Rewards near float64's largest number: summed in the blocks' log-step order, 1e308 + 1e308
    overflows where the recursion's (1e308 + (1e308 - 1e308)) does not. Such a block takes the
    recursion (as GAE's, test_gae.py), whose finite returns the backends must give exactly."""
    rewards = np.zeros((1, 24))
    rewards[0, -3:] = [1e308, 1e308, -1e308]
    mask = np.ones((1, 24), dtype=bool)
    if holes:
        mask[0, [5, 17, 19]] = False
        rewards[0, [5, 17, 19]] = np.inf
    for name, call in (
        ("discounted_returns", ppo_fast.discounted_returns),
        ("remax", functools.partial(ppo_fast.remax, baselines=np.array([0.5]))),
    ):
        result = np.asarray(call(rewards, gamma=1.0, mask=mask, backend=compiled_backend))
        oracle = np.asarray(call(rewards, gamma=1.0, mask=mask, backend="python"))
        assert np.isfinite(oracle).all(), name
        np.testing.assert_array_equal(result, oracle, err_msg=name)


@pytest.mark.parametrize("gamma", [1e-300, 1e-40, 0.0])
def test_an_infinite_bootstrap_reaches_every_return_as_the_recursion_says(backend, gamma):
    """r + gamma * inf is inf for any gamma > 0, also where gamma^8 underflows to 0 (which the
    compiled kernels' blocks of 8 positions would make NaN); for gamma = 0 it is NaN (0 * inf),
    and so is every return before it (0 * NaN)."""
    rewards = np.ones((2, 19))
    result = ppo_fast.discounted_returns(
        rewards, gamma=gamma, bootstrap=np.array([np.inf, -np.inf]), backend=backend
    )
    if gamma > 0.0:
        np.testing.assert_array_equal(result, np.array([[np.inf], [-np.inf]]) * rewards)
    else:
        assert np.isnan(result).all()


def test_non_finite_values_propagate_as_in_the_oracle(backend):
    """A NaN reward reaches its row's earlier returns, and through the group's baseline the
    advantages of its group at those indices: no other row, no other group."""
    rewards = np.ones((4, 5))
    rewards[0, 3] = np.nan
    old_logprobs = np.full((4, 5), -1.0)
    sum_pi_squared = np.full((4, 5), 0.5)
    returns = ppo_fast.discounted_returns(rewards, backend=backend)
    np.testing.assert_array_equal(np.isnan(returns[0]), [True, True, True, True, False])
    assert np.isfinite(returns[1:]).all()
    result = ppo_fast.optimal_token_baseline(
        rewards, old_logprobs, sum_pi_squared, [0, 0, 1, 1], backend=backend
    )
    np.testing.assert_array_equal(np.isnan(result.advantages[:2, :4]), True)
    assert np.isfinite(result.advantages[:2, 4]).all() and np.isfinite(result.advantages[2:]).all()
    baselines = np.array([0.5, np.inf, -np.inf, np.nan])
    remax = ppo_fast.remax(np.ones((4, 5)), baselines, backend=backend)
    expected = np.arange(5, 0, -1)[None, :] - baselines[:, None]
    np.testing.assert_array_equal(remax.advantages, expected)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches(backend, shape, dtype):
    x = np.zeros(shape, dtype=dtype)
    assert ppo_fast.discounted_returns(x, backend=backend).shape == shape
    result = ppo_fast.remax(x, np.zeros(shape[0]), backend=backend)
    assert result.advantages.shape == shape and result.advantages.dtype == dtype
    result = ppo_fast.optimal_token_baseline(x, x, x, np.arange(shape[0]), backend=backend)
    assert result.returns.shape == shape and result.returns.dtype == dtype
    packed = ppo_fast.discounted_returns(np.zeros(0, dtype), cu_seqlens=[0], backend=backend)
    assert packed.shape == (0,)
    assert ppo_fast.reinforce_plus_plus(x, whiten=False, backend=backend).returns.shape == shape
    with pytest.raises(ValueError, match=r"no valid position.*pass whiten=False"):
        ppo_fast.reinforce_plus_plus(x, backend=backend)


# ---- out= ---------------------------------------------------------------------------------------


def _calls(rewards, mask):
    rng = np.random.default_rng(0)
    old_logprobs = -np.abs(rng.normal(size=rewards.shape)).astype(rewards.dtype)
    sum_pi_squared = np.full_like(rewards, 0.5)
    groups = np.arange(rewards.shape[0]) % 2
    return {
        "reinforce_plus_plus": lambda **k: ppo_fast.reinforce_plus_plus(rewards, mask=mask, **k),
        "remax": lambda **k: ppo_fast.remax(rewards, np.ones(rewards.shape[0]), mask=mask, **k),
        "optimal_token_baseline": lambda **k: ppo_fast.optimal_token_baseline(
            rewards, old_logprobs, sum_pi_squared, groups, mask=mask, **k
        ),
    }


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "remax", "optimal_token_baseline"])
def test_out_pairs_equal_the_call_without_and_are_returned(name, dtype):
    rng = np.random.default_rng(4)
    rewards = rng.normal(size=(5, 8)).astype(dtype)
    mask = rng.random((5, 8)) < 0.7
    call = _calls(rewards, mask)[name]
    expected = call()
    outs = (np.full_like(rewards, np.nan), np.full_like(rewards, np.nan))
    result = call(out=outs)
    assert result.advantages is outs[0] and result.returns is outs[1]
    np.testing.assert_array_equal(result.advantages, expected.advantages)
    np.testing.assert_array_equal(result.returns, expected.returns)
    with pytest.raises(TypeError, match=r"out must be a tuple \(advantages, returns\)"):
        call(out=np.empty_like(rewards))
    with pytest.raises(ValueError, match=r"out\[0\] \(advantages\) shares memory with rewards"):
        call(out=(rewards, np.empty_like(rewards)))
    shared = np.empty_like(rewards)
    with pytest.raises(ValueError, match=r"out\[1\] \(returns\) shares memory with out\[0\]"):
        call(out=(shared, shared))


def test_discounted_returns_out(dtype):
    rewards = np.random.default_rng(6).normal(size=(3, 4)).astype(dtype)
    expected = ppo_fast.discounted_returns(rewards, gamma=0.9)
    out = np.full_like(rewards, np.nan)
    assert ppo_fast.discounted_returns(rewards, gamma=0.9, out=out) is out
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="out shares memory with rewards"):
        ppo_fast.discounted_returns(rewards, out=rewards)
    with pytest.raises(TypeError, match="out has dtype"):
        ppo_fast.discounted_returns(rewards, out=np.empty((3, 4), np.float16))


# ---- errors that say what to fix ----------------------------------------------------------------


def _otb(**changes):
    arrays = {
        "rewards": np.ones((3, 4)),
        "old_logprobs": np.full((3, 4), -1.0),
        "sum_pi_squared": np.full((3, 4), 0.5),
        "groups": [0, 0, 1],
    }
    return ppo_fast.optimal_token_baseline(**{**arrays, **changes})


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: _otb(groups=[0, 1]), ValueError, r"groups must have shape \(3,\)"),
        (
            lambda: _otb(groups=_groups.factorize([0, 1], 2)),
            ValueError,
            "groups has 2 rows but the batch has 3",
        ),
        (lambda: _otb(groups=[0, None, 1]), ValueError, r"groups\[1\] is None"),
        (lambda: _otb(zero_tail=1), TypeError, "zero_tail must be True or False"),
        (lambda: _otb(eps=-1.0), ValueError, r"eps must lie in \[0"),
        (lambda: _otb(is_weights=np.ones((3, 4), np.float32)), TypeError, "is_weights is float32"),
        (lambda: _otb(sum_pi_squared=np.ones((3, 5))), ValueError, "sum_pi_squared has shape"),
        (lambda: _otb(gamma=1.5), ValueError, r"gamma must lie in \[0, 1\]"),
        (
            lambda: ppo_fast.remax(np.ones((3, 4)), 0.5),
            ValueError,
            r"baselines must have shape \(3,\)",
        ),
        (
            lambda: ppo_fast.remax(np.ones((3, 4)), ["a", "b", "c"]),
            TypeError,
            "baselines must be a real number",
        ),
        (
            lambda: ppo_fast.reinforce_plus_plus(np.ones((3, 4)), whiten="yes"),
            TypeError,
            "whiten must be True or False",
        ),
        (
            lambda: ppo_fast.reinforce_plus_plus(np.ones((3, 4)), unbiased=None),
            TypeError,
            "unbiased must be True or False",
        ),
        (
            lambda: ppo_fast.reinforce_plus_plus(np.ones((1, 1)), unbiased=True),
            ValueError,
            r"unbiased variance needs at least two valid positions.*pass whiten=False",
        ),
        (
            lambda: ppo_fast.discounted_returns(np.ones((3, 4)), bootstrap=0.0),
            ValueError,
            r"bootstrap must have shape \(3,\)",
        ),
    ],
)
def test_bad_input_is_an_error_that_says_what_to_fix(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---- verl 0.9.1 ---------------------------------------------------------------------------------


@functools.cache
def _verl_functions():
    """verl 0.9.1's core_algos where verl imports (pip install --no-deps verl==0.9.1), else the
    verbatim copy of its functions in ppo_fast._peers (held to verl's source by
    test_compat_peer_copies.py)."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        from ppo_fast._peers import copy

        return copy("verl_0_9_1")
    return core_algos


def _verl():
    pytest.importorskip("torch")
    return _verl_functions()


def _tensor(array: np.ndarray):
    import torch

    return torch.from_numpy(array)


def _padded(rng, n_rows, width, holes: bool, empty: bool):
    """(B, T) 0/1 masks: right-padded without holes, or with holes and left padding."""
    lengths = rng.integers(0 if empty else 1, width + 1, n_rows)
    valid = np.arange(width)[None, :] < lengths[:, None]
    if holes:
        valid &= rng.random((n_rows, width)) < 0.75
        valid[::3] = np.roll(valid[::3], 2, axis=1)  # some left padding too
    return valid


def _close(actual, expected, dtype, where=None, what="", rtol=0.0):
    """Equal to verl's result at ``where`` (everywhere by default), on the scale of the result:
    float64 to 1e-12, float32 to 2e-5 (verl computes in the input dtype: in float32 its running
    return and its sums round in float32), or ``rtol`` when larger."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if where is not None:
        actual, expected = actual[where], expected[where]
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    rtol = max(rtol, 1e-12 if np.dtype(dtype) == np.float64 else 2e-5)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


@pytest.mark.parametrize("holes", [False, True], ids=["right-padded", "holes"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_equals_verl(holes, gamma, dtype):
    """verl's masked_whiten is unbiased with eps 1e-8 under the square root: unbiased=True. Its
    masked_mean divides by the count + 1e-8, which moves the mean and the variance by a relative
    1e-8 / count: the advantages are compared to that (ppo_fast.compat.verl reproduces it)."""
    verl = _verl()
    rng = np.random.default_rng(11)
    valid = _padded(rng, 12, 30, holes, empty=True)
    rewards = (rng.normal(size=valid.shape) * valid).astype(dtype)
    config = types.SimpleNamespace(gamma=gamma)
    advantages, returns = verl.compute_reinforce_plus_plus_outcome_advantage(
        _tensor(rewards), _tensor(valid.astype(dtype)), config
    )
    ours = ppo_fast.reinforce_plus_plus(rewards, gamma=gamma, mask=valid, unbiased=True)
    _close(ours.returns, returns, dtype, what="returns")
    quirk = 10 * 1e-8 / valid.sum()
    _close(ours.advantages, advantages, dtype, what="advantages", rtol=quirk)


@pytest.mark.parametrize("holes", [False, True], ids=["right-padded", "holes"])
def test_remax_equals_verl_at_the_valid_positions(holes, dtype):
    """verl's ReMax returns are the reverse cumulative sum over every position, so that they are
    not 0 at masked positions before a row's last valid token (holes, left padding): compared at
    the valid positions (ppo_fast.compat reproduces the quirk)."""
    verl = _verl()
    rng = np.random.default_rng(12)
    valid = _padded(rng, 10, 25, holes, empty=True)
    rewards = (rng.normal(size=valid.shape) * valid).astype(dtype)
    baselines = rng.normal(size=10).astype(dtype)
    advantages, returns = verl.compute_remax_outcome_advantage(
        _tensor(rewards),
        _tensor(baselines),
        _tensor(valid.astype(dtype)),
    )
    ours = ppo_fast.remax(rewards, baselines, mask=valid)
    _close(ours.returns, returns, dtype, valid, "returns")
    _close(ours.advantages, advantages, dtype, valid, "advantages")
    if not holes:  # right-padded: verl's are 0 past a row's end too
        _close(ours.returns, returns, dtype, what="returns")
        _close(ours.advantages, advantages, dtype, what="advantages")


def _otb_inputs(rng, valid, dtype, weighted):
    shape = valid.shape
    rewards = (rng.normal(size=shape) * valid).astype(dtype)
    old_logprobs = -np.abs(rng.normal(size=shape)).astype(dtype)
    pi_squared = np.exp(2.0 * old_logprobs.astype(np.float64))
    sum_pi_squared = (pi_squared + rng.uniform(size=shape) * (1 - pi_squared)).astype(dtype)
    is_weights = rng.uniform(0.5, 1.5, shape).astype(dtype) if weighted else None
    return rewards, old_logprobs, sum_pi_squared, is_weights


def _verl_otb(function, rewards, valid, ids, old_logprobs, sum_pi_squared, is_weights, zero_tail):
    tensor = _tensor
    return function(
        tensor(rewards),
        tensor(valid.astype(rewards.dtype)),
        ids,
        tensor(old_logprobs),
        tensor(sum_pi_squared),
        None if is_weights is None else tensor(is_weights),
        handle_zero_tail=zero_tail,
    )


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("weighted", [False, True], ids=["no-is", "is-weights"])
def test_optimal_token_baseline_equals_verls_plain_variant_on_right_padded_masks(
    zero_tail, weighted, dtype
):
    verl = _verl()
    rng = np.random.default_rng(13)
    # Empty rows only where verl's plain variant agrees (see the test below).
    valid = _padded(rng, 16, 20, holes=False, empty=zero_tail)
    ids = rng.integers(0, 5, 16)
    rewards, old_logprobs, sum_pi_squared, is_weights = _otb_inputs(rng, valid, dtype, weighted)
    advantages, returns = _verl_otb(
        verl.compute_optimal_token_baseline_advantage,
        rewards,
        valid,
        ids,
        old_logprobs,
        sum_pi_squared,
        is_weights,
        zero_tail,
    )
    ours = ppo_fast.optimal_token_baseline(
        rewards,
        old_logprobs,
        sum_pi_squared,
        ids,
        is_weights=is_weights,
        mask=valid,
        zero_tail=zero_tail,
    )
    _close(ours.returns, returns, dtype, what="returns")
    _close(ours.advantages, advantages, dtype, what="advantages")


def test_verls_plain_variant_counts_empty_rows_in_a_group():
    """The documented difference: a group of one row with valid tokens and one without gets
    B = G W / (W + eps) in verl's plain variant with handle_zero_tail=False, and 0 here (as in
    its tir variant, and in both with handle_zero_tail=True)."""
    verl = _verl()
    rng = np.random.default_rng(14)
    valid = np.array([[True] * 4, [False] * 4])
    rewards, old_logprobs, sum_pi_squared, _ = _otb_inputs(rng, valid, np.float64, False)
    arguments = (rewards, valid, np.array([0, 0]), old_logprobs, sum_pi_squared, None)
    plain, _ = _verl_otb(verl.compute_optimal_token_baseline_advantage, *arguments, False)
    tir, _ = _verl_otb(verl.compute_multi_turn_optimal_token_baseline_advantage, *arguments, False)
    ours = ppo_fast.optimal_token_baseline(
        rewards, old_logprobs, sum_pi_squared, [0, 0], mask=valid, zero_tail=False
    )
    np.testing.assert_array_equal(ours.advantages, ours.returns)
    _close(ours.advantages, tir, np.float64)
    assert np.all(np.abs(plain.numpy()[0]) < 1e-6)  # verl's: nearly 0, its own baseline


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("weighted", [False, True], ids=["no-is", "is-weights"])
def test_optimal_token_baseline_equals_verls_tir_variant_on_masks_with_holes(
    zero_tail, weighted, dtype
):
    """verl's tir returns are the reverse cumulative sum over every position (not 0 at a hole or
    in left padding): returns are compared at the valid positions, advantages everywhere."""
    verl = _verl()
    rng = np.random.default_rng(15)
    valid = _padded(rng, 16, 20, holes=True, empty=True)
    ids = np.array([f"prompt-{i}" for i in rng.integers(0, 5, 16)], dtype=object)
    rewards, old_logprobs, sum_pi_squared, is_weights = _otb_inputs(rng, valid, dtype, weighted)
    advantages, returns = _verl_otb(
        verl.compute_multi_turn_optimal_token_baseline_advantage,
        rewards,
        valid,
        ids,
        old_logprobs,
        sum_pi_squared,
        is_weights,
        zero_tail,
    )
    ours = ppo_fast.optimal_token_baseline(
        rewards,
        old_logprobs,
        sum_pi_squared,
        ids,
        is_weights=is_weights,
        mask=valid,
        zero_tail=zero_tail,
    )
    _close(ours.returns, returns, dtype, valid, "returns")
    _close(ours.advantages, advantages, dtype, what="advantages")


def test_reinforce_plus_plus_by_default_whitens_with_the_population_variance():
    # The documented defaults (gamma 1, whiten, unbiased=False, eps 1e-8) against the formula:
    # the reward-to-go of each valid token, then (G - mean) / sqrt(var + 1e-8) over them.
    rng = np.random.default_rng(21)
    rewards = rng.normal(size=(4, 7))
    lengths = np.array([7, 3, 0, 5])
    mask = np.arange(7) < lengths[:, None]
    to_go = np.where(mask, np.cumsum((rewards * mask)[:, ::-1], axis=1)[:, ::-1], 0.0)
    valid = to_go[mask]
    expected = np.where(mask, (to_go - valid.mean()) / np.sqrt(valid.var() + 1e-8), 0.0)
    result = ppo_fast.reinforce_plus_plus(rewards, mask=mask)
    np.testing.assert_allclose(result.advantages, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(result.returns, to_go, rtol=1e-12, atol=1e-14)
    for whiten in (True, False):  # checked whether or not it is used
        with pytest.raises(ValueError, match="eps must"):
            ppo_fast.reinforce_plus_plus(rewards, mask=mask, whiten=whiten, eps=-1e-8)
