"""DPPO, KL-Cov and Clip-Cov (ppo_fast.policy), their selections (ppo_fast.covariance), their
torch twins (both paths) and the kernels' log. Every backend against the oracle is
tests/test_kernels.py's (the table); verl parity is tests/test_compat_token_losses_verl.py's."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import COMPILED, COMPILED_NUMBA_PARALLEL

import ppo_fast


def _batch(seed=0, rows=4, width=9):
    rng = np.random.default_rng(seed)
    old = rng.uniform(-2.5, -0.05, (rows, width))
    logp = np.minimum(old + rng.normal(0, 0.3, (rows, width)), -0.01)
    adv = rng.normal(size=(rows, width))
    mask = rng.random((rows, width)) < 0.8
    return logp, old, adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_kl_cov_gradient_is_the_derivative_of_the_loss(agg):
    """Five-point differences in each valid logprob, the selection held. (DPPO's loss holds the
    capped ratio and the region constant, which a difference of the loss does not: its gradient
    is checked against torch autograd of verl's detached form below.)"""
    logp, old, adv, mask = _batch()
    selected = ppo_fast.kl_cov_selection(logp, adv, mask=mask, ratio=0.2)
    assert selected.any()
    base = ppo_fast.kl_cov_loss(logp, old, adv, selected, coef=0.5, mask=mask, agg=agg)
    h = 1e-6
    for b, t in zip(*np.nonzero(mask), strict=True):
        values = []
        for step in (-2, -1, 1, 2):
            moved = logp.copy()
            moved[b, t] += step * h
            values.append(
                ppo_fast.kl_cov_loss(moved, old, adv, selected, coef=0.5, mask=mask, agg=agg).loss
            )
        slope = (values[0] - 8 * values[1] + 8 * values[2] - values[3]) / (12 * h)
        assert base.grad[b, t] == pytest.approx(slope, rel=1e-5, abs=1e-8), (b, t)
    assert np.all(base.grad[~mask] == 0)


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_gradient_is_the_held_ratio_times_the_advantage_inside_the_region(divergence):
    torch = pytest.importorskip("torch")
    logp, old, adv, mask = _batch(3)
    result = ppo_fast.dppo_loss(
        logp, old, adv, mask=mask, divergence=divergence, divergence_low=0.05, ratio_cap=1.1
    )
    x = torch.tensor(logp, requires_grad=True)
    o, a, m = torch.tensor(old), torch.tensor(adv), torch.tensor(mask, dtype=torch.float64)
    prob, old_prob = x.exp(), o.exp()
    if divergence == "tv":
        inside = torch.where(a > 0, prob - old_prob <= 0.05, prob - old_prob >= -0.05)
    else:
        d = old_prob * (o - x) + (1 - old_prob) * torch.log(
            (1 - old_prob + 1e-8) / (1 - prob + 1e-8)
        )
        inside = torch.where(
            a > 0, (d <= 0.05) | (prob <= old_prob), (d <= 0.05) | (prob >= old_prob)
        )
    ratio = torch.clamp((x - o).exp(), max=1.1).detach()
    loss = (-a * ratio * x * inside.detach().double() * m).sum() / m.sum()
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-12)
    np.testing.assert_allclose(result.grad, x.grad.numpy(), rtol=1e-12, atol=1e-15)
    assert result.clipfrac == pytest.approx(float(((~inside).double() * m).sum() / m.sum()))
    assert 0 < result.clipfrac < 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", ["python", *COMPILED])
def test_dppo_kl_with_a_bound_of_zero_keeps_no_token_whose_probability_moved_against_it(
    backend, dtype
):
    """The binary KL is positive wherever p != p_old: with a bound of 0 a token is inside
    only where its probability did not move away from its advantage's side, however small the
    move. In float32 the formula's two terms cancel below their rounding where |p - p_old| < 3e-4,
    and the dtype's arithmetic kept about half of such tokens at random (and backends apart)."""
    rng = np.random.default_rng(11)
    old = rng.uniform(-3.0, -0.05, (64, 128)).astype(dtype)
    # moves from 1e-6 to 1e-3 of |old|: every one well above an ulp of the log-probability
    step = rng.uniform(1e-6, 1e-3, old.shape) * np.abs(old)
    sign = rng.choice([-1.0, 1.0], old.shape)
    logp = (old + sign * step).astype(dtype)
    assert np.all(logp != old)
    adv = rng.choice([-1.0, 1.0], old.shape).astype(dtype)
    against = np.where(adv > 0, logp > old, logp < old)
    assert 0.4 < against.mean() < 0.6
    result = ppo_fast.dppo_loss(
        logp, old, adv, divergence="kl", divergence_low=0.0, divergence_high=0.0,
        ratio_cap=np.inf, backend=backend,
    )  # fmt: skip
    np.testing.assert_array_equal(result.grad == 0, against)
    assert result.clipfrac == pytest.approx(against.mean())


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_with_one_bound_inf_still_holds_the_other(divergence):
    """divergence_low=inf with a finite divergence_high: 0.8.19's numba kernel took its 0 as
    low - low, NaN there, and kept every token (the loss of no trust region at all)."""
    logp, old, adv, _ = _batch(7, rows=4, width=64)
    options = {"divergence": divergence, "divergence_low": np.inf, "divergence_high": 0.01}
    oracle = ppo_fast.dppo_loss(logp, old, adv, backend="python", **options)
    assert 0.05 < oracle.clipfrac < 0.5
    for backend in COMPILED:
        result = ppo_fast.dppo_loss(logp, old, adv, backend=backend, **options)
        np.testing.assert_array_equal(result.grad == 0, oracle.grad == 0, err_msg=backend)
        np.testing.assert_allclose(result.grad, oracle.grad, rtol=1e-12, err_msg=backend)
        assert result.clipfrac == oracle.clipfrac, backend


def _binary_kl(logp, old):
    """verl's binary KL in float64 (the oracle's order of operations)."""
    prob, old_prob = np.exp(logp), np.exp(old)
    complement = 1.0 - old_prob
    return old_prob * (old - logp) + complement * np.log((complement + 1e-8) / ((1 - prob) + 1e-8))


@pytest.mark.parametrize("bound", [1e-3, 0.02, 0.2, 1.5])
def test_dppo_kl_on_float32_decides_as_float64_next_to_every_bound(bound):
    """Float32 log-probabilities a few ulp either side of where the binary KL crosses the bound
    (found by bisection in float64), probabilities up to 1 - 1e-7, on both sides of p_old (A > 0
    against the high bound, A < 0 against the low one): every backend decides them as the
    oracle's float64 does (a float32 evaluation got 6-47% of them wrong)."""
    rng = np.random.default_rng(int(bound * 1000))
    n = 3000
    old = -np.exp(rng.uniform(np.log(1e-7), np.log(7.0), n))  # probabilities up to 1 - 1e-7
    above = rng.random(n) < 0.5  # logp above old (A > 0) or below it (A < 0)
    low = np.where(above, old, old - 60.0)
    high = np.where(above, 0.0, old)
    for _ in range(80):  # bisection: d grows away from old on either side
        middle = 0.5 * (low + high)
        past = _binary_kl(middle, old) > bound
        low, high = np.where(past == above, low, middle), np.where(past == above, middle, high)
    root = 0.5 * (low + high)
    crossing = np.abs(_binary_kl(root, old) - bound) < 1e-6 * max(bound, 1.0)
    crossing &= np.cumsum(crossing) <= 4 * (crossing.sum() // 4)  # whole rows of 4
    root, old32, above = root[crossing], old.astype(np.float32)[crossing], above[crossing]
    assert root.size > n // 2  # above old, a large bound may be past log((1 - p_old) / 1e-8)
    steps = np.arange(-4, 5)  # float32 ulps from the crossing
    logp = root.astype(np.float32)[:, None].repeat(steps.size, axis=1)
    for k, step in enumerate(steps):
        for _ in range(abs(step)):
            logp[:, k] = np.nextafter(logp[:, k], np.float32(np.sign(step) * np.inf))
    logp = logp.reshape(-1, 36)  # rows of 4 crossings, 9 steps each
    old_rows = np.repeat(old32, steps.size).reshape(logp.shape)
    adv = np.where(np.repeat(above, steps.size), 1.0, -1.0).astype(np.float32).reshape(logp.shape)
    options = {"divergence": "kl", "divergence_low": bound, "divergence_high": bound}
    oracle = ppo_fast.dppo_loss(logp, old_rows, adv, backend="python", **options)
    outside = oracle.grad == 0
    assert 0.2 < outside.mean() < 0.8  # the crossings are where the decision turns
    for backend in COMPILED:
        result = ppo_fast.dppo_loss(logp, old_rows, adv, backend=backend, **options)
        np.testing.assert_array_equal(result.grad == 0, outside, err_msg=backend)


def test_kl_cov_selection_is_the_top_k_and_clip_cov_selection_follows_its_seed():
    logp, old, adv, mask = _batch(5, rows=6, width=30)
    picked = ppo_fast.kl_cov_selection(logp, adv, mask=mask, ratio=0.1)
    valid = mask.ravel()
    cov = (adv.ravel() - adv.ravel()[valid].mean()) * (logp.ravel() - logp.ravel()[valid].mean())
    k = max(int(0.1 * valid.sum()), 1)
    expected = np.flatnonzero(valid)[np.argsort(-cov[valid])[:k]]
    np.testing.assert_array_equal(np.flatnonzero(picked), np.sort(expected))
    first = ppo_fast.clip_cov_selection(logp, old, adv, mask=mask, seed=3, ratio=0.1, lower=0.0)
    again = ppo_fast.clip_cov_selection(logp, old, adv, mask=mask, seed=3, ratio=0.1, lower=0.0)
    np.testing.assert_array_equal(first, again)
    assert first.sum() == k and not (first & ~mask).any()
    dropped = ppo_fast.clip_cov_loss(logp, old, adv, first, mask=mask)
    plain = ppo_fast.clipped_surrogate(logp, old, adv, mask=mask, weights=(~first).astype(float))
    assert dropped.loss == plain.loss and dropped.clipfrac == pytest.approx(k / valid.sum())


@pytest.mark.parametrize("backend", ppo_fast.available_backends())
def test_kl_cov_selection_breaks_ties_by_position_and_ranks_nan_last(backend):
    logp, _, adv, mask = _batch(6, rows=5, width=40)
    valid = np.flatnonzero(mask.ravel())
    k = max(int(0.1 * valid.size), 1)
    # equal advantages: every covariance is 0, a tie the earliest positions win
    flat = ppo_fast.kl_cov_selection(logp, np.ones_like(adv), mask=mask, ratio=0.1, backend=backend)
    np.testing.assert_array_equal(np.flatnonzero(flat), valid[:k])
    # a NaN log-prob makes the mean, and so every covariance, NaN: all count as -inf
    poisoned = logp.copy()
    poisoned.ravel()[valid[-1]] = np.nan
    nan = ppo_fast.kl_cov_selection(poisoned, adv, mask=mask, ratio=0.1, backend=backend)
    np.testing.assert_array_equal(np.flatnonzero(nan), valid[:k])
    # the packed layout picks the same tokens as the padded one, and lengths as the mask
    lengths = np.array([3, 40, 0, 17, 25])
    prefix = np.arange(40)[None, :] < lengths[:, None]
    padded = ppo_fast.kl_cov_selection(logp, adv, lengths=lengths, ratio=0.2, backend=backend)
    masked = ppo_fast.kl_cov_selection(logp, adv, mask=prefix, ratio=0.2, backend=backend)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    packed = ppo_fast.kl_cov_selection(
        logp[prefix], adv[prefix], cu_seqlens=cu_seqlens, ratio=0.2, backend=backend
    )
    np.testing.assert_array_equal(padded, masked)
    np.testing.assert_array_equal(packed, padded[prefix])
    assert padded.sum() == max(int(0.2 * lengths.sum()), 1)


@pytest.mark.parametrize("backend", COMPILED_NUMBA_PARALLEL)
@pytest.mark.parametrize(
    "ratio, ties, nan",
    [
        (0.002, False, 0.0),
        (0.002, True, 0.0),
        (0.01, True, 0.02),
        (0.5, True, 0.1),
        (0.003, False, 1.0),
    ],
)
def test_kl_cov_top_k_picks_the_oracles_tokens_through_many_rounds_and_threads(
    backend, ratio, ties, nan, dtype
):
    """The kernels' second pass keeps its candidates in a buffer of at most 2k + 8 slots a range
    of rows, which keeps its k strongest when full, and a range a thread: with k small against the
    tokens it is full many times. Ties (rounded values: many equal covariances), NaN at valid
    positions (some, or all: every covariance -inf), one group whose rows are out of position
    order, and 1, 2 and 3 threads: the oracle's tokens, whose means take the rows' sums in row
    order."""
    from ppo_fast import _backend, _reference

    rng = np.random.default_rng(11)
    n_rows, width = 900, 48
    logp = rng.uniform(-3, 0, n_rows * width)
    adv = rng.normal(size=n_rows * width)
    if ties:
        logp, adv = np.round(logp), np.round(adv)
    adv[rng.random(adv.size) < nan] = np.nan
    starts = np.arange(n_rows, dtype=np.int64) * width
    spans = np.full(n_rows, width, dtype=np.int64)
    lengths = rng.integers(0, width + 1, n_rows).astype(np.int64)
    mask = (rng.random(n_rows * width) < 0.8).astype(np.uint8)
    group_rows = rng.permutation(n_rows).astype(np.int64)
    group_starts = np.array([0, n_rows], dtype=np.int64)
    kernels = _backend.resolve(backend)
    arguments = [logp.astype(dtype), adv.astype(dtype), starts, spans, lengths, mask]
    arguments += [group_rows, group_starts, ratio]
    expected = np.full(n_rows * width, 0xAB, dtype=np.uint8)
    _reference.kl_cov_top_k(*arguments, expected, 1)
    assert 10 < expected.sum() < 0.8 * expected.size
    for n_threads in (1, 2, 3):
        selected = np.full(n_rows * width, 0xAB, dtype=np.uint8)
        kernels.kl_cov_top_k(*arguments, selected, n_threads)
        np.testing.assert_array_equal(selected, expected, err_msg=f"{n_threads} threads")


def test_the_torch_selections_are_the_numpy_ones_as_bool_tensors():
    torch = pytest.importorskip("torch")
    import ppo_fast.torch as pt

    logp, old, adv, mask = _batch(8, rows=5, width=30)
    tensors = [torch.tensor(a) for a in (logp, old, adv)]
    tensors[0].requires_grad_()
    picked = pt.kl_cov_selection(tensors[0], tensors[2], mask=torch.tensor(mask), ratio=0.1)
    assert picked.dtype == torch.bool and picked.shape == logp.shape
    expected = ppo_fast.kl_cov_selection(logp, adv, mask=mask, ratio=0.1)
    np.testing.assert_array_equal(picked.numpy(), expected)
    drawn = pt.clip_cov_selection(
        *tensors, seed=4, ratio=0.1, lower=-1.0, lengths=torch.tensor([30, 2, 0, 9, 17])
    )
    again = ppo_fast.clip_cov_selection(
        logp, old, adv, seed=4, ratio=0.1, lower=-1.0, lengths=np.array([30, 2, 0, 9, 17])
    )
    np.testing.assert_array_equal(drawn.numpy(), again)
    assert again.any()


def test_bad_input_is_an_error_naming_the_argument():
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="divergence_low must"):
        ppo_fast.dppo_loss(logp, old, adv, mask=mask, divergence_low=-0.1)
    with pytest.raises(ValueError, match="divergence_high must"):
        ppo_fast.dppo_loss(logp, old, adv, mask=mask, divergence_high=-0.1)
    with pytest.raises(ValueError, match="ratio_cap must"):
        ppo_fast.dppo_loss(logp, old, adv, mask=mask, ratio_cap=0.0)
    with pytest.raises(ValueError, match="divergence"):
        ppo_fast.dppo_loss(logp, old, adv, mask=mask, divergence="js")
    with pytest.raises(ValueError, match="selected has shape"):
        ppo_fast.kl_cov_loss(logp, old, adv, mask[:, :3], mask=mask)
    with pytest.raises(TypeError, match="selected must be bool"):
        ppo_fast.clip_cov_loss(logp, old, adv, mask * 0.5, mask=mask)
    with pytest.raises(TypeError, match="seed must be"):
        ppo_fast.clip_cov_selection(logp, old, adv, mask=mask, seed=None)
    with pytest.raises(ValueError, match="lower must be <= upper"):
        ppo_fast.clip_cov_selection(logp, old, adv, mask=mask, seed=0, lower=2, upper=1)
    with pytest.raises(ValueError, match="coef must"):
        ppo_fast.kl_cov_loss(logp, old, adv, mask, mask=mask, coef=-0.1)


def test_kl_cov_counts_its_selected_valid_tokens_whatever_the_coefficient():
    # clipfrac is the share of the valid tokens the selection picked; with coef 0 the kernel
    # penalises none, and the count comes from the selection itself.
    logp, old, adv, mask = _batch(seed=5)
    selected = np.zeros_like(mask)
    selected[:, ::3] = True  # some of them at positions that are not valid
    share = np.count_nonzero(selected & mask) / np.count_nonzero(mask)
    for coef in (0.0, 0.1, 1.0):
        result = ppo_fast.kl_cov_loss(logp, old, adv, selected, mask=mask, coef=coef)
        assert result.clipfrac == pytest.approx(share, rel=1e-15), coef
    unpenalised = ppo_fast.kl_cov_loss(logp, old, adv, selected, mask=mask, coef=0.0)
    nothing = ppo_fast.kl_cov_loss(logp, old, adv, np.zeros_like(mask), mask=mask, coef=1.0)
    assert unpenalised.loss == nothing.loss
    np.testing.assert_array_equal(unpenalised.grad, nothing.grad)


def test_clip_cov_is_the_clipped_surrogate_with_the_selected_weights_zeroed():
    logp, old, adv, mask = _batch(seed=6)
    rng = np.random.default_rng(6)
    weights = rng.uniform(0.2, 3.0, logp.shape)
    selected = rng.random(logp.shape) < 0.3
    got = ppo_fast.clip_cov_loss(logp, old, adv, selected, mask=mask, weights=weights)
    expected = ppo_fast.clipped_surrogate(
        logp, old, adv, mask=mask, weights=np.where(selected, 0.0, weights)
    )
    assert got.loss == expected.loss
    np.testing.assert_array_equal(got.grad, expected.grad)
    assert got.approx_kl == expected.approx_kl
    # clipfrac: the share of the valid tokens dropped; nothing is clipped below
    assert got.clipfrac == pytest.approx(np.count_nonzero(selected & mask) / mask.sum())
    assert got.clipfrac_lower == 0.0
    empty = ppo_fast.clip_cov_loss(logp, old, adv, selected, mask=np.zeros_like(mask))
    assert np.isnan(empty.clipfrac) and np.isnan(empty.clipfrac_lower)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "kl_cov"])
def test_torch_device_path_equals_the_kernels(name, monkeypatch):
    torch = pytest.importorskip("torch")
    import ppo_fast.torch as pt

    logp, old, adv, mask = _batch(7)
    tensors = [torch.tensor(a, dtype=torch.float32) for a in (logp, old, adv)]
    m = torch.tensor(mask)

    def run():
        x = tensors[0].clone().requires_grad_()
        if name == "kl_cov":
            picked = torch.tensor(ppo_fast.kl_cov_selection(logp, adv, mask=mask, ratio=0.2))
            out = pt.kl_cov_loss(x, *tensors[1:], picked, coef=0.5, mask=m)
        else:
            out = pt.dppo_loss(x, *tensors[1:], divergence=name[-2:], divergence_low=0.1, mask=m)
        out.loss.backward()
        return out, x.grad

    kernels, grad = run()
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
    device, device_grad = run()
    for a, b in zip(kernels, device, strict=True):
        assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(device_grad.numpy(), grad.numpy(), rtol=1e-5, atol=1e-7)


def test_the_kernels_log_is_within_one_ulp():
    numba = pytest.importorskip("numba")
    from ppo_fast._numba_math import log_poly

    @numba.njit
    def evaluate(xs, out):
        for i in range(xs.shape[0]):
            out[i] = log_poly(xs[i])

    rng = np.random.default_rng(0)
    for dtype, span in ((np.float32, 85.0), (np.float64, 700.0)):
        info = np.finfo(dtype)
        xs = np.concatenate(
            [np.exp(rng.uniform(-span, span, 200_000)), 1 + rng.uniform(-1e-3, 1e-3, 20_000),
             [info.tiny, info.tiny / 3, info.smallest_subnormal, info.max, 1.0, 0.5]]
        ).astype(dtype)  # fmt: skip
        xs = xs[np.isfinite(xs) & (xs > 0)]
        out = np.empty_like(xs)
        evaluate(xs, out)
        exact = np.log(xs.astype(np.longdouble)).astype(dtype)
        error = np.abs(out.astype(np.float64) - exact) / np.spacing(np.abs(exact)).astype(float)
        assert error.max() <= 1, (dtype, xs[np.argmax(error)])
        special = np.array([0.0, -0.0, -1.0, np.inf, -np.inf, np.nan], dtype=dtype)
        out = np.empty_like(special)
        evaluate(special, out)
        np.testing.assert_array_equal(out, [-np.inf, -np.inf, np.nan, np.inf, np.nan, np.nan])


def test_torch_selection_errors_name_selected(monkeypatch):
    torch = pytest.importorskip("torch")
    import ppo_fast.torch as pt

    logp, old, adv, mask = (torch.tensor(a) for a in _batch())
    for forced in (False, True):
        monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
        with pytest.raises(ValueError, match="selected has shape"):
            pt.kl_cov_loss(logp, old, adv, mask[:, :2], mask=mask)
        with pytest.raises(TypeError, match="selected must be bool"):
            pt.kl_cov_loss(logp, old, adv, mask * 0.5, mask=mask)
        as_integers = pt.kl_cov_loss(logp, old, adv, mask.long(), mask=mask)
        assert (
            as_integers.loss.item() == pt.kl_cov_loss(logp, old, adv, mask, mask=mask).loss.item()
        )
        with pytest.raises(ValueError, match="coef must"):
            pt.kl_cov_loss(logp, old, adv, mask, mask=mask, coef=-0.1)


def _dyadic_batch():
    """4 x 8 tokens whose means and covariances are exact in float64 (quarters over 32 valid
    tokens), so that a covariance can sit exactly on a bound."""
    rng = np.random.default_rng(8)
    adv = rng.integers(-6, 7, (4, 8)) / 4.0
    logp = -rng.integers(1, 12, (4, 8)) / 4.0
    # ratios exp(logp - old) from 0.6 to 1.5: PPO's clip (0.2) binds on some tokens
    old = logp - rng.choice([-0.5, -0.1, 0.0, 0.1, 0.4], (4, 8))
    return logp, old, adv


def test_clip_cov_selection_takes_its_candidates_and_only_those():
    logp, old, adv = _dyadic_batch()
    mask = np.ones(logp.shape, dtype=bool)
    cov = (adv - adv.mean()) * (logp - logp.mean())  # exact here
    ratio = np.exp(logp - old)
    # PPO's clip (0.2) binds: above 1 + 0.2 where A > 0, below 1 - 0.2 where A < 0
    clipped = np.where(adv > 0, ratio > 1.0 + 0.2, (adv < 0) & (ratio < 1.0 - 0.2))
    assert clipped.any() and (~clipped).any()
    lower = float(np.sort(np.unique(cov))[1])  # some tokens sit exactly on it: not candidates
    upper = float(np.quantile(cov, 0.9))
    candidates = ~clipped & (cov > lower) & (cov < upper)
    assert candidates.any() and (~clipped & (cov == lower)).any()
    options = {"lower": lower, "upper": upper, "mask": mask}
    every = ppo_fast.clip_cov_selection(logp, old, adv, seed=0, ratio=1.0, **options)
    np.testing.assert_array_equal(every, candidates)
    one = ppo_fast.clip_cov_selection(logp, old, adv, seed=0, ratio=1e-6, **options)
    assert one.sum() == 1 and candidates[one].all()  # k = max(floor(ratio * n), 1)
    # lengths: the same rows as a mask without holes (the positions past a length are out)
    lengths = np.array([8, 5, 0, 7])
    as_mask = np.arange(8) < lengths[:, None]
    from ppo_fast.covariance import valid_positions

    np.testing.assert_array_equal(valid_positions((4, 8), lengths=lengths), as_mask.ravel())
    for seed in range(3):
        np.testing.assert_array_equal(
            ppo_fast.clip_cov_selection(logp, old, adv, seed=seed, ratio=0.3, lengths=lengths),
            ppo_fast.clip_cov_selection(logp, old, adv, seed=seed, ratio=0.3, mask=as_mask),
        )
    # bounds that are allowed: an infinite upper, lower == upper (no candidate), clip_high > 0
    ppo_fast.clip_cov_selection(logp, old, adv, seed=0, lower=lower, upper=np.inf, mask=mask)
    none = ppo_fast.clip_cov_selection(logp, old, adv, seed=0, lower=1.0, upper=1.0, mask=mask)
    assert not none.any()
    ppo_fast.clip_cov_selection(logp, old, adv, seed=0, clip_high=0.5, mask=mask)
    with pytest.raises(ValueError, match="clip_low must"):
        ppo_fast.clip_cov_selection(logp, old, adv, seed=0, clip_low=1.5, mask=mask)
    for bad in (0.0, -0.5):
        with pytest.raises(ValueError, match="ratio must"):
            ppo_fast.kl_cov_selection(logp, adv, ratio=bad, mask=mask)


def _exact(torch, old, log_ratio):
    """logp = old + log_ratio, checked to give the log-ratio back exactly (logp - old)."""
    logp = old + log_ratio
    assert torch.equal(logp - old, log_ratio)
    return logp


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("bits", [32, 64])
def test_torch_dppo_device_path_at_the_ratio_cap_is_the_kernels(divergence, bits, monkeypatch):
    """Ratios exactly at the cap (2, from a log-ratio of log 2), beyond it (4) and below, all
    inside the divergence region: the capped share (clipfrac_lower) counts the ratios strictly
    above the cap, on both paths, and loss and gradient agree."""
    torch = pytest.importorskip("torch")
    import ppo_fast.torch as pt

    dtype = {32: torch.float32, 64: torch.float64}[bits]
    ln2 = torch.tensor(np.log(2.0), dtype=dtype)
    log_ratio = torch.stack([ln2, ln2, 2 * ln2, -ln2, ln2, 0 * ln2, 2 * ln2, ln2])
    old = torch.tensor([-1.0, -1.0, -2.0, -0.25, -1.0, -1.0, -2.0, -1.0], dtype=dtype)
    logp = _exact(torch, old, log_ratio)
    ratio = log_ratio.exp()
    assert (ratio[[0, 1, 4, 7]] == 2.0).all() and (ratio[[2, 6]] == 4.0).all()
    adv = torch.tensor([0.5, -1.0, 1.5, -0.5, 0.0, 1.0, -0.25, 2.0], dtype=dtype)
    cu = torch.tensor([0, 5, 8])
    options = {"divergence": divergence, "divergence_low": 1.0, "ratio_cap": 2.0}
    results = []
    for forced in (False, True):
        monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
        x = logp.clone().requires_grad_()
        out = pt.dppo_loss(x, old, adv, cu_seqlens=cu, **options)
        out.loss.backward()
        results.append((out, x.grad))
    (kernel, grad), (device, device_grad) = results
    assert kernel.clipfrac.item() == 0.0  # every token inside the region
    assert kernel.clipfrac_lower.item() == pytest.approx(2 / 8)  # the two ratios of 4
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if bits == 32 else {"rtol": 1e-12, "atol": 1e-15}
    for a, b in zip(kernel, device, strict=True):
        np.testing.assert_allclose(b.item(), a.item(), **tolerance)
    np.testing.assert_allclose(device_grad.numpy(), grad.numpy(), **tolerance)


def test_torch_kl_cov_selection_device_path_breaks_ties_at_the_k_th_by_position(monkeypatch):
    """Covariances exact in float64 (quarters and halves over 32 valid tokens), so that many tie:
    the selection is the k largest, ties at the k-th value to the lowest flat positions, for k
    from 1 to every valid token, on the kernels and on the device path."""
    torch = pytest.importorskip("torch")
    import ppo_fast.torch as pt

    rng = np.random.default_rng(12)
    adv = rng.choice([-1.0, -0.5, 0.5, 1.0], (4, 10))
    logp = -rng.choice([0.5, 1.0, 1.5, 2.0], (4, 10))
    mask = np.zeros((4, 10), dtype=bool)
    mask.flat[rng.permutation(40)[:32]] = True
    valid = mask.ravel()
    cov = (adv - adv[mask].mean()) * (logp - logp[mask].mean())  # exact: dyadic, few bits
    order = np.lexsort((np.arange(40), -cov.ravel()))  # by covariance, then by position
    order = order[valid[order]]
    straddled = 0
    for ratio in (1 / 32, 0.1, 0.2, 0.25, 0.5, 0.9, 1.0, 3.0):
        k = min(max(int(ratio * 32), 1), 32)
        expected = np.zeros(40, dtype=bool)
        expected[order[:k]] = True
        values = cov.ravel()[order]
        kth = values[k - 1]
        # the k-th value is tied with tokens left out, and some are above it
        straddled += bool((values[:k] > kth).any() and k < 32 and values[k] == kth)
        picks = []
        for forced in (False, True):
            monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
            picks.append(
                pt.kl_cov_selection(
                    torch.tensor(logp), torch.tensor(adv), mask=torch.tensor(mask), ratio=ratio
                )
            )
        for picked in picks:
            np.testing.assert_array_equal(picked.numpy().ravel(), expected, err_msg=f"{ratio}")
    assert straddled >= 2


def test_torch_kl_cov_selection_runs_the_kernels_on_cpu_and_torch_on_the_device_path(monkeypatch):
    """CPU tensors go to the kernels (read zero-copy through to_numpy, ``backend`` honoured: an
    unknown one is an error); the device path reads nothing through the host and does not use
    ``backend``, and picks the same tokens."""
    torch = pytest.importorskip("torch")
    import ppo_fast.torch as pt
    from ppo_fast import _validate

    logp, _, adv, mask = (torch.tensor(a) for a in _batch(13, rows=5, width=12))
    read = []
    tensor_array = _validate.tensor_array

    def spy(name, tensor):
        read.append(name)
        return tensor_array(name, tensor)

    monkeypatch.setattr(_validate, "tensor_array", spy)
    picked = pt.kl_cov_selection(logp, adv, mask=mask, ratio=0.2)
    assert {"logprobs", "advantages", "mask"} <= set(read)
    with pytest.raises(ValueError, match="backend"):
        pt.kl_cov_selection(logp, adv, mask=mask, ratio=0.2, backend="no-such-backend")

    def refuse(name, tensor):
        raise AssertionError(f"{name} was read through the host")

    monkeypatch.setattr(_validate, "tensor_array", refuse)
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
    forced = pt.kl_cov_selection(logp, adv, mask=mask, ratio=0.2, backend="no-such-backend")
    assert torch.equal(forced, picked) and picked.sum() == int(0.2 * int(mask.sum()))
