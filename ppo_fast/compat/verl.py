"""verl's PPO numerics on ppo_fast's kernels: swap the import, keep the numbers.

    from verl.trainer.ppo import core_algos       ->  from ppo_fast.compat import verl as core_algos
    import verl.utils.torch_functional as verl_F  ->  from ppo_fast.compat import verl as verl_F

Reproduces verl 0.9.1 (https://github.com/volcengine/verl, tag v0.9.1, PyPI verl==0.9.1):
``verl/trainer/ppo/core_algos.py`` and ``verl/utils/torch_functional.py``. Every function has the
signature, argument order, return type, dtype promotion and quirks of the function it names, and
equals it to float32 rounding (the tests hold it to 1e-6 relative against verl itself).

What runs where:

- ``compute_gae_advantage_return``: the ppo_fast GAE kernel replaces verl's Python loop over the
  response length. verl skips masked positions as ppo_fast does (the next value and the running
  advantage carry across them), but it also stores the carried advantage at each masked position
  (the advantage of the next valid token, 0 after the last), and ``returns = advantages + values``
  everywhere; both are reproduced in torch around the kernel.
- ``masked_var`` and ``masked_whiten``: the sums come from the ppo_fast moments kernel (float64);
  verl's own scalar arithmetic follows (``mask.sum() + 1e-8`` denominators, the Bessel factor
  ``n / (n - 1)`` in torch's default dtype, the ValueError for fewer than two valid tokens), and
  the whitening is applied at every position, masked ones included, as verl does. When ``values``
  requires grad they run verl's torch code (the copy's), so autograd is unchanged.
- ``compute_policy_loss_vanilla``, ``compute_policy_loss``, ``compute_value_loss``: the fused
  kernels through ``ppo_fast.torch`` autograd Functions (one pass for the loss, the gradient and
  the statistics); the kernel returns the masked token sum (or sum of per-sequence means) and
  verl's ``agg_loss`` normalisation is applied to it in torch, with its global-count arguments
  (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``).
- ``masked_sum``, ``masked_mean``, ``agg_loss``, ``clip_by_value``, ``kl_penalty``,
  ``kl_penalty_forward``, ``compute_rewards``, the KL controllers: verl's code, plain torch and
  NumPy, run from the verbatim copy in ``ppo_fast._peers.verl_0_9_1``. They are vectorised
  already and are differentiated inside losses.

Differences, by design: masks must hold 0/1 (verl multiplies by any weights, ppo_fast rejects
them with a ValueError); values stored at masked positions never reach the kernels, where verl's
``x * 0`` turns a NaN there into NaN results (parity holds for finite inputs); the fused losses are
differentiated with respect to ``log_prob`` / ``vpreds`` only, and raise if the old log-probs,
advantages, returns or old values require grad (verl's trainers detach them).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import torch as ppo_torch
from .._peers import verl_0_9_1 as _verl
from .._peers.verl_0_9_1 import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    clip_by_value,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
    masked_mean,
    masked_sum,
)
from ._fused_loss import fused_loss, non_empty_rows
from ._masked import PeerMaskedStats

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "clip_by_value",
    "compute_gae_advantage_return",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_rewards",
    "compute_value_loss",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

_LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


# ---- verl/utils/torch_functional.py -------------------------------------------------------------


_STATS = PeerMaskedStats(
    peer_masked_var=_verl.masked_var,
    peer_masked_whiten=_verl.masked_whiten,
    mean_denominator=lambda mask: mask.sum() + 1e-8,
    no_token_error="At least one element in the mask has to be 1.",
    one_token_error="The sum of the mask is one, which can cause a division by zero.",
)


def masked_var(values, mask, unbiased=True):
    """verl.utils.torch_functional.masked_var: unbiased by default; ValueError for fewer than
    two valid tokens."""
    return _STATS.masked_var(values, mask, unbiased)


def masked_whiten(values, mask, shift_mean=True):
    """verl.utils.torch_functional.masked_whiten: ``(values - mean) * rsqrt(var + 1e-8)`` at every
    position (masked ones too), with verl's unbiased masked variance."""
    return _STATS.masked_whiten(values, mask, shift_mean)


# ---- verl/trainer/ppo/core_algos.py -------------------------------------------------------------
# Deliberately written again: the signatures of the fused functions below (a drop-in keeps verl's
# parameter lists line for line) and compute_policy_loss_vanilla's metrics dict (verl's return
# value); their bodies run on the kernels, so the copy's functions cannot be called for them.


def _carry_into_masked(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """At each masked position, the advantage of the next valid position of its row (0 after the
    last): what verl's loop leaves in ``lastgaelam`` there."""
    valid = mask.bool()
    if bool(valid.all()):
        return advantages
    width = valid.shape[-1]
    positions = torch.arange(width, device=valid.device).expand_as(valid)
    own_or_end = torch.where(valid, positions, width)
    next_valid = own_or_end.flip(-1).cummin(dim=-1).values.flip(-1)
    padded = torch.cat([advantages, advantages.new_zeros((*advantages.shape[:-1], 1))], dim=-1)
    return padded.gather(-1, next_valid)


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: torch.Tensor,
    lam: torch.Tensor,
):
    """verl.trainer.ppo.core_algos.compute_gae_advantage_return on the GAE kernel.

    (bs, response_length) rewards, values and 0/1 mask; gamma and lam scalars (or per-row).
    Returns ``(advantages, returns)``: advantages whitened by ``masked_whiten`` over the mask,
    returns = advantages + values before whitening, both at every position as verl leaves them.
    """
    with torch.no_grad():
        dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
        rewards, values = token_level_rewards.to(dtype), values.to(dtype)
        advantages = ppo_torch.gae(
            rewards, values, gamma=gamma, lam=lam, mask=response_mask
        ).advantages
        advantages = _carry_into_masked(advantages, response_mask)
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def _fused_agg_loss(
    kernel,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: Any = None,
    **arguments: Any,
) -> tuple[torch.Tensor, Any]:
    """agg_loss with the fused ``kernel`` taking its masked sum: ``(loss, kernel result)``,
    differentiable through the kernel's loss."""
    if loss_agg_mode not in _LOSS_AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    if loss_agg_mode == "token-sum":
        count = None
    elif loss_agg_mode == "token-mean":
        count = batch_num_tokens
        if count is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            count = loss_mask.sum()
    else:
        count = global_batch_size
        if count is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            count = non_empty_rows(loss_mask)
    loss_scale = None
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss_scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    agg = "seq-mean-token-mean" if loss_agg_mode == "seq-mean-token-mean" else "token-mean"
    return fused_loss(kernel, loss_mask, agg, count, dp_size, loss_scale, **arguments)


def _as_verl_mean(mean: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A kernel statistic (a mean over the valid tokens, NaN when there is none) as verl's
    ``masked_mean``: the same sum over ``mask.sum() + 1e-8``, so 0 when no token is valid."""
    count = mask.sum()
    total = torch.nan_to_num(mean.double() * count.double(), nan=0.0)
    return total.to(torch.promote_types(dtype, mask.dtype)) / (count + 1e-8)


def _policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange_low,
    cliprange_high,
    clip_ratio_c,
    loss_agg_mode,
    rollout_is_weights=None,
    global_batch_info=None,
):
    """The vanilla PPO policy loss and its three statistics, fused."""
    assert clip_ratio_c > 1.0, (
        "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
        + f" but get the value: {clip_ratio_c}."
    )
    dtype = torch.promote_types(
        torch.promote_types(log_prob.dtype, old_log_prob.dtype), advantages.dtype
    )
    weights = None if rollout_is_weights is None else rollout_is_weights.to(dtype)
    pg_loss, result = _fused_agg_loss(
        ppo_torch.clipped_surrogate,
        response_mask,
        loss_agg_mode,
        **(global_batch_info or {}),
        logprobs=log_prob.to(dtype),
        old_logprobs=old_log_prob.to(dtype),
        advantages=advantages.to(dtype),
        clip_low=cliprange_low,
        clip_high=cliprange_high,
        dual_clip=clip_ratio_c,
        log_ratio_clamp=20.0,
        weights=weights,
    )
    pg_clipfrac = _as_verl_mean(result.clipfrac, response_mask, torch.float32)
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, dtype)
    pg_clipfrac_lower = _as_verl_mean(result.clipfrac_lower, response_mask, torch.float32)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange=None,
    cliprange_low=None,
    cliprange_high=None,
    clip_ratio_c=3.0,
    loss_agg_mode: str = "token-mean",
):
    """verl.trainer.ppo.core_algos.compute_policy_loss (deprecated there: it warns the same
    FutureWarning): ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, all tensors.

    Dual clip at ``clip_ratio_c`` for negative advantages, the log-ratio clamped to [-20, 20].
    """
    warnings.warn(
        "Warning: Function 'verl.trainer.ppo.core_algos.compute_policy_loss' is deprecated. "
        "Please use 'verl.trainer.ppo.core_algos.compute_policy_loss_vanilla' instead.",
        category=FutureWarning,
        stacklevel=2,
    )
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    return _policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cliprange_low,
        cliprange_high,
        clip_ratio_c,
        loss_agg_mode,
    )


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_vanilla: ``(pg_loss, metrics)`` with
    metrics ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (floats).

    ``config`` is verl's ActorConfig (or a DictConfig): ``clip_ratio``, ``clip_ratio_low``,
    ``clip_ratio_high``, ``get("clip_ratio_c", 3.0)`` and ``global_batch_info`` (the agg_loss
    keyword arguments) are read from it. ``rollout_is_weights`` multiply the per-token loss.
    """
    assert config is not None
    assert type(config).__name__ != "AlgoConfig"
    clip_ratio = config.clip_ratio
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        loss_agg_mode,
        rollout_is_weights,
        config.global_batch_info,
    )
    pg_metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, pg_metrics


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
):
    """verl.trainer.ppo.core_algos.compute_value_loss: ``(vf_loss, vf_clipfrac)``.

    Note verl's argument order: predictions, returns, then the old values.
    ``0.5 * agg_loss(max((vpreds - returns)^2, (clip(vpreds, values +- c) - returns)^2))``.
    """
    dtype = torch.promote_types(torch.promote_types(vpreds.dtype, returns.dtype), values.dtype)
    vf_loss, result = _fused_agg_loss(
        ppo_torch.value_loss,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
        values=vpreds.to(dtype),
        old_values=values.to(dtype),
        returns=returns.to(dtype),
        clip=cliprange_value,
    )
    vf_clipfrac = _as_verl_mean(result.clipfrac, response_mask, torch.float32)
    return vf_loss, vf_clipfrac
