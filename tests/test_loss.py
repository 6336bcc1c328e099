"""The fused policy and value losses: seeds, exact gradients, statistics, oracle equality."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest
import torch
from batches import Batch, ragged_batches
from conftest import RTOL, assert_matches_oracle
from hypothesis import example, given
from hypothesis import strategies as st

import ppo_fast
from ppo_fast import _reference, _validate
from ppo_fast._rows import COUNT_BY_ROW
from ppo_fast.loss import AGGREGATIONS

# --------------------------------------------------------------------------------------------
# shared/seeds/003_548ffc3288f9bb9e.txt: epsilon = 0.2, one token per case.
# (case, A, rho, L). The gradient of L with respect to log pi is A * rho on the sloped branch
# and 0 on a flat (clipped) one; the loss of a one-token batch is -L, its gradient -dL.
SEED_CASES = [
    ("1 good token inside the band", 2.0, 1.15, 2.30, True),
    ("2 good token too eager", 2.0, 1.6, 2.4, False),
    ("3 good token backed off", 2.0, 0.7, 1.4, True),
    # The seed's prose says the gradient here "still pushes the probability further down". The
    # mathematics disagrees: L = clip(rho) * A = 0.8 * -3 is flat in rho, so the gradient is 0.
    ("4 bad token already dropped", -3.0, 0.5, -2.4, False),
    ("5 bad token more eager", -3.0, 1.4, -4.2, True),
    ("6a zero advantage", 0.0, 1.9, 0.0, True),
    ("6b ratio exactly one", 2.0, 1.0, 2.0, True),
    ("8a same ratio, good token", 2.0, 1.5, 2.4, False),
    ("8b same ratio, bad token", -2.0, 1.5, -3.0, True),
]


@pytest.mark.parametrize(
    ("case", "advantage", "ratio", "objective", "sloped"),
    SEED_CASES,
    ids=[c[0] for c in SEED_CASES],
)
def test_seed_003_cases(backend, case, advantage, ratio, objective, sloped):
    result = ppo_fast.clipped_surrogate(
        np.array([[math.log(ratio)]]),
        np.zeros((1, 1)),
        np.array([[advantage]]),
        clip_low=0.2,
        backend=backend,
    )
    assert -result.loss == pytest.approx(objective, abs=5e-13)
    expected_grad = -advantage * ratio if sloped else 0.0
    assert result.grad[0, 0] == pytest.approx(expected_grad, abs=1e-12)
    clipped = not sloped
    assert result.clipfrac == float(clipped)


def test_seed_000_step_7(backend):
    """Token 1: log-ratio 0.05, normalised advantage 1.10; the ratio is inside the band."""
    ratio_inputs = (np.array([[-0.85]]), np.array([[-0.9]]))
    result = ppo_fast.clipped_surrogate(*ratio_inputs, np.array([[1.10]]), backend=backend)
    # The seed multiplies its rounded ratio 1.05 by 1.10 and prints 1.155; exactly it is 1.1564.
    assert -result.loss == pytest.approx(1.10 * math.exp(0.05), rel=1e-12)
    assert -result.loss == pytest.approx(1.155, abs=0.002)
    assert result.clipfrac == 0.0
    assert result.grad[0, 0] == pytest.approx(-1.10 * math.exp(0.05), rel=1e-12)


# --------------------------------------------------------------------------------------------
# The plain formula in torch, as trainers write it (verl's compute_policy_loss_vanilla and
# agg_loss), for autograd to differentiate.


def torch_aggregate(per_token, mask, agg, num_tokens=None, num_seqs=None, loss_scale=None):
    mask = mask.to(per_token.dtype)
    per_token = torch.where(mask > 0, per_token, torch.zeros_like(per_token))
    row_sums = per_token.sum(-1)
    counts = mask.sum(-1)
    if agg == "token-mean":
        return row_sums.sum() / (counts.sum() if num_tokens is None else num_tokens)
    if agg == "seq-mean-token-sum-norm":
        return row_sums.sum() / (mask.shape[-1] if loss_scale is None else loss_scale)
    seqs = (counts > 0).sum() if num_seqs is None else num_seqs
    if agg == "seq-mean-token-sum":
        return row_sums.sum() / seqs
    return torch.where(counts > 0, row_sums / counts.clamp(min=1), 0.0).sum() / seqs


def torch_policy_loss(
    logp,
    old,
    adv,
    mask,
    clip_low=0.2,
    clip_high=None,
    dual_clip=None,
    log_ratio_clamp=None,
    weights=None,
    **agg,
):
    log_ratio = logp - old
    if log_ratio_clamp is not None:
        log_ratio = torch.clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    high = clip_low if clip_high is None else clip_high
    objective = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + high) * adv)
    if dual_clip is not None:
        objective = torch.where(adv < 0, torch.maximum(objective, dual_clip * adv), objective)
    per_token = -objective * (1.0 if weights is None else weights)
    return torch_aggregate(per_token, mask, **agg)


def torch_value_loss(values, old, returns, mask, clip=None, **agg):
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token = 0.5 * unclipped
    else:
        clipped_values = torch.clamp(values, old - clip, old + clip)
        per_token = 0.5 * torch.maximum(unclipped, (clipped_values - returns) ** 2)
    return torch_aggregate(per_token, mask, **agg)


def autograd(function, x, *rest, **kwargs):
    leaf = torch.from_numpy(x.copy()).requires_grad_(True)
    loss = function(leaf, *(torch.from_numpy(r) for r in rest), **kwargs)
    loss.backward()
    return loss.item(), leaf.grad.numpy()


def away_from_kinks(rng, shape, dtype=np.float64, clip=0.2, dual=3.0, clamp=None, margin=0.02):
    """Log-probs whose ratios stay `margin` away from every kink of the objective."""
    old = rng.uniform(-3, -0.5, shape)
    edges = [1 - clip, 1 + clip, dual]
    log_ratio = rng.uniform(-1.3, 1.3, shape)
    for _ in range(20):
        ratio = np.exp(log_ratio)
        near = np.zeros(shape, dtype=bool)
        for edge in edges:
            near |= np.abs(ratio - edge) < margin
        if clamp is not None:
            near |= np.abs(np.abs(log_ratio) - clamp) < margin
        if not near.any():
            break
        log_ratio[near] = rng.uniform(-1.3, 1.3, int(near.sum()))
    return (old + log_ratio).astype(dtype), old.astype(dtype)


VARIANTS = [
    {},
    {"clip_low": 0.2, "clip_high": 0.28},
    {"dual_clip": 3.0},
    {"log_ratio_clamp": 0.5},
    {"weights": True},
    {"clip_high": 0.28, "dual_clip": 3.0, "log_ratio_clamp": 1.0, "weights": True},
]
AGG_OPTIONS = [
    {"agg": "token-mean"},
    {"agg": "token-mean", "num_tokens": 100.0},
    {"agg": "seq-mean-token-mean"},
    {"agg": "seq-mean-token-mean", "num_seqs": 7.0},
    {"agg": "seq-mean-token-sum"},
    {"agg": "seq-mean-token-sum-norm"},
    {"agg": "seq-mean-token-sum-norm", "loss_scale": 64.0},
]


def policy_case(rng, variant, dtype=np.float64, shape=(4, 9)):
    clamp = variant.get("log_ratio_clamp")
    logp, old = away_from_kinks(rng, shape, dtype, clamp=clamp)
    adv = rng.normal(size=shape).astype(dtype)
    mask = rng.random(shape) < 0.75
    mask[0] = False  # a fully masked row: it does not count as a sequence
    kwargs = {k: v for k, v in variant.items() if k != "weights"}
    weights = rng.uniform(0.5, 2.0, shape).astype(dtype) if variant.get("weights") else None
    return logp, old, adv, mask, kwargs, weights


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "plain")
@pytest.mark.parametrize("agg", AGG_OPTIONS, ids=lambda a: "/".join(map(str, a.values())))
def test_policy_loss_equals_torch_autograd(backend, variant, agg):
    rng = np.random.default_rng(5)
    logp, old, adv, mask, kwargs, weights = policy_case(rng, variant)
    result = ppo_fast.clipped_surrogate(
        logp, old, adv, mask=mask, weights=weights, **kwargs, **agg, backend=backend
    )
    extra = (torch.from_numpy(weights),) if weights is not None else ()
    leaf = torch.from_numpy(logp.copy()).requires_grad_(True)
    loss = torch_policy_loss(
        leaf,
        torch.from_numpy(old),
        torch.from_numpy(adv),
        torch.from_numpy(mask),
        **kwargs,
        weights=extra[0] if extra else None,
        **agg,
    )
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-12, abs=1e-14)
    np.testing.assert_allclose(result.grad, leaf.grad.numpy(), rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "plain")
def test_policy_gradient_by_five_point_finite_differences(backend, variant):
    rng = np.random.default_rng(6)
    logp, old, adv, mask, kwargs, weights = policy_case(rng, variant, shape=(3, 6))
    for agg in AGGREGATIONS:

        def loss_at(x, agg=agg):
            return ppo_fast.clipped_surrogate(
                x, old, adv, mask=mask, weights=weights, agg=agg, **kwargs, backend=backend
            ).loss

        grad = ppo_fast.clipped_surrogate(
            logp, old, adv, mask=mask, weights=weights, agg=agg, **kwargs, backend=backend
        ).grad
        np.testing.assert_allclose(
            grad, five_point(loss_at, logp), rtol=1e-7, atol=1e-10, err_msg=agg
        )


def five_point(function, x, h=1e-4):
    """d function / d x by the five-point stencil, O(h^4)."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        values = []
        for step in (2, 1, -1, -2):
            shifted = x.copy()
            shifted[index] += step * h
            values.append(function(shifted))
        grad[index] = (-values[0] + 8 * values[1] - 8 * values[2] + values[3]) / (12 * h)
    return grad


def test_policy_loss_on_packed_rows_equals_padded(backend):
    rng = np.random.default_rng(8)
    logp, old, adv, mask, _, weights = policy_case(rng, {"weights": True})
    lengths = mask.sum(1)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    for agg in (
        {"agg": "token-mean"},
        {"agg": "seq-mean-token-mean"},
        {"agg": "seq-mean-token-sum"},
        {"agg": "seq-mean-token-sum-norm", "loss_scale": 9},
    ):
        padded = ppo_fast.clipped_surrogate(
            logp, old, adv, mask=mask, weights=weights, dual_clip=2.0, **agg, backend=backend
        )
        packed = ppo_fast.clipped_surrogate(
            logp[mask],
            old[mask],
            adv[mask],
            cu_seqlens=cu,
            weights=weights[mask],
            dual_clip=2.0,
            **agg,
            backend=backend,
        )
        assert packed.loss == pytest.approx(padded.loss, rel=1e-13)
        np.testing.assert_allclose(packed.grad, padded.grad[mask], rtol=1e-13)
        for name in ("clipfrac", "clipfrac_lower", "approx_kl"):
            assert getattr(packed, name) == pytest.approx(getattr(padded, name), rel=1e-13)


def test_packed_sum_norm_needs_a_loss_scale(backend):
    x = np.zeros(3)
    with pytest.raises(ValueError, match="needs loss_scale"):
        ppo_fast.clipped_surrogate(
            x, x, x, cu_seqlens=[0, 3], agg="seq-mean-token-sum-norm", backend=backend
        )


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batches_with_global_counts_sum_to_the_whole(backend, agg):
    """With the global num_tokens / num_seqs, micro-batch losses and gradients add up."""
    rng = np.random.default_rng(9)
    logp, old, adv, mask, _, _ = policy_case(rng, {}, shape=(6, 10))
    whole = ppo_fast.clipped_surrogate(logp, old, adv, mask=mask, agg=agg, backend=backend)
    counts = mask.sum(1)
    globals_ = {
        "token-mean": {"num_tokens": counts.sum()},
        "seq-mean-token-mean": {"num_seqs": np.count_nonzero(counts)},
        "seq-mean-token-sum": {"num_seqs": np.count_nonzero(counts)},
        "seq-mean-token-sum-norm": {},
    }[agg]
    parts = [
        ppo_fast.clipped_surrogate(
            logp[s], old[s], adv[s], mask=mask[s], agg=agg, **globals_, backend=backend
        )
        for s in (slice(0, 2), slice(2, 6))
    ]
    assert sum(p.loss for p in parts) == pytest.approx(whole.loss, rel=1e-12)
    np.testing.assert_allclose(np.concatenate([p.grad for p in parts]), whole.grad, rtol=1e-12)


def test_statistics(backend):
    rng = np.random.default_rng(10)
    logp, old, adv, mask, _, _ = policy_case(rng, {}, shape=(5, 30))
    result = ppo_fast.clipped_surrogate(
        logp, old, adv, mask=mask, clip_low=0.1, clip_high=0.3, dual_clip=1.5, backend=backend
    )
    ratio, a = np.exp(logp - old)[mask], adv[mask]
    unclipped, clipped = ratio * a, np.clip(ratio, 0.9, 1.3) * a
    objective = np.minimum(unclipped, clipped)
    assert result.clipfrac == pytest.approx(np.mean(clipped < unclipped))
    assert result.clipfrac_lower == pytest.approx(np.mean((a < 0) & (1.5 * a > objective)))
    assert result.approx_kl == pytest.approx(np.mean((old - logp)[mask]), rel=1e-12)
    assert 0 < result.clipfrac < 1 and 0 < result.clipfrac_lower < 1


def test_approx_kl_uses_the_clamped_log_ratio_as_verl_does(backend):
    logp, old = np.array([[5.0, -0.1]]), np.zeros((1, 2))
    result = ppo_fast.clipped_surrogate(
        logp, old, np.ones((1, 2)), log_ratio_clamp=1.0, backend=backend
    )
    assert result.approx_kl == pytest.approx((-1.0 + 0.1) / 2)
    assert result.grad[0, 0] == 0.0  # the clamp is active: the ratio no longer moves


def test_no_valid_token(backend):
    x = np.full((2, 3), np.nan)
    result = ppo_fast.clipped_surrogate(x, x, x, mask=np.zeros((2, 3)), backend=backend)
    assert result.loss == 0.0 and not result.grad.any()
    assert math.isnan(result.clipfrac) and math.isnan(result.approx_kl)
    value = ppo_fast.value_loss(x, x, x, lengths=[0, 0], clip=0.2, backend=backend)
    assert value.loss == 0.0 and not value.grad.any() and math.isnan(value.clipfrac)


# Kinks: where two branches meet, the gradient is the unclipped (sloped) branch's.


def test_at_the_trust_region_edge_the_gradient_is_the_unclipped_one(backend):
    """rho = 1 exactly with clip_high = 0 (upper edge) or clip_low = 0 (lower edge)."""
    zeros = np.zeros((1, 2))
    adv = np.array([[2.0, -3.0]])
    for clips in ({"clip_low": 0.2, "clip_high": 0.0}, {"clip_low": 0.0, "clip_high": 0.2}):
        result = ppo_fast.clipped_surrogate(zeros, zeros, adv, **clips, backend=backend)
        np.testing.assert_array_equal(result.grad, -adv / 2)
        assert result.clipfrac == 0.0
        _, torch_grad = autograd(
            torch_policy_loss,
            zeros,
            zeros,
            adv,
            np.ones((1, 2), dtype=bool),
            **clips,
            agg="token-mean",
        )
        np.testing.assert_array_equal(result.grad, torch_grad)  # autograd agrees at this kink


def test_at_the_log_ratio_clamp_the_gradient_flows(backend):
    result = ppo_fast.clipped_surrogate(
        np.array([[0.5, -0.5]]),
        np.zeros((1, 2)),
        np.array([[-1.0, 1.0]]),
        log_ratio_clamp=0.5,
        clip_low=0.9,
        clip_high=1.0,
        backend=backend,
    )
    expected = -np.array([[-1.0, 1.0]]) * np.exp([[0.5, -0.5]]) / 2
    np.testing.assert_allclose(result.grad, expected, rtol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_at_an_exact_dual_clip_tie_every_backend_takes_the_unclipped_branch(backend, dtype):
    """rho equal to dual_clip to the last bit, A = -1: the dual clip is taken only where it is
    strictly larger, so the gradient is the unclipped one (a `>=` would give 0). Each backend's
    own exp gives rho: read it from a first call, then make it the dual clip."""
    logp = np.array([[0.9, 1.3, 2.1]], dtype=dtype)
    old = np.zeros_like(logp)
    advantages = np.full_like(logp, -1.0)
    free = ppo_fast.clipped_surrogate(
        logp, old, advantages, clip_high=math.inf, agg="seq-mean-token-sum", backend=backend
    )
    ratios = free.grad[0]  # -(-1) * rho * 1 on the unclipped branch
    assert (ratios > 1.0).all()
    for k, ratio in enumerate(ratios):
        tie = ppo_fast.clipped_surrogate(
            logp,
            old,
            advantages,
            clip_high=math.inf,
            dual_clip=float(ratio),
            agg="seq-mean-token-sum",
            backend=backend,
        )
        assert tie.grad[0, k] == ratio, (k, tie.grad)
        assert tie.clipfrac_lower == (ratios > ratio).mean()


def test_at_a_dual_clip_tie_the_gradient_is_the_unclipped_one():
    """The oracle (the specification): rho = dual_clip exactly, A < 0. Autograd gives half."""
    logp = np.array([[math.log(2.0)]])
    assert math.exp(logp[0, 0]) == 2.0
    result = ppo_fast.clipped_surrogate(
        logp, np.zeros((1, 1)), np.array([[-1.0]]), dual_clip=2.0, backend="python"
    )
    assert result.clipfrac_lower == 0.0
    assert result.grad[0, 0] == pytest.approx(2.0)


# --------------------------------------------------------------------------------------------
# Value loss.


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", AGG_OPTIONS, ids=lambda a: "/".join(map(str, a.values())))
def test_value_loss_equals_torch_autograd(backend, clip, agg):
    rng = np.random.default_rng(11)
    shape = (4, 9)
    old = rng.normal(size=shape)
    values = old + rng.uniform(-0.5, 0.5, shape)
    # Keep away from the clip edges, where the derivative of clamp jumps.
    values[np.abs(np.abs(values - old) - 0.2) < 0.01] += 0.05
    returns = rng.normal(size=shape)
    mask = rng.random(shape) < 0.75
    mask[1] = False
    result = ppo_fast.value_loss(values, old, returns, mask=mask, clip=clip, **agg, backend=backend)
    loss, grad = autograd(torch_value_loss, values, old, returns, mask, clip=clip, **agg)
    assert result.loss == pytest.approx(loss, rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(result.grad, grad, rtol=1e-12, atol=1e-15)
    fd = five_point(
        lambda v: (
            ppo_fast.value_loss(v, old, returns, mask=mask, clip=clip, **agg, backend=backend).loss
        ),
        values,
    )
    np.testing.assert_allclose(result.grad, fd, rtol=1e-7, atol=1e-10)
    unclipped = (values - returns) ** 2
    clipped = (np.clip(values, old - 0.2, old + 0.2) - returns) ** 2
    expected_clipfrac = np.mean((clipped > unclipped)[mask]) if clip else 0.0
    assert result.clipfrac == pytest.approx(expected_clipfrac)


def test_value_loss_formula(backend, dtype):
    values = np.array([[1.0, 0.0, 3.0]], dtype=dtype)
    old = np.array([[0.0, 0.0, 2.9]], dtype=dtype)
    returns = np.array([[0.0, 1.0, 0.0]], dtype=dtype)
    result = ppo_fast.value_loss(values, old, returns, clip=0.5, backend=backend)
    # token 0: max(1, (0.5)^2) = 1 (unclipped); token 1: max(1, 1) = 1 (tie: unclipped);
    # token 2: max(9, 2.4^2) = 9 (unclipped).
    assert result.loss == pytest.approx(0.5 * (1 + 1 + 9) / 3, rel=1e-6)
    np.testing.assert_allclose(result.grad, [[1 / 3, -1 / 3, 1.0]], rtol=1e-6)
    values = np.array([[1.0]], dtype=dtype)
    returns = np.array([[3.0]], dtype=dtype)
    result = ppo_fast.value_loss(
        values, np.zeros((1, 1), dtype), returns, clip=0.5, backend=backend
    )
    # clipped to 0.5: (0.5 - 3)^2 = 6.25 > (1 - 3)^2 = 4: the flat clipped branch.
    assert result.loss == pytest.approx(0.5 * 6.25) and result.grad[0, 0] == 0
    assert result.clipfrac == 1.0


# --------------------------------------------------------------------------------------------
# Every compiled backend equals the oracle on generated ragged batches.

loss_options = st.fixed_dictionaries(
    {
        "clip_low": st.sampled_from([0.2, 0.1, 0.0]),
        "clip_high": st.sampled_from([None, 0.28, 5.0]),
        "dual_clip": st.sampled_from([None, 3.0, 1.5]),
        "log_ratio_clamp": st.sampled_from([None, 20.0, 0.3]),
        "agg": st.sampled_from(AGGREGATIONS),
        "weights": st.booleans(),
    }
)


# approx_kl is a mean of log-ratios that cancels: this batch once made the compiled backends
# (-6.70715e-05) and the oracle (-6.70804e-05) differ by 1e-4 relative, within float32 rounding.
CANCELLING_KL = Batch("none", np.dtype(np.float32), np.ones((2, 22), bool), 2, {}, None)


@given(batch=ragged_batches(), options=loss_options)
@example(
    batch=dataclasses.replace(CANCELLING_KL, rng=np.random.default_rng(1975)),
    options={
        "clip_low": 0.2,
        "clip_high": None,
        "dual_clip": None,
        "log_ratio_clamp": None,
        "agg": "token-mean",
        "weights": False,
    },
)
def test_policy_loss_backends_equal_oracle(compiled_backend, batch, options):
    options = dict(options)
    if options["agg"] == "seq-mean-token-sum-norm" and batch.layout == "packed":
        options["loss_scale"] = 50.0
    use_weights = options.pop("weights")
    logp = batch.tokens(-4, 0)
    old = batch.tokens(-4, 0)
    adv = batch.tokens(-3, 3)
    weights = batch.tokens(0, 2) if use_weights else None
    args = (logp, old, adv)
    kwargs = dict(weights=weights, **options, **batch.layout_kwargs)
    actual = ppo_fast.clipped_surrogate(*args, **kwargs, backend=compiled_backend)
    expected = ppo_fast.clipped_surrogate(*args, **kwargs, backend="python")
    assert_matches_oracle(actual.grad, expected.grad, batch.dtype, "grad")
    assert not np.isnan(actual.grad).any()
    # The loss is a sum of per-token terms computed in the input dtype: judge it on the scale
    # of the sum of their magnitudes.
    magnitude = ppo_fast.clipped_surrogate(
        *args,
        **{**kwargs, "clip_low": 0.0, "clip_high": 0.0, "dual_clip": None, "log_ratio_clamp": 30.0},
        backend="python",
    )
    scale = max(1.0, abs(magnitude.loss), abs(expected.loss))
    tolerance = 1e-12 if batch.dtype == np.float64 else 1e-5
    assert abs(actual.loss - expected.loss) <= tolerance * scale * 10
    for name in ("clipfrac", "clipfrac_lower"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert (math.isnan(a) and math.isnan(e)) or a == pytest.approx(e, rel=tolerance), name
    # A mean that cancels: judged on the mean magnitude of its terms, not on its own.
    valid = batch.valid
    log_ratios = logp[valid].astype(np.float64) - old[valid]
    kl_scale = float(np.abs(log_ratios).mean()) if log_ratios.size else 1.0
    a, e = actual.approx_kl, expected.approx_kl
    assert (math.isnan(a) and math.isnan(e)) or abs(a - e) <= 10 * tolerance * kl_scale


@given(
    batch=ragged_batches(),
    clip=st.sampled_from([None, 0.2, 0.0]),
    agg=st.sampled_from(AGGREGATIONS),
)
def test_value_loss_backends_equal_oracle(compiled_backend, batch, clip, agg):
    values, old, returns = batch.tokens(), batch.tokens(), batch.tokens()
    extra = {"loss_scale": 40.0} if (agg.endswith("norm") and batch.layout == "packed") else {}
    kwargs = dict(clip=clip, agg=agg, **extra, **batch.layout_kwargs)
    actual = ppo_fast.value_loss(values, old, returns, **kwargs, backend=compiled_backend)
    expected = ppo_fast.value_loss(values, old, returns, **kwargs, backend="python")
    assert_matches_oracle(actual.grad, expected.grad, batch.dtype, "grad")
    assert actual.loss == pytest.approx(
        expected.loss, rel=1e-5 if batch.dtype == np.float32 else 1e-12, abs=1e-12
    )
    assert (math.isnan(actual.clipfrac) and math.isnan(expected.clipfrac)) or (
        actual.clipfrac == pytest.approx(expected.clipfrac, rel=1e-5)
    )


def test_large_batches_match_the_oracle_and_use_threads(compiled_backend, dtype):
    rng = np.random.default_rng(12)
    shape = (8, 20_000)
    logp = rng.uniform(-3, 0, shape).astype(dtype)
    old = (logp + rng.normal(0, 0.3, shape)).astype(dtype)
    adv = rng.normal(size=shape).astype(dtype)
    mask = rng.random(shape) < 0.9
    kwargs = dict(mask=mask, dual_clip=3.0, clip_high=0.28, agg="seq-mean-token-mean")
    actual = ppo_fast.clipped_surrogate(logp, old, adv, **kwargs, backend=compiled_backend)
    expected = ppo_fast.clipped_surrogate(logp, old, adv, **kwargs, backend="python")
    assert_matches_oracle(actual.grad, expected.grad, dtype)
    assert actual.loss == pytest.approx(expected.loss, rel=1e-5 if dtype == np.float32 else 1e-12)


# --------------------------------------------------------------------------------------------
# The vectorizable exp of the numba kernels.


def test_polynomial_exp_is_exact_to_the_dtypes_rounding():
    numba = pytest.importorskip("numba")  # the numba backend's own helper
    from ppo_fast._numba_math import exp_poly

    @numba.njit
    def evaluate(xs, out):
        for i in range(xs.shape[0]):
            out[i] = exp_poly(xs[i])

    for dtype, low, high, ulps in ((np.float32, -87.0, 88.0, 1), (np.float64, -700, 700, 2)):
        xs = np.concatenate([np.linspace(low, high, 400_001), [0.0, -0.0, 1e-12, -1e-12]])
        xs = xs.astype(dtype)
        out = np.empty_like(xs)
        evaluate(xs, out)
        exact = np.exp(xs.astype(np.longdouble)).astype(dtype)
        error = np.abs(out.astype(np.float64) - exact) / np.spacing(exact).astype(np.float64)
        assert error.max() <= ulps, (dtype, xs[np.argmax(error)])
        # Finite arguments saturate to finite bounds instead of overflowing (ppo_fast/loss.py);
        # NaN, inf and -inf give what math.exp gives.
        extremes = np.array([-1e4, 1e4, np.nan, np.inf, -np.inf], dtype=dtype)
        out = np.empty_like(extremes)
        evaluate(extremes, out)
        assert np.isfinite(out[:2]).all() and out[0] > 0
        assert np.isnan(out[2]) and out[3] == np.inf and out[4] == 0.0


def _exp_arguments(dtype, rng):
    """Arguments of every class for exp, as bits where it matters: NaNs with payloads and
    either sign (a signalling one too), +-inf, +-0, subnormals, the saturation's edges, huge
    values, any bits at all, and the usual range."""
    unsigned = np.uint32 if dtype == np.float32 else np.uint64
    bits = [0x7FC00001, 0xFFC12345, 0x7F800001] if dtype == np.float32 else [
        0x7FF8000000000001, 0xFFF8000000012345, 0x7FF0000000000001
    ]  # fmt: skip
    special = np.concatenate([
        np.array(bits, unsigned).view(dtype),
        np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 5e-324, -5e-324, 87.29, 87.31,
                  88.29, 88.31, -87.29, -87.31, 708.0, 709.0, 709.1, -708.1, 1e30, -1e30], dtype),
    ])  # fmt: skip
    width = 32 if dtype == np.float32 else 64
    any_bits = rng.integers(0, 2**width, 40_000, dtype=np.uint64).astype(unsigned).view(dtype)
    usual = (rng.normal(size=40_000) * rng.choice([0.1, 3.0, 60.0, 1000.0], 40_000)).astype(dtype)
    x = np.concatenate([special, any_bits, usual])
    return np.concatenate([x, np.zeros(-x.size % 16, dtype)])


def test_the_avx512_register_exps_give_the_polynomial_exps_bits():
    """Where numba compiles for AVX-512, the losses' ratios (clipped_exps: the clip and exp's
    saturation as one pair of bounds, vscalef, vfixupimm) and k3's float64 exp (exp64_lanes)
    give exp_poly's bits lane by lane, NaN payloads included, for every class of argument and
    clamps from 0 to none (the C twins are held to numba's bits by the kernel tests)."""
    numba = pytest.importorskip("numba")
    from ppo_fast import _numba_core
    from ppo_fast._numba_lanes import _lanes_load, _lanes_store
    from ppo_fast._numba_math import (
        EXP_FIXUP_CLAMPED,
        EXP_FIXUP_UNCLAMPED,
        clipped_exps,
        exp64_lanes,
        exp_bounds,
        exp_constants,
        exp_poly,
        exp_registers,
    )

    if not _numba_core._AVX512:
        pytest.skip("numba compiles without AVX-512 here: the register exps are not built")

    @numba.njit
    def registers(logprobs, old, clamp, out):
        low, high = exp_bounds(clamp, exp_constants(clamp))
        table = EXP_FIXUP_CLAMPED if clamp < np.inf else EXP_FIXUP_UNCLAMPED
        constants = exp_registers(out)
        for i in range(0, out.shape[0], 64 // out.itemsize):
            clipped_exps(logprobs, old, i, low, high, table, out, i, constants)

    @numba.njit
    def one_by_one(logprobs, old, clamp, out):
        for i in range(out.shape[0]):
            out[i] = exp_poly(min(max(logprobs[i] - old[i], -clamp), clamp))

    @numba.njit
    def float64_lanes(x, out):
        registers = exp_registers(0.0)
        for i in range(0, x.shape[0], 8):
            _lanes_store(out, i, exp64_lanes(_lanes_load(x, i), registers))

    @numba.njit
    def exps(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_poly(x[i])

    rng = np.random.default_rng(39)
    for dtype in (np.float32, np.float64):
        unsigned = np.uint32 if dtype == np.float32 else np.uint64
        x = _exp_arguments(dtype, rng)
        for old in (np.zeros_like(x), rng.normal(size=x.size).astype(dtype)):
            for clamp in (0.0, 0.1, 20.0, 100.0, 1e30, np.inf):
                clamp = dtype(clamp)
                got, expected = np.empty_like(x), np.empty_like(x)
                registers(x, old, clamp, got)
                one_by_one(x, old, clamp, expected)
                differ = got.view(unsigned) != expected.view(unsigned)
                assert not differ.any(), (dtype, clamp, x[differ][:5], old[differ][:5])
        if dtype == np.float64:
            got, expected = np.empty_like(x), np.empty_like(x)
            float64_lanes(x, got)
            exps(x, expected)  # a signalling NaN stays so, in both
            differ = got.view(unsigned) != expected.view(unsigned)
            assert not differ.any(), x[differ][:5]


def test_a_bool_mask_whose_bytes_are_not_0_or_1_is_its_truth(backend):
    """numpy and torch let a bool array hold bytes other than 0 and 1 (a uint8 view): every
    nonzero byte is valid, and counts say so (they once summed the bytes)."""
    rng = np.random.default_rng(11)
    logp, old, adv = (rng.normal(size=(2, 6)) for _ in range(3))
    truth = np.array([[1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 1, 0]], dtype=bool)
    bytes_of_two = (truth.astype(np.uint8) * 2).view(bool)
    for agg in AGGREGATIONS:
        expected = ppo_fast.clipped_surrogate(logp, old, adv, mask=truth, agg=agg, backend=backend)
        actual = ppo_fast.clipped_surrogate(
            logp, old, adv, mask=bytes_of_two, agg=agg, backend=backend
        )
        for name in ("loss", "clipfrac", "clipfrac_lower", "approx_kl"):
            assert getattr(actual, name) == getattr(expected, name), (agg, name)
        np.testing.assert_array_equal(actual.grad, expected.grad)
        expected = ppo_fast.value_loss(logp, old, adv, mask=truth, agg=agg, backend=backend)
        actual = ppo_fast.value_loss(logp, old, adv, mask=bytes_of_two, agg=agg, backend=backend)
        assert (actual.loss, actual.clipfrac) == (expected.loss, expected.clipfrac), agg
        np.testing.assert_array_equal(actual.grad, expected.grad)


@pytest.mark.parametrize(
    ("dtype", "value"), [(np.float64, 1e200), (np.float32, 1e20)], ids=["float64", "float32"]
)
def test_a_per_token_value_that_overflows_its_dtype_is_inf_on_every_backend(backend, dtype, value):
    """(1e200)^2 overflows float64, (1e20)^2 float32: the loss is inf, on the oracle too (it
    once raised OverflowError, and computed float32 in float64)."""
    values = np.array([[value, 1.0]], dtype=dtype)
    zeros = np.zeros_like(values)
    result = ppo_fast.value_loss(values, zeros, zeros, backend=backend)
    assert result.loss == math.inf
    assert result.grad[0, 0] == dtype(value) * dtype(0.5)  # the gradient (v - R) / n is finite


NORMALISERS = [
    ("token-mean", "num_tokens"),
    ("seq-mean-token-mean", "num_seqs"),
    ("seq-mean-token-sum", "num_seqs"),
    ("seq-mean-token-sum-norm", "loss_scale"),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_a_normaliser_whose_reciprocal_overflows_the_dtype_is_refused(backend, dtype):
    """A normaliser's reciprocal is the rows' scale: where it overflows the loss's dtype, every
    loss refuses it, naming it (the compiled kernels once wrote NaN at the masked positions, their
    0 being scale - scale, where the oracle wrote 0); twice that normaliser, the smallest whose
    scale is finite (and the common case's smallest for float32), gives the oracle's numbers, inf
    where a gradient or a loss overflows, and 0 at the masked positions."""
    largest = float(np.finfo(dtype).max)
    rng = np.random.default_rng(7)
    logp, old, adv = rng.normal(-1.0, 0.3, size=(3, 2, 9)).astype(dtype)
    mask = rng.random((2, 9)) < 0.7
    selected = rng.random((2, 9)) < 0.5
    losses = [
        functools.partial(getattr(ppo_fast, name), logp, old, adv)
        for name in (
            "clipped_surrogate",
            "value_loss",
            "cispo_loss",
            "sapo_loss",
            "dppo_loss",
            "reinforce_loss",
            "gspo_loss",
            "geo_mean_loss",
        )
    ] + [functools.partial(ppo_fast.kl_cov_loss, logp, old, adv, selected)]
    for (agg, name), loss in itertools.product(NORMALISERS, losses):
        what = f"{loss.func.__name__} {agg}"
        with pytest.raises(ValueError, match=f"{name} must be at least .* for {dtype.__name__}"):
            loss(mask=mask, agg=agg, **{name: 0.5 / largest}, backend=backend)
        smallest = {name: 2.0 / largest}
        with np.errstate(over="ignore"):  # the gradients and losses that overflow are inf
            result = loss(mask=mask, agg=agg, **smallest, backend=backend)
            oracle = loss(mask=mask, agg=agg, **smallest, backend="python")
        assert np.abs(oracle.grad[mask]).max() > largest / 100, what  # the scale is that large
        assert (result.grad[~mask] == 0).all(), what
        for field, actual, expected in zip(result._fields, result, oracle, strict=True):
            assert_matches_oracle(actual, expected, dtype, f"{what}: {field}")


def test_the_oracles_float32_rounding_is_numpys_cast_bit_for_bit():
    """The oracle rounds each per-token float32 value as numpy casts float64 to float32: doubles
    of every bit pattern and exponent, either side of float32's overflow (its largest value plus
    half an ulp and less), its subnormals, signed zeros, inf and NaN."""
    rounded = _reference.in_dtype(np.float32)
    largest = float(np.finfo(np.float32).max)
    edges = [largest, largest * (1 + 2**-25), largest * (1 + 2**-24), 1e39, 1e-45, 7e-46, 1e-46]
    edges += [np.nextafter(largest * (1 + 2**-24), 0.0), 0.0, 5e-324, math.inf, math.nan]
    rng = np.random.default_rng(7)
    values = np.concatenate(
        [
            rng.integers(0, 2**64, 50_000, dtype=np.uint64).view(np.float64),
            rng.standard_normal(50_000) * 10.0 ** rng.integers(-50, 40, 50_000),
            edges,
            np.negative(edges),
        ]
    )
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(np.float32).astype(np.float64)
    got = np.array([rounded(value) for value in values.tolist()])
    same = (got.view(np.uint64) == expected.view(np.uint64)) | (np.isnan(got) & np.isnan(expected))
    assert same.all(), values[~same][:5]
    assert _reference.in_dtype(np.float64) is float


def test_a_non_finite_log_ratio_without_a_clamp_stays_non_finite(backend):
    """old log-probs of -inf, +inf or NaN at valid positions: the ratio is inf, 0 or NaN, and
    the loss NaN or inf as IEEE arithmetic says, on every backend (the compiled ones once
    saturated exp and returned finite numbers)."""
    logp = np.array([[-1.0, -1.0, -1.0, -1.0]])
    for old_value in (-np.inf, np.inf, np.nan):
        for advantage in (1.0, -1.0):
            old = np.array([[-1.2, old_value, -0.9, -1.0]])
            adv = np.full((1, 4), advantage)
            oracle = ppo_fast.clipped_surrogate(logp, old, adv, backend="python")
            actual = ppo_fast.clipped_surrogate(logp, old, adv, backend=backend)
            case = (old_value, advantage)
            for name in ("loss", "approx_kl", "clipfrac"):
                want, got = getattr(oracle, name), getattr(actual, name)
                np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"{name} {case}")
            np.testing.assert_allclose(actual.grad, oracle.grad, rtol=1e-12, err_msg=str(case))
    # A ratio of inf on a bad token: the loss is inf (the compiled backends once gave 4.1e307).
    bad_token = ppo_fast.clipped_surrogate(
        logp, np.array([[-1.0, -np.inf, -1.0, -1.0]]), np.full((1, 4), -1.0), backend=backend
    )
    assert bad_token.loss == math.inf


# Each public policy loss with its own settings (those of clip_cov_loss and kl_cov_loss select
# every token), called on (logprobs, old_logprobs, advantages, backend=...).
_FAMILY = {
    "clipped_surrogate": lambda *a, **k: ppo_fast.clipped_surrogate(*a, clip_high=np.inf, **k),
    "dual_clip": lambda *a, **k: ppo_fast.clipped_surrogate(*a, dual_clip=3.0, **k),
    "cispo": lambda *a, **k: ppo_fast.cispo_loss(*a, clip_high=np.inf, **k),
    "sapo": ppo_fast.sapo_loss,
    "gspo": ppo_fast.gspo_loss,
    "gspo_sequence": lambda *a, **k: ppo_fast.gspo_loss(*a, form="sequence", **k),
    "geo_mean": ppo_fast.geo_mean_loss,
    "dppo": ppo_fast.dppo_loss,
    "reinforce": ppo_fast.reinforce_loss,
    "clip_cov": lambda lp, *a, **k: ppo_fast.clip_cov_loss(lp, *a, np.ones(lp.shape, bool), **k),
    "kl_cov": lambda lp, *a, **k: ppo_fast.kl_cov_loss(lp, *a, np.ones(lp.shape, bool), **k),
}


@pytest.mark.parametrize("loss", sorted(_FAMILY))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_log_ratio_past_exps_range_gives_the_oracles_numbers(compiled_backend, loss, dtype):
    """A token whose log-ratio is just past the range where exp is finite in the dtype (or far
    past it), of either sign, with an advantage of either sign, in a row of its own beside a row
    of usual tokens: every compiled backend equals the oracle, whose exp saturates as the
    kernels' does (README, "Non-finite values"). The clipped surrogate's oracle once took
    exp(710) as inf where the kernels took exp(709). One such token a batch, so that no sum
    depends on its order (two saturated ratios of opposite signs would cancel)."""
    edge = 88.5 if dtype == np.float32 else 710.0
    usual = np.array([0.5, -0.25, 0.1, 0.0, -0.3, 0.2, 0.05, -0.1, 0.15, -0.2, 0.3], dtype)
    mask = np.ones((2, usual.size), bool)
    mask[0, 1:] = False  # the first row's token alone: a sequence loss's row mean is its ratio
    rtol = RTOL[np.dtype(dtype)]
    for log_ratio, sign in itertools.product([edge, -edge - 40.0, 1e30, -1e30], [1.0, -1.0]):
        old = np.full((2, usual.size), -1.0, dtype)
        logp = (old + np.stack([np.full(usual.size, log_ratio, dtype), usual])).astype(dtype)
        advantages = np.stack([np.full(usual.size, sign), np.linspace(0.2, 1.2, usual.size)])
        inputs = (logp, old, advantages.astype(dtype))
        with np.errstate(all="ignore"):
            oracle = _FAMILY[loss](*inputs, mask=mask, backend="python")
            actual = _FAMILY[loss](*inputs, mask=mask, backend=compiled_backend)
        case = f"log-ratio {log_ratio:g}, advantage {sign:g}"
        for name in ("loss", "clipfrac", "clipfrac_lower", "approx_kl"):
            want, got = getattr(oracle, name), getattr(actual, name)
            assert math.isfinite(want) == math.isfinite(got), (name, case, want, got)
            np.testing.assert_allclose(got, want, rtol=rtol, err_msg=f"{name}, {case}")
        same_finite = np.isfinite(actual.grad) == np.isfinite(oracle.grad)
        assert same_finite.all(), (case, actual.grad, oracle.grad)
        np.testing.assert_allclose(actual.grad, oracle.grad, rtol=rtol, err_msg=case)


# --------------------------------------------------------------------------------------------
# Hostile input specific to the losses (the shared checks are in test_validate.py).

X = np.zeros((2, 3))


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"dual_clip": 1.0}, ValueError, r"dual_clip must lie in \(1"),
        ({"dual_clip": 0.5}, ValueError, "dual_clip must lie in"),
        ({"clip_low": -0.1}, ValueError, "clip_low must lie in"),
        ({"clip_low": 1.5}, ValueError, "clip_low must lie in"),
        ({"clip_high": -0.2}, ValueError, "clip_high must lie in"),
        ({"clip_low": float("nan")}, ValueError, "clip_low must be a number, got nan"),
        ({"log_ratio_clamp": 0.0}, ValueError, "log_ratio_clamp must lie in"),
        ({"agg": "mean"}, ValueError, "agg must be one of"),
        ({"num_tokens": 0}, ValueError, "num_tokens must lie in"),
        ({"num_tokens": -5}, ValueError, "num_tokens must lie in"),
        ({"agg": "seq-mean-token-mean", "num_seqs": 0}, ValueError, "num_seqs must lie in"),
        ({"agg": "seq-mean-token-sum-norm", "loss_scale": 0}, ValueError, "loss_scale must lie in"),
        ({"agg": "seq-mean-token-mean", "num_tokens": 5}, ValueError, "num_tokens applies to"),
        ({"num_seqs": 5}, ValueError, "num_seqs applies to"),
        ({"loss_scale": 5}, ValueError, "loss_scale applies to"),
        ({"weights": np.ones((2, 4))}, ValueError, "weights has shape"),
        ({"weights": np.ones((2, 3), dtype=np.float32)}, TypeError, "weights is float32"),
    ],
)
def test_bad_loss_arguments(backend, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ppo_fast.clipped_surrogate(X, X, X, **kwargs, backend=backend)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"clip": -0.1}, ValueError, "clip must lie in"),
        ({"agg": "sum"}, ValueError, "agg must be one of"),
        ({"num_tokens": 0.0}, ValueError, "num_tokens must lie in"),
    ],
)
def test_bad_value_loss_arguments(backend, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ppo_fast.value_loss(X, X, X, **kwargs, backend=backend)


def test_loss_inputs_are_never_modified(backend, dtype):
    rng = np.random.default_rng(13)
    arrays = [rng.normal(size=(3, 8)).astype(dtype) for _ in range(4)]
    mask = rng.random((3, 8)) < 0.5
    for array in [*arrays, mask]:
        array.flags.writeable = False
    before = [a.copy() for a in [*arrays, mask]]
    ppo_fast.clipped_surrogate(
        arrays[0],
        arrays[1],
        arrays[2],
        weights=arrays[3],
        mask=mask,
        dual_clip=2.0,
        backend=backend,
    )
    ppo_fast.value_loss(
        arrays[0][:, ::2],
        arrays[1][:, ::2],
        arrays[2][:, ::2],
        clip=0.1,
        mask=mask[:, ::2],
        backend=backend,
    )
    for array, snapshot in zip([*arrays, mask], before, strict=True):
        np.testing.assert_array_equal(array, snapshot)


@pytest.mark.parametrize("width", [COUNT_BY_ROW - 1, COUNT_BY_ROW], ids=["by-axis", "by-row"])
def test_valid_counts_are_numpys_count_of_nonzero_bytes_both_ways(width):
    rng = np.random.default_rng(4)
    # Bool bytes other than 0/1 are valid too; a fully masked row counts 0.
    mask = (rng.integers(0, 3, (5, width)).astype(np.uint8) * 100).view(bool)
    mask[2] = False
    rows = _validate.rows(mask.shape, mask=mask)
    counts = rows.valid_counts
    expected = np.count_nonzero(mask.view(np.uint8), axis=1)
    assert counts.dtype == expected.dtype and np.array_equal(counts, expected)
