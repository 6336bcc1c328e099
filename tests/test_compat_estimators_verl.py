"""ppo_fast.compat.verl's critic-free advantage estimators equal verl 0.9.1's: verl itself where
it imports (ids say verl-0.9.1-real) and always the verbatim copy (verl-0.9.1-copy), on batches
of grouped rows (adjacent, shuffled, uneven and partial groups, groups of one, a group of equal
scores; string and integer uids) under right-padded masks, masks with holes and an empty row:
float64 to 1e-12, float32 to float32 rounding.

float32, where verl's loop divides by ``std + epsilon`` (GRPO, GDPO, Pass@k): verl reduces in
float32, and its mean of a group of equal scores can be an ulp off, which the division by
1e-6 turns into an advantage of order 0.01 (test_verl_float32_loop_is_off_on_equal_scores shows
it). ppo_fast's statistics are float64, so there the float32 results are held to verl's code run
in float64 and rounded to float32.
"""

from __future__ import annotations

import numpy as np
import peers
import pytest
import torch
from peers.cases import GROUPINGS, MASKS, assert_parity, group_batch

from ppo_fast.compat import _verl_estimators
from ppo_fast.compat import verl as compat

PEERS = peers.verl_real_and_copy()
BY_PEER = pytest.mark.parametrize("peer", PEERS, ids=[p.label for p in PEERS])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
GROUPED = pytest.mark.parametrize("grouping", list(GROUPINGS))
MASK_KINDS = pytest.mark.parametrize("kind", ["right-padded", "holes", "with-empty-row"])
ALL_MASKS = pytest.mark.parametrize("kind", MASKS)

# The estimators of one score per row, called (token_level_rewards, response_mask, index,
# **options), with the options each is run with.
ROW_ESTIMATORS = {
    "compute_grpo_outcome_advantage": [
        {},
        {"norm_adv_by_std_in_grpo": False},
        {"epsilon": 1e-3},
    ],
    "compute_grpo_vectorized_outcome_advantage": [{}, {"norm_adv_by_std_in_grpo": False}],
    "compute_gdpo_outcome_advantage": [{}, {"norm_adv_by_std_in_grpo": False}],
    "compute_reinforce_plus_plus_baseline_outcome_advantage": [{}],
    "compute_rloo_outcome_advantage": [{}],
    "compute_opo_outcome_advantage": [{}],
    "compute_gpg_outcome_advantage": [{}, {"f_norm": 2.5, "alpha": 7.0}],
    "compute_rloo_vectorized_outcome_advantage": [{}],
}
# Where verl's float32 loop divides its float32 statistics by std + epsilon (module docstring).
VIA_FLOAT64 = {
    "compute_grpo_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
}
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def _snapshot(*tensors):
    return [t.clone() for t in tensors]


def _assert_unchanged(before, after, what):
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new), f"{what}: an input was modified"


def _assert_same_pair(actual, expected, dtype, what):
    """verl's (advantages, returns) pair: a tuple of two tensors, the same object twice where
    verl returns one twice, equal to verl's, not differentiable."""
    assert isinstance(actual, tuple) and len(actual) == 2, f"{what}: {type(actual)}"
    assert (actual[0] is actual[1]) == (expected[0] is expected[1]), what
    for ours, theirs, name in zip(actual, expected, ("advantages", "returns"), strict=True):
        assert not ours.requires_grad, f"{what} {name}"
        assert ours.device == theirs.device, f"{what} {name}"
        assert_parity(ours, theirs, f"{what} {name}", rtol=RTOL[dtype])


def _expected(function, name, dtype, *arguments, **options):
    """verl's result, run in float64 and rounded where its float32 loop loses the digits."""
    if dtype == torch.float32 and name in VIA_FLOAT64:
        wide = [
            a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in arguments
        ]
        advantages, returns = function(*wide, **options)
        narrowed = advantages.float()
        return narrowed, narrowed if returns is advantages else returns.float()
    return function(*arguments, **options)


@BY_PEER
@pytest.mark.parametrize("name", list(ROW_ESTIMATORS))
@GROUPED
@MASK_KINDS
@DTYPES
def test_row_estimators(peer, name, grouping, kind, dtype):
    b = group_batch(grouping, kind, dtype, seed=len(name))
    inputs = (b.rewards, b.mask)
    index = b.index.copy()
    before = _snapshot(*inputs)
    for options in ROW_ESTIMATORS[name]:
        what = f"{peer.label} {name} {options}"
        expected = _expected(getattr(peer.api, name), name, dtype, *inputs, b.index, **options)
        actual = getattr(compat, name)(*inputs, b.index, **options)
        _assert_same_pair(actual, expected, dtype, what)
    _assert_unchanged(before, inputs, name)
    assert np.array_equal(index, b.index)


@BY_PEER
@pytest.mark.parametrize("uids", ["int", "str"])
@pytest.mark.parametrize(
    "name",
    ["compute_grpo_vectorized_outcome_advantage", "compute_rloo_vectorized_outcome_advantage"],
)
@DTYPES
def test_vectorised_estimators_group_integer_and_string_uids(peer, uids, name, dtype):
    b = group_batch("uneven", "holes", dtype, uids=uids, seed=3)
    expected = getattr(peer.api, name)(b.rewards, b.mask, b.index)
    actual = getattr(compat, name)(b.rewards, b.mask, b.index)
    _assert_same_pair(actual, expected, dtype, f"{peer.label} {name} {uids} uids")


@BY_PEER
@DTYPES
def test_vectorised_grpo_groups_huge_uids_without_allocating_by_them(peer, dtype):
    """A uid of 10**12 makes verl's grpo_vectorized allocate 10**12 floats per statistic (verl
    PR 7150); it is run here with small integer uids naming the same groups."""
    b = group_batch("shuffled", "right-padded", dtype, uids="huge-int")
    small = group_batch("shuffled", "right-padded", dtype, uids="int")
    assert b.index.max() > 10**12 and np.array_equal(b.groups, small.groups)
    expected = peer.api.compute_grpo_vectorized_outcome_advantage(b.rewards, b.mask, small.index)
    actual = compat.compute_grpo_vectorized_outcome_advantage(b.rewards, b.mask, b.index)
    _assert_same_pair(actual, expected, dtype, f"{peer.label} huge uids")


@BY_PEER
@pytest.mark.parametrize(
    "index",
    [
        np.array([0.5, 0.7, 0.5, 1.2, 1.0000001, 1.0]),  # truncated: 0.5, 0.7 one group
        np.array([1.0, 1.0, 2.0, 2.0, 3.0, 3.0]),  # integral floats
        np.array(["1", "01", "2", "02", "3", "3"]),  # numeric strings: parsed
        np.array(["1", "01", "a", "a", "b", "b"], dtype=object),  # not all numeric: as given
        np.array([1, "1", "a", "a", 2, 2], dtype=object),  # mixed types: by their str()
        np.array([True, False, True, True, False, False]),
    ],
    ids=["floats", "integral-floats", "numeric-str", "str", "mixed", "bool"],
)
def test_vectorised_grpo_groups_uids_as_verls_as_torch_index(peer, index):
    b = group_batch("adjacent", "right-padded", torch.float64)
    rewards, mask = b.rewards[: index.size], b.mask[: index.size]
    expected = peer.api.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
    actual = compat.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
    _assert_same_pair(actual, expected, torch.float64, f"{peer.label} {index.tolist()}")


@BY_PEER
@pytest.mark.parametrize(
    "index",
    [
        np.array([0.5, 0.7, 0.5, 1.0, 1, 0.7], dtype=object),
        np.array([0.5, 0.7, 0.5, 1.0, 1.0, 0.7]),
        np.array([True, False, True, 1, 0, 2], dtype=object),
        ["a", "b", "a", "c", "b", "c"],
    ],
    ids=["float-objects", "floats", "bool-and-int", "list"],
)
@pytest.mark.parametrize(
    "name",
    [
        "compute_grpo_outcome_advantage",
        "compute_rloo_outcome_advantage",
        "compute_rloo_vectorized_outcome_advantage",
    ],
)
def test_uids_group_by_equality_in_the_loops_and_rloo_vectorized(peer, index, name):
    """verl's loops key a dict by each uid (and rloo_vectorized groups by np.unique): 0.5 is a
    uid, 1 and 1.0 and True are one."""
    b = group_batch("adjacent", "right-padded", torch.float64)
    rewards, mask = b.rewards[: len(index)], b.mask[: len(index)]
    expected = getattr(peer.api, name)(rewards, mask, index)
    actual = getattr(compat, name)(rewards, mask, index)
    _assert_same_pair(actual, expected, torch.float64, f"{peer.label} {name} {index}")


@BY_PEER
def test_rloo_loop_and_vectorised_disagree_on_a_group_of_one_as_verl(peer):
    """verl issue 7793: the loop keeps a lone row's raw score, the vectorised path gives it 0."""
    b = group_batch("with-singletons", "right-padded", torch.float64)
    loop = compat.compute_rloo_outcome_advantage(b.rewards, b.mask, b.index)[0]
    vectorised = compat.compute_rloo_vectorized_outcome_advantage(b.rewards, b.mask, b.index)[0]
    alone = np.flatnonzero(np.bincount(b.groups)[b.groups] == 1)
    scores = b.rewards.sum(-1)
    assert alone.size
    for row in alone:
        assert torch.equal(loop[row], scores[row] * b.mask[row])
        assert not vectorised[row].any()
    for name, ours in (
        ("compute_rloo_outcome_advantage", loop),
        ("compute_rloo_vectorized_outcome_advantage", vectorised),
    ):
        theirs = getattr(peer.api, name)(b.rewards, b.mask, b.index)[0]
        assert_parity(ours, theirs, f"{peer.label} {name}", rtol=RTOL[torch.float64])


@BY_PEER
@DTYPES
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32, torch.bool], ids=str)
def test_opo_gives_a_group_without_tokens_verls_nan_but_a_group_of_one_its_zero(
    peer, dtype, mask_dtype
):
    """verl's OPO baseline of a group whose rows hold no valid token is 0 / 0: NaN on every
    position of its rows (NaN times the mask), as the compat's docstring says; ppo_fast's opo
    gives such a group s - s = 0, which the compat once returned. A group of one has baseline 0
    however long its row (here: empty), so its advantages are 0 there."""
    rewards = torch.tensor([[0, 1], [0, 0.5], [0, 2], [0, 3], [1, 1], [0.25, 0]], dtype=dtype)
    mask = torch.tensor([[0, 1], [1, 1], [0, 0], [0, 0], [0, 0], [1, 0]]).to(mask_dtype)
    index = np.array(["a", "a", "b", "b", "c", "a"], dtype=object)
    ours = compat.compute_opo_outcome_advantage(rewards, mask, index)[0]
    theirs = peer.api.compute_opo_outcome_advantage(rewards, mask, index)[0]
    assert ours[2:4].isnan().all() and not ours[[0, 1, 4, 5]].isnan().any()
    assert_parity(ours, theirs, f"{peer.label} opo", rtol=RTOL[dtype])


@BY_PEER
@GROUPED
@MASK_KINDS
@DTYPES
@pytest.mark.parametrize("normalise", [True, False])
def test_passk(peer, grouping, kind, dtype, normalise):
    """Pass@k reads norm_adv_by_std_in_grpo from config, never from its argument, and refuses a
    group of one row with verl's ValueError."""
    b = group_batch(grouping, kind, dtype, seed=11)
    config = peer.make_algo_config(norm_adv_by_std_in_grpo=normalise)
    name = "compute_grpo_passk_outcome_advantage"
    arguments = (b.rewards, b.mask, b.index)
    if np.bincount(b.groups).min() < 2:
        with pytest.raises(ValueError) as expected:
            peer.api.compute_grpo_passk_outcome_advantage(*arguments, config=config)
        with pytest.raises(ValueError) as actual:
            compat.compute_grpo_passk_outcome_advantage(*arguments, config=config)
        assert str(actual.value) == str(expected.value)
        return
    for flag in (True, False):  # ignored: config decides
        options = {"norm_adv_by_std_in_grpo": flag, "config": config}
        expected = _expected(getattr(peer.api, name), name, dtype, *arguments, **options)
        actual = compat.compute_grpo_passk_outcome_advantage(*arguments, **options)
        _assert_same_pair(actual, expected, dtype, f"{peer.label} passk {options}")
    with pytest.raises(AssertionError):
        compat.compute_grpo_passk_outcome_advantage(*arguments)


@BY_PEER
@MASK_KINDS
@DTYPES
@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
@pytest.mark.parametrize("normalise", [True, False])
def test_gdpo_reads_its_reward_dimensions_from_the_batch(peer, kind, dtype, weights, normalise):
    b = group_batch("uneven", kind, dtype, seed=5)
    rows = b.mask.shape[0]
    rng = np.random.default_rng(2)
    keys = ["format_reward", "accuracy_reward", "length_reward"]
    # verl reads these scores as float32 whatever the batch's dtype, so its float32 loop runs
    # (module docstring): dyadic scores keep its group means exact.
    scores = [0.0, 0.25, 0.5, 1.0]
    non_tensor_batch = {key: list(rng.choice(scores, rows)) for key in keys}
    non_tensor_batch["uid"] = b.index
    prompt_length = 4
    attention_mask = torch.cat([torch.ones(rows, prompt_length, dtype=torch.int64), b.mask], dim=1)
    batch = {"prompts": torch.zeros(rows, prompt_length), "attention_mask": attention_mask}
    config = peer.make_algo_config(gdpo_reward_keys=keys, gdpo_reward_weights=weights)
    arguments = (b.rewards, b.mask, b.index)
    options = {
        "norm_adv_by_std_in_grpo": normalise,
        "config": config,
        "non_tensor_batch": non_tensor_batch,
        "batch": batch,
    }
    expected = peer.api.compute_gdpo_outcome_advantage(*arguments, **options)
    actual = compat.compute_gdpo_outcome_advantage(*arguments, **options)
    _assert_same_pair(actual, expected, torch.float32, f"{peer.label} gdpo {weights} {normalise}")
    missing = peer.make_algo_config(gdpo_reward_keys=["missing_reward"])
    for function in (
        peer.api.compute_gdpo_outcome_advantage,
        compat.compute_gdpo_outcome_advantage,
    ):
        with pytest.raises(AssertionError, match="'missing_reward' not found"):
            function(*arguments, config=missing, non_tensor_batch=non_tensor_batch, batch=batch)


def test_verl_float32_loop_is_off_on_equal_scores():
    """The reason float32 GRPO is held to verl run in float64: three scores of 0.11 in float32
    get 0.0074 each from verl's loop, 0 from the float64 statistics."""
    rewards = torch.full((3, 1), 0.11, dtype=torch.float32)
    mask = torch.ones(3, 1, dtype=torch.int64)
    index = np.array(["a", "a", "a"], dtype=object)
    verl32 = peers.verl_0_9_1.compute_grpo_outcome_advantage(rewards, mask, index)[0]
    assert verl32.min() > 0.007
    ours = compat.compute_grpo_outcome_advantage(rewards, mask, index)[0]
    assert torch.equal(ours, torch.zeros_like(ours))


def test_a_tensor_of_uids_is_refused_where_verls_loop_fails_on_it():
    b = group_batch("adjacent", "right-padded")
    index = torch.tensor(b.groups)
    with pytest.raises(KeyError):
        peers.verl_0_9_1.compute_grpo_outcome_advantage(b.rewards, b.mask, index)
    for name in (
        "compute_grpo_outcome_advantage",
        "compute_rloo_outcome_advantage",
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
    ):
        with pytest.raises(TypeError, match=r"index must be .* index\.cpu\(\)\.numpy\(\)"):
            getattr(compat, name)(b.rewards, b.mask, index)


def test_gpg_scales_by_verls_float32_alpha():
    """verl ignores gpg's alpha argument and uses B / (nonzero scores), a float32 tensor: 6 / 5
    is 1.2000000477 even for float64 scores."""
    rewards = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [0.0]], dtype=torch.float64)
    mask = torch.ones(6, 1, dtype=torch.int64)
    index = np.array([0, 0, 0, 1, 1, 1])
    advantages = compat.compute_gpg_outcome_advantage(rewards, mask, index, alpha=3.0)[0]
    assert advantages[0, 0].item() == float(np.float32(6 / 5)) * (1.0 - 2.0)


@BY_PEER
@ALL_MASKS
@DTYPES
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(peer, kind, dtype, gamma):
    b = group_batch("uneven", kind, dtype, seed=7)
    config = peer.make_algo_config(gamma=gamma)
    before = _snapshot(b.rewards, b.mask)
    expected = peer.api.compute_reinforce_plus_plus_outcome_advantage(b.rewards, b.mask, config)
    actual = compat.compute_reinforce_plus_plus_outcome_advantage(b.rewards, b.mask, config)
    _assert_same_pair(actual, expected, dtype, f"{peer.label} REINFORCE++ gamma={gamma}")
    _assert_unchanged(before, (b.rewards, b.mask), "REINFORCE++")
    with pytest.raises(AssertionError):
        compat.compute_reinforce_plus_plus_outcome_advantage(b.rewards, b.mask)


@BY_PEER
@ALL_MASKS
@DTYPES
def test_remax_leaves_returns_at_masked_positions_as_verl(peer, kind, dtype):
    b = group_batch("uneven", kind, dtype, seed=8)
    before = _snapshot(b.rewards, b.baselines, b.mask)
    expected = peer.api.compute_remax_outcome_advantage(b.rewards, b.baselines, b.mask)
    actual = compat.compute_remax_outcome_advantage(b.rewards, b.baselines, b.mask)
    _assert_same_pair(actual, expected, dtype, f"{peer.label} ReMax")
    _assert_unchanged(before, (b.rewards, b.baselines, b.mask), "ReMax")
    if kind in ("left-padded", "holes"):
        masked = b.mask == 0
        assert actual[1][masked].abs().sum() > 0, "verl's returns are not zeroed where masked"


OTB = [
    "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
]
OTB_OPTIONS = [{}, {"handle_zero_tail": False}, {"epsilon": 1e-3}]


def _otb_arguments(b, with_is_weights):
    weights = b.is_weights if with_is_weights else None
    return (b.rewards, b.mask, b.index, b.old_log_probs, b.sum_pi_squared, weights)


@BY_PEER
@pytest.mark.parametrize("name", OTB)
@GROUPED
@ALL_MASKS
@DTYPES
@pytest.mark.parametrize("with_is_weights", [False, True])
def test_optimal_token_baseline(peer, name, grouping, kind, dtype, with_is_weights):
    b = group_batch(grouping, kind, dtype, seed=9)
    arguments = _otb_arguments(b, with_is_weights)
    before = _snapshot(*(a for a in arguments if torch.is_tensor(a)))
    for options in OTB_OPTIONS:
        expected = getattr(peer.api, name)(*arguments, **options)
        actual = getattr(compat, name)(*arguments, **options)
        _assert_same_pair(actual, expected, dtype, f"{peer.label} {name} {options}")
    _assert_unchanged(before, [a for a in arguments if torch.is_tensor(a)], name)


@BY_PEER
@pytest.mark.parametrize("handle_zero_tail", [True, False])
def test_plain_otb_counts_empty_rows_as_group_members(peer, handle_zero_tail):
    """A group of one row with valid tokens and three without, under a right-padded mask: verl's
    plain OTB counts the empty rows, so without the zero tail that row gets a baseline."""
    b = group_batch("adjacent", "right-padded", torch.float64)
    mask = b.mask.clone()
    mask[1:4] = 0
    arguments = (b.rewards, mask, b.index, b.old_log_probs, b.sum_pi_squared)
    name = "compute_optimal_token_baseline_advantage"
    options = {"handle_zero_tail": handle_zero_tail}
    expected = getattr(peer.api, name)(*arguments, **options)
    actual = getattr(compat, name)(*arguments, **options)
    _assert_same_pair(actual, expected, torch.float64, f"{peer.label} {options}")


def test_plain_otb_runs_on_the_kernel_where_the_alignments_agree(monkeypatch):
    def refuse(*arguments):
        raise AssertionError("a right-padded mask must run on the kernel")

    monkeypatch.setattr(_verl_estimators, "_position_aligned_otb", refuse)
    b = group_batch("uneven", "right-padded", torch.float64)
    compat.compute_optimal_token_baseline_advantage(*_otb_arguments(b, True))
    with pytest.raises(AssertionError, match="must run on the kernel"):
        holes = group_batch("uneven", "holes", torch.float64)
        compat.compute_optimal_token_baseline_advantage(*_otb_arguments(holes, True))


def test_bad_inputs_get_errors_that_name_them():
    b = group_batch("adjacent", "right-padded", torch.float64)
    with pytest.raises(TypeError, match=r"token_level_rewards must be a floating-point tensor"):
        compat.compute_rloo_outcome_advantage(b.rewards.long(), b.mask, b.index)
    with pytest.raises(ValueError, match=r"index \(the rows' group uids\): .* shape \(12,\)"):
        compat.compute_grpo_outcome_advantage(b.rewards, b.mask, b.index[:-1])
    floats = b.groups.astype(np.float64) + 0.5
    floats[3] = np.nan
    with pytest.raises(ValueError, match="index holds NaN or inf"):
        compat.compute_grpo_vectorized_outcome_advantage(b.rewards, b.mask, floats)
    with pytest.raises(ValueError, match=r"index \(the rows' group uids\): groups\[3\] is NaN"):
        compat.compute_rloo_vectorized_outcome_advantage(b.rewards, b.mask, floats)
