"""``ppo_fast.torch``'s REINFORCE/GPG/DRO, CISPO and SAPO losses (re-exported there: call them from
there): CPU tensors on the kernels, zero-copy; a tensor on another device computed there by the
kernel's formula in torch (the formulas below), with the same closed-form gradient and statistics.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import torch as _pt
from ._policy_scalars import _cispo_scalars, _reinforce_scalars, _sapo_scalars
from .policy import cispo_loss as _numpy_cispo_loss
from .policy import reinforce_loss as _numpy_reinforce_loss
from .policy import sapo_loss as _numpy_sapo_loss


def _reinforce_formula(logp, old, adv, *, beta):
    """The reinforce kernel's per-token terms: (objective, slope, log-ratio, clipped, lower),
    with l = -w * objective and d l / d logp = -w * slope."""
    log_ratio = logp - old
    objective, slope = adv * logp, adv
    if beta != 0.0:
        objective = objective - (log_ratio * log_ratio) * (beta * 0.5)
        slope = adv - log_ratio * beta
    return objective, slope, log_ratio, None, None


def _cispo_formula(logp, old, adv, *, ratio_low, ratio_high, log_ratio_clamp):
    """The cispo kernel's per-token terms, as ``_reinforce_formula``."""
    log_ratio = _pt._clamped(logp - old, log_ratio_clamp)
    ratio = log_ratio.exp()
    coefficient = ratio.clamp(ratio_low, ratio_high)
    slope = coefficient * adv
    return slope * logp, slope, log_ratio, coefficient != ratio, ratio < ratio_low


def _sapo_formula(logp, old, adv, *, tau_pos, tau_neg, log_ratio_clamp):
    """The sapo kernel's per-token terms, as ``_reinforce_formula``; the slope is 0 where the
    clamp is active (strictly beyond it: torch.clamp passes the gradient at its bounds)."""
    raw = logp - old
    log_ratio = _pt._clamped(raw, log_ratio_clamp)
    ratio = log_ratio.exp()
    tau = torch.full_like(adv, tau_neg).masked_fill_(adv > 0, tau_pos)
    sigmoid = torch.sigmoid(tau * (ratio - 1.0))
    objective = sigmoid * (4.0 / tau) * adv
    slope = adv * ((4.0 * sigmoid) * (1.0 - sigmoid)) * ratio
    if log_ratio_clamp != math.inf:
        beyond = (raw < -log_ratio_clamp) | (raw > log_ratio_clamp)
        slope = slope.masked_fill(beyond, 0.0)
    return objective, slope, log_ratio, None, None


_REINFORCE = _pt._FamilyLoss(_numpy_reinforce_loss, _reinforce_scalars, _reinforce_formula)
_CISPO = _pt._FamilyLoss(_numpy_cispo_loss, _cispo_scalars, _cispo_formula)
_SAPO = _pt._FamilyLoss(_numpy_sapo_loss, _sapo_scalars, _sapo_formula)


@_pt._speaks_torch
def reinforce_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float = 0.0,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: Any = None,
    num_seqs: Any = None,
    loss_scale: Any = None,
    weights: torch.Tensor | None = None,
    backend: str | None = None,
) -> _pt.PolicyLoss:
    """``ppo_fast.reinforce_loss`` on tensors: REINFORCE / GPG (-A log pi), DRO with ``beta``."""
    return _pt._policy_family(
        _REINFORCE,
        logprobs,
        old_logprobs,
        advantages,
        {"beta": beta},
        mask=mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
        agg=agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale=loss_scale,
        weights=weights,
        backend=backend,
    )


@_pt._speaks_torch
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    log_ratio_clamp: float | None = None,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: Any = None,
    num_seqs: Any = None,
    loss_scale: Any = None,
    weights: torch.Tensor | None = None,
    backend: str | None = None,
) -> _pt.PolicyLoss:
    """``ppo_fast.cispo_loss`` on tensors: CISPO, -sg(clip(rho)) * A * log pi."""
    own = {"clip_low": clip_low, "clip_high": clip_high, "log_ratio_clamp": log_ratio_clamp}
    return _pt._policy_family(
        _CISPO,
        logprobs,
        old_logprobs,
        advantages,
        own,
        mask=mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
        agg=agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale=loss_scale,
        weights=weights,
        backend=backend,
    )


@_pt._speaks_torch
def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float | None = None,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: Any = None,
    num_seqs: Any = None,
    loss_scale: Any = None,
    weights: torch.Tensor | None = None,
    backend: str | None = None,
) -> _pt.PolicyLoss:
    """``ppo_fast.sapo_loss`` on tensors: SAPO, -sigmoid(tau * (rho - 1)) * 4 / tau * A."""
    own = {"tau_pos": tau_pos, "tau_neg": tau_neg, "log_ratio_clamp": log_ratio_clamp}
    return _pt._policy_family(
        _SAPO,
        logprobs,
        old_logprobs,
        advantages,
        own,
        mask=mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
        agg=agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale=loss_scale,
        weights=weights,
        backend=backend,
    )


for _function in (reinforce_loss, cispo_loss, sapo_loss):
    _function.__doc__ = (_function.__doc__ or "") + _pt._FAMILY_DOC
