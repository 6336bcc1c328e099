"""ppo_fast.compat.trl equals TRL 0.29.1's PPO trainer, through the verbatim copy in tests/peers
(the trainer's arithmetic is inline in PPOTrainer.train, which needs models: it cannot be called
alone; tests/test_compat_peer_copies.py holds the copy to TRL's source). Ids say trl-0.29.1-copy."""

from __future__ import annotations

import types

import peers
import pytest
import torch
from peers.cases import MASKS, assert_parity, batch

from ppo_fast.compat import trl as compat

PEER = peers.trl()
TRL = PEER.api
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
LABEL = pytest.mark.parametrize("peer", [PEER.label])


def _sequence_lengths(rows: int, width: int, seed: int) -> torch.Tensor:
    """Index of each response's last real token: empty (-1), one token, full width, and others."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(-1, width, (rows,), generator=generator)
    lengths[:3] = torch.tensor([-1, 0, width - 1])
    return lengths


@LABEL
@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 1.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@DTYPES
def test_rollout_advantages(peer, kl_estimator, whiten_rewards, gamma, lam, seed, dtype):
    b = batch("right-padded", dtype, rows=7, width=13, seed=seed)
    sequence_lengths = _sequence_lengths(7, 13, seed)
    args = types.SimpleNamespace(
        kl_estimator=kl_estimator,
        kl_coef=0.05,
        whiten_rewards=whiten_rewards,
        gamma=gamma,
        lam=lam,
    )
    responses = torch.zeros(b.logprobs.shape, dtype=torch.long)
    expected = TRL.ppo_trainer_advantages(
        args, responses, sequence_lengths, b.logprobs, b.ref_logprobs, b.values, b.scores
    )
    actual = compat.rollout_advantages(
        b.logprobs,
        b.ref_logprobs,
        b.values,
        b.scores,
        sequence_lengths,
        kl_coef=0.05,
        kl_estimator=kl_estimator,
        gamma=gamma,
        lam=lam,
        whiten_rewards=whiten_rewards,
    )
    for name in compat.RolloutAdvantages._fields:
        a, e = getattr(actual, name), getattr(expected, name)
        if e.dtype == torch.bool:
            assert torch.equal(a, e), f"{peer} {name}"
        else:
            assert_parity(a, e, f"{peer} {kl_estimator} whiten_rewards={whiten_rewards} {name}")


@LABEL
@pytest.mark.parametrize("values_dtype", [torch.float64, torch.bfloat16], ids=str)
def test_rollout_advantages_keep_the_rewards_and_values_dtypes_as_trl(peer, values_dtype):
    """A value head in another dtype than the policy's log-probs: TRL keeps its rewards in the
    log-probs' dtype and its values in theirs (the advantages and returns take both); the
    compat once cast both to their common dtype."""
    b = batch("right-padded", torch.float32, rows=5, width=9, seed=4)
    values = b.values.to(values_dtype)
    sequence_lengths = _sequence_lengths(5, 9, 4)
    args = types.SimpleNamespace(
        kl_estimator="k1", kl_coef=0.05, whiten_rewards=False, gamma=1.0, lam=0.95
    )
    responses = torch.zeros(b.logprobs.shape, dtype=torch.long)
    expected = TRL.ppo_trainer_advantages(
        args, responses, sequence_lengths, b.logprobs, b.ref_logprobs, values, b.scores
    )
    actual = compat.rollout_advantages(
        b.logprobs, b.ref_logprobs, values, b.scores, sequence_lengths, kl_coef=0.05
    )
    for name in compat.RolloutAdvantages._fields:
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.dtype == e.dtype, f"{peer} {name}"


@LABEL
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32], ids=str)
@DTYPES
def test_masked_moments_and_whitening(peer, kind, mask_dtype, dtype):
    b = batch(kind, dtype, seed=23)
    mask = b.mask.to(mask_dtype)
    x = b.advantages * 2.0 - 7.0
    for axis in (None, 1):
        assert_parity(compat.masked_mean(x, mask, axis), TRL.masked_mean(x, mask, axis), peer)
    for unbiased in (True, False):
        assert_parity(compat.masked_var(x, mask, unbiased), TRL.masked_var(x, mask, unbiased))
    for shift_mean in (True, False):
        assert_parity(
            compat.masked_whiten(x, mask, shift_mean), TRL.masked_whiten(x, mask, shift_mean)
        )


@LABEL
def test_whitening_quirks_for_zero_and_one_valid_token(peer):
    x = torch.randn(2, 5)
    none = torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError) as expected:
        TRL.masked_whiten(x, none)
    with pytest.raises(ValueError) as actual:
        compat.masked_whiten(x, none)
    assert str(actual.value) == str(expected.value)
    one = none.clone()
    one[1, 2] = True
    # TRL divides by n - 1 = 0 and whitens to NaN everywhere: so does compat.
    assert torch.isnan(TRL.masked_whiten(x, one)).all()
    assert torch.isnan(compat.masked_whiten(x, one)).all()


@LABEL
def test_first_true_indices(peer):
    bools = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(compat.first_true_indices(bools), TRL.first_true_indices(bools))
    assert compat.first_true_indices(bools).tolist() == [2, 4, 0]


# TRL 0.29.1's PPOConfig defaults (trl/experimental/ppo/ppo_config.py), which rollout_advantages
# documents as its keyword defaults.
PPO_CONFIG_DEFAULTS = {
    "kl_coef": 0.05,
    "kl_estimator": "k1",
    "gamma": 1.0,
    "lam": 0.95,
    "whiten_rewards": False,
}


@LABEL
def test_rollout_advantages_defaults_are_ppoconfigs(peer):
    b = batch("right-padded", torch.float64, rows=7, width=13, seed=3)
    sequence_lengths = _sequence_lengths(7, 13, 3)
    responses = torch.zeros(b.logprobs.shape, dtype=torch.long)
    expected = TRL.ppo_trainer_advantages(
        types.SimpleNamespace(**PPO_CONFIG_DEFAULTS),
        responses,
        sequence_lengths,
        b.logprobs,
        b.ref_logprobs,
        b.values,
        b.scores,
    )
    actual = compat.rollout_advantages(
        b.logprobs, b.ref_logprobs, b.values, b.scores, sequence_lengths
    )
    assert_parity(actual.advantages, expected.advantages, f"{peer} advantages")
    assert_parity(actual.returns, expected.returns, f"{peer} returns")
