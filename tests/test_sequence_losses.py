"""The per-sequence losses, GSPO and verl's geometric mean (ppo_fast.gspo_loss, geo_mean_loss
and their torch twins): GSPO's two gradients against autograd of the peers' expressions (verl's
detached ratio, TRL's and OpenRLHF's sequence ratio), the geometric mean against autograd of
verl's, finite differences, the torch path of tensors on another device (forced on CPU),
identities, a row with no valid token, and bad settings. The backends against the oracle:
tests/test_kernels.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_torch_policy import (
    AGGS,
    LAYOUTS,
    assert_close,
    make_case,
    normaliser,
    on_both_paths,
)

import ppo_fast
import ppo_fast.torch as pt

OPTIONS = [
    {"clip_low": 0.2, "clip_high": 0.28, "log_ratio_max": 10.0},  # verl's clamp
    {"clip_low": 0.1, "dual_clip": 3.0},  # OpenRLHF's dual clip
    {"clip_low": 0.3, "clip_high": 0.1, "log_ratio_max": 0.05},  # the clamp active
]


def reference(logp, old, adv, valid, form, options):
    """Per-token GSPO losses as the peers write them, differentiable by autograd."""
    log_ratio = torch.where(valid, logp - old, 0.0)
    mean = log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)
    if form == "detached":  # verl: sg(s) * exp(logp - sg(logp))
        log_s = logp - logp.detach() + mean.detach()[:, None]
    else:  # TRL, OpenRLHF: s itself
        log_s = mean[:, None].expand_as(logp)
    cap = options.get("log_ratio_max")
    if cap is not None:
        log_s = log_s.clamp(max=cap)
    s = log_s.exp()
    low = options["clip_low"]
    high = options.get("clip_high", low)
    objective = torch.min(s * adv, s.clamp(1 - low, 1 + high) * adv)
    if options.get("dual_clip") is not None:
        objective = torch.where(
            adv < 0, torch.max(objective, options["dual_clip"] * adv), objective
        )
    return -objective


def statistics(case, options):
    """verl's and OpenRLHF's clip fraction (the clipped branch strictly smaller), TRL's low clip
    fraction and the mean of old - logp, over the valid tokens."""
    valid = case.valid
    log_ratio = torch.where(valid, case.logp - case.old, 0.0)
    mean = log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)
    cap = options.get("log_ratio_max")
    s = (mean if cap is None else mean.clamp(max=cap)).exp()[:, None]
    low = options["clip_low"]
    high = options.get("clip_high", low)
    clipped = s.clamp(1 - low, 1 + high) * case.adv < s * case.adv
    n = valid.sum().double()
    return (
        (clipped & valid).sum() / n,
        (clipped & valid & (case.adv < 0)).sum() / n,
        torch.where(valid, case.old - case.logp, 0.0).sum() / n,
    )


def aggregate(per_token, valid, agg):
    per_token = torch.where(valid, per_token, 0.0)
    counts = valid.sum(-1)
    seqs = (counts > 0).sum()
    if agg == "token-mean":
        return per_token.sum() / valid.sum()
    if agg == "seq-mean-token-mean":
        rows = counts > 0
        return (per_token.sum(-1)[rows] / counts[rows]).sum() / seqs
    if agg == "seq-mean-token-sum":
        return per_token.sum() / seqs
    return per_token.sum() / valid.shape[-1]


def run(case, form, options, agg, weighted):
    logp = case.tokens(case.logp).clone().requires_grad_()
    result = pt.gspo_loss(
        logp,
        case.tokens(case.old),
        case.tokens(case.adv),
        form=form,
        agg=agg,
        **normaliser(case, agg),
        **options,
        **case.arguments(weighted),
    )
    result.loss.backward()
    return result, logp.grad


@pytest.mark.parametrize("form", ["detached", "sequence"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_both_forms_equal_autograd_of_the_peers_expressionon_both_paths(
    form, layout, dtype, monkeypatch
):
    for k, options in enumerate(OPTIONS):
        case = make_case(layout, dtype, seed=k)
        for agg in AGGS:
            for weighted in (False, True):
                what = f"{form} {options} {layout} {agg} weighted={weighted}"
                result, grad = run(case, form, options, agg, weighted)
                assert result.loss.dtype == dtype and grad.dtype == dtype, what
                numpy = ppo_fast.gspo_loss(
                    case.tokens(case.logp).numpy(),
                    case.tokens(case.old).numpy(),
                    case.tokens(case.adv).numpy(),
                    form=form,
                    agg=agg,
                    **normaliser(case, agg),
                    **options,
                    **{
                        k: None if v is None else v.numpy()
                        for k, v in case.arguments(weighted).items()
                    },
                )
                np.testing.assert_array_equal(grad.numpy(), numpy.grad, err_msg=what)
                assert torch.equal(result.loss.detach(), torch.tensor(numpy.loss, dtype=dtype)), (
                    what
                )

                plain = case.logp.clone().requires_grad_()
                terms = reference(plain, case.old, case.adv, case.valid, form, options)
                if weighted:
                    terms = terms * case.weights
                expected = aggregate(terms, case.valid, agg)
                expected.backward()
                magnitude = float(aggregate(terms.detach().abs(), case.valid, agg))
                assert_close(result.loss.detach(), expected.detach(), dtype, what, magnitude)
                assert_close(grad, case.tokens(plain.grad), dtype, f"d {what}")
                for stat, value in zip(result[1:], statistics(case, options), strict=True):
                    assert_close(stat, value, dtype, f"statistics {what}")

                monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
                forced, forced_grad = run(case, form, options, agg, weighted)
                monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", False)
                assert forced.loss.dtype == dtype and forced_grad.dtype == dtype, what
                assert_close(forced.loss.detach(), result.loss.detach(), dtype, f"torch {what}")
                assert_close(forced_grad, grad, dtype, f"torch d {what}")
                for stat, kernel_stat in zip(forced[1:], result[1:], strict=True):
                    assert_close(stat, kernel_stat, dtype, f"torch stats {what}")


def _batch(seed, rows=4, width=8):
    rng = np.random.default_rng(seed)
    old = rng.uniform(-3.0, -0.1, (rows, width))
    logp = old + rng.normal(0.0, 0.3, (rows, width))
    advantages = rng.normal(0.0, 1.0, (rows, width))
    mask = rng.random((rows, width)) < 0.8
    mask[:, 0] = True
    return logp, old, advantages, mask


@pytest.mark.parametrize("agg", AGGS)
def test_the_sequence_form_is_the_derivative_of_the_loss(agg):
    """Five-point finite differences of the loss (the detached form's gradient is that of verl's
    surrogate, not of the loss: it is checked against autograd above)."""
    logp, old, advantages, mask = _batch(1)
    options = {"clip_low": 0.2, "dual_clip": 2.0, "agg": agg, "mask": mask, "form": "sequence"}
    weights = np.random.default_rng(2).uniform(0.5, 1.5, logp.shape)
    result = ppo_fast.gspo_loss(logp, old, advantages, weights=weights, **options)
    h = 1e-6
    for index in [(0, 0), (1, 3), (3, 7), (2, 5)]:
        values = []
        for step in (-2, -1, 1, 2):
            shifted = logp.copy()
            shifted[index] += step * h
            values.append(ppo_fast.gspo_loss(shifted, old, advantages, weights=weights, **options))
        f = [v.loss for v in values]
        numeric = (f[0] - 8 * f[1] + 8 * f[2] - f[3]) / (12 * h)
        assert result.grad[index] == pytest.approx(numeric, rel=1e-6, abs=1e-9), index


@pytest.mark.parametrize("form", ["detached", "sequence"])
def test_rows_of_one_token_are_the_clipped_surrogate(form):
    """With one valid token per row, the sequence ratio is the token's: both forms are PPO's."""
    logp, old, advantages, _ = _batch(3, rows=6, width=5)
    lengths = np.ones(6, dtype=np.int64)
    options = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "lengths": lengths}
    ppo = ppo_fast.clipped_surrogate(logp, old, advantages, **options)
    gspo = ppo_fast.gspo_loss(logp, old, advantages, form=form, **options)
    assert gspo.loss == pytest.approx(ppo.loss, rel=1e-14)
    np.testing.assert_allclose(gspo.grad, ppo.grad, rtol=1e-14, atol=1e-17)
    assert gspo.approx_kl == pytest.approx(ppo.approx_kl, rel=1e-14)


@pytest.mark.parametrize("form", ["detached", "sequence"])
def test_a_row_with_no_valid_token_contributes_nothing(form):
    logp, old, advantages, mask = _batch(4)
    emptied = mask.copy()
    emptied[2] = False
    options = {"form": form, "agg": "token-mean", "num_tokens": 20.0}
    whole = ppo_fast.gspo_loss(logp, old, advantages, mask=emptied, **options)
    rest = ppo_fast.gspo_loss(
        np.delete(logp, 2, 0),
        np.delete(old, 2, 0),
        np.delete(advantages, 2, 0),
        mask=np.delete(emptied, 2, 0),
        **options,
    )
    assert whole.loss == rest.loss
    assert not whole.grad[2].any()
    np.testing.assert_array_equal(np.delete(whole.grad, 2, 0), rest.grad)
    none = ppo_fast.gspo_loss(logp, old, advantages, mask=np.zeros_like(mask), form=form)
    assert none.loss == 0.0 and not none.grad.any() and math.isnan(none.clipfrac)


def test_a_nan_weight_at_a_valid_position_reaches_the_loss_and_its_rows_gradient():
    """The documented result (DESIGN.md: NaN at a valid position propagates): the loss is NaN,
    and the sequence form's gradient is NaN on that row only."""
    logp, old, advantages, mask = _batch(5)
    weights = np.ones_like(logp)
    weights[1, 0] = np.nan
    result = ppo_fast.gspo_loss(logp, old, advantages, mask=mask, weights=weights, form="sequence")
    assert math.isnan(result.loss)
    assert np.isnan(result.grad[1][mask[1]]).all()
    assert np.isfinite(np.delete(result.grad, 1, 0)).all()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("clip_low", -0.1, "clip_low must"),
        ("clip_high", -0.2, "clip_high must"),
        ("dual_clip", 0.5, "dual_clip must"),
        ("log_ratio_max", math.nan, "log_ratio_max"),
        ("log_ratio_max", -math.inf, "log_ratio_max is -inf"),
        ("form", "token", "form must be one of 'detached', 'sequence'"),
    ],
)
def test_bad_settings_are_errors_naming_them(option, value, message):
    logp, old, advantages, mask = _batch(6)
    with pytest.raises(ValueError, match=message):
        ppo_fast.gspo_loss(logp, old, advantages, mask=mask, **{option: value})
    logprobs = torch.from_numpy(logp)
    with pytest.raises(ValueError, match=message):
        pt.gspo_loss(
            logprobs, torch.from_numpy(old), torch.from_numpy(advantages),
            mask=torch.from_numpy(mask), **{option: value},
        )  # fmt: skip


GEO_OPTIONS = [{"clip_low": 0.4}, {"clip_low": 0.2, "clip_high": 0.28}, {"clip_low": math.inf}]


def geo_reference(logp, old, adv, valid, weights, options):
    """verl's compute_policy_loss_geo_mean per row, broadcast onto the row's tokens."""
    low = options["clip_low"]
    high = options.get("clip_high", low)
    log_ratio = logp - old
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-low, high)
    kept = sign * torch.min(sign * log_ratio, sign * clamped)
    n = valid.sum(-1).clamp(min=1)
    row = -(torch.where(valid, adv, 0.0).sum(-1) / n)
    row = row * (torch.where(valid, kept, 0.0).sum(-1) / n).exp()
    if weights is not None:
        row = row * (torch.where(valid, weights.log(), 0.0).sum(-1) / n).exp()
    return row[:, None].expand_as(logp)


def run_geo(case, options, agg, weighted):
    logp = case.tokens(case.logp).clone().requires_grad_()
    result = pt.geo_mean_loss(
        logp,
        case.tokens(case.old),
        case.tokens(case.adv),
        agg=agg,
        **normaliser(case, agg),
        **options,
        **case.arguments(weighted),
    )
    result.loss.backward()
    return result, logp.grad


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_geo_mean_equals_autograd_of_verls_expressionon_both_paths(layout, dtype, monkeypatch):
    for k, options in enumerate(GEO_OPTIONS):
        case = make_case(layout, dtype, seed=10 + k)
        for agg in AGGS:
            for weighted in (False, True):
                what = f"geo_mean {options} {layout} {agg} weighted={weighted}"
                result, grad = run_geo(case, options, agg, weighted)
                assert result.loss.dtype == dtype and grad.dtype == dtype, what
                plain = case.logp.clone().requires_grad_()
                terms = geo_reference(
                    plain, case.old, case.adv, case.valid,
                    case.weights if weighted else None, options,
                )  # fmt: skip
                expected = aggregate(terms, case.valid, agg)
                expected.backward()
                magnitude = float(aggregate(terms.detach().abs(), case.valid, agg))
                assert_close(result.loss.detach(), expected.detach(), dtype, what, magnitude)
                assert_close(grad, case.tokens(plain.grad), dtype, f"d {what}")
                low = options["clip_low"]
                high = options.get("clip_high", low)
                log_ratio = case.logp - case.old
                outside = ~((log_ratio >= -low) & (log_ratio <= high)) & case.valid
                n = case.valid.sum().double()
                wanted = (
                    (outside & (case.adv > 0)).sum() / n,
                    (outside & (case.adv < 0)).sum() / n,
                    torch.where(case.valid, -log_ratio, 0.0).sum() / n,
                )
                for stat, value in zip(result[1:], wanted, strict=True):
                    assert_close(stat, value, dtype, f"statistics {what}")

                monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
                forced, forced_grad = run_geo(case, options, agg, weighted)
                monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", False)
                assert forced.loss.dtype == dtype and forced_grad.dtype == dtype, what
                assert_close(forced.loss.detach(), result.loss.detach(), dtype, f"torch {what}")
                assert_close(forced_grad, grad, dtype, f"torch d {what}")
                for stat, kernel_stat in zip(forced[1:], result[1:], strict=True):
                    assert_close(stat, kernel_stat, dtype, f"torch stats {what}")


def test_geo_mean_is_the_derivative_of_its_loss():
    logp, old, advantages, mask = _batch(7)
    weights = np.random.default_rng(8).uniform(0.5, 1.5, logp.shape)
    options = {"clip_low": 0.3, "clip_high": 0.25, "mask": mask, "weights": weights}
    result = ppo_fast.geo_mean_loss(logp, old, advantages, **options)
    h = 1e-6
    for index in [(0, 0), (1, 3), (3, 7), (2, 5)]:
        f = []
        for step in (-2, -1, 1, 2):
            shifted = logp.copy()
            shifted[index] += step * h
            f.append(ppo_fast.geo_mean_loss(shifted, old, advantages, **options).loss)
        numeric = (f[0] - 8 * f[1] + 8 * f[2] - f[3]) / (12 * h)
        assert result.grad[index] == pytest.approx(numeric, rel=1e-6, abs=1e-9), index


def test_geo_mean_rows_without_a_token_contribute_nothing_and_bad_bounds_are_errors():
    logp, old, advantages, mask = _batch(9)
    emptied = mask.copy()
    emptied[1] = False
    whole = ppo_fast.geo_mean_loss(logp, old, advantages, mask=emptied, num_seqs=3.0)
    rest = ppo_fast.geo_mean_loss(
        np.delete(logp, 1, 0), np.delete(old, 1, 0), np.delete(advantages, 1, 0),
        mask=np.delete(emptied, 1, 0), num_seqs=3.0,
    )  # fmt: skip
    assert whole.loss == rest.loss and not whole.grad[1].any()
    for option, value in (("clip_low", -0.2), ("clip_high", math.nan)):
        with pytest.raises(ValueError, match=option):
            ppo_fast.geo_mean_loss(logp, old, advantages, mask=mask, **{option: value})


@pytest.mark.parametrize("name", ["gspo_loss", "geo_mean_loss"])
def test_the_torch_path_reads_no_tensor_through_the_host(name, monkeypatch):
    """The torch path (forced on CPU tensors) never hands a tensor to NumPy, what would copy a
    device's memory: it is the torch formula that runs, not the kernels."""
    case = make_case("mask-holes", torch.float32, seed=9)

    def refuse(name, tensor):
        raise AssertionError(f"{name} was read through the host")

    monkeypatch.setattr(ppo_fast._validate, "tensor_array", refuse)
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
    logp = case.logp.clone().requires_grad_()
    result = getattr(pt, name)(logp, case.old, case.adv, **case.arguments(True))
    result.loss.backward()
    assert torch.isfinite(result.loss) and logp.grad.abs().sum() > 0


def _assert_paths_agree(results, dtype, what):
    (kernel, grad), (forced, forced_grad) = results
    assert forced.loss.dtype == dtype and forced_grad.dtype == dtype, what
    assert_close(forced.loss.detach(), kernel.loss.detach(), dtype, what)
    assert_close(forced_grad, grad, dtype, f"d {what}")
    for stat, kernel_stat in zip(forced[1:], kernel[1:], strict=True):
        assert_close(stat, kernel_stat, dtype, f"stats {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gspo_on_the_boundson_both_paths(dtype, monkeypatch):
    """Rows of two valid tokens whose sequence ratio is exactly 2 (at 1 + clip_high, at the
    dual clip, at log_ratio_max = log 2), 1/2 (at 1 - clip_low) and 4 (beyond them), a row
    without a valid token, advantages of 0: the torch path is the kernels', in both forms."""
    ln2 = torch.tensor(math.log(2.0), dtype=dtype)
    row_log_ratio = torch.stack([ln2, -ln2, 0 * ln2, 2 * ln2])  # row 2 has no valid token
    row_old = torch.tensor([-1.0, -0.25, -1.0, -2.0], dtype=dtype)
    mask = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    old = row_old[:, None].expand(4, 4).contiguous()
    log_ratio = row_log_ratio[:, None].expand(4, 4)
    logp = old + log_ratio
    # the bounds are hit: the log-ratio, its row mean (two equal terms) and torch's exp of it
    assert torch.equal(logp - old, log_ratio)
    assert torch.equal(log_ratio[:, :2].double().sum(-1) / 2, row_log_ratio.double())
    assert torch.equal(row_log_ratio.exp()[[0, 1, 3]], torch.tensor([2.0, 0.5, 4.0]).to(dtype))
    adv = torch.tensor(
        [[-1.5, 9.0, 0.5, 9.0], [9.0, 1.0, -0.5, 9.0], [9.0] * 4, [0.0, -0.5, 9.0, 9.0]]
    ).to(dtype)  # 9 where the mask is 0
    bounds = {"clip_low": 0.5, "clip_high": 1.0}
    for options in (
        {**bounds, "dual_clip": 2.0},
        {**bounds, "log_ratio_max": float(ln2)},
        {"clip_low": 0.2, "dual_clip": 2.0, "log_ratio_max": float(ln2)},
    ):
        for form in ("detached", "sequence"):
            for agg in ("token-mean", "seq-mean-token-mean"):
                what = f"{options} {form} {agg}"
                results = on_both_paths(
                    "gspo_loss", logp, old, adv, monkeypatch, mask=mask, form=form, agg=agg,
                    **options,
                )  # fmt: skip
                _assert_paths_agree(results, dtype, what)
                (_, grad), _ = results
                assert (grad[~mask] == 0).all(), what
                if "clip_high" in options:
                    # rows 0 and 1 sit on the clip bounds, not beyond: the slope passes
                    assert (grad[0, [0, 2]] != 0).all() and (grad[1, 1:3] != 0).all(), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_geo_mean_on_the_boundson_both_paths(dtype, monkeypatch):
    """Log-ratios exactly at the clip bounds (-1/2, 1/2: the gradient still moves them), beyond
    them and inside, advantages of 0, a row without a valid token: the torch path is the
    kernels'."""
    old = torch.full((4, 5), -1.0, dtype=dtype)
    log_ratio = torch.tensor([0.5, -0.5, 0.75, -0.75, 0.25], dtype=dtype).expand(4, 5)
    logp = old + log_ratio
    assert torch.equal(logp - old, log_ratio)
    adv = torch.tensor(
        [[1.0, 0.5, 2.0, 1.5, 0.25], [-1.0, -0.5, -2.0, -1.5, -0.25], [1.0] * 5,
         [0.0, 0.0, 1.0, -1.0, 0.0]]
    ).to(dtype)  # fmt: skip
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False  # a row without a valid token
    mask[3, 4] = False
    for options in ({"clip_low": 0.5}, {"clip_low": 0.5, "clip_high": 0.75}):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            what = f"{options} {agg}"
            results = on_both_paths(
                "geo_mean_loss", logp, old, adv, monkeypatch, mask=mask, agg=agg, **options
            )
            _assert_paths_agree(results, dtype, what)
            (kernel, grad), _ = results
            # on the bound the token moves: 1/2 where A > 0, -1/2 where A < 0
            assert grad[0, 0] != 0 and grad[1, 1] != 0, what
            assert (grad[2] == 0).all() and grad[3, 4] == 0, what
            # outside the bounds, not on them, by the sign of A: -3/4, and 3/4 unless it is
            # clip_high (rows 0 and 1 hold both, row 3 holds 3/4 with A > 0, -3/4 with A < 0)
            on_high = options.get("clip_high") == 0.75
            n = int(mask.sum())
            positive, negative = (1, 2) if on_high else (3, 3)
            assert kernel.clipfrac.item() == pytest.approx(positive / n), what
            assert kernel.clipfrac_lower.item() == pytest.approx(negative / n), what
