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
