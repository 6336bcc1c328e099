"""The peers of ``ppo_fast.benchmark``: the code that PPO trainers run today, kept faithful.

Each function follows its source line for line (the same loop over T, the same tensor operations in
the same order, the same dtype handling) and names the repository, path and commit it was read
from. Only the plumbing around the computation is replaced: arguments instead of trainer state
(``self.args.gamma``, a rollout buffer), and no device moves (everything runs on the CPU).

torch and scipy are imported inside the functions, so that importing this module costs nothing.
Where a package imports, the benchmark calls the real function instead (TorchRL's GAE).
"""

from __future__ import annotations

import numpy as np


def _torch():
    import torch

    return torch


# --------------------------------------------------------------------------------------------
# verl: volcengine/verl, verl/utils/torch_functional.py @ 03c8cca18c827405ad726f7f90b2e0c3823b7830
# (masked_mean, masked_var, masked_whiten, clip_by_value) and verl/trainer/ppo/core_algos.py
# @ 012be9d9dcb7c38499f23616142870d2682757fc (compute_gae_advantage_return, agg_loss,
# compute_policy_loss_vanilla, compute_value_loss, kl_penalty).


def verl_masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)


def verl_masked_var(values, mask, unbiased=True):
    mean = verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def verl_masked_whiten(values, mask, shift_mean=True):
    torch = _torch()
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_clip_by_value(x, tensor_min, tensor_max):
    torch = _torch()
    return torch.max(torch.min(x, tensor_max), tensor_min)


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """GAE as a Python loop over T in torch, then masked whitening of the advantages.

    Masked positions (observation tokens) carry the next value and the running advantage; the
    advantages there are not zeroed (they are whitened with the rest), so only the positions of
    the mask are comparable.
    """
    torch = _torch()
    with torch.no_grad():
        nextvalues = 0
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]

        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam

            # skip values and TD-error on observation tokens
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam

            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)

        returns = advantages + values
        advantages = verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    """Only the "token-mean" mode, the one the benchmark uses."""
    if loss_agg_mode == "token-mean":
        return verl_masked_mean(loss_mat, loss_mask)
    raise ValueError(f"the benchmark copies only token-mean, got {loss_agg_mode!r}")


def verl_compute_policy_loss_vanilla(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None
):
    """The clipped surrogate with verl's dual clip (clip_ratio_c, default 3) and log-ratio clamp.

    ``config`` is a dict with clip_ratio, clip_ratio_low, clip_ratio_high and clip_ratio_c (verl
    reads them from its ActorConfig).
    """
    torch = _torch()
    assert config is not None
    clip_ratio = config["clip_ratio"]
    clip_ratio_low = (
        config["clip_ratio_low"] if config.get("clip_ratio_low") is not None else clip_ratio
    )
    clip_ratio_high = (
        config["clip_ratio_high"] if config.get("clip_ratio_high") is not None else clip_ratio
    )
    clip_ratio_c = config.get("clip_ratio_c", 3.0)

    cliprange = clip_ratio
    cliprange_low = clip_ratio_low
    cliprange_high = clip_ratio_high

    assert clip_ratio_c > 1.0, (
        "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
        + f" but get the value: {clip_ratio_c}."
    )

    negative_approx_kl = log_prob - old_log_prob
    # Clamp negative_approx_kl for stability
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = verl_agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode
    )

    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def verl_compute_value_loss(
    vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean"
):
    torch = _torch()
    vpredclipped = verl_clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * verl_agg_loss(
        loss_mat=clipped_vf_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode
    )
    vf_clipfrac = verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    """Only the "low_var_kl" (k3) branch, the one the benchmark uses."""
    torch = _torch()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        # For numerical stability
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError(f"the benchmark copies only low_var_kl, got {kl_penalty!r}")


# --------------------------------------------------------------------------------------------
# TRL: huggingface/trl, trl/trainer/ppo_trainer.py @ be8a08742d7fb9191a48b7cb5f26c5a3e93130e8
# (PPOTrainer.train: "4. compute rewards", "6. compute advantages and returns", the policy and
# value losses) with masked_mean / masked_var / masked_whiten of trl/trainer/utils.py (the same
# bodies as verl's above: masked_var is unbiased by default).

INVALID_LOGPROB = 1.0


def trl_compute_rewards(scores, logprobs, ref_logprobs, padding_mask, sequence_lengths, kl_coef):
    """KL-shaped rewards; the score goes at ``sequence_lengths + 1`` (TRL's EOS convention)."""
    torch = _torch()
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    # Formula used by http://joschu.net/blog/kl-approx.html for the k1 and k3 estimators
    logr = ref_logprobs - logprobs
    kl = (logr.exp() - 1) - logr  # the k3 branch of TRL's kl_estimator
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    actual_end = torch.where(
        sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths
    )
    # TRL indexes with the list [actual_start, actual_end], which torch reads as this tuple (and
    # warns that the list form is deprecated).
    rewards[actual_start, actual_end] += scores
    return rewards


def trl_advantages_and_returns(rewards, values, padding_mask, gamma, lam):
    """GAE over the whole padded width (values and rewards must be 0 past the end), whitened."""
    torch = _torch()
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages = verl_masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return advantages, returns


def trl_policy_loss(new_logprobs, mb_logprobs, mb_advantage, padding_mask, cliprange):
    """The plain clipped surrogate: TRL's pg_loss, a masked token mean."""
    torch = _torch()
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses2)
    return verl_masked_mean(pg_loss_max, ~padding_mask)


def trl_value_loss(vpred, mb_values, mb_return, padding_mask_p1, cliprange_value):
    """The plain clipped value loss: TRL's vf_loss, a masked token mean."""
    torch = _torch()
    vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    return 0.5 * verl_masked_mean(vf_loss_max, ~padding_mask_p1)


# --------------------------------------------------------------------------------------------
# OpenRLHF: OpenRLHF/OpenRLHF, openrlhf/trainer/ppo_utils/experience_maker.py
# @ 89308a0b768dec168dff240ae746710fc967a49b (get_advantages_and_returns, and the advantage
# normalisation at the end of compute_advantages_and_returns).


def openrlhf_get_advantages_and_returns(values, rewards, action_mask, gamma, lambd):
    """GAE with values and rewards zeroed outside ``action_mask`` (so padding gets 0)."""
    torch = _torch()
    with torch.no_grad():
        lastgaelam = 0
        advantages_reversed = []
        response_length = rewards.size(1)

        # Mask invalid responses
        if action_mask is not None:
            values = action_mask * values
            rewards = action_mask * rewards

        for t in reversed(range(response_length)):
            nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
            delta = rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam = delta + gamma * lambd * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        return advantages.detach(), returns


def openrlhf_normalize_advantages(experience_advantages, experience_action_masks):
    """Global normalisation over a list of experiences: population variance in float32.

    ``.float()`` makes the statistics float32 whatever the input dtype, so float64 inputs agree
    with ppo_fast only to float32 precision.
    """
    torch = _torch()
    with torch.no_grad():
        all_advantages = []
        all_action_masks = []
        for advantages, action_mask in zip(
            experience_advantages, experience_action_masks, strict=True
        ):
            all_advantages.append(advantages.flatten())
            all_action_masks.append(action_mask.flatten())

        advantages_vector = torch.cat(all_advantages, dim=0).float()
        action_masks_vector = torch.cat(all_action_masks, dim=0)
        num_actions = action_masks_vector.sum()

        # mean
        mean = (advantages_vector * action_masks_vector).sum() / num_actions
        # std
        var = ((advantages_vector - mean).pow(2) * action_masks_vector).sum() / num_actions
        rstd = var.clamp(min=1e-8).rsqrt()

        return [(advantages - mean) * rstd for advantages in experience_advantages]


# --------------------------------------------------------------------------------------------
# CleanRL: vwxyzjn/cleanrl, cleanrl/ppo.py @ 020cf0e53305793c8e39f4b68f9ac1ae9099f004
# ("bootstrap value if not done"): torch, time-major (num_steps, num_envs).


def cleanrl_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """``dones[t]`` is 1 when step t starts a new episode (so step t - 1 was terminal)."""
    torch = _torch()
    num_steps = rewards.shape[0]
    with torch.no_grad():
        advantages = torch.zeros_like(rewards)
        lastgaelam = 0
        for t in reversed(range(num_steps)):
            if t == num_steps - 1:
                nextnonterminal = 1.0 - next_done
                nextvalues = next_value
            else:
                nextnonterminal = 1.0 - dones[t + 1]
                nextvalues = values[t + 1]
            delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
            advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        returns = advantages + values
    return advantages, returns


# --------------------------------------------------------------------------------------------
# Stable-Baselines3: DLR-RM/stable-baselines3, stable_baselines3/common/buffers.py
# @ 64a0a6bbac70263ef0fb10e2feabc3760e515fe4 (RolloutBuffer.reset allocates the buffers with
# np.zeros, RolloutBuffer.compute_returns_and_advantage loops over T in NumPy). SB3's buffers are
# float32; here they take the benchmark's dtype.


def sb3_compute_returns_and_advantage(
    rewards, values, episode_starts, last_values, dones, gamma, gae_lambda
):
    buffer_size = rewards.shape[0]
    advantages = np.zeros(rewards.shape, dtype=rewards.dtype)
    last_gae_lam = 0
    for step in reversed(range(buffer_size)):
        if step == buffer_size - 1:
            next_non_terminal = 1.0 - dones.astype(rewards.dtype)
            next_values = last_values
        else:
            next_non_terminal = 1.0 - episode_starts[step + 1]
            next_values = values[step + 1]
        delta = rewards[step] + gamma * next_values * next_non_terminal - values[step]
        last_gae_lam = delta + gamma * gae_lambda * next_non_terminal * last_gae_lam
        advantages[step] = last_gae_lam
    # TD(lambda) estimator, see Github PR #375
    returns = advantages + values
    return advantages, returns


# --------------------------------------------------------------------------------------------
# SciPy's lfilter as the discounted cumulative sum: openai/spinningup,
# spinup/algos/pytorch/ppo/core.py @ 20921137141b154454c0a2698709d9f9a0302101 (discount_cumsum)
# and spinup/algos/pytorch/ppo/ppo.py (PPOBuffer.finish_path), one call per trajectory.
# Spinning Up's value targets are the rewards-to-go; here they are advantages + values, the GAE
# returns every other row computes.


def spinningup_discount_cumsum(x, discount):
    import scipy.signal

    return scipy.signal.lfilter([1], [1, float(-discount)], x[::-1], axis=0)[::-1]


def spinningup_gae(rewards, values, lengths, gamma, lam):
    advantages = np.zeros_like(rewards)
    returns = np.zeros_like(rewards)
    for row, length in enumerate(lengths):
        path_slice = slice(0, int(length))
        rews = np.append(rewards[row, path_slice], 0.0)
        vals = np.append(values[row, path_slice], 0.0)
        deltas = rews[:-1] + gamma * vals[1:] - vals[:-1]
        advantages[row, path_slice] = spinningup_discount_cumsum(deltas, gamma * lam)
        returns[row, path_slice] = advantages[row, path_slice] + vals[:-1]
    return advantages, returns
