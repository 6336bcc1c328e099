"""ppo_fast.compat.verl's DPPO (TV and KL), Clip-Cov, KL-Cov and REINFORCE equal verl 0.9.1's own
functions: loss, metrics and the gradient with respect to log_prob, for every loss_agg_mode, with
and without rollout_is_weights and global batch counts (the parametrisation of
test_compat_policy_losses_verl.py). Clip-Cov draws from torch's global generator: both sides run
from the same seed. Needs verl 0.9.1 installed."""

from __future__ import annotations

import importlib

import pytest
import torch
from peers.cases import MASKS, assert_same_arguments, batch
from test_compat_policy_losses_verl import (
    AGG_MODES,
    PEER,
    REAL,
    assert_parity,
    global_args,
    verl_function,
)

from ppo_fast.compat import verl as compat

pytestmark = pytest.mark.skipif(not REAL, reason=f"needs verl 0.9.1 ({PEER.label} found)")
NAMES = ("dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "reinforce")
SIGNATURES = (*NAMES, "bypass_mode")


def config(name: str, variant: int, global_batch_info: dict):
    fields: dict = {}
    policy_loss = importlib.import_module("verl.workers.config.actor").PolicyLossConfig
    if name.startswith("dppo"):
        fields.update(
            ({"clip_ratio_low": 0.05, "clip_ratio_high": 0.1}, {"clip_ratio": 0.02})[variant]
        )
        if variant:
            fields.update(clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=20.0)
    elif name == "clip_cov":
        # bounds that hold candidates on these small batches, and a ratio that picks several
        fields["policy_loss"] = policy_loss(
            clip_cov_ratio=(0.1, 0.3)[variant], clip_cov_lb=0.05, clip_cov_ub=(5.0, 1.0)[variant]
        )
    elif name == "kl_cov":
        fields["policy_loss"] = policy_loss(
            kl_cov_ratio=(0.1, 0.02)[variant], ppo_kl_coef=(0.1, 2.0)[variant]
        )
    return PEER.make_config(**fields, global_batch_info=global_batch_info)


def call_both(name, old, logp, adv, mask, mode, cfg, weights):
    outputs = []
    for function in (
        getattr(compat, f"compute_policy_loss_{name}"),
        verl_function(f"compute_policy_loss_{name}"),
    ):
        x = logp.clone().requires_grad_()
        torch.manual_seed(5)  # Clip-Cov's draw, the same on both sides
        loss, metrics = function(old, x, adv, mask, mode, cfg, weights)
        loss.backward()
        outputs.append((loss, metrics, x.grad))
    return outputs


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", MASKS)
def test_equals_verl(name, mode, kind):
    for dtype in (torch.float32, torch.float64):
        # log-probabilities near 0 too, so that the probabilities (DPPO's masks) spread over (0, 1]
        b = batch(kind, dtype, seed=13)
        shift = torch.linspace(0.0, 2.5, b.logprobs.shape[-1], dtype=dtype)
        old, logp = (b.old_logprobs + shift).clamp(max=-1e-3), (b.logprobs + shift)
        logp = torch.where(logp - old > 3, logp, logp.clamp(max=-1e-3))
        rng = torch.Generator().manual_seed(2)
        weights = torch.rand(b.logprobs.shape, generator=rng).to(dtype) + 0.5
        for variant, (arguments, is_weights) in enumerate(
            zip(global_args(mode, b), (None, weights, weights), strict=True)
        ):
            cfg = config(name, variant % 2, arguments)
            (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = call_both(
                name, old, logp, b.advantages, b.mask, mode, cfg, is_weights
            )
            what = f"{name} {mode} {kind} {dtype} {arguments} weights={is_weights is not None}"
            assert_parity(loss, loss_ref, what, dtype)
            assert_parity(grad, grad_ref, f"d {what}", dtype)
            assert metrics.keys() == metrics_ref.keys(), what
            for key in metrics:
                assert type(metrics[key]) is type(metrics_ref[key]), f"{what} {key}"
                assert_parity(metrics[key], metrics_ref[key], f"{what} {key}", dtype)


def test_the_batch_takes_both_sides_of_the_masks_and_selects_tokens():
    """What the parity covers: DPPO tokens in and out of both regions, and non-empty
    selections for Clip-Cov and KL-Cov (they change the loss)."""
    b = batch("holes", torch.float64, seed=13)
    shift = torch.linspace(0.0, 2.5, b.logprobs.shape[-1], dtype=torch.float64)
    old, logp = (b.old_logprobs + shift).clamp(max=-1e-3), (b.logprobs + shift).clamp(max=-1e-3)
    for name in ("dppo_tv", "dppo_kl"):
        _, metrics = compat.__dict__[f"compute_policy_loss_{name}"](
            old, logp, b.advantages, b.mask, config=config(name, 0, {})
        )
        assert 0.05 < metrics["actor/pg_clipfrac"] < 0.95, (name, metrics)
    torch.manual_seed(5)
    _, metrics = compat.compute_policy_loss_clip_cov(
        old, logp, b.advantages, b.mask, config=config("clip_cov", 0, {})
    )
    assert metrics["actor/pg_clipfrac"] > 0
    plain = compat.compute_policy_loss_vanilla(
        old, logp, b.advantages, b.mask, config=PEER.make_config(clip_ratio_c=1e9)
    )[0]
    kl_cov = compat.compute_policy_loss_kl_cov(
        old, logp, b.advantages, b.mask, config=config("kl_cov", 1, {})
    )[0]
    assert kl_cov.item() != pytest.approx(plain.item(), rel=1e-6)


@pytest.mark.parametrize("name", SIGNATURES)
def test_same_arguments_as_verl(name):
    function = f"compute_policy_loss_{name}"
    assert_same_arguments(getattr(compat, function), verl_function(function), function)
    assert function in compat.__all__


def _bypass_config(loss_type: str, variant: int, global_batch_info: dict):
    algorithm = importlib.import_module("verl.trainer.config.algorithm")
    policy_loss = importlib.import_module("verl.workers.config.actor").PolicyLossConfig
    correction = (
        {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "token_k1",
         "rollout_rs_threshold": 3.0},
        {"rollout_is": "sequence", "rollout_is_threshold": 50.0, "rollout_rs": "seq_mean_k3",
         "rollout_rs_threshold": 0.5, "rollout_is_batch_normalize": True},
    )[variant]  # fmt: skip
    rollout = algorithm.RolloutCorrectionConfig(loss_type=loss_type, bypass_mode=True, **correction)
    return PEER.make_config(
        policy_loss=policy_loss(rollout_correction=rollout), global_batch_info=global_batch_info
    )


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_bypass_mode_equals_verl(loss_type, mode):
    """The weights, the rejection mask and their metrics are verl's own helper's; the loss,
    its gradient and its metrics ppo_fast's, equal to verl's."""
    for dtype in (torch.float32, torch.float64):
        b = batch("holes", dtype, seed=29)
        old, logp = b.old_logprobs, b.old_logprobs + (b.logprobs - b.old_logprobs) * 0.2
        for variant, arguments in enumerate(global_args(mode, b)[:2]):
            cfg = _bypass_config(loss_type, variant, arguments)
            outputs = []
            for function in (
                compat.compute_policy_loss_bypass_mode,
                verl_function("compute_policy_loss_bypass_mode"),
            ):
                x = logp.clone().requires_grad_()
                loss, metrics = function(old, x, b.advantages, b.mask, mode, cfg)
                loss.backward()
                outputs.append((loss, metrics, x.grad))
            (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = outputs
            what = f"bypass {loss_type} {mode} {dtype} {arguments} variant={variant}"
            assert metrics_ref["rollout_corr/rollout_rs_masked_fraction"] > 0, what
            assert_parity(loss, loss_ref, what, dtype)
            assert_parity(grad, grad_ref, f"d {what}", dtype)
            assert metrics.keys() == metrics_ref.keys(), what
            for key in metrics:
                assert_parity(metrics[key], metrics_ref[key], f"{what} {key}", dtype)
