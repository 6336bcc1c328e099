"""ppo_fast for torch tensors: the same functions, tensors in and out, and autograd for the losses.

Each function here takes the arguments of its NumPy twin in ``ppo_fast`` (same names, same
semantics, see those docstrings) as torch tensors, and returns tensors on the device and with the
dtype of its main input (``logprobs``, ``rewards``, ``x``, ``values``).

How tensors reach the kernels:

- A contiguous float32/float64 CPU tensor is handed over as ``tensor.numpy()``, which shares its
  memory: no copy. The kernel's output array is wrapped by ``torch.from_numpy``, which shares it
  too, so a CPU call copies nothing. A non-contiguous tensor is copied once (into C order).
- bfloat16 and float16 are computed in float32 and the result is cast back to the input's dtype.
- A CUDA (or any non-CPU) tensor takes a host round trip in the estimators (rewards, GAE,
  whitening): it is copied to host memory, computed there, and the result is copied back to the
  input's device, until a GPU backend exists. It is correct but pays two transfers and a
  synchronisation per call.
- Except in the losses (``clipped_surrogate``, ``value_loss`` and the policy-loss family:
  ``reinforce_loss``, ``cispo_loss``, ``sapo_loss``, ``gspo_loss``, ``geo_mean_loss``,
  ``dppo_loss``, ``kl_cov_loss``): there a tensor on another device is computed on that device by
  a torch implementation of the kernel's formula, with the same closed-form gradient and
  statistics (per-token arithmetic in the input dtype, sums in float64), and nothing is copied to
  the host. Checking the values of a mask that is not bool, of lengths or of cu_seqlens reads one
  bool back (one synchronisation). Tested on CPU by forcing that path (``_DEVICE_PATH_ON_CPU``),
  and on a CUDA device by tests/test_torch_cuda.py (run on an NVIDIA H200: README, "On a GPU").
- Inputs that require grad are read through ``.detach()``: rewards, GAE and whitening are not
  differentiated (trainers run them under ``torch.no_grad()``). The losses are:
  ``clipped_surrogate``, ``value_loss`` and the policy-loss family return a ``loss`` tensor with
  a ``grad_fn``, whose backward is the gradient the fused kernel computed in its forward pass,
  scaled by grad_output.

torch is imported here and only here: ``import ppo_fast`` never imports it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from . import _validate
from ._policy_scalars import check_temperatures
from .gae import GAEResult
from .gae import gae as _numpy_gae
from .loss import _check_agg
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
    if tensor.dtype == like.dtype and like.is_cpu:
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
    """A policy loss (the clipped surrogate, or one of the family: ``reinforce_loss``,
    ``cispo_loss``, ``sapo_loss``), 0-d and differentiable in ``logprobs``, and its statistics
    (0-d, not differentiable), each on the device and with the dtype of ``logprobs``."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    approx_kl: torch.Tensor


class ValueLoss(NamedTuple):
    """The clipped value loss (0-d, differentiable in ``values``) and its clip fraction."""

    loss: torch.Tensor
    clipfrac: torch.Tensor


def _normalisers(agg: str, num_tokens: Any, num_seqs: Any, loss_scale: Any) -> dict[str, Any]:
    return {
        "agg": agg,
        "num_tokens": to_numpy(num_tokens, "num_tokens"),
        "num_seqs": to_numpy(num_seqs, "num_seqs"),
        "loss_scale": to_numpy(loss_scale, "loss_scale"),
    }


def _no_grad_wanted(ctx: Any, names: tuple[str, ...], first: int) -> None:
    """The fused kernels differentiate with respect to their first input only: refuse to drop a
    gradient that autograd would otherwise have produced."""
    for offset, name in enumerate(names):
        if ctx.needs_input_grad[first + offset]:
            raise ValueError(
                f"{name} requires grad, but the fused loss is differentiated with respect to its "
                f"first argument only: pass {name}.detach() (PPO treats it as data)"
            )


# A float in [-bound, bound] becomes a 0-d array of the dtype without overflowing (NumPy warns
# for a finite float beyond float32's range, which torch.tensor rounds to inf): the CPU tensors'
# statistics, made from NumPy in 0.75 us each where torch.scalar_tensor takes 1.3.
_FROM_NUMPY = {
    torch.float32: (np.float32, float(np.finfo(np.float32).max)),
    torch.float64: (np.float64, math.inf),
}


def _scalars(like: torch.Tensor, *values: float) -> tuple[torch.Tensor, ...]:
    """The statistics as 0-d tensors of ``like``'s dtype on its device (``_scalar``); on the CPU
    in float32 or float64 from 0-d NumPy arrays, which round a float as torch does (to nearest),
    but for a NaN or a finite float beyond the dtype's range: ``_scalar``."""
    kind = _FROM_NUMPY.get(like.dtype) if like.is_cpu else None
    if kind is None:
        return tuple(_scalar(value, like) for value in values)
    dtype, bound = kind
    return tuple(
        _from_numpy(_array(value, dtype)) if -bound <= value <= bound else _scalar(value, like)
        for value in values
    )


_array = np.array
_from_numpy = torch.from_numpy


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """``torch.tensor(value)`` in ``like``'s dtype, on its device: scalar_tensor's tensor, the
    value rounded alike, in half the time (a microsecond a statistic), but for a finite value
    beyond the dtype's range, which scalar_tensor refuses and torch.tensor rounds (to inf)."""
    try:
        return torch.scalar_tensor(value, dtype=like.dtype, device=like.device)
    except RuntimeError:
        return torch.tensor(value, dtype=like.dtype, device=like.device)


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
    like = _main_tensor("logprobs", logprobs)
    if like.device.type != "cpu" or _DEVICE_PATH_ON_CPU:  # on the device, in torch
        own = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}
        return _surrogate_on_device(
            logprobs, old_logprobs, advantages, weights,
            {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
            _normalisers(agg, num_tokens, num_seqs, loss_scale),
            {**own, "log_ratio_clamp": log_ratio_clamp},
        )  # fmt: skip
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
    like = _main_tensor("values", values)
    if like.device.type != "cpu" or _DEVICE_PATH_ON_CPU:  # on the device, in torch
        layout = {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
        normalisers = _normalisers(agg, num_tokens, num_seqs, loss_scale)
        return _value_on_device(values, old_values, returns, layout, normalisers, clip)
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


# ---- The policy-loss family: the fused kernels for CPU tensors, the same formulas in torch on
# any other device ----

# Tests set this to run the torch path, what a tensor on another device takes, on CPU tensors.
_DEVICE_PATH_ON_CPU = False


class PolicyFamilyFunction(torch.autograd.Function):
    """Autograd for the policy-loss family (``reinforce_loss``, ``cispo_loss``, ``sapo_loss``).

    ``apply(compute, logprobs, old_logprobs, advantages, weights)`` with ``compute`` called on
    those four and returning ``(loss, grad, clipfrac, clipfrac_lower, approx_kl)``: the loss,
    d loss / d logprobs shaped like ``logprobs``, and the statistics (floats or 0-d tensors).
    The forward keeps the gradient ``compute`` returned; the backward scales it by grad_output.
    Returns (loss, clipfrac, clipfrac_lower, approx_kl) on ``logprobs``' device and dtype.
    """

    @staticmethod
    def forward(ctx, compute, logprobs, old_logprobs, advantages, weights):
        _no_grad_wanted(ctx, ("old_logprobs", "advantages", "weights"), 2)
        loss, grad, *statistics = compute(logprobs, old_logprobs, advantages, weights)
        ctx.save_for_backward(grad)
        if type(loss) is float:  # the kernels' floats (the device path's are 0-d tensors)
            outputs = _scalars(logprobs, loss, *statistics)
        else:
            outputs = tuple(
                torch.as_tensor(value, dtype=logprobs.dtype, device=logprobs.device)
                for value in (loss, *statistics)
            )
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        (grad,) = ctx.saved_tensors
        return None, grad * grad_loss, None, None, None


def _on_kernels(numpy_loss, layout, options, logprobs, old_logprobs, advantages, weights):
    """The NumPy function on the kernels (zero-copy for contiguous CPU tensors)."""
    result = numpy_loss(
        to_numpy(logprobs, "logprobs"),
        to_numpy(old_logprobs, "old_logprobs"),
        to_numpy(advantages, "advantages"),
        weights=to_numpy(weights, "weights"),
        **_layout(**layout),
        **options,
    )
    grad = from_numpy(result.grad, logprobs)
    return result.loss, grad, result.clipfrac, result.clipfrac_lower, result.approx_kl


class _TorchRows(NamedTuple):
    """The rows of a batch on its device, for the torch path."""

    valid: torch.Tensor  # bool, shaped like the token tensors
    counts: torch.Tensor  # int64 (B,): valid tokens per row
    row_of: torch.Tensor | None  # int64 (N,): each packed position's row; None when padded
    width: int | None  # T of a padded batch; None when packed


def _compute_dtype(name: str, tensor: torch.Tensor) -> torch.dtype:
    """What the torch path computes ``name`` in: its dtype, float32 for bf16/fp16 (as the kernel
    path does)."""
    if tensor.device.type == "meta":
        raise ValueError(
            f"{name} is a meta tensor: it has a shape but no data to compute on; "
            "materialise it on the CPU or an accelerator first"
        )
    if tensor.dtype in (torch.float32, torch.float64):
        return tensor.dtype
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype.startswith(("float8", "float4")):
        raise TypeError(
            f"{name} has dtype torch.{dtype}, which ppo_fast does not compute in: "
            f"cast it with {name}.float() or {name}.to(torch.float32)"
        )
    hint = (
        "pass real floating-point numbers"
        if tensor.is_complex()
        else _validate._cast_hint(name, "float32")
    )
    raise TypeError(f"{name} must be float32 or float64, got dtype {dtype}: {hint}")


def _torch_tokens(arrays: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The token tensors on ``device`` in their compute dtype, checked as ``_validate.batch``
    checks them (one shape, 1-D or 2-D, one dtype)."""
    out: list[torch.Tensor] = []
    first_name, first = "", None
    for name, value in arrays.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor (logprobs is on {device}), got "
                f"{type(value).__name__}"
            )
        dtype = _compute_dtype(name, value)
        if value.dim() not in (1, 2):
            raise ValueError(
                f"{name} must be 2-D (B, T) padded or 1-D (N,) packed, got shape "
                f"{tuple(value.shape)}"
            )
        if first is None:
            first_name, first = name, (tuple(value.shape), dtype)
        elif tuple(value.shape) != first[0]:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but {first_name} has shape {first[0]}: "
                "every per-token array must have the same shape"
            )
        elif dtype != first[1]:
            wanted = str(first[1]).removeprefix("torch.")
            raise TypeError(
                f"{name} is {str(dtype).removeprefix('torch.')} but {first_name} is {wanted}: "
                f"pass one dtype: {_validate._cast_hint(name, wanted)}"
            )
        out.append(value.detach().to(device=device, dtype=dtype))
    return tuple(out)


def _layout_error(shape: tuple[int, ...], layout: dict[str, Any]) -> None:
    """Raise the kernel path's error for a layout the torch path found wrong (host copies of the
    layout arguments: only on the way to an error)."""
    _validate.rows(shape, **_layout(**layout))
    raise ValueError(
        "mask, lengths or cu_seqlens is not a valid layout for token arrays of shape "
        f"{shape}: see the docstring of ppo_fast.clipped_surrogate"
    )


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def _torch_rows(shape: tuple[int, ...], device: torch.device, layout: dict[str, Any]) -> _TorchRows:
    """The rows of the layout, on ``device``. What the shapes and dtypes say is checked on the
    host; the values (a mask of 0/1, lengths within [0, T], cu_seqlens from 0 up to N) in one
    reduction on the device, read back as one bool (one synchronisation, when a mask that is
    not bool, lengths or cu_seqlens is given). On an error, the kernel path's is raised."""
    mask, lengths, cu_seqlens = layout["mask"], layout["lengths"], layout["cu_seqlens"]
    _validate._at_most_one_layout(mask, lengths, cu_seqlens)
    given = mask if mask is not None else lengths if lengths is not None else cu_seqlens
    if given is not None:
        try:
            given = torch.as_tensor(given, device=device)
        except (TypeError, ValueError, RuntimeError):
            _layout_error(shape, layout)
    bad = None
    if cu_seqlens is not None:
        if len(shape) != 1 or not _is_integer(given) or given.dim() != 1 or given.numel() < 1:
            _layout_error(shape, layout)
        cu = given.long()
        spans = cu[1:] - cu[:-1]
        bad = (cu[0] != 0) | (cu[-1] != shape[0]) | (spans < 0).any()
        if bool(bad):
            _layout_error(shape, layout)
        row_of = torch.repeat_interleave(
            torch.arange(spans.shape[0], device=device), spans, output_size=shape[0]
        )
        return _TorchRows(torch.ones(shape, dtype=torch.bool, device=device), spans, row_of, None)
    if len(shape) != 2:
        _layout_error(shape, layout)
    n_rows, width = shape
    if lengths is not None:
        if not _is_integer(given) or tuple(given.shape) != (n_rows,):
            _layout_error(shape, layout)
        counts = given.long()
        if bool(((counts < 0) | (counts > width)).any()):
            _layout_error(shape, layout)
        valid = torch.arange(width, device=device) < counts[:, None]
        return _TorchRows(valid, counts, None, width)
    if mask is None:
        valid = torch.ones(shape, dtype=torch.bool, device=device)
    elif tuple(given.shape) != shape or given.is_complex():
        _layout_error(shape, layout)
    elif given.dtype == torch.bool:
        valid = given
    else:
        if bool(((given != 0) & (given != 1)).any()):
            _layout_error(shape, layout)
        valid = given == 1
    return _TorchRows(valid, valid.sum(dim=-1), None, width)


def _torch_row_scales(
    agg: str,
    rows: _TorchRows,
    num_tokens: Any,
    num_seqs: Any,
    loss_scale: Any,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ppo_fast.loss._row_scales`` on the device: each row's aggregation weight (float64, (B,))
    and the number of valid tokens (a float64 0-d tensor), with its defaults and its errors
    (``dtype``: the loss's compute dtype)."""
    _check_agg(agg, num_tokens, num_seqs, loss_scale)
    dtype = np.dtype(str(dtype).removeprefix("torch."))  # float32 or float64, as NumPy names it
    counts = rows.counts
    device = counts.device
    valid = counts.sum().double()
    zeros = torch.zeros(counts.shape, dtype=torch.float64, device=device)
    if agg == "token-mean":
        if num_tokens is None:
            return zeros + torch.where(valid > 0, 1.0 / valid, 0.0), valid
        total = _validate.normaliser("num_tokens", num_tokens, dtype)
        return zeros + 1.0 / total, valid
    if agg == "seq-mean-token-sum-norm":
        if loss_scale is None:
            if rows.width is None:
                raise ValueError(
                    "agg='seq-mean-token-sum-norm' on packed rows needs loss_scale: pass the fixed "
                    "maximum response length (the padded T it stands for)"
                )
            if rows.width == 0:  # no positions at all: the loss is 0
                return zeros, valid
            loss_scale = rows.width
        scale = _validate.normaliser("loss_scale", loss_scale, dtype)
        return zeros + 1.0 / scale, valid
    if num_seqs is None:
        seqs = (counts > 0).sum().double()
    else:
        seqs = torch.tensor(
            _validate.normaliser("num_seqs", num_seqs, dtype),
            dtype=torch.float64,
            device=device,
        )
    if agg == "seq-mean-token-sum":
        return zeros + torch.where(seqs > 0, 1.0 / seqs, 0.0), valid
    per_row = seqs * counts.double()
    return torch.where(per_row > 0, 1.0 / per_row, 0.0), valid


def _clamped(log_ratio: torch.Tensor, clamp: float) -> torch.Tensor:
    return log_ratio if clamp == math.inf else log_ratio.clamp(-clamp, clamp)


def _in_torch(formula, scalars, normalisers, layout, logprobs, old_logprobs, advantages, weights):
    """The kernel's loss, gradient and statistics computed in torch on ``logprobs``' device:
    per-token arithmetic in the compute dtype, sums in float64, as the kernels."""
    device = logprobs.device
    arrays = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    if weights is not None:
        arrays["weights"] = weights
    tokens = _torch_tokens(arrays, device)
    rows = _torch_rows(tuple(logprobs.shape), device, layout)
    scales, valid = _torch_row_scales(rows=rows, **normalisers, dtype=tokens[0].dtype)
    check_temperatures(scalars, np.dtype(str(tokens[0].dtype).removeprefix("torch.")))
    logp, old, adv = tokens[:3]
    objective, slope, log_ratio, clipped, lower = formula(logp, old, adv, **scalars)
    token_scales = scales[:, None] if rows.row_of is None else scales[rows.row_of]
    if weights is None:
        losses, slope = -objective.double(), -slope
    else:
        losses, slope = -(tokens[3].double() * objective.double()), -(tokens[3] * slope)
    keep = rows.valid
    loss = torch.where(keep, losses * token_scales, 0.0).sum()
    grad = torch.where(keep, slope * token_scales.to(slope.dtype), 0.0).to(logprobs.dtype)

    def mean(per_token: torch.Tensor | None) -> torch.Tensor:
        total = valid * 0.0 if per_token is None else torch.where(keep, per_token, 0.0).sum()
        return torch.where(valid > 0, total / valid, math.nan)

    kl = mean(-log_ratio.double())
    clipfrac = mean(None if clipped is None else clipped.double())
    clipfrac_lower = mean(None if lower is None else lower.double())
    return loss, grad, clipfrac, clipfrac_lower, kl


class _FamilyLoss(NamedTuple):
    numpy: Callable[..., Any]  # the NumPy function, on the kernels
    scalars: Callable[..., dict[str, float]]  # its hyperparameters, checked, as the kernel's
    formula: Callable[..., tuple[Any, ...]]  # the kernel's per-token terms in torch


def _policy_family(
    family: _FamilyLoss,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    own: dict[str, Any],
    *,
    mask: Any,
    lengths: Any,
    cu_seqlens: Any,
    agg: str,
    num_tokens: Any,
    num_seqs: Any,
    loss_scale: Any,
    weights: torch.Tensor | None,
    backend: str | None,
) -> PolicyLoss:
    """Run a loss of the family: on the kernels for CPU tensors, in torch on another device."""
    like = _main_tensor("logprobs", logprobs)
    layout = {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
    normalisers = _normalisers(agg, num_tokens, num_seqs, loss_scale)
    if like.device.type == "cpu" and not _DEVICE_PATH_ON_CPU:
        options = {**own, **normalisers, "backend": backend}
        compute = functools.partial(_on_kernels, family.numpy, layout, options)
    else:
        scalars = family.scalars(**own)
        compute = functools.partial(_in_torch, family.formula, scalars, normalisers, layout)
    return PolicyLoss(
        *PolicyFamilyFunction.apply(compute, logprobs, old_logprobs, advantages, weights)
    )


_FAMILY_DOC = """

    Differentiable in ``logprobs``: ``loss.backward()`` gives ``logprobs.grad``, the exact
    gradient computed in the forward pass, times grad_output. CPU tensors run on the kernels
    (zero-copy); a tensor on another device is computed there by the same formulas in torch,
    with the same closed-form gradient and statistics (``backend`` is then unused). Returns
    ``PolicyLoss(loss, clipfrac, clipfrac_lower, approx_kl)``, 0-d tensors on ``logprobs``'
    device and dtype.
    """


# REINFORCE, CISPO and SAPO, the per-sequence losses (GSPO, the geometric mean), DPPO and KL-Cov,
# and the device path of clipped_surrogate and value_loss, in modules of their own (which read the
# machinery above).
from ._torch_device_losses import surrogate_on_device as _surrogate_on_device  # noqa: E402
from ._torch_device_losses import value_on_device as _value_on_device  # noqa: E402
from ._torch_policy_losses import cispo_loss, reinforce_loss, sapo_loss  # noqa: E402, F401
from ._torch_sequence_losses import geo_mean_loss as geo_mean_loss  # noqa: E402
from ._torch_sequence_losses import gspo_loss as gspo_loss  # noqa: E402
from ._torch_token_losses import (  # noqa: E402, F401
    clip_cov_selection,
    dppo_loss,
    kl_cov_loss,
    kl_cov_selection,
)
