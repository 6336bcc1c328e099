"""``ppo_fast.torch``'s clipped surrogate and value loss on a device other than the CPU: the
kernels' formulas in torch on the tensors' own device, with the same closed-form gradient and
statistics (per-token arithmetic in the compute dtype, sums in float64), nothing copied to the
host but the one bool of the layout's value check (``torch._torch_rows``). What
``ppo_fast.torch.clipped_surrogate`` and ``value_loss`` run for such tensors (tests force it on
CPU tensors with ``_DEVICE_PATH_ON_CPU``, and tests/test_torch_cuda.py on a CUDA device).

One difference from the kernels, as in the rest of the family's torch path: exp is torch's, which
overflows to inf beyond float32's (or float64's) range where the kernels' saturates (a log-ratio
above 88 in float32 without a clamp).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import torch as _pt
from ._policy_scalars import _surrogate_scalars


def _surrogate_formula(logp, old, adv, *, ratio_low, ratio_high, dual_clip, log_ratio_clamp):
    """The clipped_surrogate kernel's per-token terms (objective, slope, log-ratio, clipped,
    dual-clipped), with l = -w * objective and d l / d logp = -w * slope: the slope is
    rho * A on the unclipped branch within the clamp, 0 on a flat one (clipped, dual-clipped, or
    the clamp active, strictly beyond it: torch.clamp passes the gradient at its bounds)."""
    raw = logp - old
    inside = (raw >= -log_ratio_clamp) & (raw <= log_ratio_clamp)
    log_ratio = _pt._clamped(raw, log_ratio_clamp)
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(ratio_low, ratio_high) * adv
    # the clipped branch only where it is strictly smaller, as the kernels
    is_clipped = clipped < unclipped
    objective = torch.where(is_clipped, clipped, unclipped)
    bound = dual_clip * adv
    is_dual = (adv < 0) & (bound > objective)
    objective = torch.where(is_dual, bound, objective)
    sloped = inside & ~is_clipped & ~is_dual
    slope = torch.where(sloped, unclipped, torch.zeros_like(unclipped))
    return objective, slope, log_ratio, is_clipped, is_dual


def surrogate_on_device(
    logprobs, old_logprobs, advantages, weights, layout, normalisers, own
) -> _pt.PolicyLoss:
    """``ppo_fast.torch.clipped_surrogate`` in torch on ``logprobs``' device."""
    scalars = _surrogate_scalars(**own)

    def compute(logp, old, adv, w):
        return _pt._in_torch(_surrogate_formula, scalars, normalisers, layout, logp, old, adv, w)

    return _pt.PolicyLoss(
        *_pt.PolicyFamilyFunction.apply(compute, logprobs, old_logprobs, advantages, weights)
    )


class ValueLossDeviceFunction(torch.autograd.Function):
    """Autograd for the value loss in torch: ``apply(compute, values, old_values, returns)``
    with ``compute`` returning (loss, grad, clipfrac); the backward scales the gradient the
    forward computed by grad_output."""

    @staticmethod
    def forward(ctx, compute, values, old_values, returns):
        _pt._no_grad_wanted(ctx, ("old_values", "returns"), 2)
        loss, grad, clipfrac = compute(values, old_values, returns)
        ctx.save_for_backward(grad)
        outputs = tuple(
            torch.as_tensor(value, dtype=values.dtype, device=values.device)
            for value in (loss, clipfrac)
        )
        ctx.mark_non_differentiable(outputs[1])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        (grad,) = ctx.saved_tensors
        return None, grad * grad_loss, None, None


def _value_in_torch(clip, normalisers, layout, values, old_values, returns):
    """The value_loss kernel in torch: 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2), the
    gradient (v - R) * scale where the unclipped term is the larger or equal (0 where the
    clipped one is strictly larger), per-token arithmetic in the compute dtype, sums in
    float64."""
    device = values.device
    arrays = {"values": values, "old_values": old_values, "returns": returns}
    value, old, target = _pt._torch_tokens(arrays, device)
    rows = _pt._torch_rows(tuple(values.shape), device, layout)
    scales, valid = _pt._torch_row_scales(rows=rows, **normalisers, dtype=value.dtype)
    token_scales = scales[:, None] if rows.row_of is None else scales[rows.row_of]
    error = value - target
    unclipped = error * error
    clipped_error = torch.minimum(torch.maximum(value, old - clip), old + clip) - target
    clipped = clipped_error * clipped_error
    is_clipped = clipped > unclipped
    keep = rows.valid
    halves = torch.where(is_clipped, clipped, unclipped).double() * 0.5
    loss = torch.where(keep, halves * token_scales, 0.0).sum()
    grad = torch.where(keep & ~is_clipped, error * token_scales.to(error.dtype), 0.0)
    count = torch.where(keep & is_clipped, 1.0, 0.0).double().sum()
    clipfrac = torch.where(valid > 0, count / valid, math.nan)
    return loss, grad.to(values.dtype), clipfrac


def value_on_device(values, old_values, returns, layout, normalisers, clip: Any) -> _pt.ValueLoss:
    """``ppo_fast.torch.value_loss`` in torch on ``values``' device."""
    from . import _validate

    bound = math.inf if clip is None else _validate.scalar("clip", clip, lo=0.0, allow_inf=True)

    def compute(v, v_old, r):
        return _value_in_torch(bound, normalisers, layout, v, v_old, r)

    return _pt.ValueLoss(*ValueLossDeviceFunction.apply(compute, values, old_values, returns))
