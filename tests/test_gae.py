"""GAE: every backend equals the oracle; the oracle obeys the identities of DESIGN.md section 6."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from batches import ragged_batches
from conftest import COMPILED, assert_matches_oracle
from hypothesis import given
from hypothesis import strategies as st

import ppo_fast
from ppo_fast import _backend, _validate
from ppo_fast._spec import GAE_CHUNKS
from ppo_fast.gae import GAEResult


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


def rows_of_one_run(valid: np.ndarray) -> np.ndarray:
    """Whether each row's valid positions are adjacent (no hole between them; none is one run)."""
    rows = []
    for row in valid:
        at = np.flatnonzero(row)
        rows.append(at.size == 0 or at[-1] - at[0] == at.size - 1)
    return np.array(rows, dtype=bool)


@given(batch=ragged_batches(layouts=("mask", "lengths", "none")))
def test_padded_and_packed_layouts_agree(backend, batch):
    """The same rows, padded (holes and all) or packed without the holes, give the same
    numbers: bit for bit where a row's valid positions are one run, within the oracle's
    tolerances where it has holes (the blocks of 8 are counted from the end of each run, so
    packing the holes away moves them)."""
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
    one_run = rows_of_one_run(batch.valid)
    for name in ("advantages", "returns"):
        unpacked = np.zeros_like(getattr(padded, name))
        unpacked[batch.valid] = getattr(packed, name)
        got = getattr(padded, name)
        np.testing.assert_array_equal(got[one_run], unpacked[one_run], err_msg=name)
        assert_matches_oracle(got[~one_run], unpacked[~one_run], batch.dtype, name)
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


# -- blocks of 8 valid positions: the scan ------------------------------------------------------
#
# The compiled backends run the recursion 8 valid positions at a time (src/rows_gae.h
# ppo_gae_block, _numba_gae._gae_scan): sums reassociated within the tolerances, counted from
# the last position of each run of adjacent valid positions, with the plain recursion for a
# run's first positions that fill no block and for a block outside the scan's bounds (a TD
# error beyond 2^1000, NaN or inf, a running advantage beyond 2^1020, (gamma lam)^8
# underflowing). The oracle is the recursion.


def assert_same_non_finite(got: np.ndarray, want: np.ndarray, dtype, what: str) -> None:
    """NaN, +inf and -inf exactly where the oracle has them; the finite rest to its tolerances."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=what)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
    finite = np.isfinite(want)
    assert_matches_oracle(got[finite], want[finite], dtype, what)


def block_batch(dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of 1 to 60 positions: whole, with scattered holes, with a run of masked positions
    longer than a block, and left-padded; NaN and inf where not valid."""
    rng = np.random.default_rng(21)
    lengths = np.array([1, 7, 8, 9, 16, 17, 60, 60, 60, 33])
    valid = np.arange(60)[None, :] < lengths[:, None]
    valid[6] &= rng.random(60) > 0.3
    valid[7, 20:45] = False
    valid[8, :23] = False
    rewards = rng.uniform(-2.0, 2.0, valid.shape).astype(dtype)
    values = rng.uniform(-2.0, 2.0, valid.shape).astype(dtype)
    junk = np.array([np.nan, np.inf, -np.inf], dtype=dtype)
    for array in (rewards, values):
        array[~valid] = junk[rng.integers(0, 3, int((~valid).sum()))]
    return rewards, values, valid


@pytest.mark.parametrize("lam", [0.95, 1.0, 0.0, 1e-60])  # 1e-60: (gamma lam)^8 underflows
def test_blocks_equal_the_oracle_and_give_the_same_bits_everywhere(lam, dtype):
    """Every compiled backend equals the oracle, and they give the same bits as one another, on
    1 to 3 threads; a row whose valid positions are one run (right- or left-padded) gives the
    same bits packed (a row's blocks are counted from the end of its runs, not of its padding)."""
    rewards, values, valid = block_batch(dtype)
    kwargs = {"gamma": 0.99, "lam": lam, "bootstrap": np.linspace(-1.0, 1.0, len(valid))}
    oracle = ppo_fast.gae(rewards, values, mask=valid, **kwargs, backend="python")
    arguments = kernel_arguments(rewards, values, {"mask": valid, **kwargs})
    reference = run_kernel(COMPILED[0], arguments, 1)
    for name, got, want in zip(("advantages", "returns"), reference, oracle, strict=True):
        assert_matches_oracle(got.reshape(valid.shape), want, dtype, name)
    one_run = rows_of_one_run(valid)
    assert one_run.sum() == len(valid) - 2  # all but the rows with holes
    runs = valid & one_run[:, None]
    lengths = runs.sum(axis=1)[one_run]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    packed = {**kwargs, "cu_seqlens": cu, "bootstrap": kwargs["bootstrap"][one_run]}
    packed_arguments = kernel_arguments(rewards[runs], values[runs], packed)
    for backend in COMPILED:
        for n_threads in (1, 2, 3):
            outputs = run_kernel(backend, arguments, n_threads)
            for name, got, want in zip(("advantages", "returns"), outputs, reference, strict=True):
                bits = f"u{want.itemsize}"
                what = f"{name} {backend} {n_threads}"
                np.testing.assert_array_equal(got.view(bits), want.view(bits), err_msg=what)
        for got, want in zip(run_kernel(backend, packed_arguments, 1), reference, strict=True):
            np.testing.assert_array_equal(got, want.reshape(valid.shape)[runs], err_msg=backend)


@pytest.mark.parametrize("case", ["inf", "nan", "both infinities"])
@pytest.mark.parametrize("lam", [0.5, 0.0, 1.0, 1e-60])
@pytest.mark.parametrize("holes", [False, True], ids=["whole", "holes"])
def test_blocks_keep_the_oracles_nan_and_inf(compiled_backend, case, lam, holes, dtype):
    """A non-finite value at a valid position sends its block, and every block before it that
    carries it, to the plain recursion: NaN and inf exactly where the oracle has them."""
    rng = np.random.default_rng(9)
    rewards = rng.uniform(-1.0, 1.0, (2, 50)).astype(dtype)
    values = rng.uniform(-1.0, 1.0, (2, 50)).astype(dtype)
    mask = rng.random((2, 50)) > (0.3 if holes else -1.0)
    if case == "inf":
        rewards[:, 37] = np.inf
    elif case == "nan":
        values[:, 21] = np.nan
    else:
        rewards[:, 40] = np.inf
        rewards[:, 12] = -np.inf
    mask[:, [12, 21, 37, 40]] = True
    kwargs = {"mask": mask, "gamma": 1.0, "lam": lam}
    result = ppo_fast.gae(rewards, values, **kwargs, backend=compiled_backend)
    oracle = ppo_fast.gae(rewards, values, **kwargs, backend="python")
    for name in ("advantages", "returns"):
        got, want = getattr(result, name), getattr(oracle, name)
        what = f"{name}, {case}, lam={lam}, {compiled_backend}"
        assert_same_non_finite(got, want, dtype, what)
    if case == "inf" and lam > 0.0:  # the inf is carried through every block before it
        assert np.isposinf(oracle.advantages[:, :38][mask[:, :38]]).all()


@pytest.mark.parametrize("holes", [False, True], ids=["whole", "holes"])
def test_blocks_where_a_sum_would_overflow_take_the_recursion(compiled_backend, holes):
    """TD errors near float64's largest number: summed in the scan's order, 1e308 + 1e308
    overflows where the recursion's (1e308 + (1e308 - 1e308)) does not. Such a block takes the
    recursion, whose finite results the backends must give exactly."""
    rewards = np.zeros((1, 24))
    rewards[0, -3:] = [1e308, 1e308, -1e308]
    values = np.zeros((1, 24))
    mask = np.ones((1, 24), dtype=bool)
    if holes:
        mask[0, [5, 17, 19]] = False
        rewards[0, [5, 17, 19]] = np.inf
    kwargs = {"mask": mask, "gamma": 1.0, "lam": 1.0}
    result = ppo_fast.gae(rewards, values, **kwargs, backend=compiled_backend)
    oracle = ppo_fast.gae(rewards, values, **kwargs, backend="python")
    assert np.isfinite(oracle.advantages).all()
    np.testing.assert_array_equal(result.advantages, oracle.advantages)
    np.testing.assert_array_equal(result.returns, oracle.returns)


def test_blocks_where_a_power_would_underflow_take_the_recursion(compiled_backend):
    """gamma lam = 1e-60: (gamma lam)^8 underflows to 0, while the recursion's repeated products
    carry a running advantage of 1e301 into an advantage of 1e-179 eight positions before it.
    Such rows take the recursion: each advantage to float64's precision, tiny ones included."""
    rewards = np.zeros((1, 24))
    rewards[0, 8] = 2.0**1000  # lane 0 of the last block: the running advantage it leaves
    values = np.zeros((1, 24))
    kwargs = {"gamma": 1.0, "lam": 1e-60}
    result = ppo_fast.gae(rewards, values, **kwargs, backend=compiled_backend)
    oracle = ppo_fast.gae(rewards, values, **kwargs, backend="python")
    assert 0.0 < oracle.advantages[0, 0] < 1e-170
    np.testing.assert_allclose(result.advantages, oracle.advantages, rtol=1e-12, atol=0.0)


# -- long rows: chunks ------------------------------------------------------------------------
#
# A row whose valid extent is longer than GAE_CHUNKS.long_row positions runs in chunks of
# GAE_CHUNKS.size (_spec.py, src/rows_gae.h). The oracle is the plain recursion: the chunks' seeds
# must equal it to the tolerances, and the bits must not depend on the threads, the backend, or
# the other rows of the batch. gamma * lam close to 1 keeps the carry across a chunk visible
# ((1 - 1e-5)^16384 is 0.85): a wrong carry moves every position before it.

LONG, CHUNK = GAE_CHUNKS.long_row, GAE_CHUNKS.size
GAMMAS = (1.0, 0.99999, 1.0)
LAMS = (1.0, 0.99999, 0.5)  # the last row: gamma lam = 0.5, whose powers underflow in a chunk
INF_AT = 3 * CHUNK + 1000


def long_batch(layout: str, dtype) -> tuple[np.ndarray, np.ndarray, dict]:
    """Rows at the chunks' edges, in one layout; NaN and inf where positions are not valid.

    lengths: valid extents LONG (runs whole), LONG + 1 (5 chunks, the last of one position) and
    5 * CHUNK (5 full chunks). packed: 5 * CHUNK - 1 and 5 * CHUNK + 1. mask: holes, left
    padding, a hole longer than a chunk across a chunk boundary (a chunk with no valid position),
    and chunks whose only valid position is their first or their last.
    """
    rng = np.random.default_rng(12)
    if layout == "packed":
        lengths = np.array([5 * CHUNK - 1, 5 * CHUNK + 1, 7])
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        valid = np.ones(int(cu[-1]), dtype=bool)
        kwargs = {"cu_seqlens": cu}
    elif layout == "lengths":
        lengths = np.array([LONG, LONG + 1, 5 * CHUNK])
        valid = np.arange(5 * CHUNK + 1)[None, :] < lengths[:, None]
        kwargs = {"lengths": lengths}
    else:
        valid = rng.random((3, 5 * CHUNK + 3)) > 0.1
        valid[0, : CHUNK // 2] = False  # left padding
        valid[0, 2 * CHUNK - 100 : 3 * CHUNK + 100] = False  # chunk 2 has no valid position
        valid[1, CHUNK : 2 * CHUNK] = False
        valid[1, [CHUNK, 3 * CHUNK - 1]] = True  # the only valid positions of chunks 1 and 2
        valid[1, 2 * CHUNK : 3 * CHUNK - 1] = False
        valid[2, -CHUNK:] = False  # right padding past the last chunk boundary
        kwargs = {"mask": valid}
    shape = valid.shape
    rewards = rng.uniform(-2.0, 2.0, shape).astype(dtype)
    values = rng.uniform(-2.0, 2.0, shape).astype(dtype)
    junk = np.array([np.nan, np.inf, -np.inf], dtype=dtype)
    for array in (rewards, values):
        array[~valid] = junk[rng.integers(0, 3, int((~valid).sum()))]
    kwargs.update(gamma=np.array(GAMMAS), lam=np.array(LAMS), bootstrap=np.array([0.5, -1.0, 2.0]))
    return rewards, values, kwargs


@functools.cache
def long_oracle(layout: str, dtype) -> GAEResult:
    rewards, values, kwargs = long_batch(layout, dtype)
    return ppo_fast.gae(rewards, values, **kwargs, backend="python")


@pytest.mark.parametrize("layout", ["mask", "lengths", "packed"])
def test_long_rows_equal_the_oracle(compiled_backend, layout, dtype):
    rewards, values, kwargs = long_batch(layout, dtype)
    result = ppo_fast.gae(rewards, values, **kwargs, backend=compiled_backend)
    oracle = long_oracle(layout, dtype)
    for name in ("advantages", "returns"):
        what = f"{name}, {layout}, {compiled_backend}"
        assert_matches_oracle(getattr(result, name), getattr(oracle, name), dtype, what)


def nonfinite_row(case: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """One long row of 5 chunks with NaN or inf at valid positions of its later chunks."""
    rng = np.random.default_rng(5)
    n = 4 * CHUNK + 5
    rewards = rng.uniform(-1.0, 1.0, (1, n)).astype(dtype)
    values = rng.uniform(-1.0, 1.0, (1, n)).astype(dtype)
    if case == "inf":  # inside a run of valid blocks of chunk 3: +inf at every position before
        rewards[0, INF_AT] = np.inf
    elif case == "inf at the end":  # -inf at the row's last position: NaN before it
        values[0, n - 1] = -np.inf
    elif case == "both infinities":
        rewards[0, 3 * CHUNK + 17] = np.inf
        rewards[0, 2 * CHUNK + 5] = -np.inf
    else:
        values[0, 4 * CHUNK + 2] = np.nan
    return rewards, values


@functools.cache
def nonfinite_oracle(case: str, lam: float, dtype) -> GAEResult:
    rewards, values = nonfinite_row(case, dtype)
    return ppo_fast.gae(rewards, values, gamma=1.0, lam=lam, backend="python")


@pytest.mark.parametrize("case", ["inf", "inf at the end", "both infinities", "nan"])
# lam 0.5: (gamma lam)^(chunk) underflows to 0, where an inf must still carry on as inf;
# lam 0: gamma lam = 0, where the recursion's 0 * inf makes NaN.
@pytest.mark.parametrize("lam", [0.5, 0.0, 1.0])
def test_long_rows_keep_the_oracles_nan_and_inf(compiled_backend, case, lam, dtype):
    rewards, values = nonfinite_row(case, dtype)
    result = ppo_fast.gae(rewards, values, gamma=1.0, lam=lam, backend=compiled_backend)
    oracle = nonfinite_oracle(case, lam, dtype)
    for name in ("advantages", "returns"):
        got, want = getattr(result, name), getattr(oracle, name)
        what = f"{name}, {case}, lam={lam}, {compiled_backend}"
        assert_same_non_finite(got, want, dtype, what)
    if case == "inf" and lam > 0.0:  # what makes this case: an inf carried across chunks
        assert np.isposinf(oracle.advantages[0, : INF_AT + 1]).all()


def kernel_arguments(rewards, values, kwargs) -> list:
    """The gae kernel's arguments (without n_threads) for a batch in any layout."""
    layout = {k: kwargs[k] for k in ("mask", "lengths", "cu_seqlens") if k in kwargs}
    (token_rewards, token_values), rows = _validate.batch(
        {"rewards": rewards, "values": values}, **layout
    )
    n = rows.n_rows
    per_row = [
        np.broadcast_to(np.asarray(kwargs[k], np.float64), (n,)).copy() for k in ("gamma", "lam")
    ]
    bootstrap = np.asarray(kwargs.get("bootstrap", np.zeros(n)), np.float64)
    return [
        token_rewards.ravel(),
        token_values.ravel(),
        *rows.arguments.values(),
        *per_row,
        bootstrap,
        np.full(token_rewards.size, np.nan, token_rewards.dtype),
        np.full(token_rewards.size, np.nan, token_rewards.dtype),
    ]


def run_kernel(backend: str, arguments: list, n_threads: int) -> tuple[np.ndarray, np.ndarray]:
    arguments = [a.copy() if isinstance(a, np.ndarray) else a for a in arguments]
    _backend.resolve(backend).gae(*arguments, n_threads)
    return arguments[-2], arguments[-1]


@pytest.mark.numba
@pytest.mark.parametrize("layout", ["mask", "lengths", "packed"])
def test_long_rows_give_the_same_bits_on_any_threads_and_compiled_backend(layout, dtype):
    rewards, values, kwargs = long_batch(layout, dtype)
    arguments = kernel_arguments(rewards, values, kwargs)
    reference = run_kernel(COMPILED[0], arguments, 1)
    for backend in COMPILED:  # numba and Cython: the same operations in the same order
        for n_threads in (1, 2, 3):
            outputs = run_kernel(backend, arguments, n_threads)
            for name, got, want in zip(("advantages", "returns"), outputs, reference, strict=True):
                bits = f"u{want.itemsize}"
                np.testing.assert_array_equal(
                    got.view(bits), want.view(bits), err_msg=f"{name} {backend} {n_threads}"
                )


def test_a_rows_results_depend_on_that_row_only(compiled_backend):
    """Short and long rows packed together give each row the bits it gets alone: chunks are
    fixed by their row, and a short row runs the plain recursion as it always has."""
    rng = np.random.default_rng(8)
    lengths = [100, LONG + 3 * CHUNK + 7, 4096, LONG, 0, LONG + 1]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rewards = rng.uniform(-2.0, 2.0, int(cu[-1]))
    values = rng.uniform(-2.0, 2.0, int(cu[-1]))
    kwargs = {"gamma": 0.99999, "lam": 1.0}
    together = run_kernel(
        compiled_backend, kernel_arguments(rewards, values, {"cu_seqlens": cu, **kwargs}), 2
    )
    for b, length in enumerate(lengths):
        row = slice(cu[b], cu[b + 1])
        alone = run_kernel(
            compiled_backend,
            kernel_arguments(rewards[row], values[row], {"cu_seqlens": [0, length], **kwargs}),
            1,
        )
        for got, want in zip(together, alone, strict=True):
            np.testing.assert_array_equal(got[row].view("u8"), want.view("u8"), err_msg=f"row {b}")


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_one_long_row_takes_two_threads(monkeypatch):
    """The thread policy counts a long row's chunks as units: one row of 2^18 positions runs
    numba's parallel build on two threads, by the fast path and by the general one."""
    import numba

    from ppo_fast import _numba_kernels

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here")

    def refuse(*args):
        raise AssertionError("the serial build ran")

    for build in _numba_kernels.gae.kernels:
        monkeypatch.setattr(build, "serial", refuse)
    rewards = np.random.default_rng(2).normal(size=(1, 1 << 18)).astype(np.float32)
    try:
        ppo_fast.set_num_threads(2)
        fast = ppo_fast.gae(rewards, rewards, backend="numba")
        general = ppo_fast.gae(rewards, rewards, lengths=[1 << 18], backend="numba")
    finally:
        ppo_fast.set_num_threads(None)
    np.testing.assert_array_equal(fast.advantages, general.advantages)
