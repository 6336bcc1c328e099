"""``ppo_fast.torch``'s DPPO and KL-Cov losses and the KL-Cov and Clip-Cov selections (re-exported
there: call them from there). The losses, as the rest of the policy-loss family: CPU tensors on
the kernels, zero-copy; a tensor on another device computed there by the kernel's formula in
torch, with the same closed-form gradient and statistics (tested on CPU by forcing that path, and
on a CUDA device by tests/test_torch_cuda.py). The selections: CPU tensors read without a copy;
on another device, KL-Cov's is computed there (``_kl_cov_selection_in_torch``) and Clip-Cov's,
whose draw is NumPy's, goes through the host.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _validate
from . import torch as _pt
from ._policy_scalars import _dppo_scalars
from .policy import dppo_loss as _numpy_dppo_loss
from .policy import kl_cov_loss as _numpy_kl_cov_loss


def _dppo_formula(
    logp, old, adv, *, divergence, divergence_low, divergence_high, ratio_cap, log_ratio_clamp
):
    """The dppo kernel's per-token terms (objective, slope, log-ratio, outside, capped), with
    l = -w * objective and d l / d logp = -w * slope (``torch._reinforce_formula``'s)."""
    log_ratio = _pt._clamped(logp - old, log_ratio_clamp)
    ratio = log_ratio.exp()
    positive = adv > 0
    if divergence == 1:  # binary KL; _spec.DIVERGENCES
        # in float64, p <= p_old read as logp <= old (the kernels' and the oracle's: in float32
        # the two terms cancel below their rounding where p is near p_old)
        wide_logp, wide_old = logp.double(), old.double()
        prob, old_prob = wide_logp.exp(), wide_old.exp()
        complement = 1.0 - old_prob
        distance = old_prob * (wide_old - wide_logp) + complement * torch.log(
            (complement + 1e-8) / ((1.0 - prob) + 1e-8)
        )
        inside = torch.where(
            positive,
            (distance <= divergence_high) | (logp <= old),
            (distance <= divergence_low) | (logp >= old),
        )
    else:
        prob, old_prob = logp.exp(), old.exp()
        difference = prob - old_prob
        inside = torch.where(positive, difference <= divergence_high, difference >= -divergence_low)
    keep = inside.to(logp.dtype)
    slope = adv * torch.clamp(ratio, max=ratio_cap)
    return (slope * logp) * keep, slope * keep, log_ratio, ~inside, inside & (ratio > ratio_cap)


def _kl_cov_scalars(selected: Any, coef: float) -> dict[str, Any]:
    from . import _validate

    return {"selected": selected, "coef": _validate.scalar("coef", coef, lo=0.0)}


def _kl_cov_formula(logp, old, adv, *, selected, coef):
    """The kl_cov kernel's per-token terms, as ``_dppo_formula``; the approx_kl slot holds the
    negated |log-ratio| (its mean, negated back by the caller's -log_ratio, is verl's)."""
    picked = _torch_selection(selected, logp)
    log_ratio = logp - old
    base = adv * log_ratio.exp()
    penalised = picked & (coef != 0.0)
    objective = torch.where(penalised, base - coef * log_ratio.abs(), base)
    slope = torch.where(penalised, base - coef * torch.sign(log_ratio), base)
    return objective, slope, -log_ratio.abs(), picked, None


def _torch_selection(selected: Any, like: torch.Tensor) -> torch.Tensor:
    """``policy._selection`` on the device: a bool tensor shaped like ``like`` (bool, or
    integers of 0/1, which costs one bool read back)."""
    if not isinstance(selected, torch.Tensor):
        try:
            selected = torch.as_tensor(selected)
        except (TypeError, ValueError, RuntimeError):
            from .policy import _selection

            _selection(selected, tuple(like.shape))  # raises its error
            raise
    selected = selected.to(device=like.device)
    if tuple(selected.shape) != tuple(like.shape):
        raise ValueError(
            f"selected has shape {tuple(selected.shape)} but logprobs has shape "
            f"{tuple(like.shape)}: pass the selection computed on these logprobs (one flag per "
            "token, in their layout)"
        )
    if selected.dtype == torch.bool:
        return selected
    if _pt._is_integer(selected) and bool(((selected == 0) | (selected == 1)).all()):
        return selected != 0
    raise TypeError(
        f"selected must be bool (or integers 0/1), got {selected.dtype}: pass the selection's "
        "flags, e.g. selected.bool() for a 0/1 tensor"
    )


def _numpy_kl_cov(logprobs, old_logprobs, advantages, *, selected, **options):
    picked = selected.detach().cpu().numpy() if isinstance(selected, torch.Tensor) else selected
    return _numpy_kl_cov_loss(logprobs, old_logprobs, advantages, picked, **options)


_DPPO = _pt._FamilyLoss(_numpy_dppo_loss, _dppo_scalars, _dppo_formula)
_KL_COV = _pt._FamilyLoss(_numpy_kl_cov, _kl_cov_scalars, _kl_cov_formula)


@_pt._speaks_torch
def dppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    divergence: str = "tv",
    divergence_low: float = 0.2,
    divergence_high: float | None = None,
    ratio_cap: float | None = 20.0,
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
    """``ppo_fast.dppo_loss`` on tensors: DPPO-Binary-TV ("tv") or -KL ("kl")."""
    own = {
        "divergence": divergence,
        "divergence_low": divergence_low,
        "divergence_high": divergence_high,
        "ratio_cap": ratio_cap,
        "log_ratio_clamp": log_ratio_clamp,
    }
    return _pt._policy_family(
        _DPPO,
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
def kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    selected: torch.Tensor,
    *,
    coef: float = 1.0,
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
    """``ppo_fast.kl_cov_loss`` on tensors: -A * rho + coef * |log rho| at ``selected``."""
    return _pt._policy_family(
        _KL_COV,
        logprobs,
        old_logprobs,
        advantages,
        {"selected": selected, "coef": coef},
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


for _function in (dppo_loss, kl_cov_loss):
    _function.__doc__ = (_function.__doc__ or "") + _pt._FAMILY_DOC


def _kl_cov_selection_in_torch(
    logprobs: torch.Tensor, advantages: torch.Tensor, ratio: float, layout: dict[str, Any]
) -> torch.Tensor:
    """The kl_cov_top_k kernel's selection (the whole batch one group) in torch on the tensors'
    device, read back as nothing but the number of valid tokens (one synchronisation: k, the
    size of the top-k, depends on it).

    The covariances are the kernel's (float64, a NaN counting as -inf, ties at the k-th value to
    the lowest positions of the flat storage), but their means are torch's float64 sums, whose
    order is not the kernel's 8 lanes: they may differ from the kernel's in the last bits, and
    the tokens with them only where the k-th and (k + 1)-th largest covariances are that close.
    """
    device = logprobs.device
    logp, adv = _pt._torch_tokens({"logprobs": logprobs, "advantages": advantages}, device)
    valid = _pt._torch_rows(tuple(logprobs.shape), device, layout).valid.reshape(-1)
    n_valid = int(valid.sum())
    if n_valid == 0:
        return torch.zeros(logprobs.shape, dtype=torch.bool, device=device)
    wanted = ratio * n_valid
    k = n_valid if wanted >= n_valid else max(int(wanted), 1)
    logp, adv = logp.reshape(-1).double(), adv.reshape(-1).double()
    mean_adv = torch.where(valid, adv, 0.0).sum() / n_valid
    mean_logp = torch.where(valid, logp, 0.0).sum() / n_valid
    covariances = (adv - mean_adv) * (logp - mean_logp)
    keys = torch.where(valid & ~covariances.isnan(), covariances, -math.inf)
    # The k-th largest key of the valid tokens: the invalid ones' -inf never exceeds it.
    kth = torch.topk(keys, k, sorted=True).values[k - 1]
    above = valid & (keys > kth)
    tied = valid & (keys == kth)
    room = k - above.sum()
    chosen = above | (tied & (torch.cumsum(tied, 0) <= room))
    return chosen.reshape(logprobs.shape)


@_pt._speaks_torch
def kl_cov_selection(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    ratio: float = 0.0002,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``ppo_fast.kl_cov_selection`` on tensors: a bool tensor on ``logprobs``' device, True at
    the valid tokens of largest covariance (no gradient flows through a selection). CPU tensors
    are read without a copy. On another device it is computed there, nothing copied to the host
    but the count of valid tokens: its means are torch's float64 sums, so that it may differ
    from the kernels' selection where the k-th and (k + 1)-th largest covariances are within
    the last bits of each other (``_kl_cov_selection_in_torch``)."""
    from .covariance import kl_cov_selection as _numpy_kl_cov_selection

    like = _pt._main_tensor("logprobs", logprobs)
    if like.device.type != "cpu" or _pt._DEVICE_PATH_ON_CPU:
        ratio = _validate.scalar("ratio", ratio, lo=0.0, open_lo=True)
        layout = {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
        return _kl_cov_selection_in_torch(logprobs, advantages, ratio, layout)
    picked = _numpy_kl_cov_selection(
        _pt.to_numpy(logprobs, "logprobs"),
        _pt.to_numpy(advantages, "advantages"),
        ratio=ratio,
        backend=backend,
        **_pt._layout(mask, lengths, cu_seqlens),
    )
    return torch.from_numpy(picked).to(like.device)


@_pt._speaks_torch
def clip_cov_selection(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    seed: Any,
    ratio: float = 0.0002,
    lower: float = 1.0,
    upper: float = 5.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ppo_fast.clip_cov_selection`` on tensors (the draw is NumPy's, from ``seed``): a bool
    tensor on ``logprobs``' device; a tensor on another device takes a host round trip.
    ``ppo_fast.compat.verl`` draws with torch's generator instead, as verl does."""
    from .covariance import clip_cov_selection as _numpy_clip_cov_selection

    like = _pt._main_tensor("logprobs", logprobs)
    picked = _numpy_clip_cov_selection(
        _pt.to_numpy(logprobs, "logprobs"),
        _pt.to_numpy(old_logprobs, "old_logprobs"),
        _pt.to_numpy(advantages, "advantages"),
        seed=seed,
        ratio=ratio,
        lower=lower,
        upper=upper,
        clip_low=clip_low,
        clip_high=clip_high,
        **_pt._layout(mask, lengths, cu_seqlens),
    )
    return torch.from_numpy(picked).to(like.device)
