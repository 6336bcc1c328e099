"""``ppo_fast.torch``'s per-sequence losses (``gspo_loss``, ``geo_mean_loss``): the fused kernel
for CPU tensors,
and for a tensor on another device the kernel's formula in torch on that device, with the same
closed-form gradient and statistics (per-token arithmetic in the compute dtype, sums in
float64), nothing copied to the host. Imported by ``ppo_fast.torch``, which exports them; call
them from there.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from . import torch as _ppo_torch
from ._policy_scalars import _geo_mean_scalars, _gspo_form, _gspo_scalars
from .policy import geo_mean_loss as _numpy_geo_mean_loss
from .policy import gspo_loss as _numpy_gspo_loss
from .torch import (
    PolicyFamilyFunction,
    PolicyLoss,
    _main_tensor,
    _on_kernels,
    _speaks_torch,
    _torch_row_scales,
    _torch_rows,
    _torch_tokens,
    _TorchRows,
    to_numpy,
)


def _row_sums(rows: _TorchRows, per_token: torch.Tensor) -> torch.Tensor:
    """(B,) sums over each row's valid tokens of a float64 per-token tensor."""
    if rows.row_of is None:
        return torch.where(rows.valid, per_token, 0.0).sum(dim=-1)
    sums = torch.zeros(rows.counts.shape, dtype=per_token.dtype, device=per_token.device)
    return sums.index_add_(0, rows.row_of, per_token)


def _on_tokens(rows: _TorchRows, per_row: torch.Tensor) -> torch.Tensor:
    """A (B,) tensor broadcast onto the token positions of its rows."""
    return per_row[:, None] if rows.row_of is None else per_row[rows.row_of]


def _gspo_in_torch(scalars, form, normalisers, layout, logprobs, old_logprobs, advantages, weights):
    """The gspo kernel (``ppo_fast._reference.gspo``) in torch on ``logprobs``' device."""
    device = logprobs.device
    arrays = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    if weights is not None:
        arrays["weights"] = weights
    tokens = _torch_tokens(arrays, device)
    rows = _torch_rows(tuple(logprobs.shape), device, layout)
    scales, valid = _torch_row_scales(rows=rows, **normalisers, dtype=tokens[0].dtype)
    logp, old, adv = tokens[:3]
    keep = rows.valid
    log_ratio = logp - old
    counts = rows.counts.double().clamp(min=1.0)
    mean = (_row_sums(rows, log_ratio.double()) / counts).to(logp.dtype)
    cap = scalars["log_ratio_max"]
    beyond = mean > cap  # torch.clamp passes the gradient at its bound
    row_ratio = torch.where(beyond, cap, mean).exp()
    ratio = _on_tokens(rows, row_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(scalars["ratio_low"], scalars["ratio_high"]) * adv
    is_clipped = clipped < unclipped
    objective = torch.where(is_clipped, clipped, unclipped)
    dual = adv * scalars["dual_clip"]
    is_dual = (adv < 0) & (dual > objective)
    objective = torch.where(is_dual, dual, objective)
    slope = torch.where(is_clipped | is_dual, 0.0, adv)
    weight = None if weights is None else tokens[3].double()
    losses = -objective.double() if weight is None else -(weight * objective.double())
    token_scales = _on_tokens(rows, scales)
    loss = torch.where(keep, losses * token_scales, 0.0).sum()
    if form == 0:  # detached: each token's own term
        sloped = torch.where(_on_tokens(rows, beyond), 0.0, slope * ratio).double()
        per_token = -sloped if weight is None else -(weight * sloped)
        grad = torch.where(keep, per_token * token_scales, 0.0)
    else:  # sequence: the row's sum of slopes, through d s / d logp = s / n
        slopes = -slope.double() if weight is None else -(weight * slope.double())
        gradient_ratio = torch.where(beyond, 0.0, row_ratio).double()
        row_grad = _row_sums(rows, torch.where(keep, slopes, 0.0)) * gradient_ratio
        grad = torch.where(keep, _on_tokens(rows, row_grad * scales / counts), 0.0)

    def mean_of(per_token: torch.Tensor) -> torch.Tensor:
        total = torch.where(keep, per_token, 0.0).sum()
        return torch.where(valid > 0, total / valid, math.nan)

    return (
        loss,
        grad.to(logprobs.dtype),
        mean_of(is_clipped.double()),
        mean_of((is_clipped & (adv < 0)).double()),
        mean_of(-log_ratio.double()),
    )


def _geo_mean_in_torch(scalars, normalisers, layout, logprobs, old_logprobs, advantages, weights):
    """The geo_mean kernel (``ppo_fast._reference.geo_mean``) in torch on ``logprobs``' device."""
    device = logprobs.device
    arrays = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    if weights is not None:
        arrays["weights"] = weights
    tokens = _torch_tokens(arrays, device)
    rows = _torch_rows(tuple(logprobs.shape), device, layout)
    scales, valid = _torch_row_scales(rows=rows, **normalisers, dtype=tokens[0].dtype)
    logp, old, adv = tokens[:3]
    keep = rows.valid
    low, high = scalars["log_ratio_low"], scalars["log_ratio_high"]
    log_ratio = logp - old
    positive, negative = adv > 0, adv < 0
    kept = torch.where(
        positive,
        torch.where(log_ratio > high, high, log_ratio),
        torch.where(negative, torch.where(log_ratio < -low, -low, log_ratio), log_ratio * 0.0),
    )
    counts = rows.counts.double()
    per_row = counts.clamp(min=1.0)
    exponent = _row_sums(rows, kept.double()) / per_row
    if weights is not None:
        exponent = exponent + _row_sums(rows, tokens[3].double().log()) / per_row
    row_loss = -(_row_sums(rows, adv.double()) / per_row) * exponent.exp()
    row_loss = torch.where(counts > 0, row_loss, 0.0)  # a row without a token: nothing
    loss = (row_loss * counts * scales).sum()
    moves = (positive & (log_ratio <= high)) | (negative & (log_ratio >= -low))
    grad = torch.where(keep & moves, _on_tokens(rows, row_loss * scales), 0.0)
    outside = ~((log_ratio >= -low) & (log_ratio <= high))

    def mean_of(per_token: torch.Tensor) -> torch.Tensor:
        total = torch.where(keep, per_token, 0.0).sum()
        return torch.where(valid > 0, total / valid, math.nan)

    return (
        loss,
        grad.to(logprobs.dtype),
        mean_of((outside & positive).double()),
        mean_of((outside & negative).double()),
        mean_of(-log_ratio.double()),
    )


def _dispatch(numpy_loss, in_torch, own, scalars, layout, normalisers, backend, tensors):
    """The kernels for CPU tensors, ``in_torch`` (its checked ``scalars`` bound) elsewhere."""
    like = _main_tensor("logprobs", tensors[0])
    if like.device.type == "cpu" and not _ppo_torch._DEVICE_PATH_ON_CPU:
        options = {**own, **normalisers, "backend": backend}
        compute = functools.partial(_on_kernels, numpy_loss, layout, options)
    else:
        compute = functools.partial(in_torch, *scalars(), normalisers, layout)
    return PolicyLoss(*PolicyFamilyFunction.apply(compute, *tensors))


def _normalisers(agg, num_tokens, num_seqs, loss_scale) -> dict[str, Any]:
    return {
        "agg": agg,
        "num_tokens": to_numpy(num_tokens, "num_tokens"),
        "num_seqs": to_numpy(num_seqs, "num_seqs"),
        "loss_scale": to_numpy(loss_scale, "loss_scale"),
    }


@_speaks_torch
def geo_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float | None = None,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    agg: str = "seq-mean-token-mean",
    num_tokens: Any = None,
    num_seqs: Any = None,
    loss_scale: Any = None,
    weights: torch.Tensor | None = None,
    backend: str | None = None,
) -> PolicyLoss:
    """``ppo_fast.geo_mean_loss`` on tensors: verl's geometric-mean loss (GMPO), -mean(A) *
    exp(mean clipped log-ratio) per row."""
    own = {"clip_low": clip_low, "clip_high": clip_high}
    return _dispatch(
        _numpy_geo_mean_loss,
        _geo_mean_in_torch,
        own,
        lambda: (_geo_mean_scalars(**own),),
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        _normalisers(agg, num_tokens, num_seqs, loss_scale),
        backend,
        (logprobs, old_logprobs, advantages, weights),
    )


@_speaks_torch
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    form: str = "detached",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_max: float | None = None,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: Any = None,
    num_seqs: Any = None,
    loss_scale: Any = None,
    weights: torch.Tensor | None = None,
    backend: str | None = None,
) -> PolicyLoss:
    """``ppo_fast.gspo_loss`` on tensors: GSPO, the clipped surrogate on each row's sequence
    ratio, with verl's gradient (``form="detached"``) or TRL's and OpenRLHF's
    (``form="sequence"``)."""
    own = {
        "clip_low": clip_low,
        "clip_high": clip_high,
        "dual_clip": dual_clip,
        "log_ratio_max": log_ratio_max,
    }
    return _dispatch(
        _numpy_gspo_loss,
        _gspo_in_torch,
        {**own, "form": form},
        lambda: (_gspo_scalars(**own), _gspo_form(form)),
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        _normalisers(agg, num_tokens, num_seqs, loss_scale),
        backend,
        (logprobs, old_logprobs, advantages, weights),
    )


for _function in (gspo_loss, geo_mean_loss):
    _function.__doc__ = (_function.__doc__ or "") + _ppo_torch._FAMILY_DOC
