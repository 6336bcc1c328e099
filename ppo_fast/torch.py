"""ppo_fast for torch tensors: the same functions, tensors in and out, and autograd for the losses.

Each function here takes the arguments of its NumPy twin in ``ppo_fast`` (same names, same
semantics, see those docstrings) as torch tensors, and returns tensors on the device and with the
dtype of its main input (``logprobs``, ``rewards``, ``x``, ``values``).

How tensors reach the kernels:

- A contiguous float32/float64 CPU tensor is handed over as ``tensor.numpy()``, which shares its
  memory: no copy. The kernel's output array is wrapped by ``torch.from_numpy``, which shares it
  too, so a CPU call copies nothing. A non-contiguous tensor is copied once (into C order).
- bfloat16 and float16 are computed in float32 and the result is cast back to the input's dtype.
- A CUDA (or any non-CPU) tensor takes a host round trip: it is copied to host memory, computed
  there, and the result is copied back to the input's device, until a GPU backend exists. It is
  correct but pays two transfers and a synchronisation per call.
- Inputs that require grad are read through ``.detach()``: rewards, GAE and whitening are not
  differentiated (trainers run them under ``torch.no_grad()``). The losses are:
  ``clipped_surrogate`` and ``value_loss`` return a ``loss`` tensor with a ``grad_fn``, whose
  backward is the gradient the fused kernel computed in its forward pass, scaled by grad_output.

torch is imported here and only here: ``import ppo_fast`` never imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from . import _validate
from .gae import GAEResult
from .gae import gae as _numpy_gae
from .loss import clipped_surrogate as _numpy_clipped_surrogate
from .loss import value_loss as _numpy_value_loss
from .rewards import kl_penalty as _numpy_kl_penalty
from .rewards import shape_rewards as _numpy_shape_rewards
from .whiten import Moments
from .whiten import masked_moments as _numpy_masked_moments
from .whiten import whiten as _numpy_whiten

_Function = TypeVar("_Function", bound=Callable[..., Any])


def _speaks_torch(function: _Function) -> _Function:
    """Run ``function`` with the validation hints phrased for tensors (``x.float()``)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _validate.torch_hints():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def to_numpy(value: Any, name: str = "tensor") -> Any:
    """A tensor as a NumPy array for the kernels: a view of a CPU tensor's memory (no copy), a
    host copy of a tensor on another device, float32 for bf16/fp16 (``_validate.tensor_array``,
    whose errors name ``name``). Non-tensors pass unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    return _validate.tensor_array(name, value)


def from_numpy(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A kernel's output as a tensor on ``like``'s device with its dtype (no copy on CPU when the
    dtypes agree)."""
    tensor = torch.from_numpy(array)
    if tensor.dtype == like.dtype and like.device.type == "cpu":
        return tensor  # what .to() returns here, without parsing its arguments (per-call cost)
    return tensor.to(device=like.device, dtype=like.dtype)


def _main_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor in ppo_fast.torch, got {type(value).__name__}: "
            "use the functions of ppo_fast itself for NumPy arrays"
        )
    if not value.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor, got {value.dtype}: cast it with "
            f"{name}.float() or {name}.to(torch.float32)"
        )
    return value


def _layout(mask: Any, lengths: Any, cu_seqlens: Any) -> dict[str, Any]:
    return {
        "mask": to_numpy(mask, "mask"),
        "lengths": to_numpy(lengths, "lengths"),
        "cu_seqlens": to_numpy(cu_seqlens, "cu_seqlens"),
    }


@_speaks_torch
def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    clamp: float | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``ppo_fast.kl_penalty`` on tensors: the per-token KL estimate, shaped like ``logprobs``."""
    like = _main_tensor("logprobs", logprobs)
    out = _numpy_kl_penalty(
        to_numpy(logprobs, "logprobs"),
        to_numpy(ref_logprobs, "ref_logprobs"),
        estimator,
        clamp,
        backend=backend,
    )
    return from_numpy(out, like)


@_speaks_torch
def shape_rewards(
    scores: Any,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
    clamp: float | None = None,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``ppo_fast.shape_rewards`` on tensors: KL-shaped rewards shaped like ``logprobs``."""
    like = _main_tensor("logprobs", logprobs)
    out = _numpy_shape_rewards(
        to_numpy(scores, "scores"),
        to_numpy(logprobs, "logprobs"),
        to_numpy(ref_logprobs, "ref_logprobs"),
        kl_coef=to_numpy(kl_coef, "kl_coef"),
        estimator=estimator,
        clamp=clamp,
        backend=backend,
        **_layout(mask, lengths, cu_seqlens),
    )
    return from_numpy(out, like)


@_speaks_torch
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: Any = 1.0,
    lam: Any = 0.95,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    bootstrap: torch.Tensor | None = None,
    backend: str | None = None,
) -> GAEResult:
    """``ppo_fast.gae`` on tensors: ``GAEResult(advantages, returns)`` of tensors."""
    like = _main_tensor("rewards", rewards)
    result = _numpy_gae(
        to_numpy(rewards, "rewards"),
        to_numpy(values, "values"),
        gamma=to_numpy(gamma, "gamma"),
        lam=to_numpy(lam, "lam"),
        bootstrap=to_numpy(bootstrap, "bootstrap"),
        backend=backend,
        **_layout(mask, lengths, cu_seqlens),
    )
    return GAEResult(from_numpy(result.advantages, like), from_numpy(result.returns, like))


@_speaks_torch
def masked_moments(
    x: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    shift: float = 0.0,
    backend: str | None = None,
) -> Moments:
    """``ppo_fast.masked_moments`` on a tensor: float64 count, sum and sum of squares."""
    _main_tensor("x", x)
    return _numpy_masked_moments(
        to_numpy(x, "x"),
        shift=to_numpy(shift, "shift"),
        backend=backend,
        **_layout(mask, lengths, cu_seqlens),
    )


@_speaks_torch
def whiten(
    x: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    shift_mean: bool = True,
    unbiased: bool = False,
    eps: float = 1e-8,
    moments: Moments | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``ppo_fast.whiten`` on a tensor: whitened over the valid positions, 0 elsewhere."""
    like = _main_tensor("x", x)
    out = _numpy_whiten(
        to_numpy(x, "x"),
        shift_mean=shift_mean,
        unbiased=unbiased,
        eps=eps,
        moments=moments,
        backend=backend,
        **_layout(mask, lengths, cu_seqlens),
    )
    return from_numpy(out, like)


class PolicyLoss(NamedTuple):
    """The clipped-surrogate loss (0-d, differentiable in ``logprobs``) and its statistics (0-d,
    not differentiable), each on the device and with the dtype of ``logprobs``."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    approx_kl: torch.Tensor


class ValueLoss(NamedTuple):
    """The clipped value loss (0-d, differentiable in ``values``) and its clip fraction."""

    loss: torch.Tensor
    clipfrac: torch.Tensor


def _no_grad_wanted(ctx: Any, names: tuple[str, ...], first: int) -> None:
    """The fused kernels differentiate with respect to their first input only: refuse to drop a
    gradient that autograd would otherwise have produced."""
    for offset, name in enumerate(names):
        if ctx.needs_input_grad[first + offset]:
            raise ValueError(
                f"{name} requires grad, but the fused loss is differentiated with respect to its "
                f"first argument only: pass {name}.detach() (PPO treats it as data)"
            )


def _scalars(like: torch.Tensor, *values: float) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(v, dtype=like.dtype, device=like.device) for v in values)


class ClippedSurrogateFunction(torch.autograd.Function):
    """Autograd for ``ppo_fast.clipped_surrogate``: the forward runs the fused kernel and keeps
    the gradient it computed; the backward scales that gradient by grad_output.

    ``apply(logprobs, old_logprobs, advantages, weights, layout, options)`` with ``layout`` the
    dict of mask/lengths/cu_seqlens and ``options`` the keyword arguments of the NumPy function;
    returns (loss, clipfrac, clipfrac_lower, approx_kl).
    """

    @staticmethod
    def forward(ctx, logprobs, old_logprobs, advantages, weights, layout, options):
        _no_grad_wanted(ctx, ("old_logprobs", "advantages", "weights"), 1)
        result = _numpy_clipped_surrogate(
            to_numpy(logprobs, "logprobs"),
            to_numpy(old_logprobs, "old_logprobs"),
            to_numpy(advantages, "advantages"),
            weights=to_numpy(weights, "weights"),
            **_layout(**layout),
            **options,
        )
        ctx.save_for_backward(from_numpy(result.grad, logprobs))
        outputs = _scalars(
            logprobs, result.loss, result.clipfrac, result.clipfrac_lower, result.approx_kl
        )
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None, None


class ValueLossFunction(torch.autograd.Function):
    """Autograd for ``ppo_fast.value_loss``, as ``ClippedSurrogateFunction``:
    ``apply(values, old_values, returns, layout, options)`` returns (loss, clipfrac)."""

    @staticmethod
    def forward(ctx, values, old_values, returns, layout, options):
        _no_grad_wanted(ctx, ("old_values", "returns"), 1)
        result = _numpy_value_loss(
            to_numpy(values, "values"),
            to_numpy(old_values, "old_values"),
            to_numpy(returns, "returns"),
            **_layout(**layout),
            **options,
        )
        ctx.save_for_backward(from_numpy(result.grad, values))
        outputs = _scalars(values, result.loss, result.clipfrac)
        ctx.mark_non_differentiable(outputs[1])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None


@_speaks_torch
def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
    agg: str = "token-mean",
    num_tokens: Any = None,
    num_seqs: Any = None,
    loss_scale: Any = None,
    weights: torch.Tensor | None = None,
    backend: str | None = None,
) -> PolicyLoss:
    """``ppo_fast.clipped_surrogate`` on tensors, differentiable in ``logprobs``:
    ``loss.backward()`` gives ``logprobs.grad``, the fused kernel's exact gradient."""
    _main_tensor("logprobs", logprobs)
    options = {
        "clip_low": clip_low,
        "clip_high": clip_high,
        "dual_clip": dual_clip,
        "log_ratio_clamp": log_ratio_clamp,
        "agg": agg,
        "num_tokens": to_numpy(num_tokens, "num_tokens"),
        "num_seqs": to_numpy(num_seqs, "num_seqs"),
        "loss_scale": to_numpy(loss_scale, "loss_scale"),
        "backend": backend,
    }
    layout = {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
    return PolicyLoss(
        *ClippedSurrogateFunction.apply(
            logprobs, old_logprobs, advantages, weights, layout, options
        )
    )


@_speaks_torch
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    clip: float | None = None,
    agg: str = "token-mean",
    num_tokens: Any = None,
    num_seqs: Any = None,
    loss_scale: Any = None,
    backend: str | None = None,
) -> ValueLoss:
    """``ppo_fast.value_loss`` on tensors, differentiable in ``values``."""
    _main_tensor("values", values)
    options = {
        "clip": clip,
        "agg": agg,
        "num_tokens": to_numpy(num_tokens, "num_tokens"),
        "num_seqs": to_numpy(num_seqs, "num_seqs"),
        "loss_scale": to_numpy(loss_scale, "loss_scale"),
        "backend": backend,
    }
    layout = {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
    return ValueLoss(*ValueLossFunction.apply(values, old_values, returns, layout, options))
