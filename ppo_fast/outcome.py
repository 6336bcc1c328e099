"""Outcome advantage estimators: one score per row, compared within its group (no critic).

A batch of B rows (responses) carries one score per row, ``scores[b]`` (K of them, one per reward
key, for ``gdpo``), and one group label per row, ``groups[b]``: the rows sampled for one prompt
share a label. Labels are integer ids or any hashable uids (str, bytes, uuid.UUID, tuples, mixed),
or a ``Groups`` factorised once; groups may be uneven, partial, interleaved or of one row
(DESIGN.md section 2; ``ppo_fast._groups``). For group g with rows b of scores s_b (n_g of them),
in float64,

    mean_g = sum_b s_b / n_g
    var_g  = sum_b (s_b - mean_g)**2 / (n_g - ddof)       (centred: no E[s^2] - E[s]^2)

and the estimators are, for row b of group g,

    grpo          A_b = (s_b - mean_g) / (std + eps)    std = sqrt(var_g), the batch's, or none
    rloo          A_b = s_b - mean_{j != b} s_j = (n_g s_b - sum_g) / (n_g - 1)
    opo           A_b = s_b - sum_j len_j s_j / sum_j len_j       (len: the row's valid tokens)
    gpg           A_b = alpha (s_b - mean_g) / f_norm
    pass_at_k     A_b = (max_g - second max_g) / (std_g + eps) for the group's best row, else 0
    reinforce_plus_plus_baseline   A_b = whiten(s_b - mean_g)
    gdpo          A_b = whiten(sum_k w_k grpo_k(s_bk))

where ``whiten`` is over the batch's tokens: row b's value counted once per valid token,
(A - mean) / sqrt(var + whiten_eps) with the population (or unbiased) variance, as verl's
``masked_whiten`` of the value broadcast onto the row's tokens.

Conventions, the same in every estimator:

- A group of one row (``singleton``): ``"raw"`` compares it with nothing: baseline 0 and std 1,
  so its score passes through the formula (verl's loops: s / (1 + eps) in GRPO); ``"zero"`` makes
  its own score the baseline: advantage s - s, 0 for a finite score (TRL, verl's
  ``rloo_vectorized``); ``"error"`` raises ValueError naming the group and its row.
- NaN scores (``nan``): ``"propagate"``: a NaN enters its group's statistics, so every advantage
  of the group is NaN; ``"omit"``: the group's statistics are over its other scores (TRL's
  ``nanmean``/``nanstd``) and only the NaN row's advantage is NaN; a group left with one score is
  a group of one; ``"raise"``: ValueError naming the row. inf is data: IEEE arithmetic.
- The result: without a layout, the (B,) advantages. With one of ``mask`` (B, T), ``lengths``
  (B,) and ``padded_length=T``, or ``cu_seqlens`` (B+1,), each row's advantage on each of its
  valid tokens and 0 elsewhere: (B, T), or packed (N,) (DESIGN.md section 2).
- Dtypes: float32 and float64 scores give that dtype; bool and integer scores are read as
  float64. Statistics are float64, reduced per group over the dense group ids one row after
  another in row order (a compiled loop; ``np.bincount`` where numba is not installed, with the
  same bits): the same bits on every call.
- An empty batch (B = 0) gives an empty result; whitening, which needs a valid token, raises.
- Inputs are never modified.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from . import _validate
from ._outcome_groups import (
    NanPolicy,
    Singleton,
    _batch,
    _broadcast,
    _choices,
    _ddof,
    _flag,
    _group_counts,
    _group_sums,
    _group_variances,
    _grpo_rows,
    _present,
    _quiet,
    _result,
    _row_tokens,
    _singletons,
    _std,
    _whiten_rows,
)


def grpo(
    scores: ArrayLike,
    groups: object,
    *,
    std: Literal["group", "batch"] | None = "group",
    eps: float = 1e-6,
    eps_in_sqrt: bool = False,
    ddof: int = 1,
    singleton: Singleton = "raw",
    nan: NanPolicy = "propagate",
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    padded_length: int | None = None,
) -> np.ndarray:
    """Group-normalised advantages (GRPO), and group-centred ones (Dr. GRPO, ``std=None``).

        A_b = (s_b - mean_g) / (std + eps),    or (s_b - mean_g) / sqrt(var + eps) with
                                               eps_in_sqrt=True, or s_b - mean_g with std=None

    where std = sqrt(var) is the row's group's (``std="group"``: var_g with ``ddof``) or the
    whole batch's (``std="batch"``: the variance of every score about the batch's mean, with
    ``ddof``; TRL's scale_rewards="batch"; with nan="propagate" one NaN score makes it NaN, and
    so every advantage of a group of two or more). A group of one has std 1 and mean 0 ("raw":
    the score passes through as s / (1 + eps), verl's loop and its vectorised GRPO) or mean s
    ("zero": advantage 0, TRL).

    Parameters
    ----------
    scores
        (B,): each row's score. float32 and float64 are kept; bool and integers are read as
        float64. NaN follows ``nan``; inf propagates (IEEE arithmetic).
    groups
        (B,): each row's group label: integer ids (any integer dtype, integral floats; never
        used as memory indices), hashable uids (str, bytes, uuid.UUID, tuples, a mix), or a
        ``Groups`` factorised once (``ppo_fast._groups.factorize(groups, B)``).
    std
        "group" (default), "batch", or None (no division: Dr. GRPO, verl's
        norm_adv_by_std_in_grpo=False, TRL's scale_rewards="none").
    eps
        Added to the std (to the variance under the square root with ``eps_in_sqrt``); > 0.
        verl and the GRPO paper 1e-6, TRL 1e-4, OpenRLHF 1e-9.
    eps_in_sqrt
        Divide by sqrt(var + eps) instead of std + eps.
    ddof
        The variance's divisor is n - ddof: 1 (unbiased, torch.std's; verl, TRL, OpenRLHF) or 0.
    singleton
        A group with one score: "raw" (mean 0, std 1), "zero" (advantage 0) or "error".
    nan
        NaN scores: "propagate" (their group's advantages are NaN), "omit" (left out of their
        group's statistics, TRL's nanmean/nanstd; only their own advantage is NaN) or "raise".
    mask, lengths, cu_seqlens, padded_length
        At most one layout, for a per-token result: a 0/1 (B, T) ``mask`` (holes and left
        padding allowed; nonzero is valid) or ``lengths`` (B,) with ``padded_length=T`` (row b
        is positions 0 .. lengths[b]-1) give (B, T); ``cu_seqlens`` (B+1,) gives packed (N,)
        with N = cu_seqlens[-1]. Each row's advantage goes on each of its valid tokens, 0
        elsewhere. None of them: the (B,) per-row advantages.

    Returns
    -------
    The advantages, (B,) or per token, in the dtype of ``scores`` (float64 for bool and integer
    scores). Inputs are never modified.
    """
    batch = _batch(scores, groups, mask, lengths, cu_seqlens, padded_length)
    scale = _std(std)
    epsilon = _validate.scalar("eps", eps, lo=0.0, open_lo=True)
    in_sqrt = _flag("eps_in_sqrt", eps_in_sqrt)
    divisor = _ddof(ddof)
    _choices(singleton, nan)
    with _quiet():
        present = _present(batch.scores, nan)
        advantages = _grpo_rows(
            batch.scores, batch.groups, scale, epsilon, in_sqrt, divisor, singleton, present
        )
    return _result(advantages, batch)


def rloo(
    scores: ArrayLike,
    groups: object,
    *,
    singleton: Singleton = "raw",
    nan: NanPolicy = "propagate",
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    padded_length: int | None = None,
) -> np.ndarray:
    """Leave-one-out advantages (RLOO): each row's baseline is the mean of the other rows of its
    group,

        A_b = s_b - sum_{j != b} s_j / (n_g - 1) = (n_g s_b - sum_g) / (n_g - 1)

    computed as the right-hand side in float64 (n_g / (n_g - 1) times s_b - mean_g). A group of
    one has no other row: "raw" gives its score (baseline 0, verl's loop), "zero" gives 0 (verl's
    rloo_vectorized, TRL), "error" raises.

    Parameters
    ----------
    scores
        (B,): each row's score. float32 and float64 are kept; bool and integers are read as
        float64. NaN follows ``nan``; inf propagates (IEEE arithmetic).
    groups
        (B,): each row's group label: integer ids (any integer dtype, integral floats; never
        used as memory indices), hashable uids (str, bytes, uuid.UUID, tuples, a mix), or a
        ``Groups`` factorised once (``ppo_fast._groups.factorize(groups, B)``).
    singleton
        A group with one score: "raw" (baseline 0), "zero" (advantage 0) or "error".
    nan
        NaN scores: "propagate" (their group's advantages are NaN), "omit" (left out of their
        group's n_g and sum; only their own advantage is NaN) or "raise".
    mask, lengths, cu_seqlens, padded_length
        At most one layout, for a per-token result: a 0/1 (B, T) ``mask`` (holes and left
        padding allowed; nonzero is valid) or ``lengths`` (B,) with ``padded_length=T`` (row b
        is positions 0 .. lengths[b]-1) give (B, T); ``cu_seqlens`` (B+1,) gives packed (N,)
        with N = cu_seqlens[-1]. Each row's advantage goes on each of its valid tokens, 0
        elsewhere. None of them: the (B,) per-row advantages.

    Returns
    -------
    The advantages, (B,) or per token, in the dtype of ``scores`` (float64 for bool and integer
    scores). Inputs are never modified.
    """
    batch = _batch(scores, groups, mask, lengths, cu_seqlens, padded_length)
    _choices(singleton, nan)
    x, ids = batch.scores, batch.groups.ids
    with _quiet():
        present = _present(x, nan)
        counts = _group_counts(batch.groups, present)
        sums = _group_sums(x, batch.groups, present)
        single = _singletons(batch.groups, counts, singleton, present)
        row_counts = counts[ids]
        advantages = (row_counts * x - sums[ids]) / (row_counts - 1.0)
        if single is not None:
            alone = single[ids]
            advantages[alone] = x[alone] if singleton == "raw" else x[alone] - x[alone]
    return _result(advantages, batch)


def opo(
    scores: ArrayLike,
    groups: object,
    *,
    token_counts: ArrayLike | None = None,
    singleton: Singleton = "raw",
    nan: NanPolicy = "propagate",
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    padded_length: int | None = None,
) -> np.ndarray:
    """Length-weighted baseline advantages (OPO, arXiv 2505.23585; verl's ``opo``):

        A_b = s_b - sum_j len_j s_j / sum_j len_j        over the rows j of b's group, b included

    where len_j is row j's number of valid tokens: from the layout, or ``token_counts`` when the
    result is per row. A group of one has baseline 0 ("raw", verl) or its own score ("zero"). A
    group whose rows hold no token at all has no weighted baseline: its rows get s_b - s_b (0 for
    a finite score; they have no token to carry it either).

    Parameters
    ----------
    scores
        (B,): each row's score. float32 and float64 are kept; bool and integers are read as
        float64. NaN follows ``nan``; inf propagates (IEEE arithmetic).
    groups
        (B,): each row's group label: integer ids (any integer dtype, integral floats; never
        used as memory indices), hashable uids (str, bytes, uuid.UUID, tuples, a mix), or a
        ``Groups`` factorised once (``ppo_fast._groups.factorize(groups, B)``).
    token_counts
        (B,) non-negative integers: each row's valid tokens, for a per-row result. Required
        without a layout; refused with one (the layout gives them).
    singleton
        A group with one score: "raw" (baseline 0), "zero" (advantage 0) or "error".
    nan
        NaN scores: "propagate" (their group's advantages are NaN), "omit" (left out of their
        group's baseline; only their own advantage is NaN) or "raise".
    mask, lengths, cu_seqlens, padded_length
        At most one layout, for a per-token result: a 0/1 (B, T) ``mask`` (holes and left
        padding allowed; nonzero is valid) or ``lengths`` (B,) with ``padded_length=T`` (row b
        is positions 0 .. lengths[b]-1) give (B, T); ``cu_seqlens`` (B+1,) gives packed (N,)
        with N = cu_seqlens[-1]. Each row's advantage goes on each of its valid tokens, 0
        elsewhere. None of them: the (B,) per-row advantages.

    Returns
    -------
    The advantages, (B,) or per token, in the dtype of ``scores`` (float64 for bool and integer
    scores). Inputs are never modified.
    """
    batch = _batch(scores, groups, mask, lengths, cu_seqlens, padded_length)
    _choices(singleton, nan)
    tokens = _row_tokens(batch.layout, token_counts, batch.scores.shape[0])
    if tokens is None:
        raise ValueError(
            "opo weighs each row by its valid tokens: pass token_counts (B,) for a per-row "
            "result, or a layout (mask, lengths with padded_length, or cu_seqlens)"
        )
    x, ids = batch.scores, batch.groups.ids
    with _quiet():
        present = _present(x, nan)
        single = _singletons(batch.groups, _group_counts(batch.groups, present), singleton, present)
        row_lengths = tokens.astype(np.float64)
        group_lengths = _group_sums(row_lengths, batch.groups, present)
        baselines = _group_sums(row_lengths * x, batch.groups, present) / group_lengths
        own = group_lengths == 0  # no token in the group: no weighted baseline
        if single is not None:
            if singleton == "raw":
                baselines[single] = 0.0
                own &= ~single
            else:
                own |= single
        row_baselines = np.where(own[ids], x, baselines[ids])
        advantages = x - row_baselines
    return _result(advantages, batch)


def gpg(
    scores: ArrayLike,
    groups: object,
    *,
    alpha: float | None = None,
    f_norm: float = 1.0,
    singleton: Singleton = "raw",
    nan: NanPolicy = "propagate",
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    padded_length: int | None = None,
) -> np.ndarray:
    """Group Policy Gradient advantages (GPG, arXiv 2504.02546; verl's ``gpg``):

        A_b = alpha (s_b - mean_g) / f_norm,      alpha = n / max(m, 1) when not given

    where n is the number of scores in the statistics (B; the non-NaN ones with nan="omit") and
    m how many of them are nonzero (a NaN is nonzero, as in torch.count_nonzero): verl computes
    this alpha whatever its ``alpha`` argument says. A group of one has mean 0 ("raw", verl) or
    its own score ("zero").

    Parameters
    ----------
    scores
        (B,): each row's score. float32 and float64 are kept; bool and integers are read as
        float64. NaN follows ``nan``; inf propagates (IEEE arithmetic).
    groups
        (B,): each row's group label: integer ids (any integer dtype, integral floats; never
        used as memory indices), hashable uids (str, bytes, uuid.UUID, tuples, a mix), or a
        ``Groups`` factorised once (``ppo_fast._groups.factorize(groups, B)``).
    alpha
        The scale, > 0 and finite; None (default) for n / max(m, 1) as above.
    f_norm
        The divisor, > 0 and finite (verl: 1).
    singleton
        A group with one score: "raw" (mean 0), "zero" (advantage 0) or "error".
    nan
        NaN scores: "propagate" (their group's advantages are NaN), "omit" (left out of their
        group's mean and of n and m; only their own advantage is NaN) or "raise".
    mask, lengths, cu_seqlens, padded_length
        At most one layout, for a per-token result: a 0/1 (B, T) ``mask`` (holes and left
        padding allowed; nonzero is valid) or ``lengths`` (B,) with ``padded_length=T`` (row b
        is positions 0 .. lengths[b]-1) give (B, T); ``cu_seqlens`` (B+1,) gives packed (N,)
        with N = cu_seqlens[-1]. Each row's advantage goes on each of its valid tokens, 0
        elsewhere. None of them: the (B,) per-row advantages.

    Returns
    -------
    The advantages, (B,) or per token, in the dtype of ``scores`` (float64 for bool and integer
    scores). Inputs are never modified.
    """
    batch = _batch(scores, groups, mask, lengths, cu_seqlens, padded_length)
    if alpha is not None:
        alpha = _validate.scalar("alpha", alpha, lo=0.0, open_lo=True)
    divisor = _validate.scalar("f_norm", f_norm, lo=0.0, open_lo=True)
    _choices(singleton, nan)
    x = batch.scores
    with _quiet():
        present = _present(x, nan)
        if alpha is None:
            counted = x if present is None else x[present]
            alpha = counted.shape[0] / max(int(np.count_nonzero(counted)), 1)
        centred = _grpo_rows(x, batch.groups, None, 0.0, False, 1, singleton, present)
        advantages = alpha * centred / divisor
    return _result(advantages, batch)


def pass_at_k(
    scores: ArrayLike,
    groups: object,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    ddof: int = 1,
    singleton: Singleton = "error",
    nan: NanPolicy = "propagate",
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    padded_length: int | None = None,
) -> np.ndarray:
    """Pass@k advantages (arXiv 2503.19595; verl's ``grpo_passk``): only each group's best row
    gets one,

        A_best = (max_g - second_max_g) / (std_g + eps)   (without the division: normalize=False)
        A_b    = 0 for every other row

    where second_max_g is the largest score of the group's other rows and std_g = sqrt(var_g)
    with ``ddof``. When the maximum is shared (a tie), max_g - second_max_g = 0 and every row of
    the group gets 0: which of the tied rows torch.topk designates in verl is unspecified (on
    CPU it is neither the first nor the last), and it does not change the result. A group of
    one has no second score: "error" (the default; verl raises), "raw" (second max 0 and std 1:
    s / (1 + eps)) or "zero".

    Parameters
    ----------
    scores
        (B,): each row's score. float32 and float64 are kept; bool and integers are read as
        float64. NaN follows ``nan``; inf propagates (IEEE arithmetic).
    groups
        (B,): each row's group label: integer ids (any integer dtype, integral floats; never
        used as memory indices), hashable uids (str, bytes, uuid.UUID, tuples, a mix), or a
        ``Groups`` factorised once (``ppo_fast._groups.factorize(groups, B)``).
    normalize
        Divide by std_g + eps (verl's norm_adv_by_std_in_grpo, default True).
    eps
        Added to the std; > 0 (verl: 1e-6).
    ddof
        The variance's divisor is n - ddof: 1 (unbiased, torch.std's; verl) or 0.
    singleton
        A group with one score: "error" (default), "raw" or "zero".
    nan
        NaN scores: "propagate" (every advantage of their group is NaN), "omit" (left out of
        their group's maximum and std; only their own advantage is NaN) or "raise".
    mask, lengths, cu_seqlens, padded_length
        At most one layout, for a per-token result: a 0/1 (B, T) ``mask`` (holes and left
        padding allowed; nonzero is valid) or ``lengths`` (B,) with ``padded_length=T`` (row b
        is positions 0 .. lengths[b]-1) give (B, T); ``cu_seqlens`` (B+1,) gives packed (N,)
        with N = cu_seqlens[-1]. Each row's advantage goes on each of its valid tokens, 0
        elsewhere. None of them: the (B,) per-row advantages.

    Returns
    -------
    The advantages, (B,) or per token, in the dtype of ``scores`` (float64 for bool and integer
    scores). Inputs are never modified.
    """
    batch = _batch(scores, groups, mask, lengths, cu_seqlens, padded_length)
    normalized = _flag("normalize", normalize)
    epsilon = _validate.scalar("eps", eps, lo=0.0, open_lo=True)
    divisor = _ddof(ddof)
    _choices(singleton, nan)
    x, ids, n_groups = batch.scores, batch.groups.ids, batch.groups.n_groups
    with _quiet():
        present = _present(x, nan)
        counts = _group_counts(batch.groups, present)
        single = _singletons(batch.groups, counts, singleton, present)
        missing = np.isnan(x)
        # A NaN is -inf here: it wins no maximum. It may tie one of -inf, which gives 0 as any
        # tie does, and its own row is NaN below.
        candidates = np.where(missing, -np.inf, x)
        maxima = np.full(n_groups, -np.inf)
        np.maximum.at(maxima, ids, candidates)
        is_max = candidates == maxima[ids]
        n_max = np.bincount(ids, weights=is_max, minlength=n_groups)
        runners_up = np.full(n_groups, -np.inf)
        np.maximum.at(runners_up, ids, np.where(is_max, -np.inf, candidates))
        # Only a maximum held by one row makes a best row: a tie (n_max > 1) gives every row 0.
        gaps = maxima - runners_up
        if normalized:
            centred = x - (_group_sums(x, batch.groups, present) / counts)[ids]
            variances = _group_variances(centred, batch.groups, counts, present, divisor)
            gaps /= np.sqrt(variances) + epsilon
        best = is_max & (n_max[ids] == 1)
        advantages = np.where(best, gaps[ids], 0.0)
        if single is not None:
            alone = single[ids]
            if singleton == "raw":
                raw = x[alone] / (1.0 + epsilon) if normalized else x[alone]
                advantages[alone] = raw
            else:
                advantages[alone] = x[alone] - x[alone]
        if present is not None:  # nan="omit": a NaN score's own row
            advantages[missing] = np.nan
        elif missing.any():  # nan="propagate": every row of a NaN score's group
            advantages[(_group_sums(missing, batch.groups, None) > 0)[ids]] = np.nan
    return _result(advantages, batch)


def reinforce_plus_plus_baseline(
    scores: ArrayLike,
    groups: object,
    *,
    whiten: bool = True,
    unbiased: bool = False,
    whiten_eps: float = 1e-8,
    token_counts: ArrayLike | None = None,
    singleton: Singleton = "raw",
    nan: NanPolicy = "propagate",
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    padded_length: int | None = None,
) -> np.ndarray:
    """REINFORCE++ with a group baseline (arXiv 2501.03262; verl's
    ``reinforce_plus_plus_baseline``, OpenRLHF's ``reinforce_baseline``): the group mean is
    subtracted, then the batch is whitened over its tokens,

        a_b = s_b - mean_g
        A_b = (a_b - mu) / sqrt(sigma2 + whiten_eps)
        mu  = sum_b len_b a_b / N,   sigma2 = sum_b len_b (a_b - mu)**2 / (N or N - 1 if unbiased)

    with len_b row b's valid tokens (from the layout, or ``token_counts``; 1 per row without
    either) and N = sum_b len_b: the masked whitening of a_b broadcast onto the tokens. A row
    without a token is not in mu and sigma2. A group of one has mean 0 ("raw", verl) or its own
    score ("zero"). verl whitens with unbiased=True and whiten_eps=1e-8; OpenRLHF with the
    population variance clamped at 1e-8 (unbiased=False, whiten_eps=0: the same while
    sigma2 >= 1e-8).

    Parameters
    ----------
    scores
        (B,): each row's score. float32 and float64 are kept; bool and integers are read as
        float64. NaN follows ``nan``; inf propagates (IEEE arithmetic).
    groups
        (B,): each row's group label: integer ids (any integer dtype, integral floats; never
        used as memory indices), hashable uids (str, bytes, uuid.UUID, tuples, a mix), or a
        ``Groups`` factorised once (``ppo_fast._groups.factorize(groups, B)``).
    whiten
        Whiten over the tokens (default); False gives a_b.
    unbiased
        Divide the whitening variance by N - 1 instead of N (population, the default).
    whiten_eps
        Added to the whitening variance under the square root; >= 0.
    token_counts
        (B,) non-negative integers: each row's valid tokens, the whitening weights of a per-row
        result; refused with a layout (the layout gives them).
    singleton
        A group with one score: "raw" (mean 0), "zero" (a_b = 0) or "error".
    nan
        NaN scores: "propagate" (NaN enters the statistics: every advantage is NaN once
        whitened), "omit" (left out of their group's mean and of the whitening; only their own
        advantage is NaN) or "raise".
    mask, lengths, cu_seqlens, padded_length
        At most one layout, for a per-token result: a 0/1 (B, T) ``mask`` (holes and left
        padding allowed; nonzero is valid) or ``lengths`` (B,) with ``padded_length=T`` (row b
        is positions 0 .. lengths[b]-1) give (B, T); ``cu_seqlens`` (B+1,) gives packed (N,)
        with N = cu_seqlens[-1]. Each row's advantage goes on each of its valid tokens, 0
        elsewhere. None of them: the (B,) per-row advantages.

    Returns
    -------
    The advantages, (B,) or per token, in the dtype of ``scores`` (float64 for bool and integer
    scores). Whitening with no valid token (B = 0 included), or one and unbiased=True, raises
    ValueError. Inputs are never modified.
    """
    batch = _batch(scores, groups, mask, lengths, cu_seqlens, padded_length)
    whitened = _flag("whiten", whiten)
    bessel = _flag("unbiased", unbiased)
    epsilon = _validate.scalar("whiten_eps", whiten_eps, lo=0.0)
    _choices(singleton, nan)
    tokens = _row_tokens(batch.layout, token_counts, batch.scores.shape[0])
    with _quiet():
        present = _present(batch.scores, nan)
        advantages = _grpo_rows(batch.scores, batch.groups, None, 0.0, False, 1, singleton, present)
        if whitened:
            advantages = _whiten_rows(advantages, tokens, bessel, epsilon, present)
    return _result(advantages, batch)


def gdpo(
    scores: ArrayLike,
    groups: object,
    *,
    weights: ArrayLike | None = None,
    whiten: bool = True,
    unbiased: bool = False,
    whiten_eps: float = 1e-8,
    token_counts: ArrayLike | None = None,
    std: Literal["group", "batch"] | None = "group",
    eps: float = 1e-6,
    eps_in_sqrt: bool = False,
    ddof: int = 1,
    singleton: Singleton = "raw",
    nan: NanPolicy = "propagate",
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    padded_length: int | None = None,
) -> np.ndarray:
    """Group reward-decoupled advantages (GDPO, arXiv 2601.05242; verl's ``gdpo``): GRPO on each
    reward key alone, their weighted sum, then whitening over the batch's tokens,

        a_b = sum_k w_k grpo(s_{., k})_b
        A_b = (a_b - mu) / sqrt(sigma2 + whiten_eps)      (mu, sigma2 as in
                                                           reinforce_plus_plus_baseline)

    with every option of ``grpo`` applied to each key. With nan="omit" a row's NaN keys are left
    out of its sum (TRL's nansum) and a row whose every key is NaN gets NaN. verl whitens with
    unbiased=True and whiten_eps=1e-8. TRL's multi_objective_aggregation="normalize_then_sum" is
    ``gdpo(..., eps=1e-4, nan="omit", singleton="zero", whiten=False)`` (a key left with one
    score in a group is NaN there, which its nansum drops) followed by its batch scaling
    (a - mean) / (std + 1e-4), which divides by std + eps rather than sqrt(var + eps).

    Parameters
    ----------
    scores
        (B, K): row b's score for each of K reward keys. float32 and float64 are kept; bool and
        integers are read as float64. NaN follows ``nan``; inf propagates (IEEE arithmetic).
    groups
        (B,): each row's group label: integer ids (any integer dtype, integral floats; never
        used as memory indices), hashable uids (str, bytes, uuid.UUID, tuples, a mix), or a
        ``Groups`` factorised once (``ppo_fast._groups.factorize(groups, B)``).
    weights
        (K,) finite weights of the keys; default 1 each.
    whiten, unbiased, whiten_eps, token_counts
        As in ``reinforce_plus_plus_baseline``: whiten over the tokens (default), the population
        (default) or unbiased variance, eps under the square root (>= 0), and each row's tokens
        for a per-row result (1 per row without them).
    std, eps, eps_in_sqrt, ddof, singleton
        As in ``grpo``, for each key.
    nan
        NaN scores: "propagate" (NaN enters the statistics: every advantage is NaN once
        whitened), "omit" (left out of its key's group statistics and of its row's sum) or
        "raise".
    mask, lengths, cu_seqlens, padded_length
        At most one layout, for a per-token result: a 0/1 (B, T) ``mask`` (holes and left
        padding allowed; nonzero is valid) or ``lengths`` (B,) with ``padded_length=T`` (row b
        is positions 0 .. lengths[b]-1) give (B, T); ``cu_seqlens`` (B+1,) gives packed (N,)
        with N = cu_seqlens[-1]. Each row's advantage goes on each of its valid tokens, 0
        elsewhere. None of them: the (B,) per-row advantages.

    Returns
    -------
    The advantages, (B,) or per token, in the dtype of ``scores`` (float64 for bool and integer
    scores). Whitening with no valid token (B = 0 included), or one and unbiased=True, raises
    ValueError. Inputs are never modified.
    """
    batch = _batch(scores, groups, mask, lengths, cu_seqlens, padded_length, ndim=2)
    n_rows, n_keys = batch.scores.shape
    key_weights = _key_weights(weights, n_keys)
    whitened = _flag("whiten", whiten)
    bessel = _flag("unbiased", unbiased)
    whitening_eps = _validate.scalar("whiten_eps", whiten_eps, lo=0.0)
    scale = _std(std)
    epsilon = _validate.scalar("eps", eps, lo=0.0, open_lo=True)
    in_sqrt = _flag("eps_in_sqrt", eps_in_sqrt)
    divisor = _ddof(ddof)
    _choices(singleton, nan)
    tokens = _row_tokens(batch.layout, token_counts, n_rows)
    with _quiet():
        present = _present(batch.scores, nan)
        advantages = np.zeros(n_rows)
        for key in range(n_keys):
            column = np.ascontiguousarray(batch.scores[:, key])
            kept = None if present is None else present[:, key]
            normalised = _grpo_rows(
                column, batch.groups, scale, epsilon, in_sqrt, divisor, singleton, kept
            )
            if kept is not None:
                normalised = np.where(kept, normalised, 0.0)
            advantages += key_weights[key] * normalised
        rows_present = None if present is None else present.any(axis=1)
        if rows_present is not None:
            advantages[~rows_present] = np.nan
        if whitened:
            advantages = _whiten_rows(advantages, tokens, bessel, whitening_eps, rows_present)
    return _result(advantages, batch)


def _key_weights(weights: ArrayLike | None, n_keys: int) -> np.ndarray:
    if weights is None:
        return np.ones(n_keys)
    array = _validate.row_data("weights", weights)
    if array.shape != (n_keys,):
        raise ValueError(
            f"weights must have shape ({n_keys},), one weight per reward key (column of "
            f"scores), got shape {array.shape}"
        )
    if not np.all(np.isfinite(array)):
        k = int(np.argmax(~np.isfinite(array)))
        raise ValueError(f"weights[{k}] must be finite, got {array[k]!r}")
    return array.astype(np.float64, copy=False)


def broadcast_to_tokens(
    per_row: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    padded_length: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """One value per row onto each of the row's valid tokens, 0 at every other position:

        result[b, t] = per_row[b] if position t of row b is valid else 0     (padded)
        result[n]    = per_row[b] for cu_seqlens[b] <= n < cu_seqlens[b+1]   (packed)

    what every outcome estimator does with its (B,) advantages when given a layout.

    Parameters
    ----------
    per_row
        (B,): one value per row. float32 and float64 are kept; bool and integers are read as
        float64. NaN and inf are copied like any value.
    mask, lengths, cu_seqlens, padded_length
        Exactly one layout: a 0/1 (B, T) ``mask`` (holes and left padding allowed; nonzero is
        valid) or ``lengths`` (B,) with ``padded_length=T`` (row b is positions
        0 .. lengths[b]-1) give (B, T); ``cu_seqlens`` (B+1,) gives packed (N,) with
        N = cu_seqlens[-1].
    out
        Optional preallocated result: a C-contiguous, writeable NumPy array of the result's shape
        and dtype, sharing no memory with an input. It is written and returned.

    Returns
    -------
    (B, T) or (N,) in the dtype of ``per_row`` (float64 for bool and integers); ``out`` when
    given. Inputs are never modified.
    """
    values = _validate.row_data("per_row", per_row)
    layout = _validate.row_layout(
        values.shape[0],
        data="per_row",
        mask=mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
        padded_length=padded_length,
    )
    if layout is None:
        raise ValueError(
            "broadcast_to_tokens needs a layout: pass mask (B, T), lengths (B,) with "
            "padded_length=T, or cu_seqlens (B+1,)"
        )
    if out is not None:
        inputs = {"per_row": per_row, "mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens}
        out = _validate.out_array("out", out, layout.shape, values.dtype, inputs)
    return _broadcast(values, layout, out)
