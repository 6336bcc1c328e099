# Copyright the OpenRLHF authors (https://github.com/OpenRLHF/OpenRLHF). The copied files carry
# no notice of their own; the project's LICENSE is the Apache License 2.0:
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
"""A verbatim copy of the OpenRLHF 0.11.2 functions that ppo_fast.compat.openrlhf reproduces.

Source: https://github.com/OpenRLHF/OpenRLHF, release v0.11.2 (PyPI openrlhf==0.11.2):
  openrlhf/models/utils.py                       KL_IS_WEIGHT_CLIP, compute_approx_kl,
                                                 compute_reward, masked_mean
  openrlhf/models/loss.py                        aggregate_loss, PolicyLoss, ValueLoss
  openrlhf/trainer/ppo_utils/experience_maker.py RemoteExperienceMaker.get_advantages_and_returns
                                                 (a method that never reads self; here a
                                                 function that takes self),
                                                 compute_advantages_and_returns and
                                                 get_cumulative_returns (methods; here functions
                                                 that take self, bound to the stand-in class
                                                 ``RemoteExperienceMaker``), and the last block
                                                 of compute_advantages_and_returns (the
                                                 normalisation of the advantages across all
                                                 experiences), here the body of
                                                 ``normalize_advantages``
  openrlhf/trainer/ppo_utils/length_penalty.py   apply_overlong_penalty,
                                                 apply_stop_properly_penalty,
                                                 apply_length_penalties (what
                                                 compute_advantages_and_returns calls first)

OpenRLHF cannot be imported here: its package imports deepspeed, ray, peft and flash-attn (a CUDA
build) at the top. So the parity tests always run against this copy; its bodies are OpenRLHF's,
byte for byte apart from formatting, and tests/test_compat_peer_copies.py checks them against the
fingerprints in ``FINGERPRINTS`` and, where the wheel is installed (pip install --no-deps
openrlhf==0.11.2), against its source. Apache License 2.0.
"""

# Third-party code, kept verbatim: not linted.
# ruff: noqa
from __future__ import annotations

import itertools
import logging
from typing import List, Optional, Tuple, Union

import torch
import torch.nn as nn

# Stand-in for openrlhf.utils.logging_utils.init_logger(__name__).
logger = logging.getLogger(__name__)


# openrlhf/models/utils.py
KL_IS_WEIGHT_CLIP = 10.0


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    log_probs_old: Optional[torch.Tensor] = None,
    kl_estimator: str = "k1",
    unbiased_gradient: bool = False,
) -> torch.Tensor:
    """
    Compute the approximate KL divergence between two distributions.
    Schulman blog: http://joschu.net/blog/kl-approx.html

    Args:
        log_probs: Log probabilities of the new (current) policy π_θ.
        log_probs_base: Log probabilities of the reference policy π_ref.
        log_probs_old: Log probabilities of the rollout policy π_θ_old. Only used when
            unbiased_gradient=True, to importance-weight the off-policy KL-loss gradient.
        kl_estimator: k1 / k2 / k3 (Schulman). Selects the forward value.
        unbiased_gradient: If True, keep the chosen estimator's forward value but backprop the
            true reverse-KL gradient E_{y~π_θ_old}[w · k1 · ∇log π_θ] via a straight-through trick,
            with w = π_θ/π_θ_old (clamped, detached). k1/k2/k3 then share the same (correct)
            gradient and differ only in value/variance. If False, behaves exactly as the legacy
            estimator (gradient flows through the estimator formula unchanged).
    """

    log_ratio = log_probs.float() - log_probs_base.float()

    if kl_estimator == "k1":
        value = log_ratio  # log_ratio is already p - q
    elif kl_estimator == "k2":
        # Non-negative KL approximation: (p - q)^2 / 2
        # http://joschu.net/blog/kl-approx.html
        # Approximately equivalent to one-step KL penalty with k1
        # used in https://arxiv.org/pdf/2310.10505.
        value = log_ratio**2 / 2.0
    elif kl_estimator == "k3":
        # Non-negative KL approximation: exp(q - p) - 1 - (q - p)
        # http://joschu.net/blog/kl-approx.html
        # Below -10, k3 already exceeds the final cap. Bound before exp to
        # avoid an overflowing derivative (0 * inf) after the final clamp.
        k3_log_ratio = log_ratio.clamp(min=-10)
        value = (-k3_log_ratio).exp() - 1 + k3_log_ratio
    else:
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")

    value = value.clamp(min=-10, max=10)

    if not unbiased_gradient:
        return value

    # Unbiased, importance-sampling-corrected reverse-KL gradient. k2's pathwise gradient
    # reproduces the score-function form ℓ·∇log π_θ = k1·∇log π_θ; multiplying by the detached
    # IS weight w gives the off-policy estimator E_{y~π_θ_old}[w · k1 · ∇log π_θ] = ∇_θ D_KL(π_θ‖π_ref).
    if log_probs_old is None:
        w = 1.0
    else:
        w = (log_probs.float() - log_probs_old.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
    grad_surrogate = w * (log_ratio**2 / 2.0)

    # Straight-through: forward value = chosen estimator, backward gradient = ∇grad_surrogate.
    return value.detach() + grad_surrogate - grad_surrogate.detach()


def compute_reward(
    r: Union[torch.Tensor, float],
    kl_coef: float,
    kl: Union[torch.Tensor, list[torch.Tensor]],
    action_mask: Optional[torch.Tensor] = None,
    reward_clip_range: Tuple[float, float] = None,
) -> Union[torch.Tensor, list[torch.Tensor]]:
    if kl_coef <= 0.0:
        kl_coef = 0.0

    if reward_clip_range:
        r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])

    kl_reward = -kl_coef * kl
    # The following code is equivalent to:
    #
    # last_reward = torch.zeros_like(kl)
    # for i in range(last_reward.size(0)):
    #     for t in reversed(range(last_reward.size(1))):
    #         if action_mask[i][t] > 0.5:
    #             last_reward[i][t] = r[i]
    #             break
    #
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(
        dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype)
    )

    reward = last_reward + kl_reward

    return reward


def masked_mean(
    tensor: torch.Tensor, mask: Optional[torch.Tensor], dim: int = None
) -> torch.Tensor:
    if mask is None:
        return tensor.mean(dim=dim)
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


# openrlhf/models/loss.py
def aggregate_loss(
    loss: torch.Tensor,
    loss_mask: torch.Tensor,
    token_level_loss: bool = True,
    dp_size: int = 1,
    batch_num_tokens: Optional[float] = None,
    global_batch_size: Optional[float] = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar using one of two reduction modes:

    - ``token_level_loss=True``  -> per-token: masked-sum / global token count.
    - ``token_level_loss=False`` -> per-sample: sum of per-sequence token-means / global
      sample count.

    ``batch_num_tokens`` (token mode) and ``global_batch_size`` (sample mode) carry the
    *global* batch totals so the loss is invariant to data-parallel sharding; ``dp_size``
    compensates for the gradient averaging that DeepSpeed/DDP applies across DP ranks.
    """
    if token_level_loss:
        if batch_num_tokens is None:
            return masked_mean(loss, loss_mask, dim=None)
        return (loss * loss_mask).sum() / batch_num_tokens * dp_size

    token_counts = loss_mask.sum(dim=-1)
    seq_loss = (loss * loss_mask).sum(dim=-1) / (token_counts + 1e-8)
    seq_mask = (token_counts > 0).float()  # exclude fully masked sequences
    if global_batch_size is None:
        return masked_mean(seq_loss, seq_mask, dim=None)
    return (seq_loss * seq_mask).sum() / global_batch_size * dp_size


class PolicyLoss(nn.Module):
    """
    Policy Loss for PPO
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: list = (0.5, 5.0),
    ) -> None:
        super().__init__()
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.token_level_loss = token_level_loss
        self.dual_clip = dual_clip
        self.policy_loss_type = policy_loss_type
        # Train/rollout (DeepSpeed-actor vs vLLM) logprob-mismatch correction on the per-token
        # IS ratio pi_train/pi_rollout. A gate reads a statistic per unit (level: token, or the
        # per-sequence mean) and drops (mask) or clamps (clip) units outside [low, high].
        # gating selects the statistic: the ratio itself (TIS / ICEPOP / seq-mask-tis) or the
        # sampled-token binary_kl / tv divergence between rollout and train policy (a trust
        # region; FlashREINFORCE gates the per-sequence mean binary KL).
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold

        # GSPO requires sequence-level loss (per-sample mean)
        if policy_loss_type == "gspo":
            self.token_level_loss = False

        # Dual-clip PPO: https://arxiv.org/pdf/1912.09729
        if dual_clip is not None:
            assert dual_clip > 1.0, f"dual_clip must be > 1.0, got {dual_clip}"

        if is_correction_level not in {"off", "token", "seq"}:
            raise ValueError(
                f"is_correction_level must be off/token/seq, got {is_correction_level}"
            )
        if is_correction_mode not in {"mask", "clip"}:
            raise ValueError(f"is_correction_mode must be mask/clip, got {is_correction_mode}")
        if is_correction_gating not in {"ratio", "binary_kl", "tv"}:
            raise ValueError(
                f"is_correction_gating must be ratio/binary_kl/tv, got {is_correction_gating}"
            )
        # Only the per-token ratio is a weight that can be clamped; a per-sequence statistic or a
        # divergence is a rejection filter.
        if is_correction_mode == "clip" and (
            is_correction_level == "seq" or is_correction_gating != "ratio"
        ):
            raise ValueError(
                "is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio"
            )
        # A divergence is bounded from above only; the default ratio band [0.5, 5] would reject everything.
        if (
            is_correction_gating != "ratio"
            and is_correction_level != "off"
            and is_correction_threshold[0] > 0
        ):
            raise ValueError(
                f"is_correction_gating={is_correction_gating} takes an upper bound only (a single delta)"
            )

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ) -> torch.Tensor:
        raw_policy_log_ratio = log_probs - old_log_probs
        if self.policy_loss_type == "ppo":
            policy_log_ratio = raw_policy_log_ratio.clamp(min=-20.0, max=20.0)
            ratio = policy_log_ratio.exp()
        elif self.policy_loss_type == "gspo":
            # GSPO: https://arxiv.org/pdf/2507.18071
            if self.is_correction_level != "off":
                log_ratio = log_probs - rollout_log_probs
            else:
                log_ratio = raw_policy_log_ratio
            ratio = (log_ratio * action_mask).sum(dim=-1) / action_mask.sum(dim=-1).clamp(min=1)
            ratio = ratio.exp().unsqueeze(-1) * action_mask
        else:
            raise ValueError(f"Invalid policy loss type: {self.policy_loss_type}")

        surr1 = ratio * advantages
        surr2 = ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages

        if self.dual_clip is None:
            # Standard PPO
            loss = -torch.min(surr1, surr2)
        else:
            # Standard PPO clipping
            clip1 = torch.min(surr1, surr2)
            # Dual-clip: additional lower bound for negative advantages
            clip2 = torch.max(clip1, self.dual_clip * advantages)
            # Apply dual-clip: use clip2 for negative advantages, clip1 for positive advantages
            loss = -torch.where(advantages < 0, clip2, clip1)

        # Your Efficient RL Framework Secretly Brings You Off-Policy RL Training: https://fengyao.notion.site/off-policy-rl
        vllm_kl = is_filter_ratio = None
        if self.is_correction_level != "off" and self.policy_loss_type == "ppo":
            low, high = self.is_correction_threshold
            seq_level = self.is_correction_level == "seq"
            is_log_ratio = (
                old_log_probs - rollout_log_probs
            ).detach()  # log(pi_train / pi_rollout)
            token_is = is_log_ratio.exp()
            # Gated statistic per unit: at seq level the ratio's geometric mean, a divergence's plain mean.
            if self.is_correction_gating == "ratio":
                stat = (
                    masked_mean(is_log_ratio, action_mask, dim=-1).unsqueeze(-1)
                    if seq_level
                    else is_log_ratio
                )
                stat = stat.exp()
            else:
                p = rollout_log_probs.exp().clamp(
                    1e-6, 1 - 1e-6
                )  # clamp keeps the binary-KL logs finite
                q = old_log_probs.exp().clamp(1e-6, 1 - 1e-6)
                if self.is_correction_gating == "binary_kl":
                    stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
                else:  # tv
                    stat = (p - q).abs()
                if seq_level:
                    stat = masked_mean(stat, action_mask, dim=-1).unsqueeze(-1)
            if self.is_correction_mode == "clip":
                coef = stat.clamp(min=low, max=high)
                filtered = (stat < low) | (stat > high)
            else:  # mask: drop out-of-band units, survivors keep their per-token IS weight
                keep = (stat >= low) & (stat <= high)
                coef = torch.where(keep, token_is, 0.0)
                filtered = ~keep
            loss = coef * loss
            # Filter fraction at the unit's own granularity: per token, or per sequence.
            if seq_level:
                is_filter_ratio = filtered.float().mean()
            else:
                is_filter_ratio = masked_mean(filtered.float(), action_mask, dim=None)
            vllm_kl = masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None)

        loss = aggregate_loss(
            loss,
            action_mask,
            token_level_loss=self.token_level_loss,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
        )
        clip_ratio = masked_mean(torch.lt(surr2, surr1).float(), action_mask, dim=None)
        ppo_kl = masked_mean(-raw_policy_log_ratio.detach(), action_mask, dim=None)
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio


class ValueLoss(nn.Module):
    """
    Value Loss for PPO
    """

    def __init__(self, clip_eps: float = None, token_level_loss: bool = True) -> None:
        super().__init__()
        self.clip_eps = clip_eps
        self.token_level_loss = token_level_loss

    def forward(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ) -> torch.Tensor:
        if self.clip_eps is not None:
            values_clipped = old_values + (values - old_values).clamp(-self.clip_eps, self.clip_eps)
            surr1 = (values_clipped - returns) ** 2
            surr2 = (values - returns) ** 2
            loss = torch.max(surr1, surr2)
        else:
            loss = (values - returns) ** 2

        loss = aggregate_loss(
            loss,
            action_mask,
            token_level_loss=self.token_level_loss,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
        )
        return 0.5 * loss


# openrlhf/trainer/ppo_utils/experience_maker.py (RemoteExperienceMaker)
@torch.no_grad()
def get_advantages_and_returns(
    self,
    values: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lambd: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Function that computes advantages and returns from rewards and values.
    Calculated as in the original PPO paper: https://arxiv.org/abs/1707.06347
    Note that rewards may include a KL divergence loss term.

    Advantages looks like this:
    Adv1 =  R1 + γ * λ * R2     + γ^2 * λ^2 * R3       + ...
          - V1 + γ * (1 - λ) V2 + γ^2 * λ * (1 - λ) V3 + ...

    Returns looks like this:
    Ret1 =  R1 + γ * λ * R2     + γ^2 * λ^2 * R3       + ...
               + γ * (1 - λ) V2 + γ^2 * λ * (1 - λ) V3 + ...

    Input:
    - values: Tensor of shape (batch_size, response_size)
    - rewards: Tensor of shape (batch_size, response_size)

    Output:
    - advantages: Tensor of shape (batch_size, response_size)
    - returns: Tensor of shape (batch_size, response_size)
    """
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


@torch.no_grad()
def compute_advantages_and_returns(self, experiences: List[Experience]) -> List[Experience]:
    """Compute shaped rewards, advantages, and returns for a batch of experiences."""
    args = self.strategy.args

    # Use at least FP32 for reward penalties and group statistics.
    for experience in experiences:
        experience.rewards = experience.rewards.to(
            torch.promote_types(experience.rewards.dtype, torch.float32)
        )

    # ── Length penalties (DAPO overlong / ProRL stop properly) ──
    apply_length_penalties(experiences, args)

    # ── Reward shaping (baseline subtraction) ──
    exp_len = [len(experience.index) for experience in experiences]
    indices = torch.tensor(
        list(itertools.chain.from_iterable(experience.index for experience in experiences))
    )
    raw_rewards = torch.cat([experience.rewards for experience in experiences], dim=0)
    rewards = torch.empty_like(raw_rewards)
    rewards[indices] = raw_rewards  # sorted by original prompt order

    rewards = rewards.reshape(-1, args.rollout.n_samples_per_prompt)

    if args.rollout.n_samples_per_prompt > 1:
        group_reward_stds = (
            rewards.std(-1, keepdim=True)
            .repeat(1, args.rollout.n_samples_per_prompt)
            .reshape(-1)[indices]
            .split(exp_len)
        )
        for experience, group_reward_std in zip(experiences, group_reward_stds):
            experience.info["group_reward_std"] = group_reward_std

    if args.algo.advantage.estimator == "rloo":
        baseline = (rewards.sum(-1, keepdim=True) - rewards) / (
            args.rollout.n_samples_per_prompt - 1
        )
        rewards = rewards - baseline
    elif args.algo.advantage.estimator in ["reinforce_baseline", "dr_grpo"]:
        rewards = rewards - rewards.mean(-1, keepdim=True)
    elif args.algo.advantage.estimator == "group_norm":
        rewards = (rewards - rewards.mean(-1, keepdim=True)) / (
            rewards.std(-1, keepdim=True) + 1e-9
        )
    elif args.algo.advantage.estimator == "flash_reinforce":
        # FlashREINFORCE: baseline = mean over the whole rollout batch (the single-rollout
        # regime has no prompt group), no whitening below.
        rewards = rewards - rewards.mean()

    rewards = rewards.reshape(-1)[indices].split(exp_len)

    # ── Per-token advantages and returns ──
    for experience, reward in zip(experiences, rewards):
        reward = compute_reward(
            reward,
            self.kl_ctl.value,
            experience.kl,
            action_mask=experience.action_mask,
            reward_clip_range=args.reward.clip_range,
        )

        if self.advantage_estimator == "gae":
            experience.advantages, experience.returns = self.get_advantages_and_returns(
                experience.values,
                reward,
                experience.action_mask,
                args.algo.advantage.gamma,
                args.algo.advantage.lambd,
            )
        elif self.advantage_estimator in [
            "reinforce",
            "rloo",
            "reinforce_baseline",
            "group_norm",
            "dr_grpo",
            "flash_reinforce",
        ]:
            if args.algo.advantage.gamma != 1.0 and self.advantage_estimator != "reinforce":
                logger.warning(f"gamma is set to 1.0 for {self.advantage_estimator}")
                args.algo.advantage.gamma = 1.0

            experience.returns = self.get_cumulative_returns(
                reward,
                experience.action_mask,
                args.algo.advantage.gamma,
            )
            experience.advantages = experience.returns.clone()
        else:
            raise Exception(f"Unkown advantage_estimator {self.advantage_estimator}")

        experience.info["return"] = reward.sum(dim=-1)
        experience.kl = None

    # ── Normalize advantages across all experiences ──
    if args.algo.advantage.estimator in ["gae", "reinforce", "reinforce_baseline"]:
        all_advantages = torch.cat([exp.advantages.flatten() for exp in experiences], dim=0).float()
        all_action_masks = torch.cat([exp.action_mask.flatten() for exp in experiences], dim=0)
        num_actions = all_action_masks.sum()

        mean = (all_advantages * all_action_masks).sum() / num_actions
        if not args.algo.advantage.no_std_norm:
            var = ((all_advantages - mean).pow(2) * all_action_masks).sum() / num_actions
            rstd = var.clamp(min=1e-8).rsqrt()
        else:
            rstd = 1

        for exp in experiences:
            exp.advantages = (exp.advantages - mean) * rstd

    return experiences


@torch.no_grad()
def get_cumulative_returns(
    self,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    Function that computes advantages and returns from rewards using REINFORCE.
    REINFORCE uses cumulative returns without the GAE (Generalized Advantage Estimation).

    Input:
    - rewards: Tensor of shape (batch_size, response_size)
    - action_mask: Tensor of shape (batch_size, response_size), binary mask
    - gamma: discount factor

    Output:
    - returns: Tensor of shape (batch_size, response_size)
    """
    response_length = rewards.size(1)
    returns = torch.zeros_like(rewards)
    cumulative_return = torch.zeros(rewards.size(0), device=rewards.device)

    # Mask invalid responses if action_mask is provided
    if action_mask is not None:
        rewards = action_mask * rewards

    # Calculate returns by accumulating discounted rewards
    for t in reversed(range(response_length)):
        cumulative_return = rewards[:, t] + gamma * cumulative_return
        returns[:, t] = cumulative_return

    return returns


@torch.no_grad()
def normalize_advantages(args, experiences):
    """RemoteExperienceMaker.compute_advantages_and_returns's last block, verbatim: ``args``
    carries algo.advantage.estimator and algo.advantage.no_std_norm, each experience its
    advantages and action_mask."""
    # ── Normalize advantages across all experiences ──
    if args.algo.advantage.estimator in ["gae", "reinforce", "reinforce_baseline"]:
        all_advantages = torch.cat([exp.advantages.flatten() for exp in experiences], dim=0).float()
        all_action_masks = torch.cat([exp.action_mask.flatten() for exp in experiences], dim=0)
        num_actions = all_action_masks.sum()

        mean = (all_advantages * all_action_masks).sum() / num_actions
        if not args.algo.advantage.no_std_norm:
            var = ((all_advantages - mean).pow(2) * all_action_masks).sum() / num_actions
            rstd = var.clamp(min=1e-8).rsqrt()
        else:
            rstd = 1

        for exp in experiences:
            exp.advantages = (exp.advantages - mean) * rstd

    return experiences


class RemoteExperienceMaker:
    """Stand-in for RemoteExperienceMaker: what the copied methods read of ``self`` (the
    strategy's args, the KL controller, the estimator read at construction) and the copied
    methods, bound as OpenRLHF binds them. OpenRLHF's constructor also takes the Ray actor
    groups and the tokenizer, which these methods never touch."""

    def __init__(self, kl_controller, strategy):
        self.strategy = strategy
        self.args = strategy.args
        self.advantage_estimator = strategy.args.algo.advantage.estimator
        self.kl_ctl = kl_controller

    compute_advantages_and_returns = compute_advantages_and_returns
    get_advantages_and_returns = get_advantages_and_returns
    get_cumulative_returns = get_cumulative_returns


# openrlhf/trainer/ppo_utils/length_penalty.py
def apply_overlong_penalty(
    experiences: List,
    max_new_tokens: int,
    overlong_buffer_len: float,
    overlong_penalty_factor: float = 1.0,
) -> int:
    """
    DAPO-style overlong penalty based on response length.

    Penalizes responses that exceed (max_new_tokens - overlong_buffer_len).
    Formula: penalty = -min(exceed_len, buffer_len) / buffer_len * penalty_factor

    Args:
        experiences: List of Experience objects with rewards and info
        max_new_tokens: Maximum generation length
        overlong_buffer_len: Buffer length before max_new_tokens
        overlong_penalty_factor: Maximum penalty factor

    Returns:
        Number of samples that received penalty
    """
    assert max_new_tokens >= overlong_buffer_len, (
        f"max_new_tokens ({max_new_tokens}) must be >= overlong_buffer_len ({overlong_buffer_len})"
    )

    expected_len = max_new_tokens - overlong_buffer_len
    total_penalized = 0

    for experience in experiences:
        response_lengths = experience.response_length
        batch_size = len(response_lengths)

        for j in range(batch_size):
            valid_response_length = response_lengths[j].item()
            # Cap the exceed_len to overlong_buffer_len to prevent excessive penalty
            exceed_len = min(valid_response_length - expected_len, overlong_buffer_len)

            if exceed_len > 0:
                overlong_penalty = -exceed_len / overlong_buffer_len * overlong_penalty_factor
                experience.rewards[j] += overlong_penalty
                total_penalized += 1

    return total_penalized


def apply_stop_properly_penalty(
    experiences: List,
    stop_properly_penalty_coef: float,
) -> int:
    """
    ProRL-style stop properly penalty based on vLLM finish_reason.

    Penalizes samples that were truncated (finish_reason == "length").

    When stop_properly_penalty_coef >= 0: scale truncated rewards by this coefficient.
    When stop_properly_penalty_coef < 0: set truncated rewards to this value directly
        (e.g., -0.5 gives truncated samples a fixed negative reward).

    Args:
        experiences: List of Experience objects with rewards and info
        stop_properly_penalty_coef: Coefficient to penalize truncated samples.
            If >= 0: multiplicative scaling [0, 1].
            If < 0: fixed reward override for truncated samples.

    Returns:
        Number of truncated samples
    """
    if stop_properly_penalty_coef >= 0:
        assert 0 <= stop_properly_penalty_coef <= 1, (
            f"stop_properly_penalty_coef must be in [0, 1] or negative, got {stop_properly_penalty_coef}"
        )

    total_truncated = 0

    for experience in experiences:
        truncated_flags = experience.truncated
        if truncated_flags is None:
            continue

        batch_size = len(truncated_flags)
        for j in range(batch_size):
            if truncated_flags[j].item():
                if stop_properly_penalty_coef < 0:
                    # Fixed negative reward for truncated samples
                    experience.rewards[j] = stop_properly_penalty_coef
                else:
                    # Scale truncated sample rewards by the penalty coefficient
                    experience.rewards[j] = experience.rewards[j] * stop_properly_penalty_coef
                total_truncated += 1

    return total_truncated


def apply_length_penalties(experiences: List, args) -> None:
    """
    Apply length penalties to experiences based on configuration.

    Supports two types of penalties:
    1. DAPO Overlong Penalty (--overlong_buffer_len, --overlong_penalty_factor)
    2. ProRL Stop Properly Penalty (--stop_properly_penalty_coef)

    Both can be enabled simultaneously.

    Args:
        experiences: List of Experience objects
        args: Training arguments containing penalty configuration
    """
    total_samples = sum(len(exp.rewards) for exp in experiences)

    # DAPO-style overlong penalty based on response length
    if getattr(args.reward, "overlong_buffer_len", None) is not None:
        max_new_tokens = getattr(args.rollout, "max_new_tokens", None) or args.data.max_len
        num_penalized = apply_overlong_penalty(
            experiences=experiences,
            max_new_tokens=max_new_tokens,
            overlong_buffer_len=args.reward.overlong_buffer_len,
            overlong_penalty_factor=getattr(args.reward, "overlong_penalty_factor", 1.0),
        )
        logger.info(
            f"[DAPO Overlong Penalty] {num_penalized}/{total_samples} samples penalized, "
            f"buffer_len={args.reward.overlong_buffer_len}, factor={args.reward.overlong_penalty_factor}"
        )

    # ProRL-style stop properly penalty based on finish_reason
    if getattr(args.reward, "stop_properly_penalty_coef", None) is not None:
        num_truncated = apply_stop_properly_penalty(
            experiences=experiences,
            stop_properly_penalty_coef=args.reward.stop_properly_penalty_coef,
        )
        logger.info(
            f"[ProRL Stop Properly Penalty] {num_truncated}/{total_samples} samples truncated, "
            f"coef={args.reward.stop_properly_penalty_coef}"
        )

    # Sync info["reward"] with the modified rewards so logged metrics reflect penalties
    for experience in experiences:
        if "reward" in experience.info:
            experience.info["reward"] = experience.rewards.clone()


# Fingerprints of OpenRLHF 0.11.2's definitions (ppo_fast._peers.fingerprint), taken from its wheel.
DISTRIBUTION = ("openrlhf", "0.11.2")
FINGERPRINTS = {
    "openrlhf/models/utils.py": {
        "compute_approx_kl": "f6b50bf65af67957",
        "compute_reward": "e09882452e7f435b",
        "masked_mean": "452f46c526a08e4f",
    },
    "openrlhf/models/loss.py": {
        "aggregate_loss": "2d7b869c77485b84",
        "PolicyLoss": "46523bcb89988b33",
        "ValueLoss": "7fc49ccf3da73420",
    },
    "openrlhf/trainer/ppo_utils/experience_maker.py": {
        "RemoteExperienceMaker.get_advantages_and_returns": "e2b86877f07b76e9",
        "RemoteExperienceMaker.compute_advantages_and_returns": "df0a7d7743a1b5cf",
        "RemoteExperienceMaker.get_cumulative_returns": "6ea388d4467a275a",
    },
    "openrlhf/trainer/ppo_utils/length_penalty.py": {
        "apply_overlong_penalty": "bedf4399515ea9c7",
        "apply_stop_properly_penalty": "2347e34989b2e858",
        "apply_length_penalties": "bc9a3aa73d34d8ae",
    },
}
BLOCKS = {
    "normalize_advantages": (
        "openrlhf/trainer/ppo_utils/experience_maker.py",
        "RemoteExperienceMaker.compute_advantages_and_returns",
        "if args.algo.advantage.estimator in ['gae', 'reinforce', 'reinforce_baseline']",
        "if args.algo.advantage.estimator in ['gae', 'reinforce', 'reinforce_baseline']",
        "5887345bf4c5b8ee",
    ),
}
