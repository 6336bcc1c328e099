"""verl 0.9.1's critic-free advantage estimators on ppo_fast's kernels (``ppo_fast.compat.verl``
re-exports them: import them from there). The rows are grouped by their ``index`` uids with
ppo_fast's factorisation, the group statistics run on ``ppo_fast.outcome`` and the returns and the
optimal token baseline on ``ppo_fast.returns`` (float64); verl's torch expressions stay around
them, so the dtypes and the quirks are verl's (each named in its function's docstring).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from .. import outcome as _outcome
from .. import returns as _returns
from .. import torch as ppo_torch
from .._groups import Groups, factorize
from .._peers import verl_0_9_1 as _verl
from ._outcome import outcome_rows
from ._verl_functional import _carry_into_masked, masked_whiten

# ---- verl/trainer/ppo/core_algos.py: the critic-free advantage estimators -----------------------
# verl's estimators reduce one score per row (the row's sum of token_level_rewards, over every
# position) per group of ``index`` uids, then broadcast it back with ``* response_mask``. Here the
# grouping and the reduction are ppo_fast's (``ppo_fast.outcome``, ``ppo_fast.returns``, float64
# statistics, O(B)); the row sum and the broadcast stay verl's torch expressions, which fix the
# result's dtype (that of ``scores * response_mask``) as verl's do.


# What the row sums are named in errors: verl's argument they come from.
_REWARDS = "token_level_rewards"


def _uid_labels(index: Any) -> Any:
    """``index`` as labels that group as verl's dict keys (or ``np.unique``) group them: floats
    and bools are uids there (0.5 is a group, True is 1), where ppo_fast's groups refuse them as
    ids; as Python objects they compare and hash as verl's keys do."""
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    if isinstance(index, np.ndarray) and index.dtype.kind in "fb":
        return index.astype(object)
    return index


def _factorize_index(labels: Any, n_rows: int) -> Groups:
    try:
        return factorize(labels, n_rows)
    except (TypeError, ValueError) as error:
        raise type(error)(f"index (the rows' group uids): {error}") from None


def _row_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """Each row's score, its token-level rewards summed over the positions, as verl takes it;
    anything but (bs, response_length) is refused here, naming verl's argument (verl would sum
    a 3-D tensor over its last axis and go on with (bs, T) "scores")."""
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.ndim != 2:
        shape = tuple(getattr(token_level_rewards, "shape", ()))
        raise ValueError(
            f"token_level_rewards must be a 2-D tensor (bs, response_length), got shape {shape}: "
            "pass the per-token rewards with each response's score on its last valid token"
        )
    return token_level_rewards.sum(dim=-1)


def _loop_groups(index: Any, n_rows: int) -> Groups:
    """The groups of verl's loop estimators, which key a dict by ``index[i]``."""
    if isinstance(index, torch.Tensor):
        raise TypeError(
            "index must be a NumPy array or a list of uids, got a torch.Tensor: verl's loop keys "
            "a dict by index[i], a new 0-d tensor each time (hashed by identity), and fails with "
            "a KeyError; pass index.cpu().numpy()"
        )
    return _factorize_index(_uid_labels(index), n_rows)


def _as_torch_index_groups(index: Any, n_rows: int) -> Groups:
    """The groups of verl's ``as_torch_index(index)`` (verl/utils/groupwise.py), numbered densely.

    as_torch_index keeps integer labels as they are (verl then allocates max(uid) + 1 floats per
    group statistic: PR 7150), rounds floats within 1e-6 of an integer, truncates other floats to
    integers and parses numeric strings as integers (so 0.5 and 0.7, or "1" and "01", are one
    group), and numbers any other labels with ``np.unique``, falling back to their ``str`` when
    they do not sort. The copy's own function decides every label it would transform; labels it
    would only pass to ``np.unique`` group by equality, which ppo_fast's factorisation gives
    without the sort."""
    if isinstance(index, torch.Tensor):
        return _factorize_index(_verl.as_torch_index(index, device="cpu").numpy(), n_rows)
    labels = _verl._to_1d_numpy_object_array(index)
    if labels.dtype.kind in "iu":
        return _factorize_index(labels, n_rows)
    if labels.dtype.kind == "f" and not np.all(np.isfinite(labels)):
        # as_torch_index casts NaN and inf to the integer -2**63, which verl's group_mean_std
        # then uses as a memory index (an IndexError).
        raise ValueError(
            "index holds NaN or inf: every row needs a group uid; pass integer or string uids"
        )
    if labels.dtype.kind in "fb":
        return _factorize_index(_verl.as_torch_index(labels, device="cpu").numpy(), n_rows)
    try:
        parsed = labels.astype(np.int64)
    except Exception:  # as verl's: any label that int() refuses leaves the labels as they are
        parsed = None
    if parsed is not None:
        return _factorize_index(parsed, n_rows)
    if labels.dtype == object and len(set(map(type, labels))) > 1:
        # np.unique cannot sort labels of several types: verl's fallback numbers their str().
        return _factorize_index(_verl.as_torch_index(labels, device="cpu").numpy(), n_rows)
    return _factorize_index(labels, n_rows)


def _loop_grpo(
    scores: torch.Tensor, groups: Groups, epsilon: float, norm_adv_by_std_in_grpo: bool
) -> torch.Tensor:
    """The per-row advantages of verl's GRPO loop, on ``ppo_fast.outcome.grpo``.

    verl gives a group of one row the std ``torch.tensor(1.0)``, a float32, so its divisor
    ``std + epsilon`` is float32(1 + epsilon) (1.00000095 for 1e-6) whatever the scores' dtype;
    ppo_fast's "raw" convention divides by 1 + epsilon: those rows are divided as verl does."""
    std = "group" if norm_adv_by_std_in_grpo else None
    advantages = outcome_rows(_REWARDS, _outcome.grpo, scores, groups, std=std, eps=epsilon)
    if not norm_adv_by_std_in_grpo:
        return advantages
    alone = torch.from_numpy(groups.sizes[groups.ids] == 1).to(scores.device)
    return torch.where(alone, scores / (torch.tensor(1.0) + epsilon), advantages)


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``scalars.unsqueeze(-1) * response_mask``."""
    return per_row.unsqueeze(-1) * response_mask


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage on ``ppo_fast.outcome.grpo``:
    ``(advantages, advantages)``, the same tensor twice, as verl returns it.

    Each row's score (its token_level_rewards summed over every position) becomes
    ``(score - mean) / (std + epsilon)`` over the rows of its ``index`` uid (unbiased std), or
    ``score - mean`` when ``norm_adv_by_std_in_grpo`` is false (Dr. GRPO); a group of one row
    keeps mean 0 and std 1, so its advantage is ``score / (1 + epsilon)``, with ``1 + epsilon``
    in float32 as verl computes it (1.00000095). The result is that value times
    ``response_mask``. ``config`` is not read.

    verl's loop reduces in the scores' dtype: in float32 its group mean of equal scores can be
    one ulp off, and divided by ``std + 1e-6`` that ulp becomes an advantage of order 0.01
    (three scores of 0.11 get 0.0074 each, not 0). The statistics here are float64, so the
    float32 result is verl's computed in float64 and rounded once.
    """
    with torch.no_grad():
        scores = _row_scores(token_level_rewards)
        groups = _loop_groups(index, scores.shape[0])
        advantages = _loop_grpo(scores, groups, epsilon, norm_adv_by_std_in_grpo)
        advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_grpo_vectorized_outcome_advantage: GRPO as
    ``compute_grpo_outcome_advantage``, with the vectorised path's own quirks, reproduced:

    - The groups are those of verl's ``as_torch_index``: integer uids as they are, floats near an
      integer rounded and other floats truncated (0.5 and 0.7 are one group), numeric strings
      parsed (``"1"`` and ``"01"`` are one group). verl then allocates ``max(uid) + 1`` floats
      for each group statistic, so a uid of 10**12 asks for terabytes, and a negative uid raises
      an IndexError (PR 7150). Here the uids are numbered densely by ppo_fast's factorisation:
      the same groups and the same result, for the memory of the groups that exist.
    - The group mean and std are float32 whatever the scores' dtype (verl's ``group_mean_std``,
      run here from the copy on the dense ids), and float64 scores have that float32 mean
      subtracted: float64 results differ from the loop's by about 1e-7.
    - ``norm_adv_by_std_in_grpo`` is honoured by this function, but verl's trainer
      (``ray_trainer.compute_advantage``) does not pass it to any estimator but GRPO's loop, so
      there ``grpo_vectorized`` always divides by the std (PR 7893). ``config`` is not read.
    """
    with torch.no_grad():
        scores = _row_scores(token_level_rewards)
        groups = _as_torch_index_groups(index, scores.shape[0])
        group_ids = torch.tensor(groups.ids, device=scores.device)
        mean_g, std_g, _ = _verl.group_mean_std(scores, group_ids, eps=0.0, device=scores.device)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean_g[group_ids]) / (std_g[group_ids] + epsilon)
        else:
            scalars = scores - mean_g[group_ids]
        advantages = _broadcast(scalars, response_mask)
        return advantages, advantages


def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: dict | None = None,
    batch: dict | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_gdpo_outcome_advantage (arXiv 2601.05242):
    ``(advantages, advantages)``.

    Each reward dimension k is normalised by GRPO within the groups (the loop's conventions,
    ``norm_adv_by_std_in_grpo`` and ``epsilon`` as given), the dimensions are summed with their
    weights (float32), and the sum is whitened over the batch's valid tokens by verl's
    ``masked_whiten`` (unbiased, so fewer than two valid tokens raise ValueError), times
    ``response_mask``.

    With ``config``, ``non_tensor_batch`` and ``batch`` all given, the dimensions are the
    per-row scores ``non_tensor_batch[key]`` for each key of ``config.gdpo_reward_keys``
    (float32; verl writes each on one token of a zero row and sums the row back, which gives the
    score itself), weighted by ``config.gdpo_reward_weights`` (default all 1); verl's assertions
    on missing keys are kept. Otherwise there is one dimension, the rows' sums of
    ``token_level_rewards``, weight 1: GRPO then whitening.
    """
    dimensions = None
    reward_weights = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        gdpo_reward_keys = config.get("gdpo_reward_keys", None)
        assert gdpo_reward_keys, (
            "GDPO requires 'algorithm.gdpo_reward_keys' listing the individual reward "
            "component keys returned by compute_score (e.g. ['format_reward', 'accuracy_reward'])."
        )
        dimensions = []
        for key in gdpo_reward_keys:
            assert key in non_tensor_batch, (
                f"GDPO reward key '{key}' not found in non_tensor_batch. "
                f"Available keys: {list(non_tensor_batch.keys())}. "
                f"Make sure your compute_score returns a dict containing '{key}'."
            )
            scores = np.asarray(non_tensor_batch[key], dtype=np.float32)
            dimensions.append(torch.tensor(scores, device=token_level_rewards.device))
        gdpo_weights = config.get("gdpo_reward_weights", None)
        if gdpo_weights is not None:
            reward_weights = list(gdpo_weights)
    with torch.no_grad():
        if dimensions is None:
            dimensions = [_row_scores(token_level_rewards)]
        if reward_weights is None:
            reward_weights = [1.0] * len(dimensions)
        if len(reward_weights) < len(dimensions):
            raise ValueError(
                f"gdpo_reward_weights has {len(reward_weights)} weights for "
                f"{len(dimensions)} gdpo_reward_keys: give one weight per key"
            )
        weights = torch.tensor(reward_weights, dtype=torch.float32, device=dimensions[0].device)
        groups = _loop_groups(index, dimensions[0].shape[0])
        combined = None
        for weight, scores in zip(weights, dimensions, strict=False):
            normalised = _loop_grpo(scores, groups, epsilon, norm_adv_by_std_in_grpo)
            term = weight * _broadcast(normalised, response_mask)
            combined = term if combined is None else combined + term
        advantages = masked_whiten(combined, response_mask) * response_mask
    return advantages, advantages


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_grpo_passk_outcome_advantage (arXiv 2503.19595) on
    ``ppo_fast.outcome.pass_at_k``: ``(advantages, advantages)``.

    Only the best row of each group gets an advantage, ``max - second max`` of the group's
    scores, divided by ``std + epsilon`` (unbiased std) when normalising; every other row gets 0.
    ``config`` is required (an AssertionError without it, as verl), and whether to normalise is
    ``config.get("norm_adv_by_std_in_grpo", True)``: verl ignores the argument of that name. A
    group of one row raises verl's ValueError, naming the first such group in the order the
    uids first appear.
    """
    assert config is not None
    # if True, normalize advantage by std within group
    norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", True)
    with torch.no_grad():
        scores = _row_scores(token_level_rewards)
        groups = _loop_groups(index, scores.shape[0])
        sizes = groups.sizes
        if np.any(sizes < 2):
            group = int(np.argmax(sizes < 2))
            raise ValueError(
                "Pass@k requires at least 2 samples per group. "
                f"Got {sizes[group]} for group {groups.labels[group]}."
            )
        advantages = outcome_rows(
            _REWARDS,
            _outcome.pass_at_k,
            scores,
            groups,
            normalize=bool(norm_adv_by_std_in_grpo),
            eps=epsilon,
        )
        advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage
    (arXiv 2501.03262): ``(advantages, advantages)``.

    Each row's score minus its group's mean (a group of one keeps its score), on the row's valid
    tokens, whitened over the batch's valid tokens by verl's ``masked_whiten`` (unbiased; fewer
    than two valid tokens raise ValueError), times ``response_mask``. The centring is
    ``ppo_fast.outcome.grpo`` without the std; ``epsilon`` and ``config`` are not read. verl
    annotates ``index`` as a tensor, but its loop fails on one (a KeyError): pass the uids.
    """
    with torch.no_grad():
        scores = _row_scores(token_level_rewards)
        groups = _loop_groups(index, scores.shape[0])
        centred = outcome_rows(_REWARDS, _outcome.grpo, scores, groups, std=None)
        advantages = _broadcast(centred, response_mask)
        advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, advantages


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_rloo_outcome_advantage (arXiv 2402.14740) on
    ``ppo_fast.outcome.rloo``: ``(advantages, advantages)``.

    Each row's score minus the mean of the other rows of its group,
    ``(n * score - group sum) / (n - 1)``, times ``response_mask``. A group of one row keeps its
    raw score (``compute_rloo_vectorized_outcome_advantage`` gives it 0 instead: verl issue
    7793). ``epsilon`` and ``config`` are not read.
    """
    with torch.no_grad():
        scores = _row_scores(token_level_rewards)
        groups = _loop_groups(index, scores.shape[0])
        advantages = outcome_rows(_REWARDS, _outcome.rloo, scores, groups, singleton="raw")
        advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_opo_outcome_advantage (arXiv 2505.23585) on
    ``ppo_fast.outcome.opo``: ``(advantages, advantages)``.

    Each row's score minus its group's length-weighted mean score,
    ``sum(len * score) / sum(len)`` with ``len`` the row's ``response_mask`` sum, times
    ``response_mask``; a group of one row keeps its score, and a group whose rows have no valid
    token has a 0 / 0 baseline (NaN), as in verl. ``epsilon`` and ``config`` are not read.
    """
    with torch.no_grad():
        scores = _row_scores(token_level_rewards)
        groups = _loop_groups(index, scores.shape[0])
        # verl weights by the row sums of the mask, float for a float mask: counts here.
        token_counts = ppo_torch.to_numpy(response_mask.sum(dim=-1).long(), "response_mask")
        advantages = outcome_rows(_REWARDS, _outcome.opo, scores, groups, token_counts=token_counts)
        # ppo_fast's opo gives a group without tokens s - s; verl's baseline there is 0 / 0, a
        # NaN on every position of the group's rows (times the mask), but for a group of one,
        # whose baseline is 0.
        group_tokens = np.bincount(groups.ids, weights=token_counts, minlength=groups.n_groups)
        no_baseline = ((group_tokens == 0) & (groups.sizes > 1))[groups.ids]
        if no_baseline.any():
            advantages = advantages.masked_fill(
                torch.from_numpy(no_baseline).to(advantages.device), math.nan
            )
        advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_gpg_outcome_advantage on ``ppo_fast.outcome.gpg``:
    ``(advantages, advantages)``.

    ``alpha * (score - group mean) / f_norm`` times ``response_mask`` (a group of one keeps mean
    0). verl ignores its ``alpha`` argument: it sets ``alpha = bs / max(m, 1)`` with m the number
    of nonzero scores, a float32 tensor (torch's default dtype), so float64 scores are scaled by
    the float32 rounding of that ratio (6 / 5 is 1.2000000477); so does this function.
    ``epsilon`` and ``config`` are not read.
    """
    with torch.no_grad():
        scores = _row_scores(token_level_rewards)
        groups = _loop_groups(index, scores.shape[0])
        batch_alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        advantages = outcome_rows(
            _REWARDS, _outcome.gpg, scores, groups, alpha=float(batch_alpha), f_norm=f_norm
        )
        advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_rloo_vectorized_outcome_advantage on
    ``ppo_fast.outcome.rloo``: ``(advantages, advantages)``.

    As ``compute_rloo_outcome_advantage``, but a group of one row gets 0 (verl multiplies by
    ``count > 1``), where the loop keeps its raw score: verl issue 7793, reproduced. The uids are
    grouped as ``np.unique`` groups them (a torch tensor of uids is accepted here, where the
    loop fails on one); verl raises a TypeError for uids of several types that do not sort, which
    are grouped by equality here. ``epsilon`` and ``config`` are not read.
    """
    with torch.no_grad():
        scores = _row_scores(token_level_rewards)
        groups = _factorize_index(_uid_labels(index), scores.shape[0])
        advantages = outcome_rows(_REWARDS, _outcome.rloo, scores, groups, singleton="zero")
        advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_reinforce_plus_plus_outcome_advantage (arXiv
    2501.03262): ``(advantages, returns)``.

    The returns are the discounted sums ``G_t = r_t + gamma * G_next`` over each row's valid
    tokens (``config.gamma``; masked tokens are skipped, the return carries across them), 0 at
    masked positions: ``ppo_fast.returns.discounted_returns``, in float64. The advantages are the
    returns whitened over the batch's valid tokens by verl's ``masked_whiten`` (unbiased; fewer
    than two valid tokens raise ValueError), times ``response_mask``. ``config`` is required (an
    AssertionError without it, as verl).
    """
    assert config is not None
    gamma = config.gamma
    with torch.no_grad():
        returns = _returns.discounted_returns(
            ppo_torch.to_numpy(token_level_rewards, "token_level_rewards"),
            gamma=gamma,
            mask=ppo_torch.to_numpy(response_mask, "response_mask"),
        )
        returns = ppo_torch.from_numpy(returns, token_level_rewards)
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def _returns_to_go(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``(rewards * response_mask).flip(-1).cumsum(-1).flip(-1)``: at a valid position the
    sum of the row's valid rewards from there on (``ppo_fast.returns.discounted_returns`` with
    gamma 1, float64), and at a masked one the return of the row's next valid position, 0 after
    the last (verl's cumulative sum runs through masked positions and stores its running total
    there: left padding and holes get nonzero returns)."""
    returns = _returns.discounted_returns(
        ppo_torch.to_numpy(rewards, "token_level_rewards"),
        gamma=1.0,
        mask=ppo_torch.to_numpy(response_mask, "response_mask"),
    )
    return _carry_into_masked(ppo_torch.from_numpy(returns, rewards), response_mask)


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_remax_outcome_advantage (arXiv 2310.10505):
    ``(advantages, returns)``.

    The returns are each valid token's reward-to-go over the row's valid rewards; verl does not
    zero them at masked positions, where they hold the return of the row's next valid token
    (left padding gets the whole row's), and the advantages are ``returns - reward_baselines *
    response_mask``, so at a masked position they are that return too: both reproduced. Note
    verl's argument order: the baselines (bs,) come before the mask. ``config`` is not read.
    """
    with torch.no_grad():
        dtype = torch.promote_types(token_level_rewards.dtype, response_mask.dtype)
        returns = _returns_to_go(token_level_rewards.to(dtype), response_mask)
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def _kernel_otb(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    handle_zero_tail: bool,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ppo_fast.returns.optimal_token_baseline`` (rows aligned by valid-token index) on verl's
    tensors: ``(advantages, returns)`` in the dtype of ``rewards * response_mask``, the returns
    carried into masked positions as verl's cumulative sum leaves them."""
    result_dtype = torch.promote_types(token_level_rewards.dtype, response_mask.dtype)
    tokens = [token_level_rewards, old_log_probs, sum_pi_squared]
    if rollout_is_weights is not None:
        tokens.append(rollout_is_weights)
    # The kernel takes one dtype: the widest of verl's operands, as its arithmetic promotes them.
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tokens], result_dtype)
    names = ("token_level_rewards", "old_log_probs", "sum_pi_squared", "rollout_is_weights")
    arrays = [ppo_torch.to_numpy(t.to(dtype), n) for t, n in zip(tokens, names, strict=False)]
    result = _returns.optimal_token_baseline(
        *arrays[:3],
        groups,
        is_weights=arrays[3] if rollout_is_weights is not None else None,
        mask=ppo_torch.to_numpy(response_mask, "response_mask"),
        eps=epsilon,
        zero_tail=bool(handle_zero_tail),
    )
    device = token_level_rewards.device
    advantages = torch.from_numpy(result.advantages).to(device=device, dtype=result_dtype)
    returns = torch.from_numpy(result.returns).to(device=device, dtype=result_dtype)
    return advantages, _carry_into_masked(returns, response_mask)


def _position_aligned_otb(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Groups,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    handle_zero_tail: bool,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's plain OTB where its alignment by position differs from the kernel's by valid-token
    index: verl's torch expressions, with its loop over the groups replaced by sums over the
    dense group ids (``index_add_``) and its zero-tail bookkeeping by per-group maxima."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w_per_timestep = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w_per_timestep = w_per_timestep * (rollout_is_weights**2)
    w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
    device = returns.device
    group_ids = torch.tensor(groups.ids, device=device)
    per_group = (groups.n_groups, returns.shape[-1])
    weighted = returns * w_cumulative * response_mask
    numerator = weighted.new_zeros(per_group).index_add_(0, group_ids, weighted)
    weights = w_cumulative * response_mask
    denominator = weights.new_zeros(per_group).index_add_(0, group_ids, weights) + epsilon
    baselines = (numerator / denominator)[group_ids].to(returns.dtype)
    # A group of one row has no baseline.
    sizes = torch.tensor(groups.sizes, device=device)[group_ids]
    baselines[sizes == 1] = 0.0
    if handle_zero_tail:
        lengths = response_mask.sum(dim=-1).long()
        longest = torch.full((groups.n_groups,), -1, device=device)
        longest = longest.scatter_reduce(0, group_ids, lengths, "amax")[group_ids]
        at_longest = lengths == longest
        n_longest = torch.zeros(groups.n_groups, dtype=torch.long, device=device)
        n_longest = n_longest.index_add_(0, group_ids, at_longest.long())[group_ids]
        others = torch.where(at_longest, -1, lengths)
        second = torch.full((groups.n_groups,), -1, device=device)
        second = second.scatter_reduce(0, group_ids, others, "amax")[group_ids]
        # verl zeroes the unique longest row's baseline from the second-longest length on.
        alone_longest = at_longest & (n_longest == 1) & (sizes > 1)
        positions = torch.arange(returns.shape[-1], device=device)
        baselines[alone_longest[:, None] & (positions >= second[:, None])] = 0.0
    advantages = (returns - baselines) * response_mask
    return advantages, returns


def _kernel_aligns_as_verl(
    response_mask: torch.Tensor, groups: Groups, handle_zero_tail: bool
) -> bool:
    """Whether verl's plain OTB (rows aligned by position) equals the kernel's (by valid-token
    index): when every row's valid tokens start its row with no hole, and no group holds a
    single row with valid tokens among empty ones without the zero tail (verl counts the empty
    rows as members: that row gets a baseline G W / (W + eps), the kernel's none)."""
    valid = response_mask.bool()
    lengths = valid.sum(dim=-1)
    positions = torch.arange(valid.shape[-1], device=valid.device)
    if not torch.equal(valid, positions < lengths[:, None]):
        return False
    if handle_zero_tail:
        return True
    non_empty = np.bincount(
        groups.ids, weights=(lengths > 0).cpu().numpy(), minlength=groups.n_groups
    )
    return not np.any((non_empty == 1) & (groups.sizes > 1))


def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_optimal_token_baseline_advantage:
    ``(advantages, returns)``, the optimal token baseline (OTB) of each group of ``index``.

    Returns ``G_t``: the reward-to-go over the row's valid rewards. Baseline at position t:
    ``sum(G_t W_t) / (sum(W_t) + epsilon)`` over the group's rows valid at t, with
    ``W_t = cumsum((1 - 2 exp(old_log_probs) + sum_pi_squared) * rollout_is_weights**2)`` over
    the valid positions; none for a group of one row, and with ``handle_zero_tail`` none for the
    group's unique longest row from the second-longest row's length on. Advantages ``(G - B)``
    times ``response_mask``.

    verl's quirks, reproduced: the rows are aligned by position t, not by the index of the
    valid token (``compute_multi_turn_optimal_token_baseline_advantage`` aligns by index), and
    the zero tail starts at the position equal to the second-longest number of valid tokens;
    the returns are not zeroed at masked positions (they hold the next valid token's return);
    a row without valid tokens is a member of its group. Where the mask is right-padded (every
    row's valid tokens first, no hole) the two alignments agree and ``ppo_fast.returns.
    optimal_token_baseline`` runs; otherwise verl's torch expressions, vectorised over the
    groups.
    """
    with torch.no_grad():
        groups = _loop_groups(index, token_level_rewards.shape[0])
        arguments = (
            token_level_rewards,
            response_mask,
            groups,
            old_log_probs,
            sum_pi_squared,
            rollout_is_weights,
            handle_zero_tail,
            epsilon,
        )
        if _kernel_aligns_as_verl(response_mask, groups, handle_zero_tail):
            return _kernel_otb(*arguments)
        return _position_aligned_otb(*arguments)


def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl.trainer.ppo.core_algos.compute_multi_turn_optimal_token_baseline_advantage (the
    "tir" OTB) on ``ppo_fast.returns.optimal_token_baseline``: ``(advantages, returns)``.

    As ``compute_optimal_token_baseline_advantage``, but the rows of a group are compared token
    by token in the order of their valid tokens, whatever their positions (tool and observation
    tokens masked out of a turn do not shift them), and rows without valid tokens belong to no
    group; verl's per-row Python loops are the kernel's pass over the rows. The returns are not
    zeroed at masked positions (they hold the next valid token's return), as verl leaves them.
    """
    with torch.no_grad():
        groups = _loop_groups(index, token_level_rewards.shape[0])
        return _kernel_otb(
            token_level_rewards,
            response_mask,
            groups,
            old_log_probs,
            sum_pi_squared,
            rollout_is_weights,
            handle_zero_tail,
            epsilon,
        )
