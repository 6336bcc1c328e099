"""ppo_fast.compat.verl's policy-loss family (GPG, DRO, CISPO, SAPO, GSPO, the geometric mean)
equals verl 0.9.1's own functions: loss, metrics and the gradient with respect to log_prob, for
every loss_agg_mode, with and without rollout_is_weights and global batch counts. Needs verl
0.9.1 installed (.ci/run installs it): its own ActorConfig and PolicyLossConfig build the
configs, which the stand-ins of the verbatim copy in ppo_fast._peers only imitate."""

from __future__ import annotations

import importlib
import itertools
import types

import peers
import pytest
import torch
from peers.cases import MASKS, assert_same_arguments, batch
from peers.cases import assert_parity as _assert_parity

from ppo_fast.compat import verl as compat

PEER = peers.verl()
REAL = PEER.label == "verl-0.9.1-real"
pytestmark = pytest.mark.skipif(not REAL, reason=f"needs verl 0.9.1 ({PEER.label} found)")
NAMES = ("gpg", "dro", "cispo", "sapo", "gspo", "geo_mean")
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def verl_function(name: str):
    return getattr(PEER.api, name)  # verl's own (the module is skipped without it)


def config(name: str, variant: int, global_batch_info: dict):
    """An ActorConfig for the loss: two variants of its hyperparameters."""
    fields: dict = {}
    if name == "dro":
        policy_loss = importlib.import_module("verl.workers.config.actor").PolicyLossConfig
        fields["policy_loss"] = policy_loss(dro_beta=(0.1, 2.0)[variant])
    elif name in ("cispo", "gspo", "geo_mean"):
        fields.update(
            ({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, {"clip_ratio": 0.3})[variant]
        )
        if variant:
            fields.update(clip_ratio_low=None, clip_ratio_high=None)
    elif name == "sapo":
        fields.update(({}, {"tau_pos": 2.0, "tau_neg": 0.5})[variant])
    return PEER.make_config(**fields, global_batch_info=global_batch_info)


def global_args(mode: str, b) -> list[dict]:
    tokens = float(b.mask.sum())
    seqs = float((b.mask.sum(-1) > 0).sum())
    return [
        {},
        {"dp_size": 2, "batch_num_tokens": 2 * tokens + 3, "global_batch_size": 2 * seqs + 1},
        {"loss_scale_factor": 64} if mode == "seq-mean-token-sum-norm" else {"dp_size": 1},
    ]


def call_both(name, old, logp, adv, mask, mode, cfg, weights):
    """(loss, metrics, d loss / d log_prob) of ours and of verl's."""
    outputs = []
    for function in (
        getattr(compat, f"compute_policy_loss_{name}"),
        verl_function(f"compute_policy_loss_{name}"),
    ):
        x = logp.clone().requires_grad_()
        loss, metrics = function(old, x, adv, mask, mode, cfg, weights)
        loss.backward()
        outputs.append((loss, metrics, x.grad))
    return outputs


def assert_parity(actual, expected, what, dtype):
    _assert_parity(actual, expected, what, dtype, rtol=RTOL[dtype])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", MASKS)
def test_equals_verl(name, mode, kind):
    for dtype in (torch.float32, torch.float64):
        b = batch(kind, dtype, seed=13)
        rng = torch.Generator().manual_seed(2)
        weights = torch.rand(b.logprobs.shape, generator=rng).to(dtype) + 0.5
        for variant, (arguments, is_weights) in enumerate(
            zip(global_args(mode, b), (None, weights, weights), strict=True)
        ):
            cfg = config(name, variant % 2, arguments)
            (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = call_both(
                name, b.old_logprobs, b.logprobs, b.advantages, b.mask, mode, cfg, is_weights
            )
            what = f"{name} {mode} {kind} {dtype} {arguments} weights={is_weights is not None}"
            assert_parity(loss, loss_ref, what, dtype)
            assert_parity(grad, grad_ref, f"d {what}", dtype)
            assert metrics.keys() == metrics_ref.keys(), what
            for key in metrics:
                assert type(metrics[key]) is type(metrics_ref[key]), f"{what} {key}"
                assert_parity(metrics[key], metrics_ref[key], f"{what} {key}", dtype)


def test_the_batch_takes_the_clamp_and_the_clip():
    """What the parity above covers: log-ratios beyond verl's clamp at 20, ratios clipped below
    and above (CISPO), advantages of both signs (SAPO's two temperatures)."""
    b = batch("holes", torch.float64, seed=13)
    log_ratio = (b.logprobs - b.old_logprobs)[b.mask.bool()]
    assert (log_ratio > 20).any() and (log_ratio < -20).any()
    assert (log_ratio.exp() < 0.8).any() and (log_ratio.exp() > 1.28).any()
    assert (b.advantages[b.mask.bool()] > 0).any() and (b.advantages[b.mask.bool()] < 0).any()


@pytest.mark.parametrize("mode", [*AGG_MODES, "not-a-mode"])
def test_sapo_aggregates_by_seq_mean_token_mean_whatever_the_mode(mode):
    """verl's quirk, reproduced: SAPO's loss_agg_mode is not read."""
    b = batch("with-empty-row", torch.float64, seed=17)
    cfg = config("sapo", 0, {})
    (loss, _, grad), (loss_ref, _, grad_ref) = call_both(
        "sapo", b.old_logprobs, b.logprobs, b.advantages, b.mask, mode, cfg, None
    )
    (seq_mean, _, _), _ = call_both(
        "sapo", b.old_logprobs, b.logprobs, b.advantages, b.mask, "seq-mean-token-mean", cfg, None
    )
    assert_parity(loss, loss_ref, mode, torch.float64)
    assert_parity(grad, grad_ref, f"d {mode}", torch.float64)
    assert loss.item() == seq_mean.item()


def test_gpg_reads_neither_old_log_prob_nor_returns_metrics():
    b = batch("holes", torch.float64, seed=19)
    cfg = config("gpg", 0, {})
    for function in (compat.compute_policy_loss_gpg, verl_function("compute_policy_loss_gpg")):
        _, metrics = function(None, b.logprobs, b.advantages, b.mask, "token-mean", cfg)
        assert metrics == {}
    assert_parity(
        compat.compute_policy_loss_gpg(None, b.logprobs, b.advantages, b.mask, config=cfg)[0],
        verl_function("compute_policy_loss_gpg")(
            None, b.logprobs, b.advantages, b.mask, config=cfg
        )[0],
        "gpg",
        torch.float64,
    )


@pytest.mark.parametrize("beta", [None, 0.0, -0.5])
def test_dro_refuses_a_beta_that_is_not_positive_as_verl(beta):
    b = batch("holes", torch.float64)
    policy_loss = importlib.import_module("verl.workers.config.actor").PolicyLossConfig
    cfg = PEER.make_config(policy_loss=policy_loss(dro_beta=beta))
    messages = []
    for function in (compat.compute_policy_loss_dro, verl_function("compute_policy_loss_dro")):
        with pytest.raises(ValueError) as caught:
            function(b.old_logprobs, b.logprobs, b.advantages, b.mask, config=cfg)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_cispo_and_sapo_want_an_actor_config_as_verl(name):
    b = batch("holes", torch.float64)
    stand_in = types.SimpleNamespace(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, tau_pos=1.0, tau_neg=1.05,
        global_batch_info={},
    )  # fmt: skip
    for function in (
        getattr(compat, f"compute_policy_loss_{name}"),
        verl_function(f"compute_policy_loss_{name}"),
    ):
        with pytest.raises(AssertionError):
            function(b.old_logprobs, b.logprobs, b.advantages, b.mask, config=stand_in)


@pytest.mark.parametrize("name", NAMES)
def test_float64_weights_promote_float32_inputs_as_verl(name):
    b = batch("left-padded", torch.float32, seed=23)
    weights = torch.rand(b.logprobs.shape, dtype=torch.float64) + 0.5
    cfg = config(name, 0, {})
    (loss, _, grad), (loss_ref, _, grad_ref) = call_both(
        name, b.old_logprobs, b.logprobs, b.advantages, b.mask, "token-mean", cfg, weights
    )
    assert loss.dtype == loss_ref.dtype == torch.float64
    assert_parity(loss, loss_ref, name, torch.float32)
    assert_parity(grad, grad_ref, f"d {name}", torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_same_arguments_as_verl(name):
    function = f"compute_policy_loss_{name}"
    assert_same_arguments(getattr(compat, function), verl_function(function), function)
    assert function in compat.__all__


def test_gspo_beyond_verls_clamp_of_the_sequence_log_ratio():
    """A row whose mean log-ratio is beyond verl's clamp at 10: its ratio is exp(10) and its
    gradient 0, as verl's."""
    b = batch("holes", torch.float64, seed=13)
    logprobs = b.logprobs.clone()
    logprobs[0] += 12.0
    cfg = config("gspo", 0, {})
    (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = call_both(
        "gspo", b.old_logprobs, logprobs, b.advantages, b.mask, "token-mean", cfg, None
    )
    assert not grad_ref[0].any()
    assert_parity(loss, loss_ref, "gspo clamp", torch.float64)
    assert_parity(grad, grad_ref, "d gspo clamp", torch.float64)
    assert metrics == pytest.approx(metrics_ref, rel=1e-12)


# Every loss of compat.verl that aggregates by agg_loss, and the value loss (as a policy loss).
_AGGREGATED = ("vanilla", "gpg", "dro", "cispo", "reinforce", "dppo_tv", "dppo_kl", "clip_cov")


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.bool])
def test_a_micro_batch_without_a_valid_token_has_verls_loss_and_a_zero_gradient(mode, mask_dtype):
    """No valid token and no global count: verl's loss is 0 / 0 = NaN and its gradient 0 (its
    masked_sum's torch.where gives the masked tokens none, whatever comes from above), so its
    step goes on; the kernels' zeros times 1 / 0 once gave a NaN gradient here. With global
    counts the loss is 0, as verl's."""
    b = batch("right-padded", torch.float32, seed=3)
    mask = torch.zeros(b.mask.shape, dtype=mask_dtype)
    for name in _AGGREGATED:
        for arguments in ({}, {"dp_size": 2, "batch_num_tokens": 7, "global_batch_size": 3}):
            cfg = config(name, 0, arguments)
            outputs = []
            for function in (
                getattr(compat, f"compute_policy_loss_{name}"),
                verl_function(f"compute_policy_loss_{name}"),
            ):
                x = b.logprobs.clone().requires_grad_()
                torch.manual_seed(0)  # Clip-Cov's draw, the same for both
                loss, _ = function(b.old_logprobs, x, b.advantages, mask, mode, cfg)
                loss.backward()
                outputs.append((loss, x.grad))
            (loss, grad), (loss_ref, grad_ref) = outputs
            what = f"{name} {mode} {mask_dtype} {arguments}"
            torch.testing.assert_close(loss, loss_ref, equal_nan=True, msg=what)
            torch.testing.assert_close(grad, grad_ref, msg=what)
    outputs = []
    for function in (compat.compute_value_loss, verl_function("compute_value_loss")):
        x = b.logprobs.clone().requires_grad_()
        loss, _ = function(x, b.advantages, b.old_logprobs, mask, 0.2, mode)
        loss.backward()
        outputs.append((loss, x.grad))
    (loss, grad), (loss_ref, grad_ref) = outputs
    torch.testing.assert_close(loss, loss_ref, equal_nan=True, msg=f"value {mode}")
    torch.testing.assert_close(grad, grad_ref, msg=f"value {mode}")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_the_loss_takes_verls_dtype_from_the_mask_and_the_sequence_modes(mode):
    """verl's loss is promoted with the mask (loss_mat * mask) and, in the sequence modes, with
    float32 (its .float() sequence mask): float32 inputs under a float64 mask give a float64
    loss, bfloat16 inputs a float32 one in the sequence modes. The kernel's sum is in the
    inputs' dtype, so the value agrees to the inputs' rounding."""
    arguments = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 9}
    for dtype, mask_dtype in itertools.product(
        (torch.float32, torch.bfloat16), (torch.bool, torch.int64, torch.float32, torch.float64)
    ):
        b = batch("holes", dtype, seed=5)
        mask = b.mask.to(mask_dtype)
        for name in _AGGREGATED:
            for info in ({}, arguments):
                cfg = config(name, 0, info)
                x = b.logprobs.clone().requires_grad_()
                torch.manual_seed(0)  # Clip-Cov's draw, the same for both
                ours, _ = getattr(compat, f"compute_policy_loss_{name}")(
                    b.old_logprobs, x, b.advantages, mask, mode, cfg
                )
                torch.manual_seed(0)
                theirs, _ = verl_function(f"compute_policy_loss_{name}")(
                    b.old_logprobs, b.logprobs, b.advantages, mask, mode, cfg
                )
                what = f"{name} {mode} {dtype} {mask_dtype} {info}"
                assert ours.dtype == theirs.dtype, what
                ours.backward()  # the cast keeps the gradient
                assert x.grad is not None and x.grad.dtype == dtype, what
                tolerance = {"rtol": 2e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
                torch.testing.assert_close(ours, theirs, check_dtype=False, msg=what, **tolerance)
        ours, _ = compat.compute_value_loss(
            b.logprobs, b.advantages, b.old_logprobs, mask, 0.2, mode
        )
        theirs, _ = verl_function("compute_value_loss")(
            b.logprobs, b.advantages, b.old_logprobs, mask, 0.2, mode
        )
        assert ours.dtype == theirs.dtype, f"value {mode} {dtype} {mask_dtype}"
