"""verl 0.9.1's DPPO, Clip-Cov, KL-Cov and REINFORCE policy losses on ppo_fast's fused losses.

Re-exported by ``ppo_fast.compat.verl`` (call them from there): ``compute_policy_loss_dppo_tv``,
``compute_policy_loss_dppo_kl``, ``compute_policy_loss_clip_cov``,
``compute_policy_loss_kl_cov``, ``compute_policy_loss_bypass_mode`` with verl's signature
``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights)`` and ``compute_policy_loss_reinforce``
with its own (``rollout_log_prob`` first, "seq-mean-token-sum" by default), each returning
verl's ``(loss, metrics)``. The loss runs as in ``._verl_policy_losses`` (one fused
``ppo_fast.torch`` loss for the masked sum, verl's ``agg_loss`` normalisation in torch).

Clip-Cov and KL-Cov select tokens by their covariance first, with verl's own torch expressions
(no gradient), so that the choice is verl's exactly: KL-Cov's top-k over the valid tokens, on
the host as verl computes it (``.cpu()``: a device tensor's valid advantages and log-probs are
copied there, as in verl); Clip-Cov's random draw by ``torch.randperm`` from torch's global
generator, as verl draws it, so the same generator state gives the same tokens (and advances it
as verl does). The loss then takes the selection as an input: ``ppo_fast.torch.kl_cov_loss``, and
``ppo_fast.torch.clipped_surrogate`` with the selected tokens' weights 0 for Clip-Cov.

Differences from verl, as in ``._verl_policy_losses``: inputs computed in the promoted dtype, a
0/1 mask, differentiated with respect to ``log_prob`` only (a ValueError if another input
requires grad), hyperparameters outside the loss's domain are a ValueError (negative divergence
bounds, a ratio cap that is not > 0), and a NaN or inf at a masked position does not reach the
result.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import torch as ppo_torch
from .._peers import verl_0_9_1 as _verl
from ._verl_policy_losses import _as_verl_mean, _cast, _fused_verl_loss, _promoted


def _not_algo_config(config: Any) -> None:
    assert config is not None
    assert type(config).__name__ != "AlgoConfig"


def _clip_bounds(config: Any) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def _dppo(divergence, old_log_prob, log_prob, advantages, response_mask, mode, config, weights):
    _not_algo_config(config)
    low, high = _clip_bounds(config)
    dtype = _promoted(log_prob, old_log_prob, advantages, weights)
    pg_loss, result = _fused_verl_loss(
        ppo_torch.dppo_loss,
        response_mask,
        mode,
        config,
        log_prob.to(dtype),
        old_log_prob.to(dtype),
        advantages.to(dtype),
        _cast(weights, dtype),
        divergence=divergence,
        divergence_low=low,
        divergence_high=high,
        ratio_cap=config.get("clip_ratio_c", 20.0),
        log_ratio_clamp=20.0,
    )
    # verl's token losses are times its float32 valid mask (.float()): a float32 loss at least
    pg_loss = pg_loss.to(torch.promote_types(pg_loss.dtype, torch.float32))
    return pg_loss, {
        "actor/pg_clipfrac": _as_verl_mean(result.clipfrac, response_mask, torch.float32).item(),
        "actor/ppo_kl": _as_verl_mean(
            result.approx_kl, response_mask, _promoted(log_prob, old_log_prob)
        ).item(),
        "actor/pg_clipfrac_lower": _as_verl_mean(
            result.clipfrac_lower, response_mask, torch.float32
        ).item(),
    }


_DPPO_DOC = """verl.trainer.ppo.core_algos.compute_policy_loss_dppo_{name}: ``(pg_loss,
    metrics)``, the loss of ``-advantages * sg(min(ratio, clip_ratio_c)) * log_prob * valid``
    (times ``rollout_is_weights``; the ratio from the log-ratio clamped to [-20, 20]) aggregated
    by ``loss_agg_mode``, ``valid`` verl's DPPO-Binary-{upper} mask with the divergence bounds
    ``clip_ratio_low`` / ``clip_ratio_high`` (``clip_ratio`` where None) and the cap
    ``config.get("clip_ratio_c", 20.0)`` (an ActorConfig has 3.0). Metrics
    ``actor/pg_clipfrac`` (the fraction outside the region), ``actor/ppo_kl`` and
    ``actor/pg_clipfrac_lower`` (inside, with the ratio above the cap), as verl's. Runs
    ``ppo_fast.torch.dppo_loss(divergence="{name}")``.
    """


def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    return _dppo(
        "tv", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    return _dppo(
        "kl", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


compute_policy_loss_dppo_tv.__doc__ = _DPPO_DOC.format(name="tv", upper="TV")
compute_policy_loss_dppo_kl.__doc__ = _DPPO_DOC.format(name="kl", upper="KL")


def _or_default(value: Any, default: float) -> float:
    return value if value is not None else default


@torch.no_grad()
def _clip_cov_dropped(old_log_prob, log_prob, advantages, response_mask, config):
    """verl's Clip-Cov selection, its own expressions: ``corr`` (0 at the dropped tokens)."""
    policy_loss = config.policy_loss
    clip_cov_ratio = _or_default(policy_loss.clip_cov_ratio, 0.0002)
    cliprange_low, cliprange_high = _clip_bounds(config)
    clip_cov_ub = _or_default(policy_loss.clip_cov_ub, 5.0)
    clip_cov_lb = _or_default(policy_loss.clip_cov_lb, 1.0)
    assert clip_cov_ratio > 0, "clip_ratio should be larger than 0."
    log_prob = log_prob.detach()
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - _verl.masked_mean(advantages, response_mask)) * (
        log_prob - _verl.masked_mean(log_prob, response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    candidates = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    candidates = torch.nonzero(candidates)
    if len(candidates) > 0:
        perm = torch.randperm(len(candidates))  # torch's global generator, as verl's
        candidates = candidates[perm[: min(clip_num, len(candidates))]]
        corr[candidates[:, 0], candidates[:, 1]] = 0
    return corr


def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_clip_cov: ``(pg_loss, metrics)``, PPO's
    clipped surrogate (no dual clip, no clamp) with the tokens of verl's covariance selection
    dropped (times ``rollout_is_weights``), aggregated by ``loss_agg_mode``; metrics
    ``actor/pg_clipfrac`` (the fraction dropped) and ``actor/ppo_kl``.

    The selection is verl's: ``config.policy_loss.clip_cov_ratio``, ``clip_cov_lb``,
    ``clip_cov_ub`` (verl's defaults where None), its torch expressions and
    ``torch.randperm`` on torch's global generator (seed it with ``torch.manual_seed`` as for
    verl). Runs ``ppo_fast.torch.clipped_surrogate`` with the dropped tokens' weights 0.
    """
    _not_algo_config(config)
    assert config.policy_loss is not None
    corr = _clip_cov_dropped(old_log_prob, log_prob, advantages, response_mask, config)
    low, high = _clip_bounds(config)
    dtype = _promoted(log_prob, old_log_prob, advantages, rollout_is_weights)
    weights = corr.to(dtype) if rollout_is_weights is None else corr * rollout_is_weights
    pg_loss, result = _fused_verl_loss(
        ppo_torch.clipped_surrogate,
        response_mask,
        loss_agg_mode,
        config,
        log_prob.to(dtype),
        old_log_prob.to(dtype),
        advantages.to(dtype),
        weights.to(dtype),
        clip_low=low,
        clip_high=high,
    )
    pg_clipfrac = _verl.masked_mean((corr == 0).float(), response_mask)
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, _promoted(log_prob, old_log_prob))
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item()}


@torch.no_grad()
def _kl_cov_selected(log_prob, advantages, response_mask, kl_cov_ratio):
    """verl's KL-Cov selection, its own expressions (on the host, as verl's)."""
    selected = torch.zeros(advantages.shape, dtype=torch.bool, device=advantages.device)
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (
            all_valid_logp - all_valid_logp.mean()
        )
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            selected.view(-1)[all_valid_idx[large_cov_idxs.to(all_valid_idx.device)]] = True
    return selected


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_kl_cov: ``(pg_loss, metrics)``, the loss
    of ``-advantages * ratio`` (not clamped), plus ``ppo_kl_coef * |log_prob - old_log_prob|``
    at the tokens of verl's covariance top-k (times ``rollout_is_weights``), aggregated by
    ``loss_agg_mode``; metrics ``actor/ppo_kl``, the masked mean of |log-ratio| (as verl's).

    ``config.policy_loss.kl_cov_ratio`` and ``ppo_kl_coef`` (verl's defaults where None); the
    top-k is verl's, on the host. Runs ``ppo_fast.torch.kl_cov_loss``.
    """
    _not_algo_config(config)
    assert config.policy_loss is not None
    kl_cov_ratio = _or_default(config.policy_loss.kl_cov_ratio, 0.0002)
    ppo_kl_coef = _or_default(config.policy_loss.ppo_kl_coef, 1.0)
    assert kl_cov_ratio > 0, "kl_cov_ratio should be larger than 0."
    selected = _kl_cov_selected(log_prob, advantages, response_mask, kl_cov_ratio)
    dtype = _promoted(log_prob, old_log_prob, advantages, rollout_is_weights)
    pg_loss, result = _fused_verl_loss(
        ppo_torch.kl_cov_loss,
        response_mask,
        loss_agg_mode,
        config,
        log_prob.to(dtype),
        old_log_prob.to(dtype),
        advantages.to(dtype),
        _cast(rollout_is_weights, dtype),
        selected=selected,
        coef=ppo_kl_coef,
    )
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, _promoted(log_prob, old_log_prob))
    return pg_loss, {"actor/ppo_kl": ppo_kl.item()}


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_reinforce: ``(pg_loss, metrics)``, the
    loss of ``-advantages * log_prob`` (times ``rollout_is_weights``, held constant) aggregated
    by ``loss_agg_mode`` ("seq-mean-token-sum" by default, as verl's); metrics ``actor/ppo_kl``,
    the masked mean of ``rollout_log_prob - log_prob``. Runs ``ppo_fast.torch.reinforce_loss``.
    """
    assert config is not None, "ActorConfig must be provided for REINFORCE loss"
    dtype = _promoted(log_prob, advantages, rollout_is_weights)
    pg_loss, result = _fused_verl_loss(
        ppo_torch.reinforce_loss,
        response_mask,
        loss_agg_mode,
        config,
        log_prob.to(dtype),
        rollout_log_prob.to(dtype),
        advantages.to(dtype),
        _cast(rollout_is_weights, dtype),
    )
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, _promoted(log_prob, rollout_log_prob))
    return pg_loss, {"actor/ppo_kl": ppo_kl.item()}


def _rollout_correction_helper():
    """verl's own ``compute_rollout_correction_and_rejection_mask`` (rollout_corr_helper.py):
    the rollout importance weights, the rejection mask and their metrics."""
    try:
        from verl.trainer.ppo.rollout_corr_helper import (
            compute_rollout_correction_and_rejection_mask,
        )
    except ImportError as error:
        raise ImportError(
            "compute_policy_loss_bypass_mode computes its rollout importance weights, rejection "
            "mask and metrics with verl's own rollout_corr_helper, which could not be imported "
            f"({error}): install verl==0.9.1 (ppo_fast fuses the loss that follows them)"
        ) from error
    return compute_rollout_correction_and_rejection_mask


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_bypass_mode: ``(pg_loss, metrics)``.

    As verl: ``old_log_prob`` is the rollout policy's; the rollout importance weights (of
    ``log_prob`` against it, held constant) and the rejection mask come from
    ``config.policy_loss.rollout_correction`` (``loss_type``, ``rollout_is``,
    ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``,
    ``rollout_rs_threshold``); ``rollout_is_weights`` is ignored. "reinforce" runs
    ``compute_policy_loss_reinforce`` with the weights on the rejection mask, "ppo_clip"
    ``compute_policy_loss_vanilla`` on it without them (the PPO ratio is the correction); the
    metrics are that loss's and the helper's ``rollout_corr/...``.

    Different: the weights, the mask and their metrics are computed by verl's own
    ``rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` (vectorised torch,
    no gradient), so this function needs verl installed (ImportError otherwise); the loss is
    ppo_fast's fused one (``compute_policy_loss_reinforce`` or ``_vanilla`` of this module).
    """
    from .verl import compute_policy_loss_vanilla

    assert config is not None, "config is required for bypass_mode loss"
    rollout_corr_config = (
        config.policy_loss.get("rollout_correction", None)
        if hasattr(config, "policy_loss")
        else None
    )
    if rollout_corr_config is None:
        raise ValueError(
            "rollout_correction config not found in policy_loss. "
            "When using loss_mode='bypass_mode', ensure rollout_correction config is passed."
        )
    loss_type = rollout_corr_config.get("loss_type", "ppo_clip")
    with torch.no_grad():
        weights_proto, effective_mask, rollout_metrics = _rollout_correction_helper()(
            old_log_prob=log_prob,
            rollout_log_prob=old_log_prob,
            response_mask=response_mask,
            rollout_is=rollout_corr_config.get("rollout_is", None),
            rollout_is_threshold=rollout_corr_config.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=rollout_corr_config.get("rollout_is_batch_normalize", False),
            rollout_rs=rollout_corr_config.get("rollout_rs", None),
            rollout_rs_threshold=rollout_corr_config.get("rollout_rs_threshold", None),
        )
    weights = weights_proto.batch["rollout_is_weights"] if weights_proto else None
    if loss_type == "reinforce":
        pg_loss, pg_metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, weights
        )
    elif loss_type == "ppo_clip":
        pg_loss, pg_metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, None
        )
    else:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    pg_metrics.update(rollout_metrics)
    return pg_loss, pg_metrics
