"""Each policy loss's hyperparameters, checked, as its kernel takes them (float64; the numpy
stages in ``policy.py`` cast them to the input dtype), and as ``ppo_fast.torch`` hands them to its
torch formulas: one place for both, so that a bad setting gets the same error either way."""

from __future__ import annotations

import math

import numpy as np

from . import _validate
from ._spec import DIVERGENCES, GSPO_FORMS


def _log_ratio_clamp(log_ratio_clamp: float | None) -> float:
    if log_ratio_clamp is None:
        return math.inf
    return _validate.scalar(
        "log_ratio_clamp", log_ratio_clamp, lo=0.0, open_lo=True, allow_inf=True
    )


def _ratio_bounds(clip_low: float, clip_high: float | None) -> dict[str, float]:
    """The trust region [1 - clip_low, 1 + clip_high] of the ratio: clip_low in [0, 1],
    clip_high >= 0 (inf: no upper clip; None: clip_low)."""
    low = _validate.scalar("clip_low", clip_low, lo=0.0, hi=1.0)
    high = (
        low
        if clip_high is None
        else _validate.scalar("clip_high", clip_high, lo=0.0, allow_inf=True)
    )
    return {"ratio_low": 1.0 - low, "ratio_high": 1.0 + high}


def _dual_clip(dual_clip: float | None) -> float:
    if dual_clip is None:
        return math.inf
    return _validate.scalar("dual_clip", dual_clip, lo=1.0, open_lo=True, allow_inf=True)


def _surrogate_scalars(
    clip_low: float,
    clip_high: float | None,
    dual_clip: float | None,
    log_ratio_clamp: float | None,
) -> dict[str, float]:
    """The clipped surrogate's (``ppo_fast.loss``)."""
    return {
        **_ratio_bounds(clip_low, clip_high),
        "dual_clip": _dual_clip(dual_clip),
        "log_ratio_clamp": _log_ratio_clamp(log_ratio_clamp),
    }


def _reinforce_scalars(beta: float) -> dict[str, float]:
    return {"beta": _validate.scalar("beta", beta, lo=0.0)}


def _cispo_scalars(
    clip_low: float, clip_high: float | None, log_ratio_clamp: float | None
) -> dict[str, float]:
    return {
        **_ratio_bounds(clip_low, clip_high),
        "log_ratio_clamp": _log_ratio_clamp(log_ratio_clamp),
    }


def _sapo_scalars(
    tau_pos: float, tau_neg: float, log_ratio_clamp: float | None
) -> dict[str, float]:
    return {
        "tau_pos": _validate.scalar("tau_pos", tau_pos, lo=0.0, open_lo=True),
        "tau_neg": _validate.scalar("tau_neg", tau_neg, lo=0.0, open_lo=True),
        "log_ratio_clamp": _log_ratio_clamp(log_ratio_clamp),
    }


def check_temperatures(scalars: dict[str, float], dtype: np.dtype) -> None:
    """SAPO's temperatures (``_sapo_scalars``: > 0 and finite in float64) as its kernels take
    them, rounded to the loss's ``dtype``, are so there too: the gate divides by tau, and beside
    float32 arrays a tau of 1e-46 rounds to 0 (the oracle's 4 / tau raised ZeroDivisionError) and
    one of 1e39 to inf. Nothing for the other losses' scalars, which float32 holds or makes a
    bound inf, nor for float64's."""
    if "tau_pos" not in scalars or dtype != np.float32:
        return
    for name in ("tau_pos", "tau_neg"):
        value = scalars[name]
        if not _FLOAT32_ROUNDS_TO_ZERO < value < _FLOAT32_ROUNDS_TO_INF:
            rounded = "0" if value <= _FLOAT32_ROUNDS_TO_ZERO else "inf"
            raise ValueError(
                f"{name}={value!r} is {rounded} in float32, the dtype of the loss's arrays (in "
                "which it runs): a temperature lies in [1.4e-45, 3.4e+38] there"
            )


# float32's rounding to nearest, ties to even: half its smallest subnormal (2**-149) becomes 0, and
# the midpoint of its largest value (2**128 - 2**104) and 2**128 becomes inf.
_FLOAT32_ROUNDS_TO_ZERO = 2.0**-150
_FLOAT32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def _gspo_scalars(
    clip_low: float,
    clip_high: float | None,
    dual_clip: float | None,
    log_ratio_max: float | None,
) -> dict[str, float]:
    bounds = _ratio_bounds(clip_low, clip_high)
    dual = _dual_clip(dual_clip)
    cap = (
        math.inf
        if log_ratio_max is None
        else _validate.scalar("log_ratio_max", log_ratio_max, allow_inf=True)
    )
    if cap == -math.inf:
        raise ValueError(
            "log_ratio_max is -inf, which makes every ratio 0: pass a real number or None "
            "(no clamp)"
        )
    return {**bounds, "dual_clip": dual, "log_ratio_max": cap}


def _geo_mean_scalars(clip_low: float, clip_high: float | None) -> dict[str, float]:
    low = _validate.scalar("clip_low", clip_low, lo=0.0, allow_inf=True)
    high = (
        low
        if clip_high is None
        else _validate.scalar("clip_high", clip_high, lo=0.0, allow_inf=True)
    )
    return {"log_ratio_low": low, "log_ratio_high": high}


def _gspo_form(form: str) -> int:
    if form not in GSPO_FORMS:
        raise ValueError(
            f"form must be one of {', '.join(map(repr, GSPO_FORMS))}, got {form!r}: 'detached' "
            "for verl's gradient, 'sequence' for TRL's and OpenRLHF's"
        )
    return GSPO_FORMS.index(form)


def _dppo_scalars(
    divergence: str,
    divergence_low: float,
    divergence_high: float | None,
    ratio_cap: float | None,
    log_ratio_clamp: float | None,
) -> dict[str, float]:
    low = _validate.scalar("divergence_low", divergence_low, lo=0.0, allow_inf=True)
    high = (
        low
        if divergence_high is None
        else _validate.scalar("divergence_high", divergence_high, lo=0.0, allow_inf=True)
    )
    cap = (
        math.inf
        if ratio_cap is None
        else _validate.scalar("ratio_cap", ratio_cap, lo=0.0, open_lo=True, allow_inf=True)
    )
    return {
        "divergence": DIVERGENCES.index(_validate.choice("divergence", divergence, DIVERGENCES)),
        "divergence_low": low,
        "divergence_high": high,
        "ratio_cap": cap,
        "log_ratio_clamp": _log_ratio_clamp(log_ratio_clamp),
    }
