"""TRL's PPO trainer arithmetic on ppo_fast's kernels, with the trainer's conventions.

Reproduces TRL 0.29.1 (https://github.com/huggingface/trl, tag v0.29.1, PyPI trl==0.29.1), the
last release with a PPO trainer (TRL 1.x removed it):
``trl/experimental/ppo/ppo_trainer.py`` (``masked_mean``, ``masked_var``, ``masked_whiten``,
``INVALID_LOGPROB``, and steps 3 to 6 of a rollout inside ``PPOTrainer.train``),
``trl/experimental/utils.py`` (``first_true_indices``), and the advantage blocks of
``GRPOTrainer`` and ``RLOOTrainer._generate_and_score_completions`` (``grpo_advantages``,
``rloo_advantages``, with ``nanstd`` of ``trl/trainer/utils.py``), whose group statistics run
on ``ppo_fast.outcome``; and ``GRPOTrainer._compute_loss``'s loss for the loss types grpo,
bnpo, dr_grpo and dapo, with ``delta`` and ``importance_sampling_level`` (``grpo_loss``, from
``._trl_grpo_loss``, on the fused ``clipped_surrogate`` and ``gspo_loss``).

The trainer's conventions, which ``rollout_advantages`` keeps:

- ``sequence_lengths`` holds the index of each response's last real token (``first_true_indices
  (response == pad_token_id) - 1``); positions after it are padding (``padding_mask``), where the
  log-probs are replaced by ``INVALID_LOGPROB`` (so the KL there is 0).
- The score lands on the first padding slot after the EOS (``sequence_lengths + 1``), or on the
  last token when the response fills the width; values are kept up to and including that slot and
  zeroed past it (``padding_mask_p1``), so that slot is a real step of the recursion.
- GAE runs over every position (no mask), ``returns = advantages + values``, then the advantages
  are whitened over the real tokens (unbiased variance) and zeroed on the padding.

What runs where: the GAE recursion (the trainer's Python loop over the response length) runs on
the ppo_fast GAE kernel with every position valid, which is exactly the trainer's recursion; the
whitening takes its sums from the ppo_fast moments kernel and applies TRL's scalar arithmetic
(no epsilon in the mean, Bessel's n / (n - 1), ``rsqrt(var + 1e-8)``: NaN for a single valid
token, ValueError for none) at every position. The padding masks, the elementwise KL and the
reward placement (steps 3 and 4), ``masked_mean``, ``first_true_indices``, ``INVALID_LOGPROB``
and the torch fallbacks of the whitening are TRL's code, run from the verbatim copy in
``ppo_fast._peers.trl_0_29_1``. Parity holds for finite inputs (TRL's ``x * mask`` turns a NaN
at a masked position into NaN; the kernels never read it).
"""

from __future__ import annotations

import math
import types
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import outcome as _outcome
from .. import torch as ppo_torch
from .._peers import trl_0_29_1 as _trl
from .._peers.trl_0_29_1 import INVALID_LOGPROB, first_true_indices, masked_mean, nanstd
from ._masked import PeerMaskedStats
from ._outcome import outcome_rows
from ._trl_grpo_loss import GRPOLoss, grpo_loss

__all__ = [
    "INVALID_LOGPROB",
    "GRPOAdvantages",
    "GRPOLoss",
    "RLOOAdvantages",
    "RolloutAdvantages",
    "first_true_indices",
    "grpo_advantages",
    "grpo_loss",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "nanstd",
    "rloo_advantages",
    "rollout_advantages",
]

_STATS = PeerMaskedStats(
    peer_masked_var=_trl.masked_var,
    peer_masked_whiten=_trl.masked_whiten,
    mean_denominator=lambda mask_sum: mask_sum,
    no_token_error=(
        "The sum of the mask is zero, which can happen when `mini_batch_size=1`;"
        "try increase the `mini_batch_size` or `gradient_accumulation_steps`"
    ),
    one_token_error=None,
)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True):
    """trl.experimental.ppo.ppo_trainer.masked_var: unbiased by default."""
    return _STATS.masked_var(values, mask, unbiased)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True):
    """trl.experimental.ppo.ppo_trainer.masked_whiten: ``(values - mean) * rsqrt(var + 1e-8)``
    at every position, mean and unbiased variance over the mask."""
    return _STATS.masked_whiten(values, mask, shift_mean)


class RolloutAdvantages(NamedTuple):
    """What PPOTrainer.train holds after step 6 of a rollout, under the trainer's names."""

    advantages: torch.Tensor
    returns: torch.Tensor
    rewards: torch.Tensor
    non_score_reward: torch.Tensor
    kl: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    padding_mask: torch.Tensor
    padding_mask_p1: torch.Tensor


@torch.no_grad()
def rollout_advantages(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    sequence_lengths: torch.Tensor,
    *,
    kl_coef: float = 0.05,
    kl_estimator: str = "k1",
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_rewards: bool = False,
) -> RolloutAdvantages:
    """Steps 3 to 6 of PPOTrainer.train: padding masks, KL-shaped rewards with the score on the
    first padding slot, optional reward whitening, GAE, and whitened advantages.

    ``logprobs``, ``ref_logprobs`` and ``values`` are (B, T) over the response; ``scores`` (B,)
    the reward model's scores (after any ``missing_eos_penalty``); ``sequence_lengths`` (B,) the
    index of each response's last real token. The keyword defaults are PPOConfig's.
    """
    # Steps 3 and 4 are TRL's block, from the copy; ``logprobs`` stands in for the responses, of
    # which the block reads only the shape and the device.
    args = types.SimpleNamespace(kl_estimator=kl_estimator, kl_coef=kl_coef)
    step = _trl.ppo_trainer_rewards(
        args, logprobs, sequence_lengths, logprobs, ref_logprobs, values, scores
    )
    rewards, values = step.rewards, step.values
    padding_mask, padding_mask_p1 = step.padding_mask, step.padding_mask_p1

    if whiten_rewards:
        rewards = masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)

    # TRL's loop mixes the two in its arithmetic but keeps each tensor in its own dtype
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    advantages = ppo_torch.gae(rewards.to(dtype), values.to(dtype), gamma=gamma, lam=lam).advantages
    returns = advantages + values.to(dtype)
    advantages = masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return RolloutAdvantages(
        advantages,
        returns,
        rewards,
        step.non_score_reward,
        step.kl,
        step.logprobs,
        step.ref_logprobs,
        values,
        padding_mask,
        padding_mask_p1,
    )


# ---- trl/trainer/grpo_trainer.py and rloo_trainer.py: the advantages of a generation batch ------
# Both trainers score a generation batch of B = prompts x num_generations completions, the
# completions of one prompt adjacent (rows g * n .. g * n + n - 1 are group g), with one column of
# ``rewards_per_func`` per reward function (NaN where a function does not apply to a row).

_SCALE_REWARDS = ("group", "batch", "none")


class GRPOAdvantages(NamedTuple):
    """What GRPOTrainer._generate_and_score_completions holds after its advantage block."""

    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,) the weighted rewards (normalize_then_sum: of normalised ones)
    std_rewards: torch.Tensor  # (B,) the std each advantage was divided by (for logging)
    is_std_zero: torch.Tensor  # (B,) bool, for logging


class RLOOAdvantages(NamedTuple):
    """What RLOOTrainer._generate_and_score_completions holds after its advantage block."""

    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,) weighted, clipped, KL-penalised
    std_rewards: torch.Tensor  # (B / num_generations,) each group's std, for logging
    is_std_zero: torch.Tensor  # (B / num_generations,) bool, for logging


def _weighted_rewards(
    rewards_per_func: torch.Tensor, reward_weights: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, rewards)``: the float32 weights as the trainers build them from
    ``args.reward_weights`` (all 1 when None), and TRL's weighted sum of the reward functions
    that apply to each row (``nansum``)."""
    if rewards_per_func.dim() != 2:
        raise ValueError(
            "rewards_per_func must be (B, number of reward functions), got shape "
            f"{tuple(rewards_per_func.shape)}"
        )
    n_funcs = rewards_per_func.shape[1]
    if reward_weights is None:
        weights = torch.ones(n_funcs, dtype=torch.float32)
    else:
        if len(reward_weights) != n_funcs:
            raise ValueError(
                f"Number of reward weights ({len(reward_weights)}) must match number of reward "
                f"functions ({n_funcs})"
            )
        weights = torch.tensor(reward_weights, dtype=torch.float32)
    weights = weights.to(rewards_per_func.device)
    return weights, (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)


def _generation_groups(n_rows: int, num_generations: int) -> np.ndarray:
    """Group ids of a generation batch: rows g * n .. g * n + n - 1 are the completions of
    prompt g, as TRL's ``view(-1, num_generations)`` reads them."""
    if isinstance(num_generations, bool) or not isinstance(num_generations, int | np.integer):
        raise TypeError(f"num_generations must be an int, got {type(num_generations).__name__}")
    if num_generations < 1 or n_rows % num_generations:
        raise ValueError(
            f"num_generations must be a positive divisor of the batch's {n_rows} rows, got "
            f"{num_generations}: each prompt's completions fill num_generations adjacent rows"
        )
    return np.arange(n_rows) // num_generations


def grpo_advantages(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    reward_weights: Any = None,
    *,
    scale_rewards: str | bool = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> GRPOAdvantages:
    """The advantage block of GRPOTrainer._generate_and_score_completions on
    ``ppo_fast.outcome``.

    ``rewards_per_func`` (B, number of reward functions), NaN where a function does not apply;
    ``num_generations`` completions per prompt, adjacent; ``reward_weights`` one per function
    (GRPOConfig.reward_weights, all 1 when None); the keywords are GRPOConfig's, with its
    defaults (``scale_rewards`` True and False mean "group" and "none", as GRPOConfig reads them).

    - ``"sum_then_normalize"``: the weighted sum of the functions that apply (``nansum``), minus
      its group's mean, divided by ``std + 1e-4``: the group's std (``scale_rewards="group"``),
      the whole batch's (``"batch"``), or not divided (``"none"``). Unbiased stds. With one
      completion per prompt the std is 0 and every advantage is 0.
    - ``"normalize_then_sum"`` (GDPO, arXiv 2601.05242): each function normalised within the
      groups by ``nanmean`` and ``nanstd`` (NaN rows left out; a function that applies to one row
      of a group, or with one completion per prompt, contributes 0 to that group), the weighted
      ``nansum`` of those, then ``(x - mean) / (std + 1e-4)`` over the batch.

    The statistics are float64: TRL's float32 mean of equal rewards can be an ulp off, which its
    division by ``std + 1e-4`` makes an advantage (three rewards of 0.11 get 7.4e-5, 0 here).
    """
    weights, rewards = _weighted_rewards(rewards_per_func, reward_weights)
    groups = _generation_groups(rewards.shape[0], num_generations)
    if multi_objective_aggregation == "sum_then_normalize":
        scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
        if scale_rewards not in _SCALE_REWARDS:
            raise ValueError(
                f"Invalid value for scale_rewards: {scale_rewards}. Must be one of 'batch', "
                "'group', or 'none'."
            )
        std = None if scale_rewards == "none" else scale_rewards
        advantages = outcome_rows(
            "rewards_per_func", _outcome.grpo, rewards, groups, std=std, eps=1e-4, singleton="zero"
        )
        if scale_rewards == "batch":
            std_rewards = _batch_std(rewards)
        elif num_generations > 1:
            std_rewards = rewards.view(-1, num_generations).std(dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif multi_objective_aggregation == "normalize_then_sum":
        normalised = torch.stack(
            [
                _normalised_within_groups(rewards_per_func[:, k], groups, num_generations)
                for k in range(rewards_per_func.shape[1])
            ],
            dim=1,
        )
        rewards = (normalised * weights.unsqueeze(0)).nansum(dim=1)
        std_rewards = _batch_std(rewards)
        advantages = outcome_rows(
            "rewards_per_func",
            _outcome.grpo,
            rewards,
            np.zeros(rewards.shape[0], dtype=np.int64),
            eps=1e-4,
            singleton="zero",
        )
    else:
        raise ValueError(
            f"Invalid multi_objective_aggregation: {multi_objective_aggregation}. Must be "
            "'sum_then_normalize' or 'normalize_then_sum'."
        )
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return GRPOAdvantages(advantages, rewards, std_rewards, is_std_zero)


def _normalised_within_groups(
    column: torch.Tensor, groups: np.ndarray, num_generations: int
) -> torch.Tensor:
    """One reward function normalised within the groups as GRPO's "normalize_then_sum" does:
    ``(x - nanmean) / (nanstd + 1e-4)``, NaN rows left out of the statistics.

    TRL's ``nanstd`` multiplies the population variance by ``count / (count - 1)`` divided as
    int64 tensors, so in float32 (4 / 3 is 1.3333333731) whatever the rewards' dtype. With
    k = sqrt of that factor, ppo_fast's population-variance GRPO on ``k * x``, divided by k, is
    ``(x - mean) / (k * std + 1e-4)``: TRL's value, to float64 rounding. A group left with one
    reward has a NaN factor in TRL, and every one of its rows a NaN that ``nansum`` drops: a
    group of one ("zero") gives 0, which the sum drops alike."""
    present = ~torch.isnan(column)
    if num_generations > 1:
        count = present.view(-1, num_generations).sum(dim=1, keepdim=True)
        bessel = torch.where(count > 1, count / (count - 1), 1.0)
        scale = bessel.double().sqrt().repeat_interleave(num_generations).reshape(-1)
    else:
        # TRL divides by std = 0 there: every advantage is x - x, as a group of one gives.
        scale = torch.ones(column.shape[0], dtype=torch.float64, device=column.device)
    scaled = column.double() * scale
    advantages = outcome_rows(
        "rewards_per_func",
        _outcome.grpo,
        scaled,
        groups,
        eps=1e-4,
        ddof=0,
        singleton="zero",
        nan="omit",
    )
    return (advantages / scale).to(column.dtype)


def _batch_std(rewards: torch.Tensor) -> torch.Tensor:
    """TRL's batch std for logging: one std of every reward, per row; 0 for a single row."""
    if rewards.numel() > 1:
        return rewards.std().expand_as(rewards)
    return torch.zeros_like(rewards)


def rloo_advantages(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    reward_weights: Any = None,
    *,
    beta: float = 0.05,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    reward_clip_range: tuple[float, float] | None = None,
    normalize_advantages: bool = False,
) -> RLOOAdvantages:
    """The advantage block of RLOOTrainer._generate_and_score_completions on
    ``ppo_fast.outcome.rloo``.

    The weighted sum of the reward functions that apply (``nansum``), clamped to
    ``reward_clip_range``, minus ``beta`` times each completion's summed KL
    ``sum((old_per_token_logps - ref_per_token_logps) * completion_mask)`` (needed unless
    ``beta`` is 0), then each minus the mean of the other completions of its prompt (0 with one
    completion per prompt); with ``normalize_advantages``, ``(A - mean) / (std + 1e-4)`` over
    the batch. The keywords are RLOOConfig's, with its defaults.
    """
    _, rewards = _weighted_rewards(rewards_per_func, reward_weights)
    groups = _generation_groups(rewards.shape[0], num_generations)
    if reward_clip_range:
        rewards = rewards.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if beta != 0.0:
        if old_per_token_logps is None or ref_per_token_logps is None or completion_mask is None:
            raise ValueError(
                "beta != 0 subtracts the KL from the rewards: pass old_per_token_logps, "
                "ref_per_token_logps and completion_mask (or beta=0.0)"
            )
        per_token_kl = old_per_token_logps - ref_per_token_logps
        kl = (per_token_kl * completion_mask).sum(-1)
        rewards = rewards - beta * kl
    advantages = outcome_rows("rewards_per_func", _outcome.rloo, rewards, groups, singleton="zero")
    if normalize_advantages and advantages.shape[0] == 1:
        # TRL's advantages.std() of one value is NaN (unbiased), and so is its normalised one
        advantages = torch.full_like(advantages, math.nan)
    elif normalize_advantages:
        advantages = outcome_rows(
            "rewards_per_func",
            _outcome.grpo,
            advantages,
            np.zeros(advantages.shape[0], dtype=np.int64),
            eps=1e-4,
        )
    grouped_rewards = rewards.view(-1, num_generations)
    if num_generations > 1:
        std_rewards = grouped_rewards.std(dim=1)
    else:
        std_rewards = torch.zeros_like(grouped_rewards.mean(dim=1))
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return RLOOAdvantages(advantages, rewards, std_rewards, is_std_zero)
