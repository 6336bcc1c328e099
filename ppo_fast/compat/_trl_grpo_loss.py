"""TRL 0.29.1's GRPO trainer loss on ppo_fast's fused losses: ``grpo_loss``, re-exported by
``ppo_fast.compat.trl`` (call it from there).

Reproduces the block of ``GRPOTrainer._compute_loss`` (``trl/trainer/grpo_trainer.py``) from the
log-ratio to the clip metrics, for the loss types "grpo", "bnpo", "dr_grpo" and "dapo", with
``delta`` (two-sided clipping) and ``importance_sampling_level`` "token" or "sequence" (GSPO);
the verbatim copy is ``ppo_fast._peers.trl_0_29_1.grpo_trainer_loss``.

What runs where: the loss and its gradient with respect to ``per_token_logps`` in one fused pass,
``ppo_fast.torch.clipped_surrogate`` at the token level and ``ppo_fast.torch.gspo_loss(form=
"sequence")`` at the sequence level (TRL differentiates its sequence ratio through every token of
the row); the masked sum the kernel returns is normalised in torch as each loss type does. TRL's
``delta`` clamps the unclipped ratio at delta: for delta > 1 + epsilon_high that is exactly a dual
clip at c = delta (for A < 0 the objective is bounded below by delta * A and flat beyond it; for A
> 0 the clipped branch is below delta * A already), which is what runs. The clip metrics are
TRL's expressions, in torch under no_grad (one elementwise pass over the ratios).

Not reproduced: the KL term (``beta != 0``: add it to the loss yourself, e.g. from
``ppo_fast.torch.kl_penalty``), the entropy mask, the off-policy mask, vLLM's importance-sampling
correction, and the loss types "cispo", "sapo" and "luspo" (``ppo_fast.torch.cispo_loss`` and
``sapo_loss`` compute the first two). Differences, by design: the mask must hold 0/1; a value
stored at a masked position never reaches the loss (TRL's ``x * mask`` turns a NaN there into a
NaN loss); delta <= 1 + epsilon_high, where TRL's clamp is not a dual clip, is a ValueError; the
loss is differentiated with respect to ``per_token_logps`` only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import torch as ppo_torch
from .._peers.trl_0_29_1 import nanmax, nanmin
from ._fused_loss import fused_loss

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


class GRPOLoss(NamedTuple):
    """The loss (0-d, differentiable in ``per_token_logps``) and the metrics TRL logs for it,
    under TRL's keys, on one process."""

    loss: torch.Tensor
    metrics: dict[str, float]


def _clip_metrics(log_ratio, advantages, mask, level, epsilon_low, epsilon_high, delta):
    """TRL's clip_ratio metrics (one process: its gathers are the values themselves)."""
    valid = mask.bool()
    if level == "token":
        coef_1 = log_ratio.exp()
    else:
        sums = torch.where(valid, log_ratio, 0.0).sum(-1)
        coef_1 = (sums / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1).exp()
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
    count = mask.sum().clamp(min=1.0)

    def masked_batch_mean(x):
        if x.shape[1] == 1:  # the sequence level with one advantage per row
            return x.mean()
        return torch.where(valid, x, 0.0).sum() / count

    low = masked_batch_mean(is_low_clipped.float())
    high = masked_batch_mean(is_high_clipped.float())
    region = masked_batch_mean((is_low_clipped | is_high_clipped).float())
    return {
        "clip_ratio/low_mean": low.nanmean().item(),
        "clip_ratio/low_min": nanmin(low).item(),
        "clip_ratio/high_mean": high.nanmean().item(),
        "clip_ratio/high_max": nanmax(high).item(),
        "clip_ratio/region_mean": region.nanmean().item(),
    }


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int = 256,
    num_items_in_batch: Any = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    training: bool = True,
) -> GRPOLoss:
    """GRPOTrainer._compute_loss's loss and clip metrics for ``loss_type`` (TRL 0.29.1).

    Per valid token (mask = ``completion_mask``, TRL's mask times its tool mask if any), with
    coef_1 the importance weight exp(logp - old) ("token") or exp(masked mean of logp - old over
    the row) ("sequence", GSPO), coef_2 = clamp(coef_1, 1 - epsilon, 1 + epsilon_high):
    ``l = -min(min(coef_1, delta) * A, coef_2 * A)``, aggregated as TRL:

        "grpo"     the mean over the rows (all of them) of each row's mean; / accumulation steps
        "bnpo"     the token sum / max(mask.sum(), 1); / accumulation steps
        "dr_grpo"  the token sum / (B * max_completion_length); / accumulation steps
        "dapo"     the token sum / (num_items_in_batch / num_processes)

    (the accumulation steps divide in training only, as TRL's ``current_gradient_accumulation_
    steps``). Parameters are the trainer's: ``old_per_token_logps`` None means
    ``per_token_logps.detach()``; ``advantages`` (B,) or (B, T); ``epsilon_high`` None means
    ``epsilon``; ``num_items_in_batch`` (the global count of completion tokens, a number or a
    0-d tensor) is required by "dapo". Returns ``GRPOLoss(loss, metrics)``, the metrics under
    TRL's keys ``clip_ratio/low_mean``, ``low_min``, ``high_mean``, ``high_max`` and
    ``region_mean``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}, got {loss_type!r} "
            "(TRL's 'cispo' and 'sapo': ppo_fast.torch.cispo_loss and sapo_loss)"
        )
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"Unknown importance sampling level: {importance_sampling_level}. Possible values "
            "are 'token' and 'sequence'."
        )
    epsilon_low = epsilon
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if delta is not None and not delta > 1 + epsilon_high:
        raise ValueError(
            f"delta must be > 1 + epsilon_high = {1 + epsilon_high}, got {delta}: there TRL's "
            "clamp of the ratio at delta is a dual clip, which is what ppo_fast runs (TRL "
            "recommends delta > 1 + epsilon)"
        )
    if loss_type == "dapo" and num_items_in_batch is None:
        raise ValueError(
            "loss_type='dapo' needs num_items_in_batch: pass the global number of completion "
            "tokens of the step (TRL's inputs['num_items_in_batch'])"
        )
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    dtype = torch.promote_types(
        torch.promote_types(per_token_logps.dtype, old_per_token_logps.dtype), advantages.dtype
    )
    logp = per_token_logps.to(dtype)
    old = old_per_token_logps.to(dtype)
    token_advantages = advantages.to(dtype).expand(logp.shape)
    if importance_sampling_level == "token":
        kernel, own = ppo_torch.clipped_surrogate, {}
    else:
        kernel, own = ppo_torch.gspo_loss, {"form": "sequence"}
    n_rows = logp.shape[0]
    if loss_type == "grpo":
        agg, count = "seq-mean-token-mean", n_rows
    elif loss_type == "bnpo":
        agg, count = "token-mean", completion_mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        agg, count = "token-mean", n_rows * max_completion_length
    else:
        agg, count = "token-mean", num_items_in_batch / num_processes
    loss, _ = fused_loss(
        kernel,
        completion_mask,
        agg,
        count,
        logprobs=logp,
        old_logprobs=old,
        advantages=token_advantages,
        clip_low=epsilon_low,
        clip_high=epsilon_high,
        dual_clip=delta,
        **own,
    )
    if loss_type != "dapo":
        loss = loss / (gradient_accumulation_steps if training else 1.0)
    # TRL's loss is promoted with the mask (per_token_loss * mask) and, for "grpo" and "bnpo",
    # with its count mask.sum().clamp(min=1.0): the default float dtype for an integer or bool
    # mask. The kernel's sum is in the inputs' dtype.
    dtype = torch.promote_types(loss.dtype, completion_mask.dtype)
    if loss_type in ("grpo", "bnpo") and not completion_mask.is_floating_point():
        dtype = torch.promote_types(dtype, torch.get_default_dtype())
    loss = loss.to(dtype)
    with torch.no_grad():
        metrics = _clip_metrics(
            (per_token_logps - old_per_token_logps).detach(),
            advantages,
            completion_mask,
            importance_sampling_level,
            epsilon_low,
            epsilon_high,
            delta,
        )
    return GRPOLoss(loss, metrics)
