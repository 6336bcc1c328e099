"""The stages' fast paths against the general way: the same bits, the same errors.

``gae`` and ``clipped_surrogate`` recognise the common case (``_validate.common_layout``:
C-contiguous (B, T) NumPy arrays of one float dtype, no mask or a bool one, plain float
hyperparameters) and call the kernel straight away. Turning ``common_layout`` off sends every
call the general way (``batch`` starts from it too), so each test runs a call both ways and
compares: results bit for bit, errors by type and message. That the fast path was taken is
checked, so that no comparison is of the general way with itself.
"""

from __future__ import annotations

import hostile
import numpy as np
import pytest
from conftest import COMPILED

import ppo_fast
from ppo_fast import _backend, _validate

DTYPES = [np.float32, np.float64]


@pytest.fixture
def fast_calls(monkeypatch):
    """The kernels called by a fast path since the fixture started, by name."""
    calls: list[str] = []
    call = _backend.call

    def counted(name, *arguments):
        calls.append(name)
        return call(name, *arguments)

    monkeypatch.setattr(_backend, "call", counted)
    return calls


def general_way(function, **kwargs):
    """``function(**kwargs)`` with the common case turned off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_validate, "common_layout", lambda arrays, mask: None)
        return function(**kwargs)


def masks(rng, shape):
    """No mask, right padding with a fully masked row, holes, and bool bytes other than 0/1."""
    n_rows, width = shape
    lengths = rng.integers(0, width + 1, n_rows)
    if n_rows:
        lengths[0] = 0
    padded = np.arange(width)[None, :] < lengths[:, None]
    holes = rng.random(shape) < 0.7
    odd_bytes = (rng.integers(0, 3, shape).astype(np.uint8) * 127).view(bool)
    return [None, padded, holes, odd_bytes]


def same_bits(fast, general):
    for a, b in zip(fast, general, strict=True):
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()
        else:
            assert np.array_equal(np.float64(a), np.float64(b), equal_nan=True), (a, b)
            assert np.signbit(a) == np.signbit(b)


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_the_fast_path_gives_the_general_ways_bits(backend, dtype, fast_calls):
    rng = np.random.default_rng(12)
    for shape in [(8, 128), (3, 5), (0, 4), (2, 0)]:
        arrays = {name: rng.normal(size=shape).astype(dtype) for name in ("r", "v", "lp", "a")}
        arrays["old"] = arrays["lp"] + rng.normal(scale=0.3, size=shape).astype(dtype)
        for mask in masks(rng, shape):
            for gamma, lam in [(0.99, 0.95), (1.0, 1.0), (-0.0, 0.0)]:
                kwargs = dict(gamma=gamma, lam=lam, mask=mask, backend=backend)
                kwargs.update(rewards=arrays["r"], values=arrays["v"])
                same_bits(ppo_fast.gae(**kwargs), general_way(ppo_fast.gae, **kwargs))
            for clip_high in [None, 0.28, np.inf]:
                kwargs = dict(clip_low=0.2, clip_high=clip_high, mask=mask, backend=backend)
                kwargs.update(logprobs=arrays["lp"], old_logprobs=arrays["old"])
                kwargs.update(advantages=arrays["a"])
                same_bits(
                    ppo_fast.clipped_surrogate(**kwargs),
                    general_way(ppo_fast.clipped_surrogate, **kwargs),
                )
    assert fast_calls.count("gae") == 4 * 4 * 3
    assert fast_calls.count("clipped_surrogate") == 4 * 4 * 3


def _fast_targets():
    """Hostile-input targets whose valid call is a common case: gae without a bootstrap, the
    clipped surrogate without weights, dual clip and clamp (tests/hostile.py's own targets take
    them, which the fast path leaves to the general way)."""

    def gae(rng):
        arrays = hostile._tokens(rng, "rewards", "values")
        return {**arrays, "gamma": 0.99, "lam": 0.95, "mask": hostile.MASK.copy()}

    def policy(rng):
        arrays = hostile._tokens(rng, "logprobs", "old_logprobs", logp=True)
        arrays.update(hostile._tokens(rng, "advantages"))
        return {**arrays, "clip_low": 0.2, "clip_high": 0.28, "mask": hostile.MASK.copy()}

    rows = {"mask": "mask", "layouts": True}
    return [
        hostile.Target(
            "gae[common]",
            ppo_fast.gae,
            gae,
            ("rewards", "values"),
            scalars={"gamma": 0.99, "lam": 0.95},
            per_row=("gamma", "lam"),
            **rows,
        ),
        hostile.Target(
            "clipped_surrogate[common]",
            ppo_fast.clipped_surrogate,
            policy,
            ("logprobs", "old_logprobs", "advantages"),
            scalars={"clip_low": 0.2, "clip_high": 0.28},
            **rows,
        ),
    ]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Casting complex values to real:UserWarning")
@pytest.mark.parametrize("target", _fast_targets(), ids=lambda t: t.name)
def test_hostile_inputs_get_the_same_answer_or_error_both_ways(target, fast_calls):
    backend = COMPILED[0] if COMPILED else "python"
    for case in [hostile.Case("valid", "", hostile._plain), *hostile.cases(target)]:
        kwargs = case.mutate(target.build(np.random.default_rng(3)))
        fast = hostile.run(target, kwargs, backend)
        general = general_way(hostile.run, target=target, kwargs=kwargs, backend=backend)
        assert fast[0] == general[0], case.id(target)
        if fast[0] == "ok":
            for a, b in zip(fast[1], general[1], strict=True):
                assert a.tobytes() == b.tobytes(), case.id(target)
        else:
            assert type(fast[1]) is type(general[1]), case.id(target)
            assert str(fast[1]) == str(general[1]), case.id(target)
    assert target.call.__name__ in fast_calls  # the valid call, at least, went the fast way
