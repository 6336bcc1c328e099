"""OpenRLHF's PPO numerics on ppo_fast's kernels: swap the import, keep the numbers.

    from openrlhf.models.utils import compute_approx_kl, compute_reward, masked_mean
    from openrlhf.models.loss import PolicyLoss, ValueLoss
        ->  from ppo_fast.compat.openrlhf import (compute_approx_kl, compute_reward, masked_mean,
                                                  PolicyLoss, ValueLoss)
    RemoteExperienceMaker.get_advantages_and_returns(self, values, rewards, action_mask, gamma,
                                                     lambd)
        ->  ppo_fast.compat.openrlhf.get_advantages_and_returns(values, rewards, action_mask,
                                                                 gamma, lambd)

Reproduces OpenRLHF 0.11.2 (https://github.com/OpenRLHF/OpenRLHF, tag v0.11.2, PyPI
openrlhf==0.11.2): ``openrlhf/models/utils.py``, ``openrlhf/models/loss.py`` and
``openrlhf/trainer/ppo_utils/experience_maker.py``, with their signatures, argument order, return
types and quirks.

What runs where:

- ``get_advantages_and_returns``: the ppo_fast GAE kernel replaces the Python loop over the
  response length. OpenRLHF does not skip masked tokens: it zeroes rewards and values there and
  runs the plain recursion over every position, so a masked token inside a response is a step
  with reward 0 and value 0 that is discounted like any other (and left padding gets nonzero
  advantages). That is exactly the kernel's GAE with every position valid on the zeroed inputs,
  which is what runs here; ppo_fast's own ``gae(mask=...)`` skips masked tokens instead.
- ``PolicyLoss`` (``policy_loss_type="ppo"``) and ``ValueLoss``: the fused kernels through
  ``ppo_fast.torch`` autograd Functions; the kernel returns the masked token sum (or the sum of
  per-sequence means) and ``aggregate_loss``'s normalisation follows in torch. The train/rollout
  importance-sampling correction (``is_correction_*``) is computed in torch from the detached
  log-probs, as OpenRLHF does, and passed to the kernel as per-token weights. ``ppo_kl`` is the
  unclamped mean of ``old - new`` log-probs, in torch. ``policy_loss_type="gspo"`` has a
  sequence-level ratio that the token kernel does not compute: it runs OpenRLHF's torch code.
- ``compute_approx_kl``, ``compute_reward``, ``masked_mean``, ``aggregate_loss``: OpenRLHF's code,
  plain torch: vectorised already, and differentiated in the KL loss.

Differences, by design: masks must hold 0/1; values stored at masked positions never reach the
fused losses (OpenRLHF's ``x * 0`` turns a NaN there into a NaN loss), so parity holds for finite
inputs; the fused losses are differentiated with respect to ``log_probs`` / ``values`` only and
raise if the old log-probs, advantages, old values or returns require grad.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import torch as ppo_torch
from ._fused_loss import fused_loss, non_empty_rows

__all__ = [
    "KL_IS_WEIGHT_CLIP",
    "PolicyLoss",
    "ValueLoss",
    "aggregate_loss",
    "compute_approx_kl",
    "compute_reward",
    "get_advantages_and_returns",
    "masked_mean",
]

# Upper bound for the importance weight pi_theta / pi_theta_old in the unbiased KL gradient.
KL_IS_WEIGHT_CLIP = 10.0


# ---- openrlhf/models/utils.py -------------------------------------------------------------------


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None):
    """openrlhf.models.utils.masked_mean: sum(tensor * mask) / sum(mask) (no epsilon)."""
    if mask is None:
        return tensor.mean(dim=dim)
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    log_probs_old: torch.Tensor | None = None,
    kl_estimator: str = "k1",
    unbiased_gradient: bool = False,
) -> torch.Tensor:
    """openrlhf.models.utils.compute_approx_kl: k1, k2 or k3 of ``log_probs - log_probs_base`` in
    float32, k3's log-ratio floored at -10, the estimate clamped to [-10, 10]; with
    ``unbiased_gradient`` the value is kept and the gradient is the importance-weighted k2's."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k1":
        value = log_ratio
    elif kl_estimator == "k2":
        value = log_ratio**2 / 2.0
    elif kl_estimator == "k3":
        # Below -10, k3 already exceeds the final cap: bound it before exp (OpenRLHF's comment).
        k3_log_ratio = log_ratio.clamp(min=-10)
        value = (-k3_log_ratio).exp() - 1 + k3_log_ratio
    else:
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")
    value = value.clamp(min=-10, max=10)
    if not unbiased_gradient:
        return value
    if log_probs_old is None:
        w = 1.0
    else:
        w = (log_probs.float() - log_probs_old.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
    grad_surrogate = w * (log_ratio**2 / 2.0)
    return value.detach() + grad_surrogate - grad_surrogate.detach()


def compute_reward(
    r: torch.Tensor | float,
    kl_coef: float,
    kl: torch.Tensor | list[torch.Tensor],
    action_mask: torch.Tensor | None = None,
    reward_clip_range: tuple[float, float] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """openrlhf.models.utils.compute_reward: ``-kl_coef * kl`` at every position plus the score
    ``r`` on each row's last position with a nonzero mask (position T-1 for a row with none)."""
    if kl_coef <= 0.0:
        kl_coef = 0.0
    if reward_clip_range:
        r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    kl_reward = -kl_coef * kl
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(
        dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype)
    )
    return last_reward + kl_reward


# ---- openrlhf/trainer/ppo_utils/experience_maker.py ---------------------------------------------


@torch.no_grad()
def get_advantages_and_returns(
    values: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RemoteExperienceMaker.get_advantages_and_returns (a method there that never reads
    ``self``): GAE over every position of ``action_mask * rewards`` and ``action_mask * values``.

    Returns ``(advantages, returns)``, shaped (batch_size, response_size), not whitened.
    """
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    values, rewards = values.to(dtype), rewards.to(dtype)
    advantages = ppo_torch.gae(rewards, values, gamma=gamma, lam=lambd).advantages
    returns = advantages + values
    return advantages.detach(), returns


# ---- openrlhf/models/loss.py --------------------------------------------------------------------


def aggregate_loss(
    loss: torch.Tensor,
    loss_mask: torch.Tensor,
    token_level_loss: bool = True,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
) -> torch.Tensor:
    """openrlhf.models.loss.aggregate_loss (plain torch): per-token masked sum over the (global)
    token count, or the mean over non-empty sequences of their token means."""
    if token_level_loss:
        if batch_num_tokens is None:
            return masked_mean(loss, loss_mask, dim=None)
        return (loss * loss_mask).sum() / batch_num_tokens * dp_size
    token_counts = loss_mask.sum(dim=-1)
    seq_loss = (loss * loss_mask).sum(dim=-1) / (token_counts + 1e-8)
    seq_mask = (token_counts > 0).float()
    if global_batch_size is None:
        return masked_mean(seq_loss, seq_mask, dim=None)
    return (seq_loss * seq_mask).sum() / global_batch_size * dp_size


def _fused_aggregate(
    kernel,
    loss_mask,
    token_level_loss,
    dp_size,
    batch_num_tokens,
    global_batch_size,
    **arguments,
):
    """aggregate_loss with the fused ``kernel`` taking its masked sum: ``(loss, kernel result)``.

    A global count is divided by and dp_size multiplied; without one, the loss is this rank's
    masked mean, which OpenRLHF does not scale by dp_size."""
    if token_level_loss:
        agg, global_count = "token-mean", batch_num_tokens
        local_count = loss_mask.sum() if loss_mask is not None else _first_numel(arguments)
    else:
        # Counted even when a global count is given: OpenRLHF's sequence-level loss needs the
        # mask, and fails without one.
        agg, global_count = "seq-mean-token-mean", global_batch_size
        local_count = non_empty_rows(loss_mask)
    if global_count is None:
        return fused_loss(kernel, loss_mask, agg, local_count, **arguments)
    return fused_loss(kernel, loss_mask, agg, global_count, dp_size, **arguments)


def _first_numel(arguments) -> int:
    """The token count when there is no mask: every element of the loss's first argument."""
    return next(iter(arguments.values())).numel()


class PolicyLoss(nn.Module):
    """openrlhf.models.loss.PolicyLoss: PPO's clipped surrogate (optionally dual-clip, and the
    train/rollout importance-sampling correction), fused for ``policy_loss_type="ppo"``.

    ``forward`` returns ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``; the last two
    are None without the correction.
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: list | tuple = (0.5, 5.0),
    ) -> None:
        super().__init__()
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.token_level_loss = token_level_loss
        self.dual_clip = dual_clip
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold

        # GSPO requires sequence-level loss (per-sample mean)
        if policy_loss_type == "gspo":
            self.token_level_loss = False
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
        if is_correction_mode == "clip" and (
            is_correction_level == "seq" or is_correction_gating != "ratio"
        ):
            raise ValueError(
                "is_correction_mode=clip requires is_correction_level=token and "
                "is_correction_gating=ratio"
            )
        if (
            is_correction_gating != "ratio"
            and is_correction_level != "off"
            and is_correction_threshold[0] > 0
        ):
            raise ValueError(
                f"is_correction_gating={is_correction_gating} takes an upper bound only "
                "(a single delta)"
            )

    def _is_correction(self, old_log_probs, rollout_log_probs, action_mask):
        """The per-token importance-sampling coefficient, the filter fraction and vllm_kl, as
        OpenRLHF computes them (all detached)."""
        low, high = self.is_correction_threshold
        seq_level = self.is_correction_level == "seq"
        is_log_ratio = (old_log_probs - rollout_log_probs).detach()
        token_is = is_log_ratio.exp()
        if self.is_correction_gating == "ratio":
            stat = (
                masked_mean(is_log_ratio, action_mask, dim=-1).unsqueeze(-1)
                if seq_level
                else is_log_ratio
            )
            stat = stat.exp()
        else:
            p = rollout_log_probs.exp().clamp(1e-6, 1 - 1e-6)
            q = old_log_probs.exp().clamp(1e-6, 1 - 1e-6)
            if self.is_correction_gating == "binary_kl":
                stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            else:
                stat = (p - q).abs()
            if seq_level:
                stat = masked_mean(stat, action_mask, dim=-1).unsqueeze(-1)
        if self.is_correction_mode == "clip":
            coef = stat.clamp(min=low, max=high)
            filtered = (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            coef = torch.where(keep, token_is, 0.0)
            filtered = ~keep
        if seq_level:
            is_filter_ratio = filtered.float().mean()
        else:
            is_filter_ratio = masked_mean(filtered.float(), action_mask, dim=None)
        vllm_kl = masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None)
        return coef, is_filter_ratio, vllm_kl

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | None = None,
        global_batch_size: float | None = None,
    ):
        if self.policy_loss_type == "gspo":
            return self._gspo(
                log_probs,
                old_log_probs,
                advantages,
                action_mask,
                rollout_log_probs,
                dp_size,
                batch_num_tokens,
                global_batch_size,
            )
        if self.policy_loss_type != "ppo":
            raise ValueError(f"Invalid policy loss type: {self.policy_loss_type}")
        vllm_kl = is_filter_ratio = coef = None
        if self.is_correction_level != "off":
            coef, is_filter_ratio, vllm_kl = self._is_correction(
                old_log_probs, rollout_log_probs, action_mask
            )
        dtype = torch.promote_types(
            torch.promote_types(log_probs.dtype, old_log_probs.dtype), advantages.dtype
        )
        if coef is not None:
            coef = torch.broadcast_to(coef, log_probs.shape).to(dtype).contiguous()
        loss, result = _fused_aggregate(
            ppo_torch.clipped_surrogate,
            action_mask,
            self.token_level_loss,
            dp_size,
            batch_num_tokens,
            global_batch_size,
            logprobs=log_probs.to(dtype),
            old_logprobs=old_log_probs.to(dtype),
            advantages=advantages.to(dtype),
            clip_low=self.clip_eps_low,
            clip_high=self.clip_eps_high,
            dual_clip=self.dual_clip,
            log_ratio_clamp=20.0,
            weights=coef,
        )
        ratio_dtype = torch.float32 if action_mask is None else action_mask.dtype
        clip_ratio = result.clipfrac.to(torch.promote_types(torch.float32, ratio_dtype))
        ppo_kl = masked_mean(-(log_probs - old_log_probs).detach(), action_mask, dim=None)
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio

    def _gspo(
        self,
        log_probs,
        old_log_probs,
        advantages,
        action_mask,
        rollout_log_probs,
        dp_size,
        batch_num_tokens,
        global_batch_size,
    ):
        """GSPO (https://arxiv.org/pdf/2507.18071): OpenRLHF's torch code, unchanged."""
        raw_policy_log_ratio = log_probs - old_log_probs
        if self.is_correction_level != "off":
            log_ratio = log_probs - rollout_log_probs
        else:
            log_ratio = raw_policy_log_ratio
        ratio = (log_ratio * action_mask).sum(dim=-1) / action_mask.sum(dim=-1).clamp(min=1)
        ratio = ratio.exp().unsqueeze(-1) * action_mask
        surr1 = ratio * advantages
        surr2 = ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages
        if self.dual_clip is None:
            loss = -torch.min(surr1, surr2)
        else:
            clip1 = torch.min(surr1, surr2)
            clip2 = torch.max(clip1, self.dual_clip * advantages)
            loss = -torch.where(advantages < 0, clip2, clip1)
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
        return loss, clip_ratio, ppo_kl, None, None


class ValueLoss(nn.Module):
    """openrlhf.models.loss.ValueLoss: ``0.5 * aggregate(max((v_clip - R)^2, (v - R)^2))``, with
    ``v_clip = old + clamp(v - old, -clip_eps, clip_eps)``; no clipping when clip_eps is None."""

    def __init__(self, clip_eps: float | None = None, token_level_loss: bool = True) -> None:
        super().__init__()
        self.clip_eps = clip_eps
        self.token_level_loss = token_level_loss

    def forward(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | None = None,
        global_batch_size: float | None = None,
    ) -> torch.Tensor:
        dtype = torch.promote_types(
            torch.promote_types(values.dtype, old_values.dtype), returns.dtype
        )
        loss, _ = _fused_aggregate(
            ppo_torch.value_loss,
            action_mask,
            self.token_level_loss,
            dp_size,
            batch_num_tokens,
            global_batch_size,
            values=values.to(dtype),
            old_values=old_values.to(dtype),
            returns=returns.to(dtype),
            clip=self.clip_eps,
        )
        return loss
