"""ppo_fast.compat.openrlhf equals OpenRLHF 0.11.2, through the verbatim copy in tests/peers
(OpenRLHF's package cannot be imported here: it imports deepspeed, peft and flash-attn; the copy
is held to OpenRLHF's source by tests/test_compat_peer_copies.py). Ids say openrlhf-0.11.2-copy."""

from __future__ import annotations

import peers
import pytest
import torch
from peers.cases import MASKS, assert_parity, assert_same_arguments, batch

from ppo_fast.compat import openrlhf as compat

PEER = peers.openrlhf()
ORL = PEER.api
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
KINDS = pytest.mark.parametrize("kind", MASKS)
LABEL = pytest.mark.parametrize("peer", [PEER.label])


@LABEL
@KINDS
@DTYPES
@pytest.mark.parametrize(("gamma", "lambd"), [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_advantages_and_returns_discount_masked_tokens(peer, kind, dtype, gamma, lambd):
    b = batch(kind, dtype)
    for mask in (b.mask, b.mask.bool(), None):
        expected = ORL.get_advantages_and_returns(None, b.values, b.rewards, mask, gamma, lambd)
        actual = compat.get_advantages_and_returns(b.values, b.rewards, mask, gamma, lambd)
        assert_parity(actual[0], expected[0], f"{peer} advantages")
        assert_parity(actual[1], expected[1], f"{peer} returns")


def test_a_hole_is_a_discounted_step_not_a_skipped_one():
    """OpenRLHF's convention, which compat keeps: the masked token between two valid ones counts
    as a step with reward 0 and value 0."""
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.zeros(1, 3)
    mask = torch.tensor([[1, 0, 1]])
    advantages, _ = compat.get_advantages_and_returns(values, rewards, mask, 0.5, 1.0)
    assert advantages[0, 0].item() == pytest.approx(0.25)  # two discounts, not one


@LABEL
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased_gradient", [False, True])
@pytest.mark.parametrize("with_old", [False, True])
@DTYPES
def test_approx_kl(peer, estimator, unbiased_gradient, with_old, dtype):
    b = batch("holes", dtype, seed=2)
    old = b.old_logprobs if with_old else None
    outputs = []
    for function in (compat.compute_approx_kl, ORL.compute_approx_kl):
        logp = b.logprobs.clone().requires_grad_()
        kl = function(logp, b.ref_logprobs, old, estimator, unbiased_gradient)
        (kl * b.mask).sum().backward()
        outputs.append((kl, logp.grad))
    what = f"{peer} {estimator} unbiased={unbiased_gradient} old={with_old}"
    assert_parity(outputs[0][0], outputs[1][0], what)
    assert_parity(outputs[0][1], outputs[1][1], f"d {what}")
    with pytest.raises(ValueError, match="Unknown kl_estimator"):
        compat.compute_approx_kl(b.logprobs, b.ref_logprobs, kl_estimator="k4")


@LABEL
@KINDS
@pytest.mark.parametrize("kl_coef", [0.05, 0.0, -1.0])
@pytest.mark.parametrize("clip_range", [None, (-0.5, 0.5)])
def test_reward_puts_the_score_on_the_last_valid_token(peer, kind, kl_coef, clip_range):
    b = batch(kind)
    kl = compat.compute_approx_kl(b.logprobs, b.ref_logprobs, kl_estimator="k3") * b.mask
    actual = compat.compute_reward(b.scores, kl_coef, kl, b.mask, clip_range)
    expected = ORL.compute_reward(b.scores, kl_coef, kl, b.mask, clip_range)
    assert_parity(actual, expected, f"{peer} kl_coef={kl_coef} clip={clip_range}")


@LABEL
@KINDS
@pytest.mark.parametrize("token_level_loss", [True, False])
def test_aggregate_loss_and_masked_mean(peer, kind, token_level_loss):
    b = batch(kind)
    for dim in (None, -1):
        assert_parity(
            compat.masked_mean(b.advantages, b.mask, dim),
            ORL.masked_mean(b.advantages, b.mask, dim),
        )
    for arguments in ({}, {"dp_size": 4, "batch_num_tokens": 40.0, "global_batch_size": 9.0}):
        assert_parity(
            compat.aggregate_loss(b.advantages, b.mask, token_level_loss, **arguments),
            ORL.aggregate_loss(b.advantages, b.mask, token_level_loss, **arguments),
            f"{peer} {arguments}",
        )


POLICY_SETTINGS = [
    {},
    {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": 3.0},
    {"dual_clip": 1.5, "token_level_loss": False},
    {"is_correction_level": "token", "is_correction_mode": "clip"},
    {"is_correction_level": "token", "is_correction_mode": "mask", "dual_clip": 3.0},
    {"is_correction_level": "seq", "is_correction_gating": "ratio"},
    {
        "is_correction_level": "token",
        "is_correction_gating": "binary_kl",
        "is_correction_threshold": (0.0, 0.05),
    },
    {
        "is_correction_level": "seq",
        "is_correction_gating": "tv",
        "is_correction_threshold": (0, 0.1),
    },
    {"policy_loss_type": "gspo"},
    {"policy_loss_type": "gspo", "dual_clip": 2.0, "is_correction_level": "token"},
]


@LABEL
@pytest.mark.parametrize("setting", range(len(POLICY_SETTINGS)))
@KINDS
@DTYPES
def test_policy_loss(peer, setting, kind, dtype):
    b = batch(kind, dtype, seed=17)
    rollout = b.old_logprobs + 0.3 * torch.randn(
        b.old_logprobs.shape, generator=torch.Generator().manual_seed(4), dtype=dtype
    )
    for arguments in ({}, {"dp_size": 2, "batch_num_tokens": 50.0, "global_batch_size": 7.0}):
        outputs = []
        for module in (compat.PolicyLoss, ORL.PolicyLoss):
            logp = b.logprobs.clone().requires_grad_()
            result = module(**POLICY_SETTINGS[setting])(
                logp, b.old_logprobs, b.advantages, b.mask, rollout, **arguments
            )
            result[0].backward()
            outputs.append((result, logp.grad))
        (actual, grad), (expected, grad_ref) = outputs
        what = f"{peer} {POLICY_SETTINGS[setting]} {arguments}"
        assert isinstance(actual, tuple) and len(actual) == 5
        names = ("loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio")
        for name, a, e in zip(names, actual, expected, strict=True):
            if e is None:
                assert a is None, f"{what} {name}"
            else:
                assert_parity(a, e, f"{what} {name}")
        assert_parity(grad, grad_ref, f"d {what}")


@LABEL
def test_policy_loss_without_a_mask(peer):
    b = batch("right-padded")
    results = []
    for module in (compat.PolicyLoss, ORL.PolicyLoss):
        logp = b.logprobs.clone().requires_grad_()
        loss, clip_ratio, ppo_kl, _, _ = module(dual_clip=3.0)(logp, b.old_logprobs, b.advantages)
        loss.backward()
        results.append((loss, clip_ratio, ppo_kl, logp.grad))
    for actual, expected in zip(*results, strict=True):
        assert_parity(actual, expected, peer)


@LABEL
@pytest.mark.parametrize("clip_eps", [None, 0.2, 100.0])
@pytest.mark.parametrize("token_level_loss", [True, False])
@KINDS
@DTYPES
def test_value_loss(peer, clip_eps, token_level_loss, kind, dtype):
    b = batch(kind, dtype, seed=19)
    for mask in (b.mask, None) if token_level_loss else (b.mask,):
        global_counts = {"dp_size": 2, "batch_num_tokens": 50.0, "global_batch_size": 7.0}
        # OpenRLHF multiplies by the mask when given global counts: it needs one then.
        for arguments in ({}, global_counts) if mask is not None else ({},):
            outputs = []
            for module in (compat.ValueLoss, ORL.ValueLoss):
                values = b.values.clone().requires_grad_()
                loss = module(clip_eps, token_level_loss)(
                    values, b.old_values, b.returns, mask, **arguments
                )
                loss.backward()
                outputs.append((loss, values.grad))
            what = f"{peer} clip={clip_eps} token_level={token_level_loss} {arguments}"
            assert_parity(outputs[0][0], outputs[1][0], what)
            assert_parity(outputs[0][1], outputs[1][1], f"d {what}")


def test_constructor_checks_match():
    for bad in (
        {"dual_clip": 1.0},
        {"is_correction_level": "batch"},
        {"is_correction_mode": "clip", "is_correction_level": "seq"},
        {"is_correction_gating": "tv", "is_correction_level": "token"},
    ):
        with pytest.raises((AssertionError, ValueError)) as expected:
            ORL.PolicyLoss(**bad)
        with pytest.raises(expected.type):
            compat.PolicyLoss(**bad)


@LABEL
@pytest.mark.parametrize("module", ["PolicyLoss", "ValueLoss"])
def test_dp_size_defaults_to_openrlhfs_one(peer, module):
    """Global counts without dp_size: OpenRLHF's default (1), the same as passing it."""
    b = batch("holes", torch.float64, seed=5)
    counts = {"batch_num_tokens": 50.0, "global_batch_size": 7.0}
    if module == "PolicyLoss":
        inputs = (b.logprobs, b.old_logprobs, b.advantages, b.mask)
    else:
        inputs = (b.values, b.old_values, b.returns, b.mask)
    default = getattr(compat, module)()(*inputs, **counts)
    explicit = getattr(compat, module)()(*inputs, dp_size=1, **counts)
    expected = getattr(ORL, module)()(*inputs, **counts)
    first = (lambda r: r[0]) if module == "PolicyLoss" else (lambda r: r)
    assert_parity(first(default), first(expected), f"{peer} {module}")
    assert_parity(first(default), first(explicit), f"{module} dp_size=1")


@LABEL
def test_is_correction_clamps_tiny_probabilities_as_openrlhf(peer):
    """Old and rollout log-probs far below log(1e-6): OpenRLHF clamps both probabilities to
    [1e-6, 1 - 1e-6] before its binary KL, which keeps every token's statistic below 1e-5 here
    (an unclamped old probability would give 1e-5 to 1e-4, and filter most tokens)."""
    rng = torch.Generator().manual_seed(8)
    old = -40.0 + 20.0 * torch.rand((3, 12), generator=rng, dtype=torch.float64)  # [-40, -20]
    rollout = -16.0 + 4.0 * torch.rand((3, 12), generator=rng, dtype=torch.float64)
    logp = old + 0.1 * torch.randn((3, 12), generator=rng, dtype=torch.float64)
    advantages = torch.randn((3, 12), generator=rng, dtype=torch.float64)
    mask = torch.ones((3, 12), dtype=torch.int64)
    settings = {"is_correction_level": "token", "is_correction_gating": "binary_kl"}
    settings |= {"is_correction_mode": "mask", "is_correction_threshold": (0.0, 1e-5)}
    results = [
        module(**settings)(logp, old, advantages, mask, rollout)
        for module in (compat.PolicyLoss, ORL.PolicyLoss)
    ]
    names = ("loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio")
    for name, actual, expected in zip(names, *results, strict=True):
        assert_parity(actual, expected, f"{peer} {name}")
    assert results[1][4].item() == 0.0  # OpenRLHF's clamp keeps every token


@pytest.mark.parametrize("name", [n for n in compat.__all__ if callable(getattr(compat, n))])
def test_the_api_takes_the_peers_arguments_and_defaults(name):
    assert_same_arguments(getattr(compat, name), getattr(ORL, name), f"{PEER.label} {name}")


@LABEL
@pytest.mark.parametrize("token_level_loss", [True, False])
def test_the_losses_take_the_masks_dtype_as_openrlhf(peer, token_level_loss):
    """OpenRLHF multiplies the token losses by the mask, so a float64 mask makes the loss of
    float32 inputs float64 (the kernel's sum is float32: the value agrees to its rounding)."""
    b = batch("holes", torch.float32, seed=23)
    for mask_dtype in (torch.bool, torch.int64, torch.float32, torch.float64):
        mask = b.mask.to(mask_dtype)
        for arguments in ({}, {"dp_size": 2, "batch_num_tokens": 50.0, "global_batch_size": 7.0}):
            what = f"{peer} {mask_dtype} token_level={token_level_loss} {arguments}"
            policy = [
                module(token_level_loss=token_level_loss)(
                    b.logprobs, b.old_logprobs, b.advantages, mask, **arguments
                )[0]
                for module in (compat.PolicyLoss, ORL.PolicyLoss)
            ]
            value = [
                module(0.2, token_level_loss)(b.values, b.old_values, b.returns, mask, **arguments)
                for module in (compat.ValueLoss, ORL.ValueLoss)
            ]
            for (ours, theirs), name in ((policy, "policy"), (value, "value")):
                assert ours.dtype == theirs.dtype, f"{name} {what}"
                torch.testing.assert_close(ours, theirs, check_dtype=False, msg=f"{name} {what}")
