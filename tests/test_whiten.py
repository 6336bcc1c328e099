"""Masked whitening and the moments behind it, locally and across simulated ranks."""

from __future__ import annotations

import numpy as np
import pytest
from batches import ragged_batches
from conftest import assert_matches_oracle
from hypothesis import assume, given
from hypothesis import strategies as st

import ppo_fast


@given(
    batch=ragged_batches(),
    shift_mean=st.booleans(),
    unbiased=st.booleans(),
    scale=st.sampled_from([1.0, 1e-4, 1e-6]),
    eps=st.sampled_from([1e-8, 1e-3, 0.0]),
)
def test_whiten_matches_numpy_on_valid_positions(backend, batch, shift_mean, unbiased, scale, eps):
    """An independent reference, written here with numpy: (x - mean) / sqrt(var + eps). Small
    variances make eps matter, so that sqrt(var) + eps or a dropped eps shows."""
    x = (batch.tokens(-3, 5) * batch.dtype.type(scale)).astype(batch.dtype)
    valid = x[batch.valid].astype(np.float64)
    assume(valid.size >= 2 and valid.var() > 0)
    out = ppo_fast.whiten(
        x, shift_mean=shift_mean, unbiased=unbiased, eps=eps, **batch.layout_kwargs, backend=backend
    )
    mean = valid.mean()
    expected = (valid - mean) / np.sqrt(valid.var(ddof=1 if unbiased else 0) + eps)
    if not shift_mean:
        expected += mean
    assert out.dtype == batch.dtype
    rtol = 1e-6 if batch.dtype == np.float32 else 1e-12
    atol = rtol * float(np.abs(expected).max())
    np.testing.assert_allclose(out[batch.valid], expected, rtol=rtol, atol=atol)
    assert not out[~batch.valid].any()


@given(batch=ragged_batches())
def test_backends_equal_oracle(compiled_backend, batch):
    x = batch.tokens(-3, 5)
    assume(batch.valid.any())
    actual = ppo_fast.whiten(x, **batch.layout_kwargs, backend=compiled_backend)
    expected = ppo_fast.whiten(x, **batch.layout_kwargs, backend="python")
    assert_matches_oracle(actual, expected, batch.dtype)
    m_actual = ppo_fast.masked_moments(x, **batch.layout_kwargs, backend=compiled_backend)
    m_expected = ppo_fast.masked_moments(x, **batch.layout_kwargs, backend="python")
    assert m_actual.count == m_expected.count
    np.testing.assert_allclose(
        [m_actual.sum, m_actual.sum_sq], [m_expected.sum, m_expected.sum_sq], rtol=1e-12, atol=1e-9
    )


def test_whitening_across_ranks_equals_whitening_the_whole_batch(backend):
    """Each rank takes moments of its shard; the all-reduced sum whitens every shard."""
    rng = np.random.default_rng(7)
    x = rng.normal(3.0, 2.0, (6, 50))
    mask = rng.random((6, 50)) < 0.7
    whole = ppo_fast.whiten(x, mask=mask, backend=backend)
    shards = [(x[:2], mask[:2]), (x[2:], mask[2:])]
    # Round 1: the global mean; round 2: moments about it (exact variance).
    first = sum(
        (ppo_fast.masked_moments(s, mask=m, backend=backend) for s, m in shards),
        start=ppo_fast.Moments(0, 0, 0),
    )
    second = [
        ppo_fast.masked_moments(s, mask=m, shift=first.mean, backend=backend) for s, m in shards
    ]
    reduced = ppo_fast.Moments.from_array(sum(m.to_array() for m in second), first.mean)
    parts = [ppo_fast.whiten(s, mask=m, moments=reduced, backend=backend) for s, m in shards]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-12, atol=1e-12)
    # One round about 0 is close too for data like this.
    parts = [ppo_fast.whiten(s, mask=m, moments=first, backend=backend) for s, m in shards]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-9, atol=1e-9)


def test_large_mean_does_not_cancel(backend):
    x = 1e9 + np.array([[1.0, 2.0, 3.0, 4.0]])
    out = ppo_fast.whiten(x, eps=0.0, backend=backend)
    np.testing.assert_allclose(
        out, [[-1.3416407865, -0.4472135955, 0.4472135955, 1.3416407865]], rtol=1e-9
    )


@given(batch=ragged_batches(), unbiased=st.booleans(), shift_mean=st.booleans())
def test_whiten_in_place_equals_the_separate_result(backend, batch, unbiased, shift_mean):
    """out=x: the same bits as a separate result, through the fast path (x itself) and the
    general way (a view of all of x, which the fast path does not take), the mask untouched."""
    x = batch.tokens(-3, 5)
    assume(batch.valid.sum() >= 2)
    options = {"unbiased": unbiased, "shift_mean": shift_mean, "backend": backend}
    expected = ppo_fast.whiten(x, **batch.layout_kwargs, **options)
    layout_copies = {k: np.array(v, copy=True) for k, v in batch.layout_kwargs.items()}
    for target in ("x", "view"):
        in_place = x.copy()
        out = in_place if target == "x" else in_place[...]
        result = ppo_fast.whiten(in_place, **batch.layout_kwargs, **options, out=out)
        assert result is out
        assert in_place.tobytes() == expected.tobytes(), target
    for name, value in batch.layout_kwargs.items():
        np.testing.assert_array_equal(value, layout_copies[name])


def test_whiten_out_overlapping_x_without_being_it_is_refused(backend):
    buffer = np.arange(11.0)
    x, shifted = buffer[1:].reshape(2, 5), buffer[:-1].reshape(2, 5)
    with pytest.raises(ValueError, match="out overlaps x without being it: pass x itself"):
        ppo_fast.whiten(x, out=shifted, backend=backend)
    np.testing.assert_array_equal(buffer, np.arange(11.0))
    mask = np.ones((2, 5))
    with pytest.raises(ValueError, match="out shares memory with mask"):
        ppo_fast.whiten(np.ones((2, 5)), mask=mask, out=mask, backend=backend)
    read_only = np.arange(10.0).reshape(2, 5)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        ppo_fast.whiten(read_only, out=read_only, backend=backend)


def moments_passes(monkeypatch) -> list[int]:
    """The rows of each moments kernel call from here on, through the fast path's entry or the
    table's (``_backend.common`` / ``_backend.run``)."""
    rows: list[int] = []
    real_common, real_run = ppo_fast._backend.common, ppo_fast._backend.run

    def common(name, backend, n_threads=0, *types):
        function = real_common(name, backend, n_threads, *types)
        if name != "moments":
            return function
        return lambda x, *rest: rows.append(x.shape[0]) or function(x, *rest)

    def run(name, backend, **arguments):
        if name == "moments":
            rows.append(arguments["starts"].shape[0])
        real_run(name, backend, **arguments)

    monkeypatch.setattr(ppo_fast._backend, "common", common)
    monkeypatch.setattr(ppo_fast._backend, "run", run)
    return rows


LAYOUTS = {
    "common": lambda valid: {"mask": valid},
    "mask": lambda valid: {"mask": valid.astype(np.int64)},
    "lengths": lambda valid: {"lengths": valid.sum(axis=1)},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_pass_over_the_batch_about_its_first_rows_mean(backend, layout, monkeypatch):
    """Rows alike: the first row's mean is within a standard deviation of the batch's, and the
    batch is read once for its moments (after the first row alone), as exact as two passes."""
    rng = np.random.default_rng(3)
    x = rng.normal(1e6, 2.0, (6, 40))
    valid = np.arange(40)[None, :] < rng.integers(20, 41, 6)[:, None]
    rows = moments_passes(monkeypatch)
    out = ppo_fast.whiten(x, **LAYOUTS[layout](valid), backend=backend)
    assert rows == [1, 6]
    # x - mean is known to an ulp of 1e6 at best (1.2e-10); moments about 0 would be off by
    # about 1e-16 * mean**2 / var: 6e-6 of the variance.
    expected = (x[valid] - x[valid].mean()) / np.sqrt(x[valid].var() + 1e-8)
    np.testing.assert_allclose(out[valid], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_first_row_unlike_the_rest_takes_a_second_pass(backend, layout, monkeypatch):
    """A first row with no valid position (moments about 0) or far from the batch's mean: a
    pass about 0 or about that row's mean would cancel (sum_sq - sum**2 / n loses every digit
    at a mean of 1e9 and a spread of 1), so the batch is read again about its mean."""
    base = 1e9 + np.array([1.0, 2.0, 3.0, 4.0])
    expected = [-1.3416407865, -0.4472135955, 0.4472135955, 1.3416407865]
    for first in (np.zeros(4), base - 3e8):
        x = np.stack([first, base, base])
        valid = np.ones((3, 4), dtype=bool)
        valid[0] = first[0] != 0.0
        valid[0, 1:] = False  # one position at most: no spread to hide the cancellation
        if valid[0, 0]:
            expected_rows = (x[valid] - x[valid].mean()) / x[valid].std()
        rows = moments_passes(monkeypatch)
        out = ppo_fast.whiten(x, **LAYOUTS[layout](valid), eps=0.0, backend=backend)
        assert rows == [1, 3, 3]
        if valid[0, 0]:
            np.testing.assert_allclose(out[valid], expected_rows, rtol=1e-9)
        else:
            np.testing.assert_allclose(out[1:], [expected, expected], rtol=1e-9)
        monkeypatch.undo()


@pytest.mark.parametrize("layout", [{"mask": np.zeros((2, 3))}, {"lengths": [0, 0]}])
def test_no_valid_position_raises(backend, layout):
    # whiten's own message, which says what to look for (not Moments.mean's, raised later).
    message = r"whiten: no valid position \(empty batch or all-zero mask\)"
    with pytest.raises(ValueError, match=message):
        ppo_fast.whiten(np.ones((2, 3)), **layout, backend=backend)
    with pytest.raises(ValueError, match=message):
        ppo_fast.whiten(np.ones((0, 3)), backend=backend)


def test_unbiased_with_one_valid_position_raises(backend):
    with pytest.raises(ValueError, match="at least two valid positions"):
        ppo_fast.whiten(np.ones((1, 3)), lengths=[1], unbiased=True, backend=backend)
    out = ppo_fast.whiten(np.ones((1, 3)), lengths=[1], backend=backend)
    np.testing.assert_array_equal(out, [[0, 0, 0]])


def test_moments_arithmetic():
    a = ppo_fast.Moments(2, 3.0, 5.0)
    b = ppo_fast.Moments(1, 1.0, 1.0)
    total = a + b
    assert (total.count, total.sum, total.sum_sq) == (3, 4.0, 6.0)
    assert total.mean == pytest.approx(4 / 3)
    assert total.var() == pytest.approx(6 / 3 - (4 / 3) ** 2)
    assert total.var(unbiased=True) == pytest.approx((6 - 16 / 3) / 2)
    with pytest.raises(ValueError, match="different shifts"):
        a + ppo_fast.Moments(1, 0.0, 0.0, shift=1.0)
    np.testing.assert_array_equal(
        ppo_fast.Moments.from_array(total.to_array()).to_array(), total.to_array()
    )
