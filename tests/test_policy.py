"""The policy-loss family (ppo_fast.policy): each loss against an independent NumPy formula on
every backend, finite differences, identities with PPO's clipped surrogate, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

import ppo_fast

LOSSES = ("reinforce", "dro", "cispo", "sapo")


def batch(seed: int, dtype=np.float64, shape=(5, 13)):
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-3.0, 0.0, shape)
    old = logp + rng.normal(0.0, 0.3, shape)
    advantages = rng.normal(size=shape)
    weights = rng.uniform(0.0, 2.0, shape)
    mask = rng.random(shape) < 0.75
    mask[0] = False  # a row without a valid token
    mask[1, 1] = False  # a hole
    return [a.astype(dtype) for a in (logp, old, advantages, weights)] + [mask]


def call(loss: str, logp, old, advantages, **options):
    """The public function for ``loss``, with settings that make each of its branches active."""
    if loss in ("reinforce", "dro"):
        return ppo_fast.reinforce_loss(
            logp, old, advantages, beta=0.0 if loss == "reinforce" else 0.7, **options
        )
    if loss == "cispo":
        return ppo_fast.cispo_loss(
            logp, old, advantages, clip_low=0.1, clip_high=0.15, log_ratio_clamp=0.4, **options
        )
    return ppo_fast.sapo_loss(
        logp, old, advantages, tau_pos=1.3, tau_neg=0.6, log_ratio_clamp=0.4, **options
    )


def reference(loss: str, logp, old, advantages, weights, mask, agg):
    """(loss, grad, clipfrac, clipfrac_lower, approx_kl) from the formulas, in float64 NumPy."""
    logp, old, a, w = (x.astype(np.float64) for x in (logp, old, advantages, weights))
    raw = logp - old
    if loss in ("reinforce", "dro"):
        beta = 0.0 if loss == "reinforce" else 0.7
        per_token = -w * (a * logp - beta / 2 * raw**2)
        slope = -w * (a - beta * raw)
        log_ratio = raw
        clipped = lower = np.zeros_like(raw, dtype=bool)
    elif loss == "cispo":
        log_ratio = np.clip(raw, -0.4, 0.4)
        ratio = np.exp(log_ratio)
        coefficient = np.clip(ratio, 0.9, 1.15)
        per_token = -w * coefficient * a * logp
        slope = -w * coefficient * a
        clipped, lower = coefficient != ratio, ratio < 0.9
    else:
        log_ratio = np.clip(raw, -0.4, 0.4)
        ratio = np.exp(log_ratio)
        tau = np.where(a > 0, 1.3, 0.6)
        s = 1.0 / (1.0 + np.exp(-tau * (ratio - 1.0)))
        per_token = -w * s * 4.0 / tau * a
        slope = np.where(np.abs(raw) <= 0.4, -w * a * 4.0 * s * (1.0 - s) * ratio, 0.0)
        clipped = lower = np.zeros_like(raw, dtype=bool)
    counts = mask.sum(axis=1)
    if agg == "token-mean":
        scales = np.full(mask.shape[0], 1.0 / counts.sum())
    else:  # seq-mean-token-mean over the rows with a valid token
        seqs = np.count_nonzero(counts)
        scales = np.where(counts > 0, 1.0 / (seqs * np.maximum(counts, 1)), 0.0)
    total = float(np.sum(np.where(mask, per_token, 0.0) * scales[:, None]))
    grad = np.where(mask, slope * scales[:, None], 0.0)
    n = mask.sum()
    stats = [float(x[mask].sum() / n) for x in (clipped, lower, -log_ratio)]
    return total, grad, *stats


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_each_loss_equals_its_formula(backend, dtype, loss, agg, weighted):
    logp, old, advantages, weights, mask = batch(3, dtype)
    options = {"mask": mask, "agg": agg, "backend": backend}
    if weighted:
        options["weights"] = weights
    result = call(loss, logp, old, advantages, **options)
    expected = reference(
        loss, logp, old, advantages, weights if weighted else np.ones_like(logp), mask, agg
    )
    tolerance = 1e-12 if dtype == np.float64 else 2e-6
    assert result.loss == pytest.approx(expected[0], rel=tolerance, abs=tolerance)
    assert result.grad.dtype == dtype
    np.testing.assert_allclose(result.grad, expected[1], rtol=tolerance, atol=tolerance)
    assert result.clipfrac == pytest.approx(expected[2], abs=1e-12)
    assert result.clipfrac_lower == pytest.approx(expected[3], abs=1e-12)
    assert result.approx_kl == pytest.approx(expected[4], rel=tolerance, abs=tolerance)
    if loss == "cispo":
        assert 0 < result.clipfrac_lower < result.clipfrac < 1  # both bounds active here


@pytest.mark.parametrize("loss", LOSSES)
def test_gradient_equals_finite_differences(loss):
    logp, old, advantages, weights, mask = batch(4)
    result = call(loss, logp, old, advantages, mask=mask, weights=weights)
    step = 1e-6
    for b, t in zip(*np.nonzero(mask), strict=True):
        if loss in ("cispo", "sapo") and abs(abs(logp[b, t] - old[b, t]) - 0.4) < 1e-4:
            continue  # at the clamp's kink
        up, down = logp.copy(), logp.copy()
        up[b, t] += step
        down[b, t] -= step
        difference = (
            call(loss, up, old, advantages, mask=mask, weights=weights).loss
            - call(loss, down, old, advantages, mask=mask, weights=weights).loss
        ) / (2 * step)
        if loss == "cispo":
            # The clipped ratio is held constant (a stop-gradient), which finite differences
            # do not: they see the ratio move. Take out its share, -w * A * logp * d clip(rho).
            ratio = math.exp(float(np.clip(logp[b, t] - old[b, t], -0.4, 0.4)))
            sloped = 0.9 < ratio < 1.15 and abs(logp[b, t] - old[b, t]) < 0.4
            n = mask.sum()
            difference -= -weights[b, t] * advantages[b, t] * logp[b, t] * ratio * sloped / n
        assert result.grad[b, t] == pytest.approx(difference, rel=1e-6, abs=1e-9), (b, t)


def test_sapo_and_ppo_have_the_same_gradient_at_ratio_one():
    """The gate's slope at rho = 1 is 1: on-policy, SAPO's gradient is PPO's (and REINFORCE's
    with the ratio, -A)."""
    logp, _, advantages, weights, mask = batch(5)
    sapo = ppo_fast.sapo_loss(logp, logp, advantages, mask=mask, weights=weights)
    ppo = ppo_fast.clipped_surrogate(logp, logp, advantages, mask=mask, weights=weights)
    np.testing.assert_allclose(sapo.grad, ppo.grad, rtol=1e-12, atol=1e-15)
    cispo = ppo_fast.cispo_loss(logp, logp, advantages, mask=mask, weights=weights)
    np.testing.assert_allclose(cispo.grad, ppo.grad, rtol=1e-12, atol=1e-15)


def test_cispo_without_bounds_is_reinforce_weighted_by_the_ratio():
    logp, old, advantages, _, mask = batch(6)
    cispo = ppo_fast.cispo_loss(logp, old, advantages, mask=mask, clip_low=1.0, clip_high=math.inf)
    ratio = np.exp(logp - old)
    reinforce = ppo_fast.reinforce_loss(logp, old, advantages, mask=mask, weights=ratio)
    assert cispo.loss == pytest.approx(reinforce.loss, rel=1e-12)
    np.testing.assert_allclose(cispo.grad, reinforce.grad, rtol=1e-12, atol=1e-15)
    assert cispo.clipfrac == 0.0


@pytest.mark.parametrize("loss", LOSSES)
def test_packed_rows_and_lengths_equal_the_padded_batch(loss):
    logp, old, advantages, weights, _ = batch(7)
    lengths = np.array([0, 13, 4, 1, 9])
    mask = np.arange(13) < lengths[:, None]
    padded = call(loss, logp, old, advantages, mask=mask, weights=weights)
    by_lengths = call(loss, logp, old, advantages, lengths=lengths, weights=weights)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    packed = call(
        loss, logp[mask], old[mask], advantages[mask], cu_seqlens=cu, weights=weights[mask]
    )
    for other in (by_lengths, packed):
        assert other.loss == pytest.approx(padded.loss, rel=1e-12)
        assert other[2:] == pytest.approx(padded[2:], rel=1e-12)
    np.testing.assert_array_equal(by_lengths.grad, padded.grad)
    np.testing.assert_array_equal(packed.grad, padded.grad[mask])


@pytest.mark.parametrize("loss", LOSSES)
def test_no_valid_token_gives_zero_loss_and_nan_statistics(loss):
    logp, old, advantages, _, _ = batch(8)
    result = call(loss, logp, old, advantages, mask=np.zeros(logp.shape, bool))
    assert result.loss == 0.0
    assert not result.grad.any()
    assert all(math.isnan(x) for x in result[2:])


def test_beta_zero_leaves_an_infinite_log_ratio_out_of_the_loss(monkeypatch):
    """GPG / REINFORCE never reads the ratio: an inf old log-prob changes only approx_kl."""
    logp, old, advantages, _, mask = batch(9)
    old[2, :] = -np.inf
    result = ppo_fast.reinforce_loss(logp, old, advantages, mask=mask)
    assert np.isfinite(result.loss) and np.isfinite(result.grad).all()
    assert result.approx_kl == -np.inf
    # the torch twin on both of its paths (kernels; torch arithmetic, as for another device)
    torch = pytest.importorskip("torch")
    import ppo_fast.torch as pft

    tensors = [torch.tensor(a) for a in (logp, old, advantages, mask)]
    for forced in (False, True):
        monkeypatch.setattr(pft, "_DEVICE_PATH_ON_CPU", forced)
        twin = pft.reinforce_loss(*tensors[:3], mask=tensors[3])
        assert torch.isfinite(twin.loss), forced
        assert twin.loss.item() == pytest.approx(result.loss, rel=1e-12), forced


def test_grad_out_is_written_and_returned():
    logp, old, advantages, _, mask = batch(10)
    out = np.full_like(logp, np.nan)
    result = ppo_fast.cispo_loss(logp, old, advantages, mask=mask, grad_out=out)
    assert result.grad is out
    np.testing.assert_array_equal(out, ppo_fast.cispo_loss(logp, old, advantages, mask=mask).grad)


@pytest.mark.parametrize(
    ("function", "option", "value", "message"),
    [
        (ppo_fast.sapo_loss, "tau_pos", 0.0, "tau_pos must"),
        (ppo_fast.sapo_loss, "tau_neg", -1.0, "tau_neg must"),
        (ppo_fast.sapo_loss, "tau_pos", math.inf, "tau_pos must"),
        (ppo_fast.sapo_loss, "tau_neg", math.nan, "tau_neg must"),
        (ppo_fast.cispo_loss, "clip_low", -0.1, "clip_low must"),
        (ppo_fast.cispo_loss, "clip_low", 1.5, "clip_low must"),
        (ppo_fast.cispo_loss, "clip_high", -0.2, "clip_high must"),
        (ppo_fast.cispo_loss, "log_ratio_clamp", 0.0, "log_ratio_clamp must"),
        (ppo_fast.reinforce_loss, "beta", -0.5, "beta must"),
        (ppo_fast.reinforce_loss, "beta", math.inf, "beta must"),
        (ppo_fast.reinforce_loss, "agg", "mean", "agg must"),
    ],
)
def test_bad_settings_are_errors_naming_them(function, option, value, message):
    logp, old, advantages, _, mask = batch(11)
    with pytest.raises(ValueError, match=message):
        function(logp, old, advantages, mask=mask, **{option: value})


def test_a_selection_of_the_wrong_shape_is_an_error_naming_it():
    logp, old, advantages, weights, mask = batch(12)
    with pytest.raises(ValueError, match="weights"):
        ppo_fast.cispo_loss(logp, old, advantages, mask=mask, weights=weights[:, :4])
    with pytest.raises(ValueError, match="mask"):
        ppo_fast.sapo_loss(logp, old, advantages, mask=mask[:3])


def _verl_config_defaults() -> dict[str, float]:
    """The float defaults of verl 0.9.1's PolicyLossConfig and ActorConfig, read from its source
    (importing verl's configs takes seconds)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed (pip install 'ppo_fast[compat-test]')")
    path = f"{spec.submodule_search_locations[0]}/workers/config/actor.py"
    with open(path) as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in ("PolicyLossConfig", "ActorConfig"):
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.value, ast.Constant)
                    and isinstance(item.value.value, float)
                ):
                    defaults[item.target.id] = item.value.value
    return defaults


def test_the_family_defaults_are_verls():
    """Each default is what verl 0.9.1's function takes when its config has none (read from
    the verbatim copy of its core_algos.py), else its config's default; each ppo_fast.torch
    twin has the same."""
    import inspect
    import re

    import ppo_fast.torch as pft
    from ppo_fast._peers import verl_0_9_1

    source = inspect.getsource(verl_0_9_1)
    fallbacks = {
        name: float(value)
        for name, value in re.findall(
            r"(\w+) = \(?\s*config\.policy_loss\.\1\s+if config\.policy_loss\.\1 is not None"
            r"\s+else ([0-9.]+)",
            source,
        )
    }
    (cap,) = re.findall(r'clip_ratio_c = config\.get\("clip_ratio_c", ([0-9.]+)\)', source)[:1]
    config = _verl_config_defaults()

    def default(function, name):
        return inspect.signature(function).parameters[name].default

    expected = [
        (ppo_fast.sapo_loss, "tau_pos", config["tau_pos"]),
        (ppo_fast.sapo_loss, "tau_neg", config["tau_neg"]),
        (ppo_fast.dppo_loss, "divergence_low", config["clip_ratio_low"]),
        (ppo_fast.dppo_loss, "ratio_cap", float(cap)),
        (ppo_fast.kl_cov_loss, "coef", fallbacks["ppo_kl_coef"]),
        (ppo_fast.kl_cov_selection, "ratio", fallbacks["kl_cov_ratio"]),
        (ppo_fast.clip_cov_selection, "ratio", fallbacks["clip_cov_ratio"]),
        (ppo_fast.clip_cov_selection, "lower", fallbacks["clip_cov_lb"]),
        (ppo_fast.clip_cov_selection, "upper", fallbacks["clip_cov_ub"]),
        # verl passes its clip_ratio_low; the default is the GMPO paper's, as documented
        (ppo_fast.geo_mean_loss, "clip_low", 0.4),
    ]
    for function, name, value in expected:
        assert default(function, name) == value, (function.__name__, name)
        twin = getattr(pft, function.__name__)
        assert default(twin, name) == value, ("ppo_fast.torch", function.__name__, name)


def test_every_loss_of_the_family_documents_its_own_and_the_shared_parameters():
    from ppo_fast import policy

    own = {
        "reinforce_loss": "beta",
        "cispo_loss": "clip_low, clip_high",
        "sapo_loss": "tau_pos, tau_neg",
        "gspo_loss": "clip_low, clip_high",
        "geo_mean_loss": "clip_low, clip_high",
        "dppo_loss": "divergence_low, divergence_high",
        "kl_cov_loss": "coef",
        "clip_cov_loss": "selected",
    }
    for name, parameter in own.items():
        doc = getattr(policy, name).__doc__
        summary = doc.splitlines()[0]
        assert summary and not summary.startswith(" "), name  # its own first line
        parameters = doc.partition("    Parameters\n    ----------\n")[2]
        assert f"\n    {parameter}\n" in f"\n{parameters}", name  # its own parameters
        assert policy._COMMON.strip() in doc, name  # and the family's shared ones
        assert doc.count("    Parameters\n    ----------\n") == 1, name
    # the torch twins: the NumPy function's text and the torch note (autograd, devices)
    import ppo_fast.torch as pft

    for name in set(own) - {"clip_cov_loss"}:  # Clip-Cov in torch: clipped_surrogate's weights
        doc = getattr(pft, name).__doc__
        assert pft._FAMILY_DOC.strip() in doc, f"ppo_fast.torch.{name}"
