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
- ``compute_approx_kl``, ``compute_reward``, ``masked_mean``, ``aggregate_loss``,
  ``KL_IS_WEIGHT_CLIP``: OpenRLHF's code, plain torch (vectorised already, and differentiated in
  the KL loss), run from the verbatim copy in ``ppo_fast._peers.openrlhf_0_11_2``.
  ``PolicyLoss`` and ``ValueLoss`` subclass the copy's classes: their constructors (defaults and
  argument checks) and GSPO are OpenRLHF's own code; only ``forward`` is replaced where it runs
  on the kernels.

Differences, by design: masks must hold 0/1; values stored at masked positions never reach the
fused losses (OpenRLHF's ``x * 0`` turns a NaN there into a NaN loss), so parity holds for finite
inputs; the fused losses are differentiated with respect to ``log_probs`` / ``values`` only and
raise if the old log-probs, advantages, old values or returns require grad.
"""

from __future__ import annotations

import torch

from .. import torch as ppo_torch
from .._peers import openrlhf_0_11_2 as _openrlhf
from .._peers.openrlhf_0_11_2 import (
    KL_IS_WEIGHT_CLIP,
    aggregate_loss,
    compute_approx_kl,
    compute_reward,
    masked_mean,
)
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


class PolicyLoss(_openrlhf.PolicyLoss):
    """openrlhf.models.loss.PolicyLoss: PPO's clipped surrogate (optionally dual-clip, and the
    train/rollout importance-sampling correction), fused for ``policy_loss_type="ppo"``.

    The constructor (its defaults and argument checks) is OpenRLHF's, inherited from the verbatim
    copy, and so is every other ``policy_loss_type`` (GSPO's sequence-level ratio is not the token
    kernel's; an unknown type raises there). ``forward`` returns ``(loss, clip_ratio, ppo_kl,
    vllm_kl, is_filter_ratio)``; the last two are None without the correction.
    """

    # Deliberately OpenRLHF's torch code again: in OpenRLHF the coefficient is computed inline in
    # PolicyLoss.forward and multiplied into its torch loss, so the copy has no function that
    # returns it; the fused kernel needs it as per-token weights. The parity tests hold the two to
    # the same numbers in every gating, level and mode.
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
        if self.policy_loss_type != "ppo":
            return super().forward(
                log_probs,
                old_log_probs,
                advantages,
                action_mask,
                rollout_log_probs,
                dp_size,
                batch_num_tokens,
                global_batch_size,
            )
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


class ValueLoss(_openrlhf.ValueLoss):
    """openrlhf.models.loss.ValueLoss: ``0.5 * aggregate(max((v_clip - R)^2, (v - R)^2))``, with
    ``v_clip = old + clamp(v - old, -clip_eps, clip_eps)``; no clipping when clip_eps is None.
    The constructor is OpenRLHF's (inherited from the verbatim copy); ``forward`` is fused."""

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
