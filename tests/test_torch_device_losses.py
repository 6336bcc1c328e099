"""ppo_fast.torch.clipped_surrogate and value_loss on the device path (torch formulas on the
tensors' device, forced on CPU tensors) equal the kernel path: loss, statistics and gradient, in
every layout and aggregation, float32 and float64, with weights, dual clip and clamp."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ppo_fast.torch as pt  # noqa: E402

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
TOL = {torch.float32: (2e-6, 1e-7), torch.float64: (1e-12, 1e-15)}


def _layouts(rng, rows=5, width=11):
    lengths = torch.tensor(rng.integers(0, width + 1, rows))
    mask = torch.tensor(rng.random((rows, width)) < 0.7)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(rng.integers(0, width, rows))]))
    return [
        ((rows, width), {"mask": mask}),
        ((rows, width), {"lengths": lengths}),
        ((int(cu[-1]),), {"cu_seqlens": cu}),
    ]


def _both(function, main, others, monkeypatch, **options):
    results = []
    for forced in (False, True):
        monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
        x = main.clone().requires_grad_()
        out = function(x, *others, **options)
        out.loss.backward()
        results.append((out, x.grad))
    return results


def _assert_same(kernel, device, dtype):
    rtol, atol = TOL[dtype]
    (out_k, grad_k), (out_d, grad_d) = kernel, device
    for a, b in zip(out_k, out_d, strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(b.item(), a.item(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(grad_d.numpy(), grad_k.numpy(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipped_surrogate_device_path_equals_the_kernels(dtype, monkeypatch):
    rng = np.random.default_rng(3)
    for shape, layout in _layouts(rng):
        old = torch.tensor(rng.uniform(-3, -0.1, shape), dtype=dtype)
        logp = old + torch.tensor(rng.normal(0, 0.6, shape), dtype=dtype)
        adv = torch.tensor(rng.normal(size=shape), dtype=dtype)
        weights = torch.tensor(rng.uniform(0.5, 1.5, shape), dtype=dtype)
        for agg in AGGS:
            scale = {"loss_scale": 7.0} if agg == "seq-mean-token-sum-norm" else {}
            for options in (
                {"clip_low": 0.2, "clip_high": 0.28},
                {"clip_low": 0.1, "dual_clip": 1.5, "log_ratio_clamp": 0.5, "weights": weights},
            ):
                kernel, device = _both(
                    pt.clipped_surrogate, logp, (old, adv), monkeypatch, agg=agg,
                    **layout, **scale, **options,
                )  # fmt: skip
                _assert_same(kernel, device, dtype)
                assert 0 < kernel[0].clipfrac.item() < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_value_loss_device_path_equals_the_kernels(dtype, monkeypatch):
    rng = np.random.default_rng(4)
    for shape, layout in _layouts(rng):
        values = torch.tensor(rng.normal(size=shape), dtype=dtype)
        old = values + torch.tensor(rng.normal(0, 0.3, shape), dtype=dtype)
        returns = torch.tensor(rng.normal(size=shape), dtype=dtype)
        for agg in AGGS:
            scale = {"loss_scale": 7.0} if agg == "seq-mean-token-sum-norm" else {}
            for clip in (None, 0.2):
                kernel, device = _both(
                    pt.value_loss, values, (old, returns), monkeypatch, agg=agg, clip=clip,
                    **layout, **scale,
                )  # fmt: skip
                _assert_same(kernel, device, dtype)


def test_device_path_refuses_what_the_kernel_path_refuses(monkeypatch):
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_low must"):
        pt.clipped_surrogate(x, x, x, clip_low=-0.1)
    with pytest.raises(ValueError, match="clip must"):
        pt.value_loss(x, x, x, clip=-1.0)
    with pytest.raises(ValueError, match="old_values requires grad"):
        pt.value_loss(x, x.clone().requires_grad_(), x)
    with pytest.raises(ValueError, match="shape"):
        pt.value_loss(x, torch.zeros(2, 4), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dppo_and_kl_cov_device_path_equals_the_kernels(dtype, monkeypatch):
    rng = np.random.default_rng(6)
    for shape, layout in _layouts(rng):
        old = torch.tensor(rng.uniform(-2.5, -0.05, shape), dtype=dtype)
        logp = (old + torch.tensor(rng.normal(0, 0.3, shape), dtype=dtype)).clamp(max=-1e-3)
        adv = torch.tensor(rng.normal(size=shape), dtype=dtype)
        weights = torch.tensor(rng.uniform(0.5, 1.5, shape), dtype=dtype)
        selected = torch.tensor(rng.random(shape) < 0.3)
        for agg in AGGS:
            scale = {"loss_scale": 7.0} if agg == "seq-mean-token-sum-norm" else {}
            for divergence in ("tv", "kl"):
                kernel, device = _both(
                    pt.dppo_loss, logp, (old, adv), monkeypatch, agg=agg, divergence=divergence,
                    divergence_low=0.05, ratio_cap=1.1, log_ratio_clamp=0.5, weights=weights,
                    **layout, **scale,
                )  # fmt: skip
                _assert_same(kernel, device, dtype)
            kernel, device = _both(
                pt.kl_cov_loss, logp, (old, adv, selected), monkeypatch, agg=agg, coef=0.7,
                weights=weights, **layout, **scale,
            )  # fmt: skip
            _assert_same(kernel, device, dtype)


def _selections(monkeypatch, logp, adv, **options):
    """kl_cov_selection on the kernels and on the device path (forced on CPU tensors)."""
    picks = []
    for forced in (False, True):
        monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
        picks.append(pt.kl_cov_selection(logp, adv, **options))
    return picks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kl_cov_selection_device_path_picks_the_kernels_tokens(dtype, monkeypatch):
    rng = np.random.default_rng(8)
    for rows, width in ((5, 11), (64, 300)):
        for shape, layout in _layouts(rng, rows, width):
            logp = torch.tensor(rng.uniform(-3, 0, shape), dtype=dtype)
            adv = torch.tensor(rng.normal(size=shape), dtype=dtype)
            for ratio in (0.0002, 0.05, 0.3, 1.0, 7.0):
                kernel, device = _selections(monkeypatch, logp, adv, ratio=ratio, **layout)
                assert device.dtype == torch.bool and device.shape == logp.shape
                assert torch.equal(device, kernel), (shape, list(layout), ratio)
                n_valid = int(
                    layout["mask"].sum()
                    if "mask" in layout
                    else layout["lengths"].sum()
                    if "lengths" in layout
                    else shape[0]
                )
                k = min(n_valid, max(int(ratio * n_valid), 1)) if n_valid else 0
                assert int(device.sum()) == k


def test_kl_cov_selection_device_path_breaks_ties_and_nans_as_the_kernels(monkeypatch):
    rng = np.random.default_rng(9)
    shape = (6, 40)
    mask = torch.tensor(rng.random(shape) < 0.8)
    # two values each: the covariances take four values, so the k-th is tied across many tokens
    logp = torch.tensor(rng.choice([-1.0, -2.0], shape), dtype=torch.float32)
    adv = torch.tensor(rng.choice([-1.0, 1.0], shape), dtype=torch.float32)
    for ratio in (0.01, 0.1, 0.3, 0.5, 0.9):
        kernel, device = _selections(monkeypatch, logp, adv, ratio=ratio, mask=mask)
        assert torch.equal(device, kernel), ratio
    # a NaN at a valid token makes every covariance NaN, which counts as -inf: the first k valid
    # tokens; a NaN where the mask is 0 changes nothing
    for where, valid in (((0, 3), True), ((1, 2), False)):
        hole = mask.clone()
        hole[where] = valid
        broken = adv.clone()
        broken[where] = float("nan")
        kernel, device = _selections(monkeypatch, logp, broken, ratio=0.1, mask=hole)
        assert torch.equal(device, kernel), where
        clean_kernel, _ = _selections(monkeypatch, logp, adv, ratio=0.1, mask=hole)
        assert torch.equal(kernel, clean_kernel) != valid
    # infinities: the means are inf, the covariances inf, -inf or NaN on both paths
    wild = adv.clone()
    wild[2, 5], wild[4, 7] = float("inf"), float("-inf")
    for pair in ((wild, logp), (adv, logp.clone().fill_(float("inf")))):
        kernel, device = _selections(monkeypatch, pair[1], pair[0], ratio=0.2, mask=mask)
        assert torch.equal(device, kernel)
    # no valid token: nothing selected
    kernel, device = _selections(monkeypatch, logp, adv, mask=torch.zeros(shape, dtype=torch.bool))
    assert not device.any() and not kernel.any()


def test_kl_cov_selection_device_path_refuses_what_the_kernel_path_refuses(monkeypatch):
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ratio must"):
        pt.kl_cov_selection(x, x, ratio=0.0)
    with pytest.raises(ValueError, match="shape"):
        pt.kl_cov_selection(x, torch.zeros(2, 4))
    with pytest.raises(ValueError):
        pt.kl_cov_selection(x, x, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError):
        pt.kl_cov_selection(x, x, lengths=torch.tensor([1, 9]))


def _on_the_bounds(dtype):
    """Tokens whose log-ratios are exactly +-log 2 (ratio 2 or 1/2), 2 log 2 (ratio 4), or 1/8,
    against olds chosen so that logp - old gives them back exactly; the advantages hold a 0, and
    values in (0, 1) and below 0. Returns (logp, old, adv, log_ratio)."""
    ln2 = torch.tensor(np.log(2.0), dtype=dtype)
    log_ratio = torch.stack(
        [ln2, ln2, ln2, -ln2, 2 * ln2, ln2, -ln2, torch.tensor(0.125, dtype=dtype)]
    )
    old = torch.tensor([-1.0, -1.0, -1.0, -0.25, -3.0, -0.5, -0.25, -2.0], dtype=dtype)
    adv = torch.tensor([-1.5, 0.0, 0.5, -1.0, -0.75, 0.25, 0.5, 0.75], dtype=dtype)
    logp = old + log_ratio
    # the boundaries are hit: the log-ratio the formulas compute, and the ratio torch's exp gives
    assert torch.equal(logp - old, log_ratio)
    ratio = torch.exp(log_ratio)
    assert ratio[:3].eq(2.0).all() and ratio[3] == 0.5 and ratio[4] == 4.0
    return logp, old, adv, log_ratio


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipped_surrogate_device_path_on_the_bounds_is_the_kernels(dtype, monkeypatch):
    """A ratio exactly at the dual clip (2: token 0, A < 0), at 1 + clip_high and 1 - clip_low,
    a log-ratio exactly at the clamp (+-log 2), advantages of 0 and in (0, 1): loss, gradient
    and statistics on the device path are the kernels'."""
    logp, old, adv, log_ratio = _on_the_bounds(dtype)
    ln2 = float(log_ratio[0])
    cu = torch.tensor([0, 3, 8])
    weights = torch.linspace(0.5, 1.5, 8, dtype=dtype)
    for options in (
        {"dual_clip": 2.0},
        {"clip_low": 0.5, "clip_high": 1.0, "dual_clip": 2.0},
        {"log_ratio_clamp": ln2},
        {"log_ratio_clamp": ln2, "dual_clip": 2.0, "weights": weights},
    ):
        for agg in ("token-mean", "seq-mean-token-mean"):
            kernel, device = _both(
                pt.clipped_surrogate, logp, (old, adv), monkeypatch, cu_seqlens=cu, agg=agg,
                **options,
            )  # fmt: skip
            _assert_same(kernel, device, dtype)
            (out, grad), (_, device_grad) = kernel, device
            if "dual_clip" in options:
                # on the dual clip, not beyond it: the token keeps its slope and is not counted
                # (token 4's ratio 4 is beyond: slope 0, counted, unless the clamp makes it 2)
                assert grad[0] != 0 and device_grad[0] != 0 and grad[4] == 0
                n_lower = 1 if "log_ratio_clamp" not in options else 0
                assert out.clipfrac_lower.item() == pytest.approx(n_lower / 8)
            if "log_ratio_clamp" in options:
                # at the clamp (+-log 2), not beyond it, the gradient passes where the ratio is
                # not clipped (tokens 0 and 6); beyond it (token 4, 2 log 2) it is 0
                assert grad[0] != 0 and grad[6] != 0 and device_grad[6] != 0 and grad[4] == 0
