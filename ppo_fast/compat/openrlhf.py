"""OpenRLHF's PPO numerics on ppo_fast's kernels: swap the import, keep the numbers.

    from openrlhf.models.utils import compute_approx_kl, compute_reward, masked_mean
    from openrlhf.models.loss import PolicyLoss, ValueLoss
        ->  from ppo_fast.compat.openrlhf import (compute_approx_kl, compute_reward, masked_mean,
                                                  PolicyLoss, ValueLoss)
    RemoteExperienceMaker.get_advantages_and_returns(self, values, rewards, action_mask, gamma,
                                                     lambd)
        ->  ppo_fast.compat.openrlhf.get_advantages_and_returns(values, rewards, action_mask,
                                                                 gamma, lambd)
    RemoteExperienceMaker.get_cumulative_returns(self, rewards, action_mask, gamma)
        ->  ppo_fast.compat.openrlhf.get_cumulative_returns(rewards, action_mask, gamma)
    RemoteExperienceMaker.compute_advantages_and_returns
        =   ppo_fast.compat.openrlhf.compute_advantages_and_returns   (a method: it reads self)

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
  ``get_cumulative_returns`` likewise, on the discounted-returns kernel.
- ``compute_advantages_and_returns``: OpenRLHF's steps, with the group baselines on
  ``ppo_fast.outcome`` (float64 statistics), GAE and the returns on the kernels above, the
  length penalties vectorised and the normalisation's sums from the moments kernel; its quirks
  kept (see its docstring).
- ``PolicyLoss`` (``policy_loss_type="ppo"``) and ``ValueLoss``: the fused kernels through
  ``ppo_fast.torch`` autograd Functions; the kernel returns the masked token sum (or the sum of
  per-sequence means) and ``aggregate_loss``'s normalisation follows in torch. The train/rollout
  importance-sampling correction (``is_correction_*``) is computed in torch from the detached
  log-probs, as OpenRLHF does, and passed to the kernel as per-token weights. ``ppo_kl`` is the
  unclamped mean of ``old - new`` log-probs, in torch. ``policy_loss_type="gspo"`` runs on
  ``ppo_fast.torch.gspo_loss`` (the sequence ratio differentiated through the whole row, as
  OpenRLHF's); without an ``action_mask`` it runs OpenRLHF's code, which needs one.
- ``compute_approx_kl``, ``compute_reward``, ``masked_mean``, ``aggregate_loss``,
  ``KL_IS_WEIGHT_CLIP``: OpenRLHF's code, plain torch (vectorised already, and differentiated in
  the KL loss), run from the verbatim copy in ``ppo_fast._peers.openrlhf_0_11_2``.
  ``PolicyLoss`` and ``ValueLoss`` subclass the copy's classes: their constructors (defaults and
  argument checks) are OpenRLHF's own code; only ``forward`` is replaced where it runs on the
  kernels.

Without editing OpenRLHF: ``install()`` (idempotent, undone by ``uninstall()``) puts
``PolicyLoss`` and the experience maker's three methods above in OpenRLHF's modules, and
``python -m ppo_fast.compat.openrlhf ARGS`` runs ``openrlhf.cli.train_ppo_ray`` with ARGS on a Ray
whose ``worker_process_setup_hook`` installs it in every worker (``runtime_env()``); see
``ppo_fast.compat._openrlhf_hook``.

Differences, by design: masks must hold 0/1; values stored at masked positions never reach the
fused losses (OpenRLHF's ``x * 0`` turns a NaN there into a NaN loss), so parity holds for finite
inputs; the fused losses are differentiated with respect to ``log_probs`` / ``values`` only and
raise if the old log-probs, advantages, old values or returns require grad; with a float64 mask,
the sequence-level losses divide each row's sum by its count where OpenRLHF divides by the count
plus 1e-8 (1e-8 / count apart, relative; the 1e-8 rounds away in float32 for other masks).
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import numpy as np
import torch

from .. import outcome as _outcome
from .. import returns as _returns
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

# The worker hook (not OpenRLHF functions: outside __all__, whose names are OpenRLHF's).
from ._openrlhf_hook import install as install
from ._openrlhf_hook import installed as installed
from ._openrlhf_hook import runtime_env as runtime_env
from ._openrlhf_hook import setup_worker as setup_worker
from ._openrlhf_hook import uninstall as uninstall
from ._outcome import outcome_rows

__all__ = [
    "KL_IS_WEIGHT_CLIP",
    "PolicyLoss",
    "ValueLoss",
    "aggregate_loss",
    "compute_advantages_and_returns",
    "compute_approx_kl",
    "compute_reward",
    "get_advantages_and_returns",
    "get_cumulative_returns",
    "masked_mean",
]

_logger = logging.getLogger(__name__)


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
        loss, result = fused_loss(kernel, loss_mask, agg, local_count, **arguments)
    else:
        loss, result = fused_loss(kernel, loss_mask, agg, global_count, dp_size, **arguments)
    if loss_mask is not None:  # OpenRLHF's products loss * loss_mask take the mask's dtype
        loss = loss.to(torch.promote_types(loss.dtype, loss_mask.dtype))
    return loss, result


def _first_numel(arguments) -> int:
    """The token count when there is no mask: every element of the loss's first argument."""
    return next(iter(arguments.values())).numel()


class PolicyLoss(_openrlhf.PolicyLoss):
    """openrlhf.models.loss.PolicyLoss: PPO's clipped surrogate (optionally dual-clip, and the
    train/rollout importance-sampling correction), fused for ``policy_loss_type="ppo"``, and
    GSPO's (``policy_loss_type="gspo"``) on the fused sequence-level kernel.

    The constructor (its defaults and argument checks) is OpenRLHF's, inherited from the verbatim
    copy, and so is an unknown ``policy_loss_type`` (it raises there). ``forward`` returns
    ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``; the last two are None without the
    correction (and for GSPO, as in OpenRLHF).
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
        if self.policy_loss_type == "gspo" and action_mask is not None:
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
        """GSPO on the fused kernel: ``ppo_fast.torch.gspo_loss(form="sequence")``, OpenRLHF's
        ratio ``exp(masked mean log-ratio)`` differentiated as a function of the whole row (the
        log-ratio against the rollout's log-probs when the correction is on, as OpenRLHF; its
        coefficient, vllm_kl and filter fraction are the PPO path's only: None here)."""
        dtype = torch.promote_types(
            torch.promote_types(log_probs.dtype, old_log_probs.dtype), advantages.dtype
        )
        reference = old_log_probs if self.is_correction_level == "off" else rollout_log_probs
        dtype = torch.promote_types(dtype, reference.dtype)
        loss, result = _fused_aggregate(
            ppo_torch.gspo_loss,
            action_mask,
            self.token_level_loss,
            dp_size,
            batch_num_tokens,
            global_batch_size,
            logprobs=log_probs.to(dtype),
            old_logprobs=reference.to(dtype),
            advantages=advantages.to(dtype),
            form="sequence",
            clip_low=self.clip_eps_low,
            clip_high=self.clip_eps_high,
            dual_clip=self.dual_clip,
        )
        clip_ratio = result.clipfrac.to(torch.promote_types(torch.float32, action_mask.dtype))
        ppo_kl = masked_mean(-(log_probs - old_log_probs).detach(), action_mask, dim=None)
        return loss, clip_ratio, ppo_kl, None, None


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


# ---- openrlhf/trainer/ppo_utils/experience_maker.py: compute_advantages_and_returns ------------

# The estimators of the per-token loop: GAE, or returns-to-go copied into the advantages.
_CUMULATIVE_ESTIMATORS = (
    "reinforce",
    "rloo",
    "reinforce_baseline",
    "group_norm",
    "dr_grpo",
    "flash_reinforce",
)
# The estimators whose advantages are normalised across all experiences at the end.
_NORMALISED_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline")


@torch.no_grad()
def get_cumulative_returns(
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """RemoteExperienceMaker.get_cumulative_returns (a method there that never reads ``self``):
    the discounted returns-to-go of ``action_mask * rewards`` over every position.

    Like ``get_advantages_and_returns``, OpenRLHF does not skip masked tokens: a masked token is a
    step with reward 0 that is discounted like any other, so the return of a token before a hole
    is discounted once more per masked token, and left padding gets the discounted return of the
    response. That is ppo_fast's ``discounted_returns`` with every position valid, on the zeroed
    rewards, which is what runs here. Returns (batch_size, response_size), the rewards' dtype.
    """
    dtype = rewards.dtype
    if action_mask is not None:
        rewards = action_mask * rewards
    returns = _returns.discounted_returns(ppo_torch.to_numpy(rewards, "rewards"), gamma=gamma)
    return ppo_torch.from_numpy(returns, rewards).to(dtype)


def _apply_length_penalties(experiences: list, args: Any) -> None:
    """apply_length_penalties (openrlhf/trainer/ppo_utils/length_penalty.py) on whole tensors:
    the DAPO overlong penalty, the ProRL stop-properly penalty, then ``info["reward"]`` synced.
    OpenRLHF loops over the rows; each experience's rewards are a fresh tensor here
    (``compute_advantages_and_returns`` copies them first), so the update stays in place as
    OpenRLHF's is without touching the caller's tensor."""
    overlong_buffer_len = getattr(args.reward, "overlong_buffer_len", None)
    if overlong_buffer_len is not None:
        max_new_tokens = getattr(args.rollout, "max_new_tokens", None) or args.data.max_len
        overlong_penalty_factor = getattr(args.reward, "overlong_penalty_factor", 1.0)
        assert max_new_tokens >= overlong_buffer_len, (
            f"max_new_tokens ({max_new_tokens}) must be >= overlong_buffer_len "
            f"({overlong_buffer_len})"
        )
        expected_len = max_new_tokens - overlong_buffer_len
        for experience in experiences:
            # float64, as OpenRLHF's per-row Python arithmetic on .item() values.
            lengths = experience.response_length.to(torch.float64)
            exceed_len = (lengths - expected_len).clamp(max=overlong_buffer_len)
            overlong_penalty = -exceed_len / overlong_buffer_len * overlong_penalty_factor
            penalty = torch.where(exceed_len > 0, overlong_penalty, 0.0)
            experience.rewards += penalty.to(experience.rewards.dtype)
    stop_properly_penalty_coef = getattr(args.reward, "stop_properly_penalty_coef", None)
    if stop_properly_penalty_coef is not None:
        if stop_properly_penalty_coef >= 0:
            assert 0 <= stop_properly_penalty_coef <= 1, (
                "stop_properly_penalty_coef must be in [0, 1] or negative, got "
                f"{stop_properly_penalty_coef}"
            )
        for experience in experiences:
            if experience.truncated is None:
                continue
            truncated = experience.truncated.bool()
            if stop_properly_penalty_coef < 0:
                penalised = torch.full_like(experience.rewards, stop_properly_penalty_coef)
            else:
                penalised = experience.rewards * stop_properly_penalty_coef
            experience.rewards[truncated] = penalised[truncated]
    for experience in experiences:
        if "reward" in experience.info:
            experience.info["reward"] = experience.rewards.clone()


def _group_baseline(estimator: str, rewards: torch.Tensor, n_samples_per_prompt: int):
    """The rewards of the batch (in prompt order, each prompt's samples adjacent) after the
    estimator's group baseline, on ``ppo_fast.outcome``; unchanged for "gae" and "reinforce"."""
    groups = np.arange(rewards.shape[0]) // n_samples_per_prompt
    single = n_samples_per_prompt == 1
    if estimator == "rloo":
        if single:
            # OpenRLHF divides the others' sum by n - 1 = 0: 0 / 0.
            return torch.full_like(rewards, float("nan"))
        return outcome_rows("rewards", _outcome.rloo, rewards, groups)
    if estimator in ("reinforce_baseline", "dr_grpo"):
        return outcome_rows("rewards", _outcome.grpo, rewards, groups, std=None, singleton="zero")
    if estimator == "group_norm":
        if single:
            # The unbiased std of one reward is NaN.
            return torch.full_like(rewards, float("nan"))
        return outcome_rows("rewards", _outcome.grpo, rewards, groups, eps=1e-9)
    if estimator == "flash_reinforce":
        whole_batch = np.zeros(rewards.shape[0], dtype=np.int64)
        return outcome_rows(
            "rewards", _outcome.grpo, rewards, whole_batch, std=None, singleton="zero"
        )
    return rewards


def _normalise_advantages(experiences: list, no_std_norm: bool) -> None:
    """The last block of compute_advantages_and_returns: every experience's advantages minus
    the mean over all experiences' valid tokens, times ``rsqrt(max(var, 1e-8))`` (population
    variance), at every position. The sums come from the moments kernel (float64); OpenRLHF takes
    them over the advantages cast to float32 and keeps a float32 mean and rstd, so both are
    rounded to float32 here too."""
    count = total = 0.0
    for experience in experiences:
        moments = ppo_torch.masked_moments(
            experience.advantages.float(), mask=experience.action_mask
        )
        count += moments.count
        total += moments.sum
    device = experiences[0].advantages.device
    # Tensors, so that no valid token gives OpenRLHF's 0 / 0 = NaN, not a ZeroDivisionError.
    count = torch.tensor(count, dtype=torch.float64, device=device)
    mean = (torch.tensor(total, dtype=torch.float64, device=device) / count).float()
    if no_std_norm:
        rstd = 1
    else:
        # A mean of NaN (no valid token: 0 / 0) or inf makes OpenRLHF's (x - mean)**2 NaN at a
        # valid token, or 0 / 0 again: its variance and every advantage are NaN.
        squares = math.nan
        if math.isfinite(float(mean)):
            squares = 0.0
            for experience in experiences:
                moments = ppo_torch.masked_moments(
                    experience.advantages.float(), mask=experience.action_mask, shift=float(mean)
                )
                squares += moments.sum_sq
        var = (torch.tensor(squares, dtype=torch.float64, device=device) / count).float()
        rstd = var.clamp(min=1e-8).rsqrt()
    for experience in experiences:
        experience.advantages = (experience.advantages - mean) * rstd


def _prompt_order(experiences: list, n_samples_per_prompt: int) -> torch.Tensor:
    """OpenRLHF's ``indices``: each row's position in prompt order (the experiences' ``index``
    lists, concatenated), checked to be a permutation that fills whole groups, which OpenRLHF's
    ``rewards[indices] = raw_rewards`` and ``reshape(-1, n_samples_per_prompt)`` assume."""
    indices = torch.tensor(
        list(itertools.chain.from_iterable(experience.index for experience in experiences)),
        dtype=torch.int64,
    )
    n_rows = indices.numel()
    if not bool(torch.equal(torch.sort(indices).values, torch.arange(n_rows))):
        raise ValueError(
            "the experiences' index lists must together hold each of 0 .. B-1 once (B, the "
            "rows of all experiences): each row's position in prompt order"
        )
    if n_samples_per_prompt < 1 or n_rows % n_samples_per_prompt:
        raise ValueError(
            f"args.rollout.n_samples_per_prompt must divide the {n_rows} rows of the "
            f"experiences, got {n_samples_per_prompt}"
        )
    return indices


@torch.no_grad()
def compute_advantages_and_returns(self: Any, experiences: list) -> list:
    """RemoteExperienceMaker.compute_advantages_and_returns: a method that reads ``self``
    (``strategy.args``, ``kl_ctl.value``, ``advantage_estimator``); bind it to the class
    (``RemoteExperienceMaker.compute_advantages_and_returns = compute_advantages_and_returns``)
    or call it with the experience maker. It sets each experience's ``advantages``, ``returns``,
    ``info`` and ``kl`` (None) as OpenRLHF does, and returns the list.

    The steps, OpenRLHF's:

    1. rewards (B,) promoted to float32 at least; the DAPO overlong and ProRL stop-properly
       length penalties (``args.reward``).
    2. The group baseline over each prompt's ``args.rollout.n_samples_per_prompt`` samples (rows
       put in prompt order by the experiences' ``index``), ``args.algo.advantage.estimator``:
       "rloo" leave-one-out, "reinforce_baseline" and "dr_grpo" minus the group mean,
       "group_norm" ``(r - mean) / (std + 1e-9)`` (unbiased std), "flash_reinforce" minus the
       batch mean; "gae" and "reinforce" none. On ``ppo_fast.outcome``, float64 statistics:
       OpenRLHF's are float32, and its mean of equal float32 rewards can be an ulp off, which
       "group_norm" divides by ``0 + 1e-9`` (three rewards of 0.11 get 0.74 there, 0 here).
       With one sample per prompt "rloo" and "group_norm" give NaN
       (OpenRLHF's 0 / 0 and the std of one value), as OpenRLHF. ``info["group_reward_std"]``
       is logged when there are several samples per prompt.
    3. Per experience: ``compute_reward`` (the reward on the last valid token, ``-kl_coef * kl``
       on every token, ``args.reward.clip_range``); then, by ``self.advantage_estimator``, GAE
       (``get_advantages_and_returns``) or returns-to-go (``get_cumulative_returns``) copied into
       the advantages; both on ppo_fast's kernels, over every position (OpenRLHF discounts masked
       tokens as steps). Every estimator but "reinforce" runs with gamma = 1 and sets
       ``args.algo.advantage.gamma = 1.0`` with a warning, as OpenRLHF does (so the config is
       changed for every later call).
    4. For "gae", "reinforce" and "reinforce_baseline", the advantages of all experiences
       normalised together: minus the mean over the valid tokens, times
       ``rsqrt(max(var, 1e-8))`` unless ``args.algo.advantage.no_std_norm``; OpenRLHF keeps both
       statistics in float32, and so does this function.

    The caller's reward tensors are left as they are: each experience gets a new one, where
    OpenRLHF adds the length penalties into a float32 caller's tensor in place.
    """
    args = self.strategy.args

    # Use at least FP32 for reward penalties and group statistics.
    for experience in experiences:
        dtype = torch.promote_types(experience.rewards.dtype, torch.float32)
        experience.rewards = experience.rewards.to(dtype, copy=True)

    _apply_length_penalties(experiences, args)

    n_samples_per_prompt = args.rollout.n_samples_per_prompt
    exp_len = [len(experience.index) for experience in experiences]
    indices = _prompt_order(experiences, n_samples_per_prompt)
    raw_rewards = torch.cat([experience.rewards for experience in experiences], dim=0)
    rewards = torch.empty_like(raw_rewards)
    rewards[indices] = raw_rewards  # sorted by original prompt order

    if n_samples_per_prompt > 1:
        group_reward_stds = (
            rewards.reshape(-1, n_samples_per_prompt)
            .std(-1, keepdim=True)
            .repeat(1, n_samples_per_prompt)
            .reshape(-1)[indices]
            .split(exp_len)
        )
        for experience, group_reward_std in zip(experiences, group_reward_stds, strict=True):
            experience.info["group_reward_std"] = group_reward_std

    rewards = _group_baseline(args.algo.advantage.estimator, rewards, n_samples_per_prompt)
    rewards = rewards[indices].split(exp_len)

    for experience, reward in zip(experiences, rewards, strict=True):
        reward = compute_reward(
            reward,
            self.kl_ctl.value,
            experience.kl,
            action_mask=experience.action_mask,
            reward_clip_range=args.reward.clip_range,
        )
        if self.advantage_estimator == "gae":
            experience.advantages, experience.returns = get_advantages_and_returns(
                experience.values,
                reward,
                experience.action_mask,
                args.algo.advantage.gamma,
                args.algo.advantage.lambd,
            )
        elif self.advantage_estimator in _CUMULATIVE_ESTIMATORS:
            if args.algo.advantage.gamma != 1.0 and self.advantage_estimator != "reinforce":
                _logger.warning(f"gamma is set to 1.0 for {self.advantage_estimator}")
                args.algo.advantage.gamma = 1.0
            experience.returns = get_cumulative_returns(
                reward, experience.action_mask, args.algo.advantage.gamma
            )
            experience.advantages = experience.returns.clone()
        else:
            raise ValueError(
                f"Unkown advantage_estimator {self.advantage_estimator} (OpenRLHF's message): "
                f"the estimators are gae, {', '.join(_CUMULATIVE_ESTIMATORS)}"
            )
        experience.info["return"] = reward.sum(dim=-1)
        experience.kl = None

    if args.algo.advantage.estimator in _NORMALISED_ESTIMATORS:
        _normalise_advantages(experiences, args.algo.advantage.no_std_norm)
    return experiences


if __name__ == "__main__":  # python -m ppo_fast.compat.openrlhf ARGS: the launcher
    from ._openrlhf_hook import main

    main()
