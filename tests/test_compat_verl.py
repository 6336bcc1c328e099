"""ppo_fast.compat.verl equals verl 0.9.1: the real package where it imports, else the verbatim
copy in tests/peers (the test ids say which: verl-0.9.1-real or verl-0.9.1-copy)."""

from __future__ import annotations

import warnings

import peers
import pytest
import torch
from peers.cases import MASKS, RTOL, assert_parity, assert_same_arguments, batch

from ppo_fast.compat import verl as compat

PEER = peers.verl()
VERL = PEER.api
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
KINDS = pytest.mark.parametrize("kind", MASKS)


def test_peer_is_named_in_the_ids():
    assert PEER.label in ("verl-0.9.1-real", "verl-0.9.1-copy")


@pytest.mark.parametrize("peer", [PEER.label])
@KINDS
@DTYPES
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
@pytest.mark.parametrize(
    "mask_dtype", [torch.int64, torch.bool, torch.float32, torch.float64], ids=str
)
def test_gae_advantage_return(peer, kind, dtype, gamma, lam, mask_dtype):
    b = batch(kind, dtype)
    mask = b.mask.to(mask_dtype)
    # verl's loop computes 1 - response_mask, which torch refuses for bool: its int64 mask's
    # results stand for the bool mask's (the results' dtype follows a floating mask's)
    verl_mask = b.mask if mask_dtype == torch.bool else mask
    expected = VERL.compute_gae_advantage_return(b.rewards, b.values, verl_mask, gamma, lam)
    actual = compat.compute_gae_advantage_return(b.rewards, b.values, mask, gamma, lam)
    assert isinstance(actual, tuple) and len(actual) == 2
    # Every position, masked ones included: verl leaves the carried advantage there. Judged at
    # the inputs' precision: with a float64 mask verl's results are float64, but its last
    # step's delta is a float32 sum of float32 inputs (ours: every step in float64).
    rtol = RTOL[dtype]
    assert_parity(actual[0], expected[0], f"{peer} advantages", rtol=rtol)
    assert_parity(actual[1], expected[1], f"{peer} returns", rtol=rtol)


@pytest.mark.parametrize("peer", [PEER.label])
@pytest.mark.parametrize(
    "mask_dtype", [torch.int64, torch.bool, torch.float32, torch.float64], ids=str
)
@KINDS
@DTYPES
def test_masked_moments_and_whitening(peer, mask_dtype, kind, dtype):
    b = batch(kind, dtype, seed=3)
    mask = b.mask.to(mask_dtype)
    x = b.advantages * 3.0 + 5.0
    for axis in (None, -1):
        assert_parity(
            compat.masked_sum(x, mask, axis), VERL.masked_sum(x, mask, axis), f"{peer} sum"
        )
        assert_parity(
            compat.masked_mean(x, mask, axis), VERL.masked_mean(x, mask, axis), f"{peer} mean"
        )
    # At the values' precision: a float64 mask makes verl's variance float64, but its deviations
    # from the mean (values - mean, a 0-d mean) stay in the values' dtype.
    rtol = RTOL[dtype]
    for unbiased in (True, False):
        assert_parity(
            compat.masked_var(x, mask, unbiased),
            VERL.masked_var(x, mask, unbiased),
            f"{peer} var unbiased={unbiased}",
            rtol=rtol,
        )
    for shift_mean in (True, False):
        assert_parity(
            compat.masked_whiten(x, mask, shift_mean),
            VERL.masked_whiten(x, mask, shift_mean),
            f"{peer} whiten shift_mean={shift_mean}",
            rtol=rtol,
        )


@pytest.mark.parametrize("peer", [PEER.label])
def test_whitening_follows_autograd_when_differentiated(peer):
    b = batch("holes", torch.float64)
    x_actual = b.advantages.clone().requires_grad_()
    x_expected = b.advantages.clone().requires_grad_()
    weights = torch.linspace(-1.0, 1.0, b.advantages.numel(), dtype=torch.float64)
    (compat.masked_whiten(x_actual, b.mask).reshape(-1) * weights).sum().backward()
    (VERL.masked_whiten(x_expected, b.mask).reshape(-1) * weights).sum().backward()
    assert_parity(x_actual.grad, x_expected.grad, f"{peer} d whiten")


@pytest.mark.parametrize("peer", [PEER.label])
@pytest.mark.parametrize("valid", [0, 1])
def test_unbiased_whitening_of_fewer_than_two_tokens_raises_as_verl(peer, valid):
    x = torch.randn(2, 4)
    mask = torch.zeros(2, 4, dtype=torch.int64)
    mask[1, :valid] = 1
    with pytest.raises(ValueError) as expected:
        VERL.masked_whiten(x, mask)
    with pytest.raises(ValueError) as actual:
        compat.masked_whiten(x, mask)
    assert str(actual.value) == str(expected.value)
    with pytest.raises(ValueError, match=r"has to be 1|is one"):
        compat.compute_gae_advantage_return(x, x, mask, 1.0, 1.0)


@pytest.mark.parametrize("peer", [PEER.label])
@pytest.mark.parametrize(
    "estimator",
    ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+", "k2+"],
)
@DTYPES
def test_kl_penalty_values_and_gradients(peer, estimator, dtype):
    b = batch("holes", dtype, seed=5)
    logp_actual = b.logprobs.clone().requires_grad_()
    logp_expected = b.logprobs.clone().requires_grad_()
    actual = compat.kl_penalty(logp_actual, b.ref_logprobs, estimator)
    expected = VERL.kl_penalty(logp_expected, b.ref_logprobs, estimator)
    assert_parity(actual, expected, f"{peer} {estimator}")
    actual.sum().backward()
    expected.sum().backward()
    assert_parity(logp_actual.grad, logp_expected.grad, f"{peer} d {estimator}")
    rewards = compat.compute_rewards(b.rewards, b.old_logprobs, b.ref_logprobs, 0.05)
    assert_parity(
        rewards, VERL.compute_rewards(b.rewards, b.old_logprobs, b.ref_logprobs, 0.05), "rewards"
    )


def test_kl_penalty_full_is_not_implemented_either():
    with pytest.raises(NotImplementedError):
        compat.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "full")


def _global_args(mode: str, b) -> list[dict]:
    tokens = float(b.mask.sum())
    seqs = float((b.mask.sum(-1) > 0).sum())
    return [
        {},
        {"dp_size": 2, "batch_num_tokens": 2 * tokens + 3, "global_batch_size": 2 * seqs + 1},
        {"dp_size": 4, "batch_num_tokens": torch.tensor(3 * tokens), "global_batch_size": 9},
        {"loss_scale_factor": 64} if mode == "seq-mean-token-sum-norm" else {"dp_size": 1},
    ]


@pytest.mark.parametrize("peer", [PEER.label])
@pytest.mark.parametrize("mode", AGG_MODES)
@KINDS
def test_agg_loss(peer, mode, kind):
    b = batch(kind)
    for arguments in _global_args(mode, b):
        loss_actual = b.advantages.clone().requires_grad_()
        loss_expected = b.advantages.clone().requires_grad_()
        actual = compat.agg_loss(loss_actual, b.mask, mode, **arguments)
        expected = VERL.agg_loss(loss_expected, b.mask, mode, **arguments)
        assert_parity(actual, expected, f"{peer} {mode} {arguments}")
        actual.backward()
        expected.backward()
        assert_parity(loss_actual.grad, loss_expected.grad, f"{peer} d {mode} {arguments}")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_global_counts_are_required_with_several_ranks(mode):
    b = batch("holes")
    with pytest.raises(ValueError, match="required when dp_size > 1"):
        compat.agg_loss(b.advantages, b.mask, mode, dp_size=2)
    config = PEER.make_config(global_batch_info={"dp_size": 2})
    with pytest.raises(ValueError, match="required when dp_size > 1"):
        compat.compute_policy_loss_vanilla(
            b.old_logprobs, b.logprobs, b.advantages, b.mask, mode, config
        )
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        compat.compute_value_loss(b.values, b.returns, b.old_values, b.mask, 0.2, "token-median")


CLIPS = [
    {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0},
    {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0},
    {"clip_ratio": 0.3, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 1.5},
]


@pytest.mark.parametrize("peer", [PEER.label])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip", range(len(CLIPS)))
@KINDS
@DTYPES
def test_policy_loss_vanilla(peer, mode, clip, kind, dtype):
    b = batch(kind, dtype, seed=7)
    weights = torch.rand(b.logprobs.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    for arguments, is_weights in zip(_global_args(mode, b)[:2], (None, weights), strict=True):
        config = PEER.make_config(**CLIPS[clip], global_batch_info=arguments)
        outputs = []
        for function in (compat.compute_policy_loss_vanilla, VERL.compute_policy_loss_vanilla):
            logp = b.logprobs.clone().requires_grad_()
            loss, metrics = function(
                b.old_logprobs, logp, b.advantages, b.mask, mode, config, is_weights
            )
            loss.backward()
            outputs.append((loss, metrics, logp.grad))
        (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = outputs
        what = f"{peer} {mode} {CLIPS[clip]} {arguments} weights={is_weights is not None}"
        assert_parity(loss, loss_ref, what)
        assert_parity(grad, grad_ref, f"d {what}")
        assert metrics.keys() == metrics_ref.keys()
        for key in metrics:
            assert_parity(metrics[key], metrics_ref[key], f"{what} {key}", dtype)


@pytest.mark.parametrize("peer", [PEER.label])
@pytest.mark.parametrize("mode", AGG_MODES)
@KINDS
def test_policy_loss_tuple_form_and_its_warning(peer, mode, kind):
    b = batch(kind, seed=11)
    results, messages = [], []
    for function in (compat.compute_policy_loss, VERL.compute_policy_loss):
        logp = b.logprobs.clone().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = function(b.old_logprobs, logp, b.advantages, b.mask, 0.2, None, 0.3, 2.0, mode)
        result[0].backward()
        results.append((result, logp.grad))
        # The copy's module is ppo_fast._peers.verl_0_9_1; verl names its own.
        messages.append(
            [
                (
                    w.category,
                    str(w.message).replace(
                        peers.verl_0_9_1.__name__, "verl.trainer.ppo.core_algos"
                    ),
                    w.filename,  # verl's points at its caller: this file
                )
                for w in caught
            ]
        )
    (actual, grad), (expected, grad_ref) = results
    assert messages[0] == messages[1] and messages[0][0][0] is FutureWarning
    assert messages[0][0][2] == __file__
    assert isinstance(actual, tuple) and len(actual) == 4
    names = ("pg_loss", "clipfrac", "ppo_kl", "clipfrac_lower")
    for name, a, e in zip(names, actual, expected, strict=True):
        assert_parity(a, e, f"{peer} {mode} {name}")
    assert float(expected[3]) > 0, "the batch must take the dual clip somewhere"
    assert_parity(grad, grad_ref, f"{peer} {mode} d pg_loss")


@pytest.mark.parametrize("peer", [PEER.label])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("cliprange_value", [0.2, 0.5, 100.0])
@KINDS
@DTYPES
def test_value_loss(peer, mode, cliprange_value, kind, dtype):
    b = batch(kind, dtype, seed=13)
    for arguments in _global_args(mode, b):
        results = []
        for function in (compat.compute_value_loss, VERL.compute_value_loss):
            vpreds = b.values.clone().requires_grad_()
            # verl's order: predictions, returns, old values.
            loss, clipfrac = function(
                vpreds, b.returns, b.old_values, b.mask, cliprange_value, mode, **arguments
            )
            loss.backward()
            results.append((loss, clipfrac, vpreds.grad))
        (loss, clipfrac, grad), (loss_ref, clipfrac_ref, grad_ref) = results
        what = f"{peer} {mode} c={cliprange_value} {arguments}"
        assert_parity(loss, loss_ref, what)
        assert_parity(clipfrac, clipfrac_ref, f"{what} clipfrac")
        assert_parity(grad, grad_ref, f"d {what}")


@pytest.mark.parametrize("peer", [PEER.label])
def test_losses_of_an_all_masked_batch_match(peer):
    b = batch("holes")
    mask = torch.zeros_like(b.mask)
    config = PEER.make_config()
    loss, metrics = compat.compute_policy_loss_vanilla(
        b.old_logprobs, b.logprobs, b.advantages, mask, "seq-mean-token-mean", config
    )
    loss_ref, metrics_ref = VERL.compute_policy_loss_vanilla(
        b.old_logprobs, b.logprobs, b.advantages, mask, "seq-mean-token-mean", config
    )
    assert (
        metrics
        == metrics_ref
        == {
            "actor/pg_clipfrac": 0.0,
            "actor/ppo_kl": 0.0,
            "actor/pg_clipfrac_lower": 0.0,
        }
    )
    assert torch.isnan(loss) and torch.isnan(loss_ref)  # 0 / 0 sequences, as verl


@pytest.mark.parametrize("peer", [PEER.label])
def test_kl_controllers(peer):
    actual = compat.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    expected = VERL.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    for current_kl, n_steps in [(1.0, 256), (12.0, 256), (6.5, 1024), (0.0, 64)]:
        actual.update(current_kl, n_steps)
        expected.update(current_kl, n_steps)
        assert actual.value == expected.value
    fixed = compat.FixedKLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == VERL.FixedKLController(0.1).value == 0.1
    controller = compat.get_kl_controller(
        type("KLConfig", (), {"type": "adaptive", "kl_coef": 0.1, "target_kl": 2.0, "horizon": 5})
    )
    assert isinstance(controller, compat.AdaptiveKLController) and controller.target == 2.0


def test_the_fused_loss_refuses_to_drop_a_gradient():
    b = batch("holes")
    with pytest.raises(ValueError, match="advantages requires grad"):
        compat.compute_policy_loss_vanilla(
            b.old_logprobs,
            b.logprobs.requires_grad_(),
            b.advantages.requires_grad_(),
            b.mask,
            "token-mean",
            PEER.make_config(),
        )


@pytest.mark.parametrize("name", [n for n in compat.__all__ if callable(getattr(compat, n))])
def test_the_api_takes_the_peers_arguments_and_defaults(name):
    assert_same_arguments(getattr(compat, name), getattr(VERL, name), f"{PEER.label} {name}")
