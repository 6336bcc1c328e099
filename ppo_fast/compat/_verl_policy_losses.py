"""verl 0.9.1's policy-loss family on ppo_fast's fused losses, and the loss aggregation that
``ppo_fast.compat.verl`` runs its fused losses under (``_fused_agg_loss``, ``_as_verl_mean``).

Re-exported by ``ppo_fast.compat.verl`` (call them from there): ``compute_policy_loss_gpg``,
``compute_policy_loss_dro``, ``compute_policy_loss_cispo``, ``compute_policy_loss_sapo``,
``compute_policy_loss_gspo``, ``compute_policy_loss_geo_mean``, with verl's signature
``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights)`` and its ``(loss, metrics)`` result, the metrics under verl's keys.

Each runs one fused ``ppo_fast.torch`` loss (``reinforce_loss``, ``cispo_loss``, ``sapo_loss``,
``gspo_loss``, ``geo_mean_loss``: the loss, its gradient and the statistics in one pass; CPU
tensors on the kernels, other devices in torch on the device) for the masked token sum, or sum
of per-sequence means, and verl's ``agg_loss`` normalisation is then applied in torch with
``config.global_batch_info`` (the geometric mean: verl's plain mean over the rows). Where verl
clamps the log-ratio (at 20 for CISPO and SAPO, the sequence log-ratio at 10 above for GSPO), so
do these.

Differences from verl, in all of them: the inputs are computed in the dtype that promotes
``log_prob``, ``advantages`` (and ``old_log_prob`` where verl reads it) and ``rollout_is_weights``,
which is verl's for inputs of one dtype; the mask must hold 0/1; the loss is differentiated with
respect to ``log_prob`` only, and a ValueError is raised if ``old_log_prob``, ``advantages`` or
``rollout_is_weights`` requires grad (verl's trainers detach them); hyperparameters outside the
loss's domain are a ValueError (see each function); a NaN or inf at a masked position does not
reach the result (verl's ``x * mask`` keeps it).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import torch as ppo_torch
from ._fused_loss import fused_loss, non_empty_rows

_LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


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
    # verl's loss takes the mask's dtype in its products loss_mat * mask, and the sequence modes
    # float32 too (their .float() sequence mask): the kernel's sum is in the inputs' dtype.
    dtype = loss_mask.dtype
    if not loss_agg_mode.startswith("token"):
        dtype = torch.promote_types(dtype, torch.float32)
    if count is None or (not isinstance(count, torch.Tensor) and count != 0):
        loss, result = fused_loss(kernel, loss_mask, agg, count, dp_size, loss_scale, **arguments)
    else:
        # verl's masked_sum picks the valid tokens with torch.where, whose backward gives every
        # other token a zero gradient whatever comes from above: a micro-batch with no valid
        # token and a count of 0 has the loss 0 / 0 = NaN and the gradient 0. The kernel's zeros
        # times 1 / 0 would be NaN (a NaN gradient, where verl's step goes on): there the count
        # is taken as 1 for the gradient and the loss keeps verl's value, without a host sync.
        count = torch.as_tensor(count, device=loss_mask.device)  # a tensor, or a number's 0
        empty = (count == 0) & ~loss_mask.bool().any()
        divisor = torch.where(empty, 1, count)
        loss, result = fused_loss(kernel, loss_mask, agg, divisor, dp_size, loss_scale, **arguments)
        empty_value = result.loss.detach() / count * dp_size
        if loss_scale is not None:
            empty_value = empty_value / loss_scale
        loss = torch.where(empty, empty_value, loss)
    return loss.to(torch.promote_types(loss.dtype, dtype)), result


def _as_verl_mean(mean: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A kernel statistic (a mean over the valid tokens, NaN when there is none) as verl's
    ``masked_mean``: the same sum over ``mask.sum() + 1e-8``, so 0 when no token is valid."""
    count = mask.sum()
    total = torch.nan_to_num(mean.double() * count.double(), nan=0.0)
    return total.to(torch.promote_types(dtype, mask.dtype)) / (count + 1e-8)


# ---- verl/trainer/ppo/core_algos.py: the policy-loss family ------------------------------------


def _promoted(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype verl's expression over ``tensors`` computes in (None: not given)."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors if t is not None))


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _is_actor_config(config: Any) -> bool:
    """verl's ``isinstance(config, ActorConfig)`` without importing verl: its ActorConfig, a
    subclass (FSDP or Megatron), or the stand-in of ppo_fast's verbatim copy."""
    return any(cls.__name__ == "ActorConfig" for cls in type(config).__mro__)


def _fused_verl_loss(
    kernel, response_mask, loss_agg_mode, config, logprobs, old_logprobs, advantages, weights, **own
):
    """``(loss, result)``: ``kernel`` aggregated as verl's agg_loss under ``config``'s
    ``global_batch_info``."""
    return _fused_agg_loss(
        kernel,
        response_mask,
        loss_agg_mode,
        **(config.global_batch_info or {}),
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        weights=weights,
        **own,
    )


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_gpg: ``(pg_loss, {})``, the loss of
    ``-log_prob * advantages`` (times ``rollout_is_weights``) aggregated by ``loss_agg_mode``.

    As verl, ``old_log_prob`` is not read (it may be anything) and the metrics are an empty dict;
    ``config`` must not be None (only its ``global_batch_info`` is read). Runs
    ``ppo_fast.torch.reinforce_loss`` (beta = 0).
    """
    assert config is not None
    dtype = _promoted(log_prob, advantages, rollout_is_weights)
    logprobs = log_prob.to(dtype)
    pg_loss, _ = _fused_verl_loss(
        ppo_torch.reinforce_loss,
        response_mask,
        loss_agg_mode,
        config,
        logprobs,
        logprobs.detach(),  # GPG has no old policy: the log-ratio (the unused KL) is 0
        advantages.to(dtype),
        _cast(rollout_is_weights, dtype),
    )
    return pg_loss, {}


def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_dro: ``(pg_loss, metrics)``, the loss of
    ``-(log_prob * advantages - 0.5 * beta * (log_prob - old_log_prob)^2)`` (times
    ``rollout_is_weights``) aggregated by ``loss_agg_mode``, with ``beta =
    config.policy_loss.dro_beta``; metrics ``actor/ppo_kl`` (the masked mean of the log-ratio's
    negative, not clamped).

    As verl: ValueError "policy_loss.dro_beta must be a positive value when using DRO" when beta
    is None or <= 0. Different: an infinite or NaN beta is a ValueError here. Runs
    ``ppo_fast.torch.reinforce_loss`` with ``beta``.
    """
    assert config is not None
    assert config.policy_loss is not None
    beta = config.policy_loss.dro_beta
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    dtype = _promoted(log_prob, old_log_prob, advantages, rollout_is_weights)
    pg_loss, result = _fused_verl_loss(
        ppo_torch.reinforce_loss,
        response_mask,
        loss_agg_mode,
        config,
        log_prob.to(dtype),
        old_log_prob.to(dtype),
        advantages.to(dtype),
        _cast(rollout_is_weights, dtype),
        beta=beta,
    )
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, _promoted(log_prob, old_log_prob))
    return pg_loss, {"actor/ppo_kl": ppo_kl.detach().item()}


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_cispo: ``(pg_loss, metrics)``, the loss of
    ``-sg(clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)) * advantages * log_prob`` (times
    ``rollout_is_weights``, the ratio from the log-ratio clamped to [-20, 20]) aggregated by
    ``loss_agg_mode``; metrics ``actor/pg_clipfrac`` (where the clipped ratio differs from the
    ratio, on either side), ``actor/ppo_kl`` (of the clamped log-ratio) and
    ``actor/pg_clipfrac_lower``, which is 0.0 as in verl.

    As verl: ``config`` must be an ActorConfig (AssertionError otherwise, a DictConfig included);
    ``clip_ratio_low`` / ``clip_ratio_high`` default to ``clip_ratio`` when None. Different:
    clip_ratio_low outside [0, 1] or a negative clip_ratio_high is a ValueError here. Runs
    ``ppo_fast.torch.cispo_loss``.
    """
    assert config is not None
    assert _is_actor_config(config)
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    dtype = _promoted(log_prob, old_log_prob, advantages, rollout_is_weights)
    pg_loss, result = _fused_verl_loss(
        ppo_torch.cispo_loss,
        response_mask,
        loss_agg_mode,
        config,
        log_prob.to(dtype),
        old_log_prob.to(dtype),
        advantages.to(dtype),
        _cast(rollout_is_weights, dtype),
        clip_low=low,
        clip_high=high,
        log_ratio_clamp=20.0,
    )
    pg_clipfrac = _as_verl_mean(result.clipfrac, response_mask, torch.float32)
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, _promoted(log_prob, old_log_prob))
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": 0.0,
    }


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_sapo: ``(pg_loss, metrics)``, the loss of
    ``-sigmoid(tau * (ratio - 1)) * 4 / tau * advantages`` (times ``rollout_is_weights``; tau =
    ``config.tau_pos`` where the advantage is > 0, ``config.tau_neg`` elsewhere; the ratio from
    the log-ratio clamped to [-20, 20]); metrics ``actor/pg_clipfrac`` and
    ``actor/pg_clipfrac_lower``, 0.0 as in verl, and ``actor/ppo_kl`` (of the clamped log-ratio).

    verl's quirk, reproduced: the loss is aggregated by "seq-mean-token-mean" whatever
    ``loss_agg_mode`` says (the argument is not read, not even checked), with
    ``config.global_batch_info``. As verl, ``config`` must be an ActorConfig (AssertionError
    otherwise). Different: a tau that is not > 0 and finite is a ValueError here (verl divides
    by it). Runs ``ppo_fast.torch.sapo_loss``.
    """
    assert config is not None
    assert _is_actor_config(config)
    dtype = _promoted(log_prob, old_log_prob, advantages, rollout_is_weights)
    pg_loss, result = _fused_verl_loss(
        ppo_torch.sapo_loss,
        response_mask,
        "seq-mean-token-mean",  # verl's SAPO, whatever loss_agg_mode is
        config,
        log_prob.to(dtype),
        old_log_prob.to(dtype),
        advantages.to(dtype),
        _cast(rollout_is_weights, dtype),
        tau_pos=config.tau_pos,
        tau_neg=config.tau_neg,
        log_ratio_clamp=20.0,
    )
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, _promoted(log_prob, old_log_prob))
    return pg_loss, {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": 0.0,
    }


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_gspo: ``(pg_loss, metrics)``, the loss of
    ``max(-advantages * s, -advantages * clip(s, 1 - clip_ratio_low, 1 + clip_ratio_high))``
    (times ``rollout_is_weights``) aggregated by ``loss_agg_mode``, where each token's ratio is
    verl's ``exp(min(log_prob - sg(log_prob) + sg(m), 10))``, m the row's mean log-ratio over its
    valid tokens (of value s = exp(min(m, 10)) at every token of the row; its gradient is the
    token's own, ``ppo_fast.gspo_loss(form="detached")``); metrics ``actor/pg_clipfrac`` (where
    the clipped branch is taken), ``actor/ppo_kl`` (the tokens' log-ratios, not clamped) and
    ``actor/pg_clipfrac_lower``, 0.0 as in verl.

    As verl: ``config`` must be an ActorConfig (AssertionError otherwise); ``clip_ratio_low`` /
    ``clip_ratio_high`` default to ``clip_ratio`` when None; a row with no valid token
    contributes nothing. Different: clip_ratio_low outside [0, 1] or a negative clip_ratio_high
    is a ValueError here. Runs ``ppo_fast.torch.gspo_loss``.
    """
    assert config is not None
    assert _is_actor_config(config)
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    dtype = _promoted(log_prob, old_log_prob, advantages, rollout_is_weights)
    pg_loss, result = _fused_verl_loss(
        ppo_torch.gspo_loss,
        response_mask,
        loss_agg_mode,
        config,
        log_prob.to(dtype),
        old_log_prob.to(dtype),
        advantages.to(dtype),
        _cast(rollout_is_weights, dtype),
        form="detached",
        clip_low=low,
        clip_high=high,
        log_ratio_max=10.0,  # verl's clamp of the log-ratio, for numerical stability
    )
    pg_clipfrac = _as_verl_mean(result.clipfrac, response_mask, torch.float32)
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, _promoted(log_prob, old_log_prob))
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": 0.0,
    }


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl.trainer.ppo.core_algos.compute_policy_loss_geo_mean (GMPO): ``(pg_loss, metrics)``,
    the mean over all rows of ``-mean(advantages) * exp(mean(r'))`` (the means over the row's
    valid tokens; r' the log-ratio clipped to [-clip_ratio_low, clip_ratio_high] on the side the
    advantage's sign selects), times the geometric mean of ``rollout_is_weights + 1e-10``;
    metrics ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower`` (tokens whose log-ratio is
    outside the bounds, with A > 0 and A < 0) and ``actor/ppo_kl``. Runs
    ``ppo_fast.torch.geo_mean_loss``.

    verl's quirks, reproduced: ``loss_agg_mode`` and ``config.global_batch_info`` are not read
    (the loss is the plain mean over the rows, empty rows counted); the clip bounds are bounds
    on the log-ratio; ``config`` must not be an AlgoConfig (AssertionError). Different: verl's
    means divide by ``n + 1e-8`` with n the row's mask sum, which is n exactly for an integer,
    bool or float32 mask (the 1e-8 is below float32's resolution there) and which these divide
    by for any mask; a negative clip bound is a ValueError here.
    """
    assert config is not None
    assert not any(cls.__name__ == "AlgoConfig" for cls in type(config).__mro__)
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    dtype = _promoted(log_prob, old_log_prob, advantages, rollout_is_weights)
    weights = None if rollout_is_weights is None else (rollout_is_weights + 1e-10).to(dtype)
    pg_loss, result = fused_loss(
        ppo_torch.geo_mean_loss,
        response_mask,
        "seq-mean-token-mean",
        response_mask.shape[0],  # torch.mean over every row
        logprobs=log_prob.to(dtype),
        old_logprobs=old_log_prob.to(dtype),
        advantages=advantages.to(dtype),
        weights=weights,
        clip_low=low,
        clip_high=high,
    )
    statistics = _promoted(log_prob, old_log_prob)
    pg_clipfrac = _as_verl_mean(result.clipfrac, response_mask, torch.float32)
    pg_clipfrac_lower = _as_verl_mean(result.clipfrac_lower, response_mask, torch.float32)
    ppo_kl = _as_verl_mean(result.approx_kl, response_mask, statistics)
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
