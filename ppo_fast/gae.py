"""Generalized advantage estimation (GAE) over ragged batches.

For the valid positions t_1 < t_2 < ... < t_n of a row (positions that are not valid are skipped:
they are not actions, and the recursion carries across them),

    delta_k = r_k + gamma * V_{k+1} - V_k,        V_{n+1} = bootstrap (0 when terminal)
    A_k     = delta_k + gamma * lam * A_{k+1},    A_{n+1} = 0
    R_k     = A_k + V_k                           (returns, before any whitening)

where r_k, V_k are rewards[t_k], values[t_k]. Advantages and returns are 0 at positions that are
not valid. gamma and lam are scalars or per-row (B,) arrays in [0, 1]; ``bootstrap`` (B,) is the
value of the state after a row's last valid token for truncated rows. The recursion runs in
float64 whatever the input dtype; the results have the dtype of ``rewards``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _validate


class GAEResult(NamedTuple):
    """Advantages and returns, each shaped like the rewards."""

    advantages: np.ndarray
    returns: np.ndarray


def gae(
    rewards: ArrayLike,
    values: ArrayLike,
    *,
    gamma: float | ArrayLike = 1.0,
    lam: float | ArrayLike = 0.95,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    bootstrap: ArrayLike | None = None,
    backend: str | None = None,
) -> GAEResult:
    """Advantages and returns by GAE; see the module docstring for the recursion.

    ``rewards`` and ``values`` are (B, T) float32/float64 with at most one of ``mask`` (0/1,
    holes and left padding allowed) or ``lengths`` (B,), or packed (N,) with ``cu_seqlens``
    (B+1,). Inputs are never modified.
    """
    rewards, values = _validate.token_arrays(rewards=rewards, values=values)
    rows = _validate.rows(rewards.shape, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    gammas = _validate.per_row("gamma", gamma, rows.n_rows, lo=0.0, hi=1.0)
    lams = _validate.per_row("lam", lam, rows.n_rows, lo=0.0, hi=1.0)
    if bootstrap is None:
        next_values = np.zeros(rows.n_rows)
    else:
        if np.ndim(bootstrap) == 0:
            raise ValueError(f"bootstrap must have shape ({rows.n_rows},), one value per row")
        next_values = _validate.per_row("bootstrap", bootstrap, rows.n_rows)
    advantages = np.empty_like(rewards)
    returns = np.empty_like(rewards)
    _backend.resolve(backend).gae(
        rewards.reshape(-1),
        values.reshape(-1),
        rows.starts,
        rows.spans,
        rows.lengths,
        rows.mask,
        gammas,
        lams,
        next_values,
        advantages.reshape(-1),
        returns.reshape(-1),
        _backend.threads_for(rows.n_rows, rows.n_positions),
    )
    return GAEResult(advantages, returns)
