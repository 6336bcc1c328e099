"""ppo_fast.compat.trl's GRPO and RLOO advantages equal TRL 0.29.1's advantage blocks, run from
the verbatim copy (TRL's trainer code is inline in _generate_and_score_completions; ids say
trl-0.29.1-copy; the copy is held to the wheel's source by tests/test_compat_peer_copies.py):
every scale_rewards and multi_objective_aggregation, one and several generations per prompt,
NaN where a reward function does not apply; float64 to 1e-12 and float32 to float32 rounding.

The float32 batches hold dyadic rewards (0, 0.25, 0.5, 1 and weights 1 and 0.5): TRL reduces in
float32, where the mean of a group of equal rewards such as 0.11 can be an ulp off, and its
division by std + 1e-4 makes that ulp an advantage of 1e-3; on dyadic rewards TRL's float32
sums are exact and the two agree to float32 rounding.
"""

from __future__ import annotations

import types

import numpy as np
import peers
import pytest
import torch
from peers.cases import assert_parity

from ppo_fast.compat import trl as compat

PEER = peers.trl()
TRL = PEER.api
LABEL = pytest.mark.parametrize("peer", [PEER.label])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
GENERATIONS = pytest.mark.parametrize("num_generations", [1, 2, 4])
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
WEIGHTS = [1.0, 0.5, 1.0]


def rewards_per_func(dtype, rows=12, seed=0):
    """(rows, 3): the first column NaN on a third of the rows (a function that does not apply
    to them), one group of equal rewards, and a column NaN on all but one row of a group."""
    rng = np.random.default_rng(seed)
    if dtype == torch.float32:
        values = rng.choice([0.0, 0.25, 0.5, 1.0], (rows, 3))
    else:
        values = rng.normal(0.0, 1.0, (rows, 3))
    values[rng.random(rows) < 0.33, 0] = np.nan
    values[0:2] = values[0]
    values[4:7, 2] = np.nan
    return torch.tensor(values, dtype=dtype)


def _grpo_self(aggregation, scale_rewards):
    return types.SimpleNamespace(
        multi_objective_aggregation=aggregation,
        reward_weights=torch.tensor(WEIGHTS, dtype=torch.float32),
        scale_rewards=scale_rewards,
        reward_funcs=[None] * len(WEIGHTS),
    )


def _assert_result(actual, expected, dtype, what):
    for field in ("advantages", "rewards", "std_rewards", "is_std_zero"):
        ours, theirs = getattr(actual, field), getattr(expected, field)
        if theirs.dtype == torch.bool:
            assert torch.equal(ours, theirs), f"{what} {field}"
        else:
            assert_parity(ours, theirs, f"{what} {field}", rtol=RTOL[dtype])


@LABEL
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@GENERATIONS
@DTYPES
def test_grpo_advantages(peer, aggregation, scale_rewards, num_generations, dtype):
    per_func = rewards_per_func(dtype)
    before = per_func.clone()
    expected = TRL.grpo_trainer_advantages(
        _grpo_self(aggregation, scale_rewards), per_func, num_generations, "cpu"
    )
    actual = compat.grpo_advantages(
        per_func,
        num_generations,
        WEIGHTS,
        scale_rewards=scale_rewards,
        multi_objective_aggregation=aggregation,
    )
    assert isinstance(actual, compat.GRPOAdvantages)
    _assert_result(actual, expected, dtype, f"{peer} {aggregation} {scale_rewards}")
    assert torch.equal(per_func.isnan(), before.isnan())
    assert torch.equal(per_func.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize(("flag", "meaning"), [(True, "group"), (False, "none")])
def test_grpo_reads_scale_rewards_flags_as_grpo_config_does(flag, meaning):
    per_func = rewards_per_func(torch.float64)
    by_flag = compat.grpo_advantages(per_func, 4, scale_rewards=flag)
    by_name = compat.grpo_advantages(per_func, 4, scale_rewards=meaning)
    assert torch.equal(by_flag.advantages, by_name.advantages)


def test_grpo_refuses_what_trl_refuses():
    per_func = rewards_per_func(torch.float32)
    with pytest.raises(ValueError, match="Invalid value for scale_rewards: global"):
        compat.grpo_advantages(per_func, 4, scale_rewards="global")
    with pytest.raises(ValueError, match="Invalid multi_objective_aggregation: mean"):
        compat.grpo_advantages(per_func, 4, multi_objective_aggregation="mean")
    with pytest.raises(ValueError, match=r"Number of reward weights \(2\) must match"):
        compat.grpo_advantages(per_func, 4, [1.0, 1.0])
    with pytest.raises(ValueError, match="num_generations must be a positive divisor"):
        compat.grpo_advantages(per_func, 5)


@LABEL
@GENERATIONS
@DTYPES
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("clip_range", [None, (-0.5, 0.75)])
@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages(peer, num_generations, dtype, beta, clip_range, normalize):
    per_func = rewards_per_func(dtype, seed=4)
    rng = np.random.default_rng(5)
    width = 7
    old = torch.tensor(rng.uniform(-2.0, -0.1, (12, width)), dtype=dtype)
    # Dyadic log-probability differences, so that float32's summed KL is exact too.
    ref = old + torch.tensor(rng.choice([-0.5, 0.25, 0.0, 0.125], (12, width)), dtype=dtype)
    completion_mask = torch.tensor(
        np.arange(width)[None, :] < rng.integers(1, width + 1, 12)[:, None], dtype=torch.int64
    )
    trainer = types.SimpleNamespace(
        reward_weights=torch.tensor(WEIGHTS, dtype=torch.float32),
        reward_clip_range=clip_range,
        beta=beta,
        normalize_advantages=normalize,
    )
    expected = TRL.rloo_trainer_advantages(
        trainer, per_func, num_generations, "cpu", old, ref, completion_mask
    )
    actual = compat.rloo_advantages(
        per_func,
        num_generations,
        WEIGHTS,
        beta=beta,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        completion_mask=completion_mask,
        reward_clip_range=clip_range,
        normalize_advantages=normalize,
    )
    assert isinstance(actual, compat.RLOOAdvantages)
    _assert_result(actual, expected, dtype, f"{peer} beta={beta} clip={clip_range} {normalize}")


@LABEL
@DTYPES
def test_rloo_normalises_a_batch_of_one_completion_to_nan_as_trl(peer, dtype):
    """TRL divides by advantages.std(), NaN for one value (unbiased): so is the advantage of
    a batch of one completion (evaluation with one generation), where the compat gave 0."""
    per_func = torch.tensor([[0.5, 1.0]], dtype=dtype)
    trainer = types.SimpleNamespace(
        reward_weights=torch.tensor([1.0, 0.5]),
        reward_clip_range=None,
        beta=0.0,
        normalize_advantages=True,
    )
    expected = TRL.rloo_trainer_advantages(trainer, per_func, 1, "cpu", None, None, None)
    actual = compat.rloo_advantages(per_func, 1, [1.0, 0.5], beta=0.0, normalize_advantages=True)
    assert expected.advantages.isnan().all() and actual.advantages.isnan().all(), peer
    assert actual.advantages.dtype == expected.advantages.dtype


def test_rloo_needs_the_log_probabilities_for_its_kl_penalty():
    with pytest.raises(ValueError, match="pass old_per_token_logps, ref_per_token_logps"):
        compat.rloo_advantages(rewards_per_func(torch.float32), 4)


def test_nanstd_is_trls():
    assert compat.nanstd is peers.trl_0_29_1.nanstd
