# Copyright 2020-2026 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""A verbatim copy of the TRL 0.29.1 trainer code (PPO, GRPO, RLOO) that ppo_fast.compat.trl
reproduces.

Source: https://github.com/huggingface/trl, release v0.29.1 (PyPI trl==0.29.1), the last release
with a PPO trainer (TRL 1.x removed it):
  trl/experimental/ppo/ppo_trainer.py  INVALID_LOGPROB, masked_mean, masked_var, masked_whiten,
                                       and, in PPOTrainer.train, the block from
                                       ``response_idxs = ...`` to the masking of the whitened
                                       advantages (steps 3 to 6 of a rollout), here the body of
                                       ``ppo_trainer_advantages``
                                       and, in its minibatch loop, the value loss (from
                                       ``vpredclipped = ...`` to ``vf_clipfrac = ...``) and the
                                       policy loss (``logprobs_diff = ...`` to ``pg_loss = ...``),
                                       here ``ppo_trainer_value_loss`` and
                                       ``ppo_trainer_policy_loss``; steps 3-4 and step 6 of
                                       the rollout block alone are ``ppo_trainer_rewards`` and
                                       ``ppo_trainer_gae`` (what the benchmark times;
                                       ppo_fast.compat.trl runs ``ppo_trainer_rewards``)
  trl/experimental/utils.py            first_true_indices
  trl/trainer/utils.py                 nanstd, nanmin, nanmax
  trl/trainer/grpo_trainer.py          in GRPOTrainer._compute_loss, the block from
                                       ``log_ratio = ...`` to the clip metrics (the importance
                                       weights, every loss_type's per-token loss, its
                                       aggregation and the logged metrics), here
                                       ``grpo_trainer_loss``;
                                       in GRPOTrainer._generate_and_score_completions, the
                                       advantage block (the ``multi_objective_aggregation``
                                       if-statement: the weighted sum or the per-function
                                       normalisation of the rewards, the group mean and the
                                       ``scale_rewards`` options), here ``grpo_trainer_advantages``
  trl/trainer/rloo_trainer.py          in RLOOTrainer._generate_and_score_completions, the block
                                       from the weighted sum of the rewards to ``is_std_zero``
                                       (clipping, the sequence-level KL penalty, the leave-one-out
                                       baseline, ``normalize_advantages``), here
                                       ``rloo_trainer_advantages``; ``gather`` is a one-process
                                       stand-in for accelerate's

The trainer's blocks are inline code in a method that needs models and a dataloader, so the tests
always run this copy; tests/test_compat_peer_copies.py checks its statements against the
fingerprints in ``FINGERPRINTS`` and ``BLOCKS`` and, where the wheel is installed (pip install --no-deps
trl==0.29.1), against its source. Apache License 2.0.
"""

# Third-party code, kept verbatim: not linted.
# ruff: noqa
from __future__ import annotations

import types

import torch


# trl/experimental/ppo/ppo_trainer.py
INVALID_LOGPROB = 1.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: bool | None = None) -> torch.Tensor:
    """Compute mean of tensor with a masked values."""
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    else:
        return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Compute variance of tensor with masked values."""
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError(
                "The sum of the mask is zero, which can happen when `mini_batch_size=1`;"
                "try increase the `mini_batch_size` or `gradient_accumulation_steps`"
            )
        # note that if mask_sum == 1, then there is a division by zero issue
        # to avoid it you just need to use a larger minibatch_size
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """Whiten values with masked values."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


# trl/experimental/utils.py
def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """
    Takes an N-dimensional bool tensor and returns an (N-1)-dimensional tensor of integers giving the position of the
    first True in each "row".

    Returns the length of the rows (bools.size(-1)) if no element is True in a given row.

    Args:
        bools (`torch.Tensor`):
            An N-dimensional boolean tensor.
        dtype (`torch.dtype`, optional):
            The desired data type of the output tensor. Defaults to `torch.long`.

    Returns:
        `torch.Tensor`:
            An (N-1)-dimensional tensor of integers indicating the position of the first True in each row. If no True
            value is found in a row, returns the length of the row.
    """
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(
        row_len, dtype=dtype, device=bools.device
    )
    return torch.min(zero_or_index, dim=-1).values


def ppo_trainer_advantages(
    args, responses, sequence_lengths, logprobs, ref_logprobs, values, scores
):
    """PPOTrainer.train's rollout block, verbatim; ``args`` carries kl_estimator, kl_coef,
    whiten_rewards, gamma and lam as the trainer's PPOConfig does."""
    response_idxs = torch.arange(responses.shape[1], device=responses.device).repeat(
        responses.shape[0], 1
    )
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)

    # 4. compute rewards
    # Formula used by http://joschu.net/blog/kl-approx.html for the k1 and k3 estimators
    logr = ref_logprobs - logprobs
    kl = -logr if args.kl_estimator == "k1" else (logr.exp() - 1) - logr  # Else statement is k3
    non_score_reward = -args.kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    actual_end = torch.where(
        sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths
    )
    rewards[actual_start, actual_end] += scores

    # 5. whiten rewards
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)

    # 6. compute advantages and returns
    lastgaelam = 0
    advantages_reversed = []
    gen_length = responses.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + args.gamma * nextvalues - values[:, t]
        lastgaelam = delta + args.gamma * args.lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return types.SimpleNamespace(
        advantages=advantages,
        returns=returns,
        rewards=rewards,
        non_score_reward=non_score_reward,
        kl=kl,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        padding_mask=padding_mask,
        padding_mask_p1=padding_mask_p1,
    )


def ppo_trainer_rewards(args, responses, sequence_lengths, logprobs, ref_logprobs, values, scores):
    """PPOTrainer.train's steps 3 and 4 (padding masks, KL-shaped rewards), verbatim; returns
    what the block leaves for steps 5 and 6, as ``ppo_trainer_advantages`` does."""
    response_idxs = torch.arange(responses.shape[1], device=responses.device).repeat(
        responses.shape[0], 1
    )
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)

    # 4. compute rewards
    # Formula used by http://joschu.net/blog/kl-approx.html for the k1 and k3 estimators
    logr = ref_logprobs - logprobs
    kl = -logr if args.kl_estimator == "k1" else (logr.exp() - 1) - logr  # Else statement is k3
    non_score_reward = -args.kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    actual_end = torch.where(
        sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths
    )
    rewards[actual_start, actual_end] += scores
    return types.SimpleNamespace(
        rewards=rewards,
        non_score_reward=non_score_reward,
        kl=kl,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        padding_mask=padding_mask,
        padding_mask_p1=padding_mask_p1,
    )


def ppo_trainer_gae(args, responses, rewards, values, padding_mask):
    """PPOTrainer.train's step 6 (GAE, then the advantages whitened), verbatim."""
    lastgaelam = 0
    advantages_reversed = []
    gen_length = responses.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + args.gamma * nextvalues - values[:, t]
        lastgaelam = delta + args.gamma * args.lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return advantages, returns


def ppo_trainer_value_loss(args, vpred, mb_values, mb_return, padding_mask_p1, micro_batch_inds):
    """PPOTrainer.train's value loss, verbatim; ``args`` carries cliprange_value."""
    vpredclipped = torch.clamp(
        vpred,
        mb_values - args.cliprange_value,
        mb_values + args.cliprange_value,
    )
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * masked_mean(vf_loss_max, ~padding_mask_p1[micro_batch_inds])
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1[micro_batch_inds])
    return vf_loss, vf_clipfrac


def ppo_trainer_policy_loss(
    args, new_logprobs, mb_logprobs, mb_advantage, padding_mask, micro_batch_inds
):
    """PPOTrainer.train's policy loss, verbatim; ``args`` carries cliprange."""
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses2)
    pg_loss = masked_mean(pg_loss_max, ~padding_mask[micro_batch_inds])
    return pg_loss


# trl/trainer/utils.py
def nanstd(
    tensor: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False
) -> torch.Tensor:
    """
    Compute the standard deviation of a tensor, ignoring NaNs.

    Args:
        tensor (`torch.Tensor`):
            Input tensor.
        dim (`int` or `tuple[int, ...]`, *optional*):
            Dimension(s) to reduce. Defaults to all dimensions.
        keepdim (`bool`, *optional*, defaults to `False`):
            Whether to keep reduced dimensions.

    Returns:
        `torch.Tensor`:
            Standard deviation of the tensor, ignoring NaNs.
    """
    # Compute variance ignoring NaNs
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)  # count of non-NaN values
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction  # Bessel's correction
    std = torch.sqrt(variance)
    if keepdim:
        return std
    if dim is None:
        return std.squeeze()
    if isinstance(dim, int):
        return std.squeeze(dim)
    dims = [(d if d >= 0 else d + std.ndim) for d in dim]
    for d in sorted(dims, reverse=True):
        std = std.squeeze(d)
    return std


def gather(tensor):
    """Stand-in for accelerate.utils.gather on one process: the tensor itself (on several, every
    process's rows, concatenated: the whole generation batch)."""
    return tensor


# trl/trainer/grpo_trainer.py
def grpo_trainer_advantages(self, rewards_per_func, num_generations, device):
    """GRPOTrainer._generate_and_score_completions's advantage block (the
    ``multi_objective_aggregation`` if-statement, with the ``scale_rewards`` options), verbatim;
    ``self`` carries multi_objective_aggregation, reward_weights, scale_rewards and reward_funcs
    (of which it reads the number) as the trainer does. Returns what the block leaves for the rest
    of the method."""
    if self.multi_objective_aggregation == "sum_then_normalize":
        # Apply weights to each reward function's output and sum
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        mean_grouped_rewards = rewards.view(-1, num_generations).mean(dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
        if self.scale_rewards in ["group", "none"]:
            # If self.scale_rewards = "none", we'll only use std_rewards to check for zero std for logging
            if num_generations > 1:
                std_rewards = rewards.view(-1, num_generations).std(dim=1)
                std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
            else:  # doesn't occur during training, but could occur in eval when num_generations_eval=1
                std_rewards = torch.zeros_like(rewards)
        elif self.scale_rewards == "batch":
            # Compute global std
            if rewards.numel() > 1:
                std_rewards = rewards.std().expand_as(rewards)
            else:  # doesn't occur during training, but could occur in eval when num_generations_eval=batch_size=1
                std_rewards = torch.zeros_like(rewards)
        else:
            raise ValueError(
                f"Invalid value for scale_rewards: {self.scale_rewards}. Must be one of 'batch', 'group', or 'none'."
            )

        advantages = rewards - mean_grouped_rewards
        if self.scale_rewards != "none":
            advantages = advantages / (std_rewards + 1e-4)
        is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # for logging

    elif self.multi_objective_aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, len(self.reward_funcs))
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = (
            nanstd(grouped, dim=1, keepdim=True)
            if num_generations > 1
            else torch.zeros_like(mean_k)
        )
        reward_k = (grouped - mean_k) / (std_k + 1e-4)
        reward_k = reward_k.view(-1, len(self.reward_funcs))
        rewards = (reward_k * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        std_rewards = (
            rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        )
        advantages = (rewards - rewards.mean()) / (std_rewards + 1e-4)
        is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # for logging

    else:
        raise ValueError(
            f"Invalid multi_objective_aggregation: {self.multi_objective_aggregation}. Must be "
            "'sum_then_normalize' or 'normalize_then_sum'."
        )

    return types.SimpleNamespace(
        advantages=advantages, rewards=rewards, std_rewards=std_rewards, is_std_zero=is_std_zero
    )


# trl/trainer/rloo_trainer.py
def rloo_trainer_advantages(
    self,
    rewards_per_func,
    num_generations,
    device,
    old_per_token_logps,
    ref_per_token_logps,
    completion_mask,
):
    """RLOOTrainer._generate_and_score_completions's advantage block (from the weighted sum of
    the reward functions to ``is_std_zero``: clipping, the sequence-level KL penalty, the
    leave-one-out baseline and ``normalize_advantages``), verbatim; ``self`` carries
    reward_weights, reward_clip_range, beta and normalize_advantages as the trainer does."""
    rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)

    # Apply reward clipping if specified
    if self.reward_clip_range:
        rewards = rewards.clamp(min=self.reward_clip_range[0], max=self.reward_clip_range[1])

    # Include the KL penalty in the reward
    if self.beta != 0.0:
        per_token_kl = old_per_token_logps - ref_per_token_logps
        # Apply sequence-level KL penalty to rewards (sum KL across tokens first, then apply to each sequence)
        kl = (per_token_kl * completion_mask).sum(-1)
        kl = gather(kl)  # rewards are gathered, so kl must be too
        rewards = rewards - self.beta * kl

    grouped_rewards = rewards.view(-1, num_generations)
    mean_grouped_rewards = grouped_rewards.mean(dim=1)
    if num_generations > 1:
        std_rewards = grouped_rewards.std(dim=1)
    else:  # doesn't occur during training, but could occur in eval when num_generations_eval=1
        std_rewards = torch.zeros_like(mean_grouped_rewards)

    # RLOO advantages computation
    grouped_sum = grouped_rewards.sum(dim=1, keepdim=True)  # (num_prompts, 1)
    if num_generations > 1:
        baselines = (grouped_sum - grouped_rewards) / (
            num_generations - 1
        )  # (num_prompts, num_generations)
        baselines = baselines.view(-1)  # Flatten back to match rewards shape
        advantages = rewards - baselines
    else:  # this case doesn't occur during training, but could in eval when num_generations_eval=1
        advantages = torch.zeros_like(rewards)

    # Normalize advantages
    if self.normalize_advantages:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-4)

    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # for logging

    return types.SimpleNamespace(
        advantages=advantages, rewards=rewards, std_rewards=std_rewards, is_std_zero=is_std_zero
    )


# Fingerprints of TRL 0.29.1's definitions (ppo_fast._peers.fingerprint), taken from its
# wheel; each trainer block is the run of statements of PPOTrainer.train between two statements,
# copied as the body of a function (BLOCKS: function -> path, method, first, last, fingerprint).
DISTRIBUTION = ("trl", "0.29.1")


def nanmin(tensor: torch.Tensor) -> torch.Tensor:
    """
    Compute the minimum value of a tensor, ignoring NaNs. This function only supports 1D tensors.

    Args:
        tensor (`torch.Tensor`): Input tensor of shape `(N,)`.

    Returns:
        `torch.Tensor`: Minimum value of the tensor, ignoring NaNs. Returns NaN if all values are NaN.
    """
    if torch.isnan(tensor).all():
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return torch.min(tensor[~torch.isnan(tensor)])


def nanmax(tensor: torch.Tensor) -> torch.Tensor:
    """
    Compute the maximum value of a tensor, ignoring NaNs. This function only supports 1D tensors.

    Args:
        tensor (`torch.Tensor`): Input tensor of shape `(N,)`.

    Returns:
        `torch.Tensor`: Maximum value of the tensor, ignoring NaNs. Returns NaN if all values are NaN.
    """
    if torch.isnan(tensor).all():
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return torch.max(tensor[~torch.isnan(tensor)])


def grpo_trainer_loss(
    self, inputs, per_token_logps, old_per_token_logps, advantages, mask, entropies, entropy_mask
):
    """GRPOTrainer._compute_loss's block from the log-ratio to the clip metrics, verbatim: the
    importance weights at the token or sequence level, the per-token loss of every loss_type,
    its aggregation and the logged metrics. ``self`` is a stand-in carrying the trainer's
    attributes (importance_sampling_level, loss_type, epsilon_low, epsilon_high, beta, args,
    off_policy_mask_threshold, use_vllm, model, current_gradient_accumulation_steps,
    max_completion_length, accelerator, _metrics); ``advantages`` is (B, 1) or (B, T) as after
    the trainer's ``unsqueeze``; returns the loss."""
    log_ratio = per_token_logps - old_per_token_logps
    if self.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif self.importance_sampling_level == "sequence":
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    else:
        raise ValueError(
            f"Unknown importance sampling level: {self.importance_sampling_level}. Possible values are 'token' "
            "and 'sequence'."
        )

    coef_1 = torch.exp(log_importance_weights)

    # Compute the KL divergence between the model and the reference model
    if self.beta != 0.0:
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = (
            torch.exp(ref_per_token_logps - per_token_logps)
            - (ref_per_token_logps - per_token_logps)
            - 1
        )
        # Importance sampling correction for the KL divergence
        if self.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    # From here, log_importance_weights (and all subsequent tensors, coef_1, coef_2, etc.) shape depends on
    # importance_sampling_level: "token" level: (B, T); "sequence" level: (B, 1)
    if self.loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=self.epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif self.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        # Two-sided clipping
        if self.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.args.delta)

        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    elif self.loss_type == "sapo":
        temperatures = torch.where(
            advantages > 0, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg
        )
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    else:
        raise ValueError(f"Unknown loss type: {self.loss_type}")

    if self.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask

    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask

    if self.use_vllm and self.vllm_importance_sampling_correction:
        per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]

    if self.beta != 0.0:
        per_token_loss = per_token_loss + self.beta * per_token_kl

    mode = "train" if self.model.training else "eval"
    if self.loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        normalizer = (
            self.current_gradient_accumulation_steps if mode == "train" else 1.0
        )  # no accum in eval
        loss = loss / normalizer
    elif self.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        normalizer = (
            self.current_gradient_accumulation_steps if mode == "train" else 1.0
        )  # no accum in eval
        loss = loss / normalizer
    elif self.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)
        normalizer = (
            self.current_gradient_accumulation_steps if mode == "train" else 1.0
        )  # no accum in eval
        loss = loss / normalizer
    elif self.loss_type in ["cispo", "dapo"]:
        normalizer = inputs["num_items_in_batch"] / self.accelerator.num_processes
        loss = (per_token_loss * mask).sum() / normalizer
    elif self.loss_type == "luspo":
        # Unless importance_sampling_level="token" (not recommended here), per_token_loss is expected to be (B, 1)
        loss = (per_token_loss * mask.sum(1, keepdim=True)).mean()
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss / normalizer
    else:
        raise ValueError(f"Unknown loss type: {self.loss_type}")

    # Log the metrics
    completion_token_count = mask.sum().clamp(min=1.0)

    def masked_batch_mean(x):
        if x.shape[1] == 1:  # when importance_sampling_level == "sequence"
            return x.mean()
        else:
            return (x * mask).sum() / completion_token_count

    if self.beta != 0.0:
        mean_kl = masked_batch_mean(per_token_kl)
        self._metrics[mode]["kl"].append(self.accelerator.gather(mean_kl).nanmean().item())

    mean_entropy = masked_batch_mean(entropies)
    self._metrics[mode]["entropy"].append(self.accelerator.gather(mean_entropy).nanmean().item())

    if self.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        # Compute the clipped probability ratios
        is_low_clipped = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped

        low_clip = masked_batch_mean(is_low_clipped.float())
        high_clip = masked_batch_mean(is_high_clipped.float())
        clip_ratio = masked_batch_mean(is_region_clipped.float())

        gathered_low_clip = self.accelerator.gather(low_clip)
        self._metrics[mode]["clip_ratio/low_mean"].append(gathered_low_clip.nanmean().item())
        self._metrics[mode]["clip_ratio/low_min"].append(nanmin(gathered_low_clip).item())
        gathered_high_clip = self.accelerator.gather(high_clip)
        self._metrics[mode]["clip_ratio/high_mean"].append(gathered_high_clip.nanmean().item())
        self._metrics[mode]["clip_ratio/high_max"].append(nanmax(gathered_high_clip).item())
        gathered_clip_ratio = self.accelerator.gather(clip_ratio)
        self._metrics[mode]["clip_ratio/region_mean"].append(gathered_clip_ratio.nanmean().item())
    elif self.loss_type == "cispo":
        is_cispo_clipped = (coef_1 > self.epsilon_high) & (advantages > 0)
        cispo_clip_ratio = masked_batch_mean(is_cispo_clipped.float())
        gathered_cispo_clip_ratio = self.accelerator.gather(cispo_clip_ratio)
        self._metrics[mode]["cispo_clip_ratio"].append(gathered_cispo_clip_ratio.nanmean().item())

    return loss


BLOCKS = {
    "ppo_trainer_advantages": (
        "trl/experimental/ppo/ppo_trainer.py",
        "PPOTrainer.train",
        "response_idxs = ",
        "advantages = torch.masked_fill(advantages, padding_mask, 0)",
        "e615ed2b59e728fd",
    ),
    "ppo_trainer_rewards": (
        "trl/experimental/ppo/ppo_trainer.py",
        "PPOTrainer.train",
        "response_idxs = ",
        "rewards[actual_start, actual_end] += scores",
        "a4ff9f50f6073d35",
    ),
    "ppo_trainer_gae": (
        "trl/experimental/ppo/ppo_trainer.py",
        "PPOTrainer.train",
        "lastgaelam = 0",
        "advantages = torch.masked_fill(advantages, padding_mask, 0)",
        "8efdd36433fe8b70",
    ),
    "ppo_trainer_value_loss": (
        "trl/experimental/ppo/ppo_trainer.py",
        "PPOTrainer.train",
        "vpredclipped = ",
        "vf_clipfrac = ",
        "b71dddcee3edb09b",
    ),
    "ppo_trainer_policy_loss": (
        "trl/experimental/ppo/ppo_trainer.py",
        "PPOTrainer.train",
        "logprobs_diff = ",
        "pg_loss = masked_mean",
        "42fc9ba2f5ffd310",
    ),
    "grpo_trainer_advantages": (
        "trl/trainer/grpo_trainer.py",
        "GRPOTrainer._generate_and_score_completions",
        "if self.multi_objective_aggregation == 'sum_then_normalize'",
        "if self.multi_objective_aggregation == 'sum_then_normalize'",
        "c192d365907c38c8",
    ),
    "grpo_trainer_loss": (
        "trl/trainer/grpo_trainer.py",
        "GRPOTrainer._compute_loss",
        "log_ratio = per_token_logps - old_per_token_logps",
        "if self.loss_type in ['grpo', 'bnpo'",
        "0b1d42ebf1c471a0",
    ),
    "rloo_trainer_advantages": (
        "trl/trainer/rloo_trainer.py",
        "RLOOTrainer._generate_and_score_completions",
        "rewards = (rewards_per_func * self.reward_weights",
        "is_std_zero = ",
        "34713493b3c5e45a",
    ),
}
FINGERPRINTS = {
    "trl/experimental/ppo/ppo_trainer.py": {
        "masked_mean": "817f0a9472bfc67d",
        "masked_var": "4ec17ea4b4d6e4a4",
        "masked_whiten": "98a17ffc1b59a451",
    },
    "trl/experimental/utils.py": {
        "first_true_indices": "35df1fd142571690",
    },
    "trl/trainer/utils.py": {
        "nanstd": "71362360ac395594",
        "nanmin": "2f974de9f5a8b0cd",
        "nanmax": "30cb5d030a7eba63",
    },
}
