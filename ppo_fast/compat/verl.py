"""verl's PPO numerics on ppo_fast's kernels: swap the import, keep the numbers.

    from verl.trainer.ppo import core_algos       ->  from ppo_fast.compat import verl as core_algos
    import verl.utils.torch_functional as verl_F  ->  from ppo_fast.compat import verl as verl_F

Reproduces verl 0.9.1 (https://github.com/volcengine/verl, tag v0.9.1, PyPI verl==0.9.1):
``verl/trainer/ppo/core_algos.py`` and ``verl/utils/torch_functional.py``. Every function has the
signature, argument order, return type, dtype promotion and quirks of the function it names, and
equals it to float32 rounding (the tests hold it to 1e-6 relative against verl itself; the
advantage estimators to 1e-12 in float64).

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
- ``compute_policy_loss_gpg``, ``compute_policy_loss_dro``, ``compute_policy_loss_cispo``,
  ``compute_policy_loss_sapo``, ``compute_policy_loss_gspo``, ``compute_policy_loss_geo_mean``
  (from ``._verl_policy_losses``): the same way, on ``ppo_fast.torch``'s ``reinforce_loss``,
  ``cispo_loss``, ``sapo_loss``, ``gspo_loss`` and ``geo_mean_loss``; verl's quirks kept
  (SAPO aggregates by "seq-mean-token-mean" whatever ``loss_agg_mode`` says, GPG returns no
  metrics, CISPO's ``pg_clipfrac_lower`` is 0) and named in each docstring.
- ``compute_policy_loss_dppo_tv``, ``_dppo_kl``, ``_clip_cov``, ``_kl_cov`` and
  ``compute_policy_loss_reinforce`` (from ``._verl_token_losses``): the same way, on
  ``ppo_fast.torch``'s ``dppo_loss``, ``clipped_surrogate``, ``kl_cov_loss`` and
  ``reinforce_loss``; Clip-Cov's and KL-Cov's token selections run verl's own torch expressions
  first (Clip-Cov's random draw on torch's global generator), so the tokens are verl's.
  ``compute_policy_loss_bypass_mode`` fuses the loss that follows verl's own rollout-correction
  helper (the weights, rejection mask and metrics: it needs verl installed).
- The critic-free advantage estimators (``compute_grpo_outcome_advantage`` and the twelve
  others of ``__all__``): the rows are grouped by their ``index`` uids with ppo_fast's
  factorisation (O(B), where verl loops over the rows in Python, and never sized by a uid's
  value), the group statistics run on ``ppo_fast.outcome`` and the returns and the optimal token
  baseline on ``ppo_fast.returns`` (float64); verl's own torch expressions stay around them (the
  row sums of ``token_level_rewards``, ``* response_mask``, ``masked_whiten``), so the dtypes
  are verl's. Each verl quirk is reproduced and named in the function's docstring (verl issue
  7793, PRs 7150 and 7893 among them); where the kernels' semantics differ from verl's, verl's
  result is computed around them, vectorised.
- ``masked_sum``, ``masked_mean``, ``agg_loss``, ``clip_by_value``, ``kl_penalty``,
  ``kl_penalty_forward``, ``compute_rewards``, the KL controllers: verl's code, plain torch and
  NumPy, run from the verbatim copy in ``ppo_fast._peers.verl_0_9_1``. They are vectorised
  already and are differentiated inside losses.

Differences, by design: masks must hold 0/1 (verl multiplies by any weights, ppo_fast rejects
them with a ValueError); values stored at masked positions never reach the kernels, where verl's
``x * 0`` turns a NaN there into NaN results (parity holds for finite inputs); the fused losses are
differentiated with respect to ``log_prob`` / ``vpreds`` only, and raise if the old log-probs,
advantages, returns or old values require grad (verl's trainers detach them); DPPO-KL's binary KL
is evaluated in float64 (``ppo_fast.dppo_loss`` says why), so that on float32 inputs a token whose
probability is within about 3e-4 of the old one can fall on the other side of a bound of 0 than
verl's float32 rounding puts it (on the right side: its binary KL is positive); with a float64
mask, "seq-mean-token-mean" divides each row's sum by its count where verl divides by the count
plus 1e-8 (1e-8 / count apart, relative; the 1e-8 rounds away in float32 for other masks).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import torch as ppo_torch
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
from ._masked import valid_positions
from ._verl_estimators import (
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_opo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from ._verl_functional import _STATS as _VERL_STATS
from ._verl_functional import _carry_into_masked, masked_var, masked_whiten
from ._verl_policy_losses import (
    _as_verl_mean,
    _fused_agg_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
)
from ._verl_token_losses import (
    compute_policy_loss_bypass_mode,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_kl_cov,
    compute_policy_loss_reinforce,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "clip_by_value",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

# ---- verl/trainer/ppo/core_algos.py -------------------------------------------------------------
# Deliberately written again: the signatures of the fused functions below (a drop-in keeps verl's
# parameter lists line for line) and compute_policy_loss_vanilla's metrics dict (verl's return
# value); their bodies run on the kernels, so the copy's functions cannot be called for them.


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
        if isinstance(response_mask, torch.Tensor) and response_mask.is_floating_point():
            # verl's loop blends by the mask (lastgaelam_ * response_mask[:, t] + ...): a
            # floating mask joins the promotion (float64 advantages for float32 values)
            dtype = torch.promote_types(dtype, response_mask.dtype)
        rewards, values = token_level_rewards.to(dtype), values.to(dtype)
        # The mask converted once for the three steps (verl's int64 response_mask: 8 bytes a
        # position that each would read and convert); gae's errors for anything else.
        valid = response_mask
        if isinstance(valid, torch.Tensor) and rewards.shape == values.shape == valid.shape:
            valid = valid_positions(response_mask)
        result = ppo_torch.gae(rewards, values, gamma=gamma, lam=lam, mask=valid)
        advantages = _carry_into_masked(result.advantages, valid)
        # verl's returns written over the kernel's, and the whitened advantages over the
        # advantages: tensors of this call, on memory that earlier results used
        # (ppo_fast.set_result_cache), where new ones would fault in fresh pages
        returns = torch.add(advantages, values, out=result.returns)
        advantages = _VERL_STATS.masked_whiten(
            advantages, response_mask, True, valid=valid, out=advantages
        )
    return advantages, returns


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
