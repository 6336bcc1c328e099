"""Critic-free token-level estimators: discounted returns (REINFORCE++), ReMax and the optimal
token baseline.

For the valid positions t_1 < t_2 < ... < t_n of a row (positions that are not valid are skipped:
they are not actions, and the return carries across them unchanged),

    G_k = r_k + gamma * G_{k+1},    G_{n+1} = bootstrap (0 when terminal)

where r_k = rewards[t_k]: the discounted return of token k (its reward-to-go when gamma = 1),
computed in float64 whatever the input dtype. Each estimator returns (advantages, returns) with
returns = G, and advantages

    reinforce_plus_plus     A_k = (G_k - mean) / sqrt(var + eps) over the valid tokens of the
                            batch (``ppo_fast.whiten``), or A = G with whiten=False (REINFORCE++,
                            https://arxiv.org/abs/2501.03262)
    remax                   A_k = G_k - baselines[b], the reward of row b's greedy response
                            (ReMax, https://arxiv.org/abs/2310.10505)
    optimal_token_baseline  A_k = G_k - B_k(group of the row)  (OTB, as in verl 0.9.1)

The optimal token baseline compares the rows of a group (the responses sampled for one prompt)
token by token: the k-th valid token of each row of the group, whatever its position (tool or
observation tokens masked out of a row do not shift it). With, per row,

    w_k = (1 - 2 * exp(old_logprobs_k) + sum_pi_squared_k) * is_weights_k**2
    W_k = w_1 + ... + w_k           (the path-variance proxy, a float64 running sum)

the baseline of a group at index k sums over the group's rows that have a k-th valid token,

    B_k = sum(G_k * W_k) / (sum(W_k) + eps)

in float64, row after row in row order. B = 0 for a group with fewer than two rows with a valid
token (a row alone has no baseline: its advantages are its returns), and, with ``zero_tail``,
B_k = 0 for k > the second-longest row's number of valid tokens when the group's longest row is
the only one that long (verl's handle_zero_tail: no other row estimates the baseline there).

Advantages and returns are 0 at positions that are not valid. gamma is a scalar or a per-row (B,)
array in [0, 1]; ``bootstrap`` (B,) is the value of the state after a row's last valid token, for
truncated rows (default 0: every row ends in a terminal state). The results have the dtype of
``rewards``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _groups, _result_arrays, _rows, _validate
from .whiten import whiten as _whiten

_OUTPUTS = ("advantages", "returns")


class AdvantagesResult(NamedTuple):
    """Advantages and returns, each shaped like the rewards."""

    advantages: np.ndarray
    returns: np.ndarray


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _row_parameters(rows: _rows.Rows, gamma: Any, bootstrap: Any) -> dict[str, np.ndarray]:
    """The kernels' gammas and bootstrap (B,), float64."""
    gammas = _validate.per_row("gamma", gamma, rows.n_rows, lo=0.0, hi=1.0)
    if bootstrap is None:
        next_values = _rows.constant_rows(0.0, rows.n_rows)
    else:
        # Values are data: a NaN or inf propagates into the results (DESIGN.md section 3).
        next_values = _validate.per_row(
            "bootstrap", bootstrap, rows.n_rows, allow_inf=True, allow_nan=True, rows_only=True
        )
    return {"gammas": gammas, "bootstrap": next_values}


def _outputs(
    out: Any, like: np.ndarray, inputs: dict[str, Any], results: tuple[str, ...] = _OUTPUTS
) -> tuple[np.ndarray, ...]:
    """Fresh result arrays shaped like ``like``, or the checked arrays of ``out``."""
    if out is None:
        return tuple(_result_arrays.empty(like.shape, like.dtype) for _ in results)
    return _validate.out_arrays(results, out, like, inputs)


def discounted_returns(
    rewards: ArrayLike,
    *,
    gamma: float | ArrayLike = 1.0,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    bootstrap: ArrayLike | None = None,
    out: np.ndarray | None = None,
    backend: str | None = None,
) -> np.ndarray:
    """The discounted return G of every valid token; see the module docstring.

    Parameters
    ----------
    rewards
        (B, T) padded, or (N,) packed with ``cu_seqlens``; float32 or float64.
    gamma
        Discount in [0, 1]: a scalar, or a (B,) array, one per row.
    mask, lengths, cu_seqlens
        At most one: a 0/1 (B, T) ``mask`` (holes and left padding allowed; nonzero is valid),
        ``lengths`` (B,) (positions 0 .. lengths[b]-1 of row b are valid), or ``cu_seqlens``
        (B+1,) for packed (N,) arrays (row b is positions cu_seqlens[b] .. cu_seqlens[b+1]-1).
        None of them: every position of a (B, T) array is valid.
    bootstrap
        (B,): the value of the state after each row's last valid token (truncated rows);
        default 0 (every row ends in a terminal state). Data: NaN or inf propagates.
    out
        Optional preallocated result: a C-contiguous, writeable NumPy array shaped like
        ``rewards`` with its dtype, sharing no memory with an input. It is written and returned.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    The returns, shaped like ``rewards`` with its dtype (``out`` when given); 0 at positions that
    are not valid. Inputs are never modified.
    """
    (token_rewards,), rows = _validate.batch(
        {"rewards": rewards}, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens
    )
    parameters = _row_parameters(rows, gamma, bootstrap)
    inputs = {"rewards": rewards, "mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
    (returns,) = _outputs(
        out, token_rewards, {**inputs, "gamma": gamma, "bootstrap": bootstrap}, ("returns",)
    )
    _backend.run(
        "discounted_returns",
        backend,
        rewards=token_rewards.ravel(),
        **rows.arguments,
        **parameters,
        returns=returns.ravel(),
    )
    return returns


def reinforce_plus_plus(
    rewards: ArrayLike,
    *,
    gamma: float | ArrayLike = 1.0,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    bootstrap: ArrayLike | None = None,
    whiten: bool = True,
    unbiased: bool = False,
    eps: float = 1e-8,
    out: tuple[np.ndarray, np.ndarray] | None = None,
    backend: str | None = None,
) -> AdvantagesResult:
    """REINFORCE++: the discounted returns, whitened over the batch's valid tokens.

    Parameters
    ----------
    rewards, gamma, mask, lengths, cu_seqlens, bootstrap, backend
        As for ``discounted_returns``.
    whiten
        Whiten the returns into the advantages: (G - mean) / sqrt(var + eps) over every valid
        token of the batch (``ppo_fast.whiten``, which needs a valid token); False takes the
        returns as the advantages.
    unbiased
        Divide the variance by n - 1 (verl's masked_whiten) instead of n (the default).
    eps
        Added to the variance under the square root (finite, >= 0).
    out
        Optional preallocated (advantages, returns): two C-contiguous, writeable NumPy arrays
        shaped like ``rewards`` with its dtype, sharing no memory with an input nor with each
        other. They are written and returned in the result.

    Returns
    -------
    AdvantagesResult(advantages, returns), each shaped like ``rewards`` with its dtype (the
    arrays of ``out`` when given); 0 at positions that are not valid.
    """
    whitened = _flag("whiten", whiten)
    unbiased = _flag("unbiased", unbiased)
    epsilon = _validate.scalar("eps", eps, lo=0.0)
    (token_rewards,), rows = _validate.batch(
        {"rewards": rewards}, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens
    )
    parameters = _row_parameters(rows, gamma, bootstrap)
    inputs = {"rewards": rewards, "mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
    advantages, returns = _outputs(
        out, token_rewards, {**inputs, "gamma": gamma, "bootstrap": bootstrap}
    )
    _backend.run(
        "discounted_returns",
        backend,
        rewards=token_rewards.ravel(),
        **rows.arguments,
        **parameters,
        returns=returns.ravel(),
    )
    if not whitened:
        np.copyto(advantages, returns)
        return AdvantagesResult(advantages, returns)
    # The layout as checked above: a mask given as numbers is converted once, not twice.
    layout = {"lengths": lengths, "cu_seqlens": cu_seqlens}
    if mask is not None:
        layout["mask"] = rows.mask.view(np.bool_).reshape(rows.shape)
    try:
        _whiten(returns, **layout, unbiased=unbiased, eps=epsilon, out=advantages, backend=backend)
    except ValueError as error:
        raise ValueError(
            "reinforce_plus_plus cannot whiten the returns over the valid tokens that mask, "
            f"lengths or cu_seqlens give ({error}): pass whiten=False to take the returns as "
            "the advantages"
        ) from None
    return AdvantagesResult(advantages, returns)


def remax(
    rewards: ArrayLike,
    baselines: ArrayLike,
    *,
    gamma: float | ArrayLike = 1.0,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    bootstrap: ArrayLike | None = None,
    out: tuple[np.ndarray, np.ndarray] | None = None,
    backend: str | None = None,
) -> AdvantagesResult:
    """ReMax: the discounted returns minus each row's baseline, in one pass.

    Parameters
    ----------
    rewards, gamma, mask, lengths, cu_seqlens, bootstrap, backend
        As for ``discounted_returns``.
    baselines
        (B,): each row's baseline (ReMax: the reward of the greedy response to its prompt), any
        real dtype. Data: NaN or inf propagates into its row's advantages.
    out
        Optional preallocated (advantages, returns), as for ``reinforce_plus_plus``.

    Returns
    -------
    AdvantagesResult(advantages, returns): advantages = returns - baselines[b] at the valid
    positions of row b; both 0 at positions that are not valid.
    """
    (token_rewards,), rows = _validate.batch(
        {"rewards": rewards}, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens
    )
    parameters = _row_parameters(rows, gamma, bootstrap)
    row_baselines = _validate.per_row(
        "baselines", baselines, rows.n_rows, allow_inf=True, allow_nan=True, rows_only=True
    )
    inputs = {
        "rewards": rewards,
        "baselines": baselines,
        "mask": mask,
        "lengths": lengths,
        "cu_seqlens": cu_seqlens,
        "gamma": gamma,
        "bootstrap": bootstrap,
    }
    advantages, returns = _outputs(out, token_rewards, inputs)
    _backend.run(
        "remax",
        backend,
        rewards=token_rewards.ravel(),
        **rows.arguments,
        **parameters,
        baselines=row_baselines,
        advantages=advantages.ravel(),
        returns=returns.ravel(),
    )
    return AdvantagesResult(advantages, returns)


def optimal_token_baseline(
    rewards: ArrayLike,
    old_logprobs: ArrayLike,
    sum_pi_squared: ArrayLike,
    groups: Any,
    *,
    is_weights: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    eps: float = 1e-8,
    zero_tail: bool = True,
    gamma: float | ArrayLike = 1.0,
    bootstrap: ArrayLike | None = None,
    out: tuple[np.ndarray, np.ndarray] | None = None,
    backend: str | None = None,
) -> AdvantagesResult:
    """The optimal token baseline (OTB): returns minus a per-group, per-token baseline; see the
    module docstring for the formulas.

    Equals verl 0.9.1's ``compute_multi_turn_optimal_token_baseline_advantage`` (its "tir"
    variant, which aligns the rows of a group by valid-token index), and
    ``compute_optimal_token_baseline_advantage`` (which aligns them by position) on right-padded
    masks without holes, with one difference there: verl's plain variant counts a row without a
    valid token as a member of its group, so that with ``handle_zero_tail=False`` a group of one
    row with valid tokens and some without gets B = G W / (W + eps) there, and 0 here.

    Parameters
    ----------
    rewards, old_logprobs, sum_pi_squared
        (B, T) padded, or (N,) packed with ``cu_seqlens``; float32 or float64, one dtype.
        ``old_logprobs`` are the sampling policy's log-probabilities of the tokens (pi =
        exp(old_logprobs)); ``sum_pi_squared`` is the sum over the vocabulary of its squared
        probabilities at each token.
    groups
        (B,): the group of each row (its prompt), as labels (integers, strings, UUIDs, any
        hashable) or an already factorised ``ppo_fast._groups.Groups``. Groups may be uneven,
        of one row, and their rows need not be adjacent.
    is_weights
        Optional (B, T) importance-sampling weights, like ``rewards``: w is multiplied by their
        square. None: 1.
    mask, lengths, cu_seqlens
        As for ``discounted_returns``.
    eps
        Added to the baseline's denominator (finite, >= 0; with 0, a zero denominator gives NaN
        or inf).
    zero_tail
        Whether the unique longest row of a group gets no baseline past the second-longest
        row's number of valid tokens (verl's handle_zero_tail, default True).
    gamma, bootstrap
        The discount and the value after a row's last valid token, as for ``discounted_returns``
        (verl uses gamma = 1 and no bootstrap).
    out
        Optional preallocated (advantages, returns), as for ``reinforce_plus_plus``.
    backend
        As for ``discounted_returns``.

    Returns
    -------
    AdvantagesResult(advantages, returns), each shaped like ``rewards`` with its dtype (the
    arrays of ``out`` when given); 0 at positions that are not valid.
    """
    epsilon = _validate.scalar("eps", eps, lo=0.0)
    zero_tail = _flag("zero_tail", zero_tail)
    arrays = {"rewards": rewards, "old_logprobs": old_logprobs, "sum_pi_squared": sum_pi_squared}
    if is_weights is not None:
        arrays["is_weights"] = is_weights
    checked, rows = _validate.batch(arrays, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    token = dict(zip(arrays, checked, strict=True))
    if isinstance(groups, _groups.Groups):
        if groups.n_rows != rows.n_rows:
            raise ValueError(
                f"groups has {groups.n_rows} rows but the batch has {rows.n_rows}: factorise "
                "the group labels of this batch's rows"
            )
        rows = rows._replace(groups=groups)
    else:
        rows = _groups.with_groups(rows, groups)
    parameters = _row_parameters(rows, gamma, bootstrap)
    inputs = {
        **arrays,
        "mask": mask,
        "lengths": lengths,
        "cu_seqlens": cu_seqlens,
        "gamma": gamma,
        "bootstrap": bootstrap,
        "groups": groups,
    }
    advantages, returns = _outputs(out, token["rewards"], inputs)
    absent = np.empty(0, dtype=token["rewards"].dtype)
    _backend.run(
        "optimal_token_baseline",
        backend,
        rewards=token["rewards"].ravel(),
        old_logprobs=token["old_logprobs"].ravel(),
        sum_pi_squared=token["sum_pi_squared"].ravel(),
        is_weights=token["is_weights"].ravel() if is_weights is not None else absent,
        **rows.arguments,
        **rows.group_arguments,
        **parameters,
        eps=epsilon,
        zero_tail=int(zero_tail),
        advantages=advantages.ravel(),
        returns=returns.ravel(),
    )
    return AdvantagesResult(advantages, returns)
