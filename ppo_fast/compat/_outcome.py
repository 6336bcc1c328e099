"""The outcome estimators of ``ppo_fast.outcome`` on the peers' tensors of one score per row.

verl, OpenRLHF and TRL hold the scores of a batch as a (B,) tensor and want the per-row
advantages back as a tensor on the same device; each compat module groups the rows as its peer
does and picks the estimator's conventions (``singleton``, ``eps``, ``std``, ``nan``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import torch as ppo_torch


def outcome_rows(
    name: str,
    estimator: Callable[..., Any],
    scores: torch.Tensor,
    groups: Any,
    **options: Any,
) -> torch.Tensor:
    """``estimator(scores, groups, **options)`` (a ``ppo_fast.outcome`` function) on the (B,)
    tensor ``scores``: the (B,) advantages as a tensor like ``scores`` (a CPU tensor's memory is
    shared both ways, no copy). Errors about the scores name ``name``, the peer's argument they
    come from; integer and bool scores are refused (the advantages would be cast back to them)."""
    ppo_torch._main_tensor(name, scores)
    advantages = estimator(ppo_torch.to_numpy(scores, name), groups, **options)
    return ppo_torch.from_numpy(advantages, scores)
