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

Threads and long rows: rows are shared among threads, and a row whose valid extent (positions 0 ..
min(length, T) - 1 from its start; mask holes included) is longer than 65,536 positions is cut
into chunks of 16,384 (``_spec.GAE_CHUNKS``), so that a few long rows (4 x 131072, or one of
262,144) can use every thread. The cuts depend on the row only, so results are identical on any
number of threads, and a row gets the same bits in any batch. A chunk's recursion starts from
the advantage and value after it, which a first pass computes from each later chunk's own sum
(in eight float64 lanes, a few ulp from the recursion: within the backends' tolerances of the
oracle, NaN and inf as the recursion gives them). That pass costs a long row about a quarter
of its time on one thread.

The compiled backends run the recursion 8 valid positions at a time: within a block the TD
errors' discounted sums by a log-step scan (three steps of lanes moved down by 1, 2 and 4), then
the advantage after the block times (gamma lam)^(8 - j), so that the chain from one block to
the next is one multiply-add, not eight. The sums are thus reassociated within a block: within
the backends' tolerances of the oracle's recursion, bit for bit the same on every compiled
backend, build and thread count. Blocks are 8 adjacent valid positions counted from the last
of each run of valid positions (a run's first positions that fill no block take the plain
recursion), so a row whose valid positions are adjacent gives the same bits padded or packed;
holes move the blocks (gathering blocks across them was slower on scattered holes). A block
with a non-finite or huge TD error (beyond 2^1000), a running advantage beyond 2^1020, or a
gamma lam whose 8th power underflows takes the plain recursion, so NaN and inf come out
exactly as the oracle's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _result_arrays, _rows, _threads, _validate
from ._spec import GAE_CHUNKS

_LONG_ROW = GAE_CHUNKS.long_row


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
    out: tuple[np.ndarray, np.ndarray] | None = None,
    backend: str | None = None,
) -> GAEResult:
    """Advantages and returns by GAE; see the module docstring for the recursion.

    Parameters
    ----------
    rewards, values
        (B, T) padded, or (N,) packed with ``cu_seqlens``; float32 or float64, one dtype.
        ``values[b, t]`` is V(s_t), the value of the state before token t.
    gamma, lam
        Discount and GAE lambda in [0, 1]: scalars, or (B,) arrays, one per row.
    mask, lengths, cu_seqlens
        At most one: a 0/1 (B, T) ``mask`` (holes and left padding allowed; nonzero is valid),
        ``lengths`` (B,) (positions 0 .. lengths[b]-1 of row b are valid), or ``cu_seqlens``
        (B+1,) for packed (N,) arrays (row b is positions cu_seqlens[b] .. cu_seqlens[b+1]-1).
        None of them: every position of a (B, T) array is valid.
    bootstrap
        (B,): the value of the state after each row's last valid token (truncated rows);
        default 0 (every row ends in a terminal state). Data: NaN or inf propagates.
    out
        Optional preallocated (advantages, returns): two C-contiguous, writeable NumPy arrays
        shaped like ``rewards`` with its dtype, sharing no memory with an input nor with each
        other. They are written and returned in the result.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    GAEResult(advantages, returns), each shaped like ``rewards`` with its dtype (the arrays of
    ``out`` when given); 0 at positions that are not valid. Inputs are never modified.
    """
    if type(gamma) is not float:
        gamma = _validate.fast_real(gamma)
    if type(lam) is not float:
        lam = _validate.fast_real(lam)
    if (
        type(gamma) is float
        and type(lam) is float
        and 0.0 <= gamma <= 1.0  # NaN fails the comparisons: it goes the general way
        and 0.0 <= lam <= 1.0
        and bootstrap is None
    ):
        layout = _validate.common_layout((rewards, values), mask, lengths, cu_seqlens)
        # rows of at most _LONG_ROW positions: none runs in chunks (the common entries run each
        # row whole, as the batch function runs such rows)
        if layout is not False and rewards.shape[-1] > _LONG_ROW:
            if type(layout) is not tuple or layout[1].max() > _LONG_ROW:
                layout = False
        if layout is not False and (
            out is None
            or (
                type(out) is tuple
                and len(out) == 2
                and _validate.common_outputs(
                    out, rewards, (rewards, values, mask, lengths, cu_seqlens)
                )
            )
        ):
            return _gae_common(rewards, values, gamma, lam, layout, out, backend)
    (token_rewards, token_values), rows = _validate.batch(
        {"rewards": rewards, "values": values}, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens
    )
    gammas = _validate.per_row("gamma", gamma, rows.n_rows, lo=0.0, hi=1.0)
    lams = _validate.per_row("lam", lam, rows.n_rows, lo=0.0, hi=1.0)
    if bootstrap is None:
        next_values = _rows.constant_rows(0.0, rows.n_rows)
    else:
        # Values are data: a NaN or inf propagates into the results (DESIGN.md section 3).
        next_values = _validate.per_row(
            "bootstrap", bootstrap, rows.n_rows, allow_inf=True, allow_nan=True, rows_only=True
        )
    if out is None:
        advantages = _result_arrays.empty(token_rewards.shape, token_rewards.dtype)
        returns = _result_arrays.empty(token_rewards.shape, token_rewards.dtype)
    else:
        advantages, returns = _validate.out_arrays(
            ("advantages", "returns"),
            out,
            token_rewards,
            {
                "rewards": rewards,
                "values": values,
                "mask": mask,
                "lengths": lengths,
                "cu_seqlens": cu_seqlens,
                "gamma": gamma,
                "lam": lam,
                "bootstrap": bootstrap,
            },
        )
    _backend.run(
        "gae",
        backend,
        rewards=token_rewards.ravel(),
        values=token_values.ravel(),
        **rows.arguments,
        gammas=gammas,
        lams=lams,
        bootstrap=next_values,
        advantages=advantages.ravel(),
        returns=returns.ravel(),
    )
    return GAEResult(advantages, returns)


def _gae_common(
    rewards: np.ndarray,
    values: np.ndarray,
    gamma: float,
    lam: float,
    mask: np.ndarray | None,
    out: tuple[np.ndarray, np.ndarray] | None,
    backend: str | None,
) -> GAEResult:
    """The common case, checked by the caller (``_validate.common_case``: two C-contiguous
    (B, T) arrays of one float dtype, no mask or a bool one; or ``_validate.common_packed``: two
    such 1-D arrays, ``mask`` their rows' (starts, spans); float gamma and lam in [0, 1], no
    bootstrap; ``out`` None or as ``_validate.common_outputs`` accepts it): what the general way
    computes, from the same arrays, in the backend's common-case entry, or its packed entry
    (tests/test_fast_path.py and test_fast_path_packed.py compare the two)."""
    shape, dtype = rewards.shape, rewards.dtype
    if out is None:
        # a small result is np.empty's, without a call around it (the fast path's cost)
        empty = np.empty if rewards.nbytes < _result_arrays.POOLED_BYTES else _result_arrays.empty
        advantages = empty(shape, dtype)
        returns = empty(shape, dtype)
    else:
        advantages, returns = out
    if type(mask) is tuple:  # packed rows' (starts, spans)
        entry, n_threads = _backend.packed_common("gae", backend, dtype, mask, shape[0])
    else:
        n_threads = _threads.threads_for(shape[0], shape[0] * shape[1])  # no row is long
        entry = _backend.common("gae", backend, n_threads, dtype, mask is not None)
    entry(rewards, values, mask, gamma, lam, 0.0, advantages, returns, n_threads)
    return _new_result((advantages, returns))


# GAEResult((advantages, returns)) without NamedTuple's __new__ in Python (a third of a
# microsecond less on the fast path).
_new_result = functools.partial(tuple.__new__, GAEResult)
