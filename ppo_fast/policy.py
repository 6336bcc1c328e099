"""The policy-loss family beyond PPO's clip: the loss, its exact gradient and the statistics in
one pass, as ``clipped_surrogate`` (``ppo_fast.loss``) does.

Per valid token, with A the advantage, w the weight (1 without ``weights``; verl's
``rollout_is_weights``), logp = ``logprobs``, old = ``old_logprobs`` and, where a ratio is used,
``log_ratio = logp - old`` clamped to [-log_ratio_clamp, log_ratio_clamp] when a clamp is given
(verl clamps at 20) and rho = exp(log_ratio):

    reinforce_loss   l = -w * (A * logp - beta / 2 * (logp - old)^2)
                     beta = 0: REINFORCE and GPG (verl's "gpg"), -w * A * logp; beta > 0: DRO
                     (verl's "dro"). d l / d logp = -w * (A - beta * (logp - old)).
    cispo_loss       l = -w * sg(c) * A * logp,  c = clip(rho, 1 - clip_low, 1 + clip_high)
                     (CISPO, MiniMax-M1: sg = stop-gradient, the clipped ratio is a constant
                     weight). d l / d logp = -w * c * A, at every token: nothing is flat.
    sapo_loss        l = -w * g * A,  g = sigmoid(tau * (rho - 1)) * 4 / tau
                     (SAPO: tau = tau_pos where A > 0, tau_neg where A <= 0).
                     d l / d logp = -w * A * 4 s (1 - s) * rho, with s = sigmoid(tau * (rho - 1)):
                     the gate's slope at rho = 1 is 1, as the ratio's in PPO; 0 where the
                     log-ratio clamp is active (strictly beyond it: torch.clamp passes the
                     gradient at its bounds).

    gspo_loss        l = -w * min(s * A, clip(s, 1 - clip_low, 1 + clip_high) * A), bounded
                     below by c * A where A < 0 with a dual clip c (GSPO, arXiv 2507.18071),
                     with one ratio per row: s = exp(min(m, log_ratio_max)), m = the mean of
                     logp - old over the row's valid tokens (n of them). The clipped branch is
                     taken where strictly smaller, the dual bound where strictly larger; slope_t
                     = d l_t / d s = -w_t * A_t on the unclipped branch, 0 on a flat one
                     (clipped, dual-clipped), and d s / d m = s, 0 where m > log_ratio_max
                     (strictly: torch.clamp passes the gradient at its bound). Two gradients:
                     form="detached" (verl's compute_policy_loss_gspo: each token's ratio is
                     sg(s) * exp(logp_t - sg(logp_t)), of value s and derivative s in its own
                     logp_t only): d l / d logp_t = slope_t * s;
                     form="sequence" (TRL's importance_sampling_level="sequence", OpenRLHF's
                     policy_loss_type="gspo": s itself, a function of every logp of the row):
                     d loss / d logp_u = (sum over the row's valid t of slope_t) * s / n for
                     every valid u of the row (times the row's aggregation weight, which is why
                     the per-row sum runs before any token's gradient is known).
                     At a tie of the branches (s at a clip bound, c * A equal to the clipped
                     objective) both forms take the unclipped slope, as clipped_surrogate. A row
                     with no valid token has no ratio: it contributes nothing (loss, gradient
                     and counts 0), which is what the peers' masked sums give.

    geo_mean_loss    verl's geometric-mean loss (GMPO, arXiv 2507.20673), one loss per row b of
                     n valid tokens: L_b = -mean(A) * exp(mean(r') + mean(log w)) (the
                     means over the row's valid tokens), with r = logp - old clipped in log
                     space by the advantage's sign: r' = min(r, clip_high) where A > 0,
                     max(r, -clip_low) where A < 0, 0 where A = 0. L_b is the per-token loss of
                     each of the row's valid tokens, so "seq-mean-token-mean" is the mean of the
                     rows' losses (verl's) and "token-mean" weighs each by its length.
                     d L_b / d logp_t = L_b / n where r' moves with r (A > 0 and r <= clip_high,
                     A < 0 and r >= -clip_low: torch's clamp and min pass the gradient at a
                     bound), 0 elsewhere (clipped, or A = 0). A weight of 0 makes its row's
                     loss 0, a negative one NaN. A row with no valid token contributes nothing.

    dppo_loss        l = -w * A * sg(min(rho, cap)) * logp * v  (DPPO, verl's "dppo_tv" and
                     "dppo_kl"): v = 1 where the token is within the trust region of the binary
                     TV or KL divergence between p = exp(logp) and p_old = exp(old), 0 outside
                     (see ``dppo_loss``); v and the capped ratio are held constant.
                     d l / d logp = -w * A * min(rho, cap) * v: the boundary of the region and
                     the cap are not kinks of the gradient (both factors are constants).
    kl_cov_loss      l = -w * (A * rho - p * |logp - old|)  (KL-Cov, verl's "kl_cov"; rho not
                     clamped): the penalty p = coef at the tokens a selection picked
                     (``ppo_fast.kl_cov_selection``), 0 elsewhere. d l / d logp = -w * (A * rho
                     - p * sign(logp - old)); at logp = old the penalty's slope is 0 (torch's
                     abs has gradient 0 at 0).
    clip_cov_loss    PPO's clipped surrogate (no dual clip; no clamp unless given) with the
                     tokens a selection picked (``ppo_fast.clip_cov_selection``) dropped: their
                     loss and gradient are 0, and they still count in the aggregation's
                     denominators (verl's "clip_cov"). Gradient: ``clipped_surrogate``'s.

Aggregation (``agg``, ``num_tokens``, ``num_seqs``, ``loss_scale``) is ``clipped_surrogate``'s:
"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", with the
global counts of a data-parallel step; the gradient is d loss / d logprobs after aggregation, 0
at positions that are not valid.

Statistics (``PolicyLossResult``), over the valid tokens: ``approx_kl``, the mean of old - logp
(of the clamped log-ratio when a clamp is given, as verl's ``ppo_kl``); for CISPO ``clipfrac``,
the fraction where the clipped ratio differs from the ratio (either bound, as verl's
``pg_clipfrac``), and ``clipfrac_lower``, where it is below the lower bound; for GSPO
``clipfrac``, the fraction of tokens on the clipped branch (verl's and OpenRLHF's clip
fraction), ``clipfrac_lower``, of those with A < 0 (the ratio below the lower bound, TRL's
``clip_ratio/low_mean``), and ``approx_kl`` of the tokens' log-ratios, not clamped; REINFORCE and
SAPO clip nothing, and their clip fractions are 0; for DPPO ``clipfrac`` is the fraction outside the
trust region and ``clipfrac_lower`` that inside it whose ratio is above the cap (verl's
``pg_clipfrac`` and ``pg_clipfrac_lower``); for KL-Cov and Clip-Cov ``clipfrac`` is the fraction
of the valid tokens the selection picked, ``clipfrac_lower`` is 0, and KL-Cov's ``approx_kl`` is
the mean of |logp - old| (the "abs" estimator, verl's ``ppo_kl`` for KL-Cov). All NaN without a
valid token.

Per-token arithmetic runs in the input dtype, sums in float64, as in ``ppo_fast.loss`` (whose
docstring says what exp does beyond float32's range and how NaN and inf propagate).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _result_arrays, _threads, _validate
from ._policy_scalars import (
    _cispo_scalars,
    _dppo_scalars,
    _geo_mean_scalars,
    _gspo_form,
    _gspo_scalars,
    _reinforce_scalars,
    _sapo_scalars,
    check_temperatures,
)
from ._spec import FLAGS, KERNELS
from .covariance import valid_positions
from .loss import (
    _NO_WEIGHTS,
    Aggregation,
    PolicyLossResult,
    _common_agg,
    _common_arrays,
    _mean,
    _row_scales,
    _totals,
    clipped_surrogate,
)

# The kernels with a token selection input (KL-Cov's): ``_run`` requires ``selected`` for them.
_SELECTING = frozenset(
    name for name, kernel in KERNELS.items() if any(a.dtype == FLAGS for a in kernel.inputs)
)


def _run(
    kernel: str,
    arrays: dict[str, Any],
    layout: dict[str, Any],
    normalisers: dict[str, Any],
    grad_out: np.ndarray | None,
    backend: str | None,
    scalars: dict[str, float],
    row_outputs: tuple[str, ...],
    codes: dict[str, int] | None = None,
    selected: Any = None,
) -> tuple[np.ndarray, list[float], float]:
    """Validate, run ``kernel`` and reduce: (grad, [loss, other row sums...], valid tokens).
    ``selected`` (KL-Cov's, required by a kernel with a token selection input): a selection
    shaped like ``logprobs``, checked here and handed to the kernel as its flags (a byte a token,
    bool's own bytes: no copy of a C-contiguous one).
    The common case (``loss._common_agg``, ``loss._common_arrays``, no weights, no selection or
    a C-contiguous bool one of the shape of ``logprobs``) goes to the kernel's common-case entry
    (``_run_common``), as ``clipped_surrogate``'s does."""
    selects = kernel in _SELECTING
    if (
        KERNELS[kernel].common
        and arrays.get("weights") is None
        and (selected is not None or not selects)
        and (
            agg := _common_agg(
                normalisers["agg"],
                layout["cu_seqlens"],
                normalisers["num_tokens"],
                normalisers["num_seqs"],
                normalisers["loss_scale"],
            )
        )
        is not None
    ):
        inputs = (arrays["logprobs"], arrays["old_logprobs"], arrays["advantages"])
        kernel_mask = _common_arrays(
            inputs, layout["mask"], grad_out, selected, layout["lengths"], layout["cu_seqlens"]
        )
        if kernel_mask is not False:
            return _run_common(
                kernel, inputs, kernel_mask, agg, grad_out, backend, scalars, codes, selected
            )
    # weights alone are optional: a None for any other array is for _validate to name
    given = {k: v for k, v in arrays.items() if k != "weights" or v is not None}
    checked, rows = _validate.batch(given, **layout)
    extra = {}
    if selects:
        flags = np.ascontiguousarray(_selection(selected, checked[0].shape))
        extra["selected"] = flags.view(np.uint8).ravel()
    logp = checked[0]
    check_temperatures(scalars, logp.dtype)
    weights = checked[3].ravel() if "weights" in given else _NO_WEIGHTS[logp.dtype]
    scales, valid = _row_scales(rows=rows, **normalisers, dtype=logp.dtype)
    if grad_out is None:
        grad = _result_arrays.empty(logp.shape, logp.dtype)
    else:
        inputs = {**given, **layout, "selected": selected}  # None where the kernel has none
        grad = _validate.out_array("grad_out", grad_out, logp.shape, logp.dtype, inputs)
    outputs = np.empty((len(row_outputs), rows.n_rows))
    token = logp.dtype.type  # the per-token arithmetic runs in the input dtype
    _backend.run(
        kernel,
        backend,
        logprobs=logp.ravel(),
        old_logprobs=checked[1].ravel(),
        advantages=checked[2].ravel(),
        weights=weights,
        **rows.arguments,
        scales=scales.astype(logp.dtype),
        **{name: token(value) for name, value in scalars.items()},
        **(codes or {}),
        grad=grad.ravel(),
        **dict(zip(row_outputs, outputs, strict=True)),
        **extra,
    )
    return grad, _totals(outputs, scales), valid


def _common_scalar_names(kernel: str) -> tuple[str, ...]:
    """The scalars and codes of ``kernel``'s common-case entry, in its order: the arguments
    between the normaliser and the outputs (``Kernel.common_arguments``)."""
    arguments = KERNELS[kernel].common_arguments
    first_output = KERNELS[kernel].outputs[0].name
    return arguments[arguments.index("normaliser") + 1 : arguments.index(first_output)]


# Each loss's common-entry scalars by name, in the entry's order.
_COMMON_SCALARS = {
    name: _common_scalar_names(name) for name, k in KERNELS.items() if k.common and k.aggregates
}


def _run_common(
    kernel: str,
    inputs: tuple[np.ndarray, np.ndarray, np.ndarray],
    mask: np.ndarray | None,
    agg: tuple[int, float],
    grad_out: np.ndarray | None,
    backend: str | None,
    scalars: dict[str, float],
    codes: dict[str, int] | None,
    selected: np.ndarray | None = None,
) -> tuple[np.ndarray, list[float], float]:
    """``_run`` in the common case, checked by the caller: the same arrays and scalars handed to
    the backend's common-case entry (``_backend.common``; for packed rows, ``mask`` their (starts,
    spans), its packed entry) with the aggregation mode's code and normaliser (``agg``, from
    ``loss._common_agg``), which counts the valid tokens, scales the
    rows and totals the row outputs as the general way does (tests/test_fast_path.py compares
    the two). The entry is called positionally, as ``clipped_surrogate``'s fast path calls its
    own: a dict of its arguments by name cost 3 of a 6.5 us call at 8 x 128."""
    logprobs = inputs[0]
    shape, dtype = logprobs.shape, logprobs.dtype
    token = dtype.type  # the per-token arithmetic runs in the input dtype
    if grad_out is not None:
        grad = grad_out
    else:  # as loss._clipped_surrogate_common's
        empty = np.empty if logprobs.nbytes < _result_arrays.POOLED_BYTES else _result_arrays.empty
        grad = empty(shape, dtype)
    check_temperatures(scalars, dtype)
    codes = codes or {}
    values = [
        token(scalars[name]) if name in scalars else codes[name] for name in _COMMON_SCALARS[kernel]
    ]
    if type(mask) is tuple:  # packed rows' (starts, spans)
        entry, n_threads = _backend.packed_common(kernel, backend, dtype, mask, shape[0])
    else:
        n_threads = _threads.threads_for(shape[0], shape[0] * shape[1])
        entry = _backend.common(kernel, backend, n_threads, dtype, mask is not None)
    if selected is None:
        arrays = (*inputs, _NO_WEIGHTS[dtype], mask)
    else:  # KL-Cov's selection, a bool array's own bytes, as the general way's flags
        arrays = (*inputs, _NO_WEIGHTS[dtype], selected, mask)
    valid, *totals = entry(*arrays, *agg, *values, grad, n_threads)
    return grad, totals, valid


def _selection(selected: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A token selection as a bool array shaped like ``logprobs``: bool, or integers of 0/1."""
    if selected is None:
        raise TypeError(
            "selected must be an array shaped like logprobs (True where the token was picked): "
            "get one from ppo_fast.kl_cov_selection or ppo_fast.clip_cov_selection"
        )
    array = np.asarray(selected)
    if array.shape != shape:
        raise ValueError(
            f"selected has shape {array.shape} but logprobs has shape {shape}: pass the "
            "selection computed on these logprobs (one flag per token, in their layout)"
        )
    if array.dtype == np.bool_:
        return array
    if np.issubdtype(array.dtype, np.integer) and np.isin(array, (0, 1)).all():
        return array != 0
    raise TypeError(
        f"selected must be bool (or integers 0/1), got {array.dtype}: pass the selection's "
        "flags, e.g. selected.astype(bool) for a 0/1 array"
    )


_COMMON = """
    logprobs, old_logprobs, advantages
        The log-probabilities of the sampled tokens under the policy being trained and under the
        policy that sampled them, and the advantages: (B, T) padded or (N,) packed with
        ``cu_seqlens``; float32 or float64, one dtype.
    mask, lengths, cu_seqlens
        At most one, as for ``clipped_surrogate``: a 0/1 (B, T) ``mask``, ``lengths`` (B,), or
        ``cu_seqlens`` (B+1,) for packed arrays; none of them: every position is valid.
    agg, num_tokens, num_seqs, loss_scale
        The aggregation mode and its normaliser, as for ``clipped_surrogate``.
    weights
        Optional per-token weights (rollout importance weights), shaped like ``logprobs``,
        multiplying the per-token loss.
    grad_out
        Optional preallocated gradient (C-contiguous, writeable, shaped like ``logprobs`` with
        its dtype, sharing no memory with an input), returned as the result's ``grad``.
    backend
        "numba", "cython", "python" (the oracle) or "auto"; default: ``set_backend``, else
        ``PPO_FAST_BACKEND``, else "auto".

    Returns
    -------
    PolicyLossResult(loss, grad, clipfrac, clipfrac_lower, approx_kl): the loss (float),
    d loss / d logprobs shaped like ``logprobs`` (0 where not valid) and the statistics (see the
    module docstring; NaN with no valid token).
"""


def reinforce_loss(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    beta: float = 0.0,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """REINFORCE / GPG (-A log pi) with DRO's quadratic penalty when ``beta`` > 0; see the module.

    Parameters
    ----------
    beta
        DRO's penalty on the squared log-ratio (>= 0, finite); 0: plain REINFORCE / GPG, where
        ``old_logprobs`` enters only ``approx_kl`` (pass ``logprobs`` itself when there is no
        sampling policy).
    """
    grad, (loss, kl), valid = _run(
        "reinforce",
        {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "weights": weights,
        },
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale": loss_scale},
        grad_out,
        backend,
        _reinforce_scalars(beta),
        ("row_loss", "row_kl"),
    )
    nothing_clipped = 0.0 if valid else math.nan
    return PolicyLossResult(loss, grad, nothing_clipped, nothing_clipped, _mean(kl, valid))


def cispo_loss(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    log_ratio_clamp: float | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """CISPO: -sg(clip(rho)) * A * log pi; see the module docstring.

    Parameters
    ----------
    clip_low, clip_high
        The ratio is clipped to [1 - clip_low, 1 + clip_high]: clip_low in [0, 1] (1: no lower
        bound), clip_high >= 0 (inf: no upper bound); ``clip_high=None`` means ``clip_low``
        (verl's clip_ratio_low / clip_ratio_high). TRL's CISPO, an upper bound ``epsilon_high``
        on the ratio alone: ``clip_low=1, clip_high=epsilon_high - 1``.
    log_ratio_clamp
        Clamp logprobs - old_logprobs to [-clamp, clamp] before exp (verl: 20; None or inf: no
        clamp).
    """
    grad, (loss, clipped, lower, kl), valid = _run(
        "cispo",
        {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "weights": weights,
        },
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale": loss_scale},
        grad_out,
        backend,
        _cispo_scalars(clip_low, clip_high, log_ratio_clamp),
        ("row_loss", "row_clipped", "row_lower", "row_kl"),
    )
    return PolicyLossResult(
        loss, grad, _mean(clipped, valid), _mean(lower, valid), _mean(kl, valid)
    )


def sapo_loss(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """SAPO: -sigmoid(tau * (rho - 1)) * 4 / tau * A; see the module docstring.

    Parameters
    ----------
    tau_pos, tau_neg
        The gate's temperatures where A > 0 and where A <= 0 (> 0, finite, and so once rounded
        to float32 beside float32 arrays; verl's defaults 1.0 and 1.05). verl aggregates SAPO by
        "seq-mean-token-mean" whatever its loss_agg_mode; here ``agg`` is what you pass.
    log_ratio_clamp
        Clamp logprobs - old_logprobs to [-clamp, clamp] before exp (verl: 20; None or inf: no
        clamp).
    """
    grad, (loss, kl), valid = _run(
        "sapo",
        {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "weights": weights,
        },
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale": loss_scale},
        grad_out,
        backend,
        _sapo_scalars(tau_pos, tau_neg, log_ratio_clamp),
        ("row_loss", "row_kl"),
    )
    nothing_clipped = 0.0 if valid else math.nan
    return PolicyLossResult(loss, grad, nothing_clipped, nothing_clipped, _mean(kl, valid))


def dppo_loss(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    divergence: str = "tv",
    divergence_low: float = 0.2,
    divergence_high: float | None = None,
    ratio_cap: float | None = 20.0,
    log_ratio_clamp: float | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """DPPO: -A * sg(min(rho, cap)) * log pi inside the trust region, 0 outside; see the module.

    With p = exp(logprobs), p_old = exp(old_logprobs), lo = ``divergence_low`` and hi =
    ``divergence_high``, a token is inside (v = 1) when (verl 0.9.1's masks):

    - "tv" (DPPO-Binary-TV): p - p_old <= hi where A > 0; p - p_old >= -lo where A <= 0;
    - "kl" (DPPO-Binary-KL): with d = p_old * (old - logp) + (1 - p_old) * log((1 - p_old +
      1e-8) / (1 - p + 1e-8)), the binary KL: d <= hi or p <= p_old where A > 0; d <= lo or p
      >= p_old where A <= 0. d is evaluated in float64 (p and p_old too) and compared with the
      bounds in float64; p <= p_old is read as logp <= old (exp is increasing). In float32 the two
      terms of d cancel below their rounding wherever |p - p_old| < about 3e-4: verl's float32
      expression finds d <= 0 for about 15% of such tokens, whose binary KL is positive, so
      with a bound of 0 (or any bound below about 1e-7) its region is decided by rounding
      there; here it is not.

    v multiplies the token's loss and gradient, so a NaN there stays NaN.

    Parameters
    ----------
    divergence
        "tv" or "kl".
    divergence_low, divergence_high
        The region's bounds (>= 0; inf: no bound); ``divergence_high=None`` means
        ``divergence_low`` (verl's clip_ratio_low / clip_ratio_high, read as divergences).
    ratio_cap
        The ratio is truncated at this value before it weighs the token (> 0; None or inf: no
        cap; verl's clip_ratio_c: its DPPO takes 20 when the config has none, and its
        ActorConfig sets 3).
    log_ratio_clamp
        Clamp logprobs - old_logprobs to [-clamp, clamp] before exp (verl: 20; None or inf: no
        clamp); the probabilities are exp of the unclamped log-probabilities, as verl's.
    """
    scalars = _dppo_scalars(divergence, divergence_low, divergence_high, ratio_cap, log_ratio_clamp)
    # the divergence is a code, an int to the kernels (until 0.8.33 it went in the token dtype,
    # so that the first call after ppo_fast.warmup compiled again)
    codes = {"divergence": scalars.pop("divergence")}
    grad, (loss, outside, capped, kl), valid = _run(
        "dppo",
        {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "weights": weights,
        },
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale": loss_scale},
        grad_out,
        backend,
        scalars,
        ("row_loss", "row_outside", "row_capped", "row_kl"),
        codes,
    )
    return PolicyLossResult(
        loss, grad, _mean(outside, valid), _mean(capped, valid), _mean(kl, valid)
    )


def kl_cov_loss(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    selected: ArrayLike,
    *,
    coef: float = 1.0,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """KL-Cov: -A * rho, plus coef * |logp - old| at the selected tokens; see the module.

    Parameters
    ----------
    selected
        bool (or 0/1 integers) shaped like ``logprobs``: the tokens that get the penalty
        (``ppo_fast.kl_cov_selection``); a selected position that is not valid is ignored.
    coef
        The penalty's coefficient (>= 0, finite; verl's ppo_kl_coef). The default is what
        verl's compute_policy_loss_kl_cov takes when its config has none; verl's
        PolicyLossConfig sets 0.1.
    """
    coef = _validate.scalar("coef", coef, lo=0.0)
    grad, (loss, penalised, abs_kl), valid = _run(
        "kl_cov",
        {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "weights": weights,
        },
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale": loss_scale},
        grad_out,
        backend,
        {"coef": coef},
        ("row_loss", "row_penalised", "row_abs_kl"),
        selected=selected,
    )
    if coef == 0.0:  # nothing is penalised, whatever is selected: count the selection itself
        penalised = _selected_count(selected, logprobs, mask, lengths, cu_seqlens)
    nothing = 0.0 if valid else math.nan
    return PolicyLossResult(loss, grad, _mean(penalised, valid), nothing, _mean(abs_kl, valid))


def _selected_count(selected, logprobs, mask, lengths, cu_seqlens) -> float:
    shape = np.shape(logprobs)
    valid = valid_positions(shape, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
    return float(np.count_nonzero(_selection(selected, shape).ravel() & valid))


def clip_cov_loss(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    selected: ArrayLike,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    log_ratio_clamp: float | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """Clip-Cov: PPO's clipped surrogate with the selected tokens dropped; see the module.

    Runs ``clipped_surrogate`` (no dual clip) with the weights 0 at the selected tokens (times
    ``weights``): a dropped token's loss and gradient are 0 (0 * w: a NaN weight there stays
    NaN, as in verl) and it still counts in the aggregation's denominators.

    Parameters
    ----------
    selected
        bool (or 0/1 integers) shaped like ``logprobs``: the tokens to drop
        (``ppo_fast.clip_cov_selection``).
    clip_low, clip_high, log_ratio_clamp
        As for ``clipped_surrogate`` (verl's Clip-Cov clamps nothing: the default).
    """
    shape = np.shape(logprobs)
    # the inputs clipped_surrogate does not see (it gets weights made here) lie apart too
    _validate.apart("grad_out", grad_out, {"selected": selected, "weights": weights})
    keep = ~_selection(selected, shape)
    if weights is None:
        kept = keep.astype(np.result_type(np.asarray(logprobs).dtype, np.float32))
    elif np.shape(weights) == shape:
        given = np.asarray(weights)
        kept = keep.astype(given.dtype) * given  # in the weights' dtype, which is checked next
    else:
        kept = weights  # for clipped_surrogate's error about their shape
    result = clipped_surrogate(
        logprobs,
        old_logprobs,
        advantages,
        mask=mask,
        lengths=lengths,
        cu_seqlens=cu_seqlens,
        clip_low=clip_low,
        clip_high=clip_high,
        log_ratio_clamp=log_ratio_clamp,
        agg=agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale=loss_scale,
        weights=kept,
        grad_out=grad_out,
        backend=backend,
    )
    dropped = _selected_count(selected, logprobs, mask, lengths, cu_seqlens)
    valid = _selected_count(np.ones(shape, dtype=bool), logprobs, mask, lengths, cu_seqlens)
    return PolicyLossResult(
        result.loss, result.grad, _mean(dropped, valid), 0.0 if valid else math.nan,
        result.approx_kl,
    )  # fmt: skip


def gspo_loss(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    form: str = "detached",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_max: float | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    agg: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """GSPO: the clipped surrogate on each row's sequence ratio exp(mean log-ratio); see the
    module docstring for the loss and both gradients.

    Parameters
    ----------
    form
        "detached" (verl: each token's gradient is its own term's) or "sequence" (TRL, OpenRLHF:
        the ratio's derivative reaches every token of the row).
    clip_low, clip_high
        The sequence ratio is clipped to [1 - clip_low, 1 + clip_high]: clip_low in [0, 1],
        clip_high >= 0 (inf: no upper bound); ``clip_high=None`` means ``clip_low``. (The GSPO
        paper's are 3e-4 and 4e-4, for a ratio that stays near 1.)
    dual_clip
        c > 1: bound the objective below by c * A where A < 0 (OpenRLHF's dual clip; TRL's
        ``delta`` when delta >= 1 + clip_high); None or inf: no dual clip.
    log_ratio_max
        Clamp the mean log-ratio above before exp (verl: 10; None or inf: no clamp); any real
        number.
    """
    grad, (loss, clipped, lower, kl), valid = _run(
        "gspo",
        {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "weights": weights,
        },
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale": loss_scale},
        grad_out,
        backend,
        _gspo_scalars(clip_low, clip_high, dual_clip, log_ratio_max),
        ("row_loss", "row_clipped", "row_lower", "row_kl"),
        {"form": _gspo_form(form)},
    )
    return PolicyLossResult(
        loss, grad, _mean(clipped, valid), _mean(lower, valid), _mean(kl, valid)
    )


def geo_mean_loss(
    logprobs: ArrayLike,
    old_logprobs: ArrayLike,
    advantages: ArrayLike,
    *,
    clip_low: float = 0.4,
    clip_high: float | None = None,
    mask: ArrayLike | None = None,
    lengths: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    agg: Aggregation = "seq-mean-token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale: float | None = None,
    weights: ArrayLike | None = None,
    grad_out: np.ndarray | None = None,
    backend: str | None = None,
) -> PolicyLossResult:
    """verl's geometric-mean loss (GMPO): -mean(A) * exp(mean clipped log-ratio) per row; see
    the module docstring.

    Parameters
    ----------
    clip_low, clip_high
        Bounds on the log-ratio itself (not the ratio): [-clip_low, clip_high], >= 0 (inf: no
        bound); ``clip_high=None`` means ``clip_low``. verl passes its clip_ratio_low /
        clip_ratio_high; the GMPO paper's are 0.4.
    weights
        Here each row's loss is multiplied by the geometric mean of its tokens' weights (verl's
        ``rollout_is_weights``, which verl offsets by 1e-10 inside the log: pass ``weights +
        1e-10`` for that).
    """
    grad, (loss, upper, lower, kl), valid = _run(
        "geo_mean",
        {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "weights": weights,
        },
        {"mask": mask, "lengths": lengths, "cu_seqlens": cu_seqlens},
        {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale": loss_scale},
        grad_out,
        backend,
        _geo_mean_scalars(clip_low, clip_high),
        ("row_loss", "row_clipped", "row_lower", "row_kl"),
    )
    return PolicyLossResult(loss, grad, _mean(upper, valid), _mean(lower, valid), _mean(kl, valid))


for _function in (
    reinforce_loss,
    cispo_loss,
    sapo_loss,
    gspo_loss,
    geo_mean_loss,
    dppo_loss,
    kl_cov_loss,
    clip_cov_loss,
):
    # One text for the parameters every loss of the family shares.
    _doc = _function.__doc__ or ""
    _head, _, _own = _doc.partition("    Parameters\n    ----------\n")
    _function.__doc__ = _head + "    Parameters\n    ----------\n" + _own.rstrip() + "\n" + _COMMON
