"""ppo_fast.compat.openrlhf's compute_advantages_and_returns and get_cumulative_returns equal
OpenRLHF 0.11.2's, run from the verbatim copy (OpenRLHF's package does not import here; ids say
openrlhf-0.11.2-copy; the copy is held to the wheel's source by
tests/test_compat_peer_copies.py): every advantage estimator, one and several samples per
prompt, experiences in shuffled prompt order, the KL in the reward, the length penalties, masks
with holes; float64 to 1e-12 and float32 to float32 rounding.

Two exceptions to 1e-12 in float64, both OpenRLHF's float32 arithmetic: the normalisation of the
advantages across experiences ("gae", "reinforce", "reinforce_baseline") keeps a float32 mean
and rstd whatever the advantages' dtype, so there float64 results agree to float32 rounding; and
the float32 batches hold dyadic rewards, whose float32 group means are exact (the mean of equal
rewards such as 0.11 can be an ulp off in float32, which "group_norm"'s division by std + 1e-9
makes an advantage of 10).
"""

from __future__ import annotations

import copy
import math
import types

import numpy as np
import peers
import pytest
import torch
from peers.cases import assert_parity, mask_of

from ppo_fast.compat import openrlhf as compat

PEER = peers.openrlhf()
ORL = PEER.api
LABEL = pytest.mark.parametrize("peer", [PEER.label])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
ESTIMATORS = (
    "gae",
    "reinforce",
    "rloo",
    "reinforce_baseline",
    "group_norm",
    "dr_grpo",
    "flash_reinforce",
)
NORMALISED = ("gae", "reinforce", "reinforce_baseline")
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}


@LABEL
@pytest.mark.parametrize("kind", ["right-padded", "left-padded", "holes", "with-empty-row"])
@DTYPES
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("with_mask", [True, False])
def test_cumulative_returns_discount_masked_tokens(peer, kind, dtype, gamma, with_mask):
    rng = np.random.default_rng(1)
    mask = torch.tensor(mask_of(kind, 6, 11, rng))
    rewards = torch.tensor(rng.normal(0.0, 1.0, (6, 11)), dtype=dtype)
    action_mask = mask if with_mask else None
    before = rewards.clone()
    expected = ORL.get_cumulative_returns(None, rewards, action_mask, gamma)
    actual = compat.get_cumulative_returns(rewards, action_mask, gamma)
    assert_parity(actual, expected, f"{peer} {kind} gamma={gamma}", rtol=RTOL[dtype])
    assert torch.equal(rewards, before)


def test_a_hole_is_a_discounted_step_in_the_returns_too():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    returns = compat.get_cumulative_returns(rewards, torch.tensor([[1, 0, 1]]), 0.5)
    assert returns[0, 0].item() == pytest.approx(0.25)


def _args(estimator, n_samples_per_prompt, gamma, no_std_norm, penalties, clip_range):
    reward = types.SimpleNamespace(clip_range=clip_range)
    if penalties:
        reward.overlong_buffer_len = 4
        reward.overlong_penalty_factor = 0.5
        reward.stop_properly_penalty_coef = penalties
    return types.SimpleNamespace(
        algo=types.SimpleNamespace(
            advantage=types.SimpleNamespace(
                estimator=estimator, gamma=gamma, lambd=0.95, no_std_norm=no_std_norm
            )
        ),
        rollout=types.SimpleNamespace(n_samples_per_prompt=n_samples_per_prompt, max_new_tokens=10),
        reward=reward,
        data=types.SimpleNamespace(max_len=10),
    )


def experiences(dtype, seed=0):
    """Two experiences (micro-batches of 8 and 4 rows, widths 9 and 7) of 12 rows in shuffled
    prompt order, with masks with holes, KL, values, truncation flags and response lengths."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(12)
    if dtype == torch.float32:
        scores = rng.choice([0.0, 0.25, 0.5, 1.0], 12)
    else:
        scores = rng.normal(0.0, 1.0, 12)
    scores[order[:2]] = scores[order[0]]  # equal rewards in one group
    made = []
    for rows, width in ((order[:8], 9), (order[8:], 7)):
        mask = torch.tensor(mask_of("holes", len(rows), width, rng))
        made.append(
            types.SimpleNamespace(
                rewards=torch.tensor(scores[rows], dtype=dtype),
                index=[int(r) for r in rows],
                kl=torch.tensor(rng.normal(0.0, 0.05, (len(rows), width)), dtype=dtype) * mask,
                action_mask=mask,
                values=torch.tensor(rng.normal(0.0, 1.0, (len(rows), width)), dtype=dtype),
                response_length=mask.sum(-1) + torch.tensor(rng.integers(0, 4, len(rows))),
                truncated=torch.tensor(rng.random(len(rows)) < 0.3),
                info={"reward": torch.tensor(scores[rows], dtype=dtype)},
                advantages=None,
                returns=None,
            )
        )
    return made


def _run(function, args, dtype):
    """``(result, maker, the experiences as given, the experiences, their reward tensors)``."""
    batch = experiences(dtype)
    given = copy.deepcopy(batch)
    reward_tensors = [experience.rewards for experience in batch]
    maker = _copy_maker(copy.deepcopy(args))
    result = function(maker, batch)
    return result, maker, given, batch, reward_tensors


def _copy_maker(args):
    """The copy's stand-in experience maker: args, a KL controller of value 0.05."""
    kl_controller = types.SimpleNamespace(value=0.05)
    return ORL.RemoteExperienceMaker(kl_controller, types.SimpleNamespace(args=args))


# OpenRLHF's own info["group_reward_std"] of one sample per prompt is torch.std of one value.
@pytest.mark.filterwarnings("ignore:std\\(\\). degrees of freedom is <= 0:UserWarning")
@LABEL
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("n_samples_per_prompt", [1, 4])
@DTYPES
@pytest.mark.parametrize(
    ("gamma", "no_std_norm", "penalties", "clip_range"),
    [(1.0, False, None, None), (0.9, True, 0.5, (-0.5, 0.5)), (0.95, False, -0.5, None)],
    ids=["plain", "gamma-no-std-penalties-clip", "gamma-fixed-penalty"],
)
def test_compute_advantages_and_returns(
    peer, estimator, n_samples_per_prompt, dtype, gamma, no_std_norm, penalties, clip_range
):
    args = _args(estimator, n_samples_per_prompt, gamma, no_std_norm, penalties, clip_range)
    expected, expected_maker, *_ = _run(ORL.compute_advantages_and_returns, args, dtype)
    actual, actual_maker, given, batch, reward_tensors = _run(
        compat.compute_advantages_and_returns, args, dtype
    )
    # OpenRLHF sets gamma to 1 in its config for every estimator but reinforce: so does compat.
    ours_gamma = actual_maker.strategy.args.algo.advantage.gamma
    assert ours_gamma == expected_maker.strategy.args.algo.advantage.gamma
    rtol = RTOL[dtype] if estimator not in NORMALISED else RTOL[torch.float32]
    what = f"{peer} {estimator} n={n_samples_per_prompt} gamma={gamma} penalties={penalties}"
    assert actual is batch and len(actual) == len(expected)
    for ours, theirs in zip(actual, expected, strict=True):
        assert ours.kl is None and theirs.kl is None
        for field in ("advantages", "returns", "rewards"):
            ours_field, theirs_field = getattr(ours, field), getattr(theirs, field)
            assert_parity(ours_field, theirs_field, f"{what} {field}", rtol=rtol)
        assert ours.info.keys() == theirs.info.keys()
        for key in theirs.info:
            assert_parity(ours.info[key], theirs.info[key], f"{what} info {key}", rtol=rtol)
    for before, tensor in zip(given, reward_tensors, strict=True):
        assert torch.equal(tensor, before.rewards), "the caller's reward tensor was modified"


def test_openrlhf_adds_the_length_penalties_into_the_callers_rewards():
    """Why compat copies the rewards first: OpenRLHF's in-place penalty reaches a float32
    caller's tensor."""
    args = _args("reinforce", 4, 1.0, False, -0.5, None)
    _, _, given, _, reward_tensors = _run(ORL.compute_advantages_and_returns, args, torch.float32)
    assert not all(
        torch.equal(tensor, before.rewards)
        for before, tensor in zip(given, reward_tensors, strict=True)
    )


def test_an_unknown_estimator_raises_as_openrlhf_does():
    args = _args("ppo", 4, 1.0, False, None, None)
    with pytest.raises(Exception, match="Unkown advantage_estimator ppo") as expected:
        ORL.compute_advantages_and_returns(_copy_maker(args), experiences(torch.float32))
    with pytest.raises(ValueError, match="Unkown advantage_estimator ppo"):
        compat.compute_advantages_and_returns(_copy_maker(args), experiences(torch.float32))
    assert type(expected.value) is Exception


def test_the_rows_must_fill_whole_prompts_in_prompt_order():
    args = _args("rloo", 5, 1.0, False, None, None)
    with pytest.raises(ValueError, match="n_samples_per_prompt must divide the 12 rows"):
        compat.compute_advantages_and_returns(_copy_maker(args), experiences(torch.float32))
    batch = experiences(torch.float32)
    batch[1].index[0] = batch[0].index[0]
    args = _args("rloo", 4, 1.0, False, None, None)
    with pytest.raises(ValueError, match=r"must together hold each of 0 \.\. B-1 once"):
        compat.compute_advantages_and_returns(_copy_maker(args), batch)


@LABEL
@pytest.mark.parametrize("estimator", NORMALISED)
@pytest.mark.parametrize("empty", ["no-valid-token", "a-nan-advantage"])
def test_advantages_normalised_over_no_valid_token_or_a_nan_are_nan_as_openrlhfs(
    peer, estimator, empty
):
    """OpenRLHF's normalisation over the batch's valid tokens: with none, its mean is 0 / 0 and
    every advantage NaN; with a NaN among them, NaN too. The compat raised a ValueError (its
    moments' shift was NaN)."""
    args = _args(estimator, 1, 1.0, False, None, None)
    outputs = []
    for function in (ORL.compute_advantages_and_returns, compat.compute_advantages_and_returns):
        batch = experiences(torch.float32, seed=3)
        for experience in batch:
            if empty == "no-valid-token":
                experience.action_mask = torch.zeros_like(experience.action_mask)
            else:
                experience.values[0, 0] = experience.kl[0, 0] = math.nan
                experience.action_mask[0, 0] = True
        outputs.append(function(_copy_maker(copy.deepcopy(args)), batch))
    for theirs, ours in zip(*outputs, strict=True):
        assert theirs.advantages.isnan().all(), f"{peer} {estimator} {empty}"
        assert ours.advantages.isnan().all(), f"{estimator} {empty}"
