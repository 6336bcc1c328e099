"""TRL's PPO trainer arithmetic on ppo_fast's kernels, with the trainer's conventions.

Reproduces TRL 0.29.1 (https://github.com/huggingface/trl, tag v0.29.1, PyPI trl==0.29.1), the
last release with a PPO trainer (TRL 1.x removed it):
``trl/experimental/ppo/ppo_trainer.py`` (``masked_mean``, ``masked_var``, ``masked_whiten``,
``INVALID_LOGPROB``, and steps 3 to 6 of a rollout inside ``PPOTrainer.train``) and
``trl/experimental/utils.py`` (``first_true_indices``).

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

import types
from typing import NamedTuple

import torch

from .. import torch as ppo_torch
from .._peers import trl_0_29_1 as _trl
from .._peers.trl_0_29_1 import INVALID_LOGPROB, first_true_indices, masked_mean
from ._masked import PeerMaskedStats

__all__ = [
    "INVALID_LOGPROB",
    "RolloutAdvantages",
    "first_true_indices",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "rollout_advantages",
]

_STATS = PeerMaskedStats(
    peer_masked_var=_trl.masked_var,
    peer_masked_whiten=_trl.masked_whiten,
    mean_denominator=torch.sum,
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

    dtype = torch.promote_types(rewards.dtype, values.dtype)
    rewards, values = rewards.to(dtype), values.to(dtype)
    advantages = ppo_torch.gae(rewards, values, gamma=gamma, lam=lam).advantages
    returns = advantages + values
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
