"""A fused loss under a peer's loss aggregation: the kernel takes the sum, the peer divides it.

verl's ``agg_loss`` and OpenRLHF's ``aggregate_loss`` both reduce the masked token losses to a sum
(over the tokens, or over the sequences of their token means), divide it by a count (of valid
tokens or of non-empty sequences, this rank's or the global one) and multiply by the data-parallel
size; verl's "seq-mean-token-sum-norm" divides by a fixed scale on top. The kernel runs with a
count of one (ppo_fast's ``num_tokens=1`` or ``num_seqs=1``), so that it returns that sum and the
sum's exact gradient, and the division is then done in torch, in the peers' order and with the
count as the caller gave it (a tensor stays a tensor): the loss rounds as the peer's does, and
autograd carries the scale into the gradient. Which count, and what happens without one, is each
peer's own and stays in its compat module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def fused_loss(
    kernel: Callable[..., Any],
    mask: torch.Tensor | None,
    agg: str,
    count: Any = None,
    dp_size: int = 1,
    loss_scale: Any = None,
    **arguments: Any,
) -> tuple[torch.Tensor, Any]:
    """``(loss, kernel result)``: ``kernel(**arguments)`` on ``mask`` summed by ``agg``
    ("token-mean": the token sum; "seq-mean-token-mean": the sum of per-sequence means), then
    ``/ count * dp_size`` (``* dp_size`` alone when ``count`` is None: a plain sum) and
    ``/ loss_scale`` when one is given."""
    unit_count = {"num_seqs": 1.0} if agg == "seq-mean-token-mean" else {"num_tokens": 1.0}
    result = kernel(mask=mask, agg=agg, **unit_count, **arguments)
    loss = result.loss if count is None else result.loss / count
    loss = loss * dp_size
    if loss_scale is not None:
        loss = loss / loss_scale
    return loss, result


def non_empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """The sequences with at least one valid token, as a float: both peers' local count."""
    return (mask.sum(dim=-1) > 0).float().sum()
