"""The masked variance and whitening that verl and TRL both write in torch, on the moments kernel.

verl 0.9.1 (``verl.utils.torch_functional``) and TRL 0.29.1 (``trl/experimental/ppo/
ppo_trainer.py``) have the same ``masked_var`` and ``masked_whiten``: the masked mean of the
squared deviations from the masked mean, Bessel-corrected by ``n / (n - 1)`` and raising when no
token is valid, then ``(values - mean) * rsqrt(var + 1e-8)`` at every position, masked ones
included. They differ in the mean's denominator (verl adds 1e-8 to the count), in the one-token
case (verl raises, TRL divides by zero and returns NaN) and in their error texts:
``PeerMaskedStats`` holds those differences and the peer's two functions, and each compat module
keeps the public functions, with its peer's signatures and docstrings, as calls into its own
instance.

The kernel takes the sums (of the values, then of the squares about the mean) in float64, and the
peer's scalar arithmetic is applied to the 0-d results, so they get the peer's dtypes. The peer's
own ``masked_var`` and ``masked_whiten``, from its verbatim copy in ppo_fast._peers, run where the
kernel cannot stand in (not two float tensors of one shape, or ``values`` differentiated, so that
autograd is unchanged) and where the peer's own arithmetic decides the answer (no valid token, a
non-finite value).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _validate
from .. import torch as ppo_torch


def valid_positions(mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 ``mask`` tensor of any dtype as a CPU bool tensor of its shape, converted in one
    compiled pass with the kernels' errors for any other value (``_validate._mask_array``, as
    every kernel call converts it). Converted once, it is handed to each kernel of a compat call
    in place of the peer's mask: verl's ``response_mask`` is int64, 8 bytes a position to read
    and convert again on every call, against the bool's one."""
    flat = _validate._mask_array(ppo_torch.to_numpy(mask, "mask"), tuple(mask.shape))
    return torch.from_numpy(flat.view(np.bool_).reshape(tuple(mask.shape)))


def _mask_sum(mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``mask.sum()`` as the peer takes it, ``valid`` being ``valid_positions(mask)``. torch sums
    a bool or integer mask in int64, where a 0/1 mask's sum is the count of its valid positions:
    counted from ``valid`` (a byte a position). A floating mask's sum is torch's own, in its
    dtype, as the peer's (a float32 sum rounds past 2**24)."""
    if mask.is_floating_point():
        return mask.sum()
    count = np.count_nonzero(valid.numpy())
    return torch.tensor(count, dtype=torch.int64, device=mask.device)


def _on_kernels(values: Any, mask: Any) -> bool:
    """Whether the moments kernel can stand in for the peer's torch reductions."""
    return (
        isinstance(values, torch.Tensor)
        and isinstance(mask, torch.Tensor)
        and values.shape == mask.shape
        and values.is_floating_point()
        and not (torch.is_grad_enabled() and values.requires_grad)
    )


@dataclass(frozen=True)
class PeerMaskedStats:
    """One peer's masked variance and whitening: its own functions and where it differs."""

    # The peer's masked_var(values, mask, unbiased) and masked_whiten(values, mask, shift_mean),
    # from its verbatim copy: what runs where the kernel does not.
    peer_masked_var: Callable[[Any, Any, bool], torch.Tensor]
    peer_masked_whiten: Callable[[Any, Any, bool], torch.Tensor]
    # The mean's denominator from the mask's sum (``mask.sum()``), as the peer writes it: the
    # dtype of the 0-d results follows it (verl's ``+ 1e-8`` is in torch's default dtype for
    # integer and bool masks).
    mean_denominator: Callable[[torch.Tensor], torch.Tensor]
    no_token_error: str
    # None: the peer divides by n - 1 = 0 and the variance is NaN (0 * inf).
    one_token_error: str | None

    def masked_var(self, values: Any, mask: Any, unbiased: bool) -> torch.Tensor:
        if _on_kernels(values, mask):
            return self._kernel_mean_var(values, mask, unbiased)[1]
        return self.peer_masked_var(values, mask, unbiased)

    def masked_whiten(
        self,
        values: Any,
        mask: Any,
        shift_mean: bool,
        valid: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The peer's masked_whiten; ``valid``: ``valid_positions(mask)``, if the caller has it;
        ``out``: a tensor of the values' shape and dtype to write the result in (the values
        themselves, when the caller owns them), when it is computed on the kernels."""
        if not _on_kernels(values, mask):
            return self.peer_masked_whiten(values, mask, shift_mean)
        mean, var = self._kernel_mean_var(values, mask, unbiased=True, valid=valid)
        # The peer's (values - mean) * rsqrt(var + 1e-8), the product in place: the same
        # operations, one fresh tensor fewer to fault in (two with ``out``).
        whitened = torch.sub(values, mean, out=out) if out is not None else values - mean
        whitened *= torch.rsqrt(var + 1e-8)
        if not shift_mean:
            whitened += mean
        return whitened

    def _bessel(self, variance: torch.Tensor, mask_sum: torch.Tensor) -> torch.Tensor:
        """The peer's unbiased correction of the kernel's variance, with its errors."""
        if mask_sum == 0:
            raise ValueError(self.no_token_error)
        if mask_sum == 1 and self.one_token_error is not None:
            raise ValueError(self.one_token_error)
        bessel_correction = mask_sum / (mask_sum - 1)
        return variance * bessel_correction

    def _kernel_mean_var(
        self,
        values: torch.Tensor,
        mask: torch.Tensor,
        unbiased: bool,
        valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The peer's masked mean and variance with the sums from the moments kernel, which reads
        ``valid`` (``valid_positions(mask)``, made here unless given) where the peer reads the
        mask; the results' dtypes follow the peer's mask."""
        if valid is None:
            valid = valid_positions(mask)
        flat_values, flat_mask = values.reshape(1, -1), valid.reshape(1, -1)
        sum_dtype = torch.promote_types(values.dtype, mask.dtype)
        mask_sum = _mask_sum(mask, valid)
        count = self.mean_denominator(mask_sum)
        first = ppo_torch.masked_moments(flat_values, mask=flat_mask)
        mean = torch.tensor(first.sum, dtype=sum_dtype, device=values.device) / count
        if not torch.isfinite(mean):
            # No valid token (0 / 0) or a non-finite value: the peer's own arithmetic says what.
            return mean, self.peer_masked_var(values, mask, unbiased)
        # The peers centre about their mean as stored (``values - mean``): so does the second pass.
        second = ppo_torch.masked_moments(flat_values, mask=flat_mask, shift=float(mean))
        variance = torch.tensor(second.sum_sq, dtype=sum_dtype, device=values.device) / count
        if unbiased:
            variance = self._bessel(variance, mask_sum)
        return mean, variance
