"""Preallocated outputs: ``out=`` (and the losses' ``grad_out=``) on every stage returning arrays.

With an out array a stage writes its result there and returns it: the same bits as without.
An out array that cannot take the result (type, dtype, shape, layout, read-only, or sharing memory
with an input or another output) is an error naming it; inputs are never modified.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ppo_fast

SHAPE = (5, 9)


def _batch(dtype: type) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    arrays = {name: rng.standard_normal(SHAPE).astype(dtype) for name in "abc"}
    arrays["mask"] = rng.random(SHAPE) < 0.7
    arrays["mask"][0] = True  # at least one valid position
    arrays["scores"] = rng.standard_normal(SHAPE[0])
    return arrays


# stage name -> (call(batch, **out_keyword), the keyword)
STAGES: dict[str, tuple[Callable[..., Any], str]] = {
    "kl_penalty": (lambda d, **k: ppo_fast.kl_penalty(d["a"], d["b"], "k3", **k), "out"),
    "shape_rewards": (
        lambda d, **k: ppo_fast.shape_rewards(
            d["scores"], d["a"], d["b"], kl_coef=0.1, mask=d["mask"], **k
        ),
        "out",
    ),
    "gae": (lambda d, **k: ppo_fast.gae(d["a"], d["b"], mask=d["mask"], **k), "out"),
    "whiten": (lambda d, **k: ppo_fast.whiten(d["a"], mask=d["mask"], **k), "out"),
    "clipped_surrogate": (
        lambda d, **k: ppo_fast.clipped_surrogate(d["a"], d["b"], d["c"], mask=d["mask"], **k),
        "grad_out",
    ),
    "value_loss": (
        lambda d, **k: ppo_fast.value_loss(d["a"], d["b"], d["c"], mask=d["mask"], clip=0.1, **k),
        "grad_out",
    ),
}


def _filled(result: Any) -> tuple[np.ndarray, ...]:
    """The arrays a stage's out keyword fills, from its result."""
    if isinstance(result, np.ndarray):
        return (result,)
    if isinstance(result, ppo_fast.GAEResult):
        return tuple(result)
    return (result.grad,)


def _outs(result: Any, fill: float = np.nan) -> Any:
    arrays = tuple(np.full_like(array, fill) for array in _filled(result))
    return arrays if isinstance(result, ppo_fast.GAEResult) else arrays[0]


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    if isinstance(x, tuple):
        return all(_same(a, b) for a, b in zip(x, y, strict=True))
    return np.float64(x).tobytes() == np.float64(y).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stage", STAGES)
def test_out_equals_the_call_without_and_is_returned(stage, dtype):
    call, keyword = STAGES[stage]
    batch = _batch(dtype)
    copies = {name: array.copy() for name, array in batch.items()}
    expected = call(batch)
    outs = _outs(expected)
    result = call(batch, **{keyword: outs})
    assert _same(result, expected)
    given_outs = outs if isinstance(outs, tuple) else (outs,)
    for given, filled in zip(given_outs, _filled(result), strict=True):
        assert filled is given
    for name, array in batch.items():
        assert _same(array, copies[name]), f"{stage} modified its input {name}"


def _bad_outs(result: Any, batch: dict[str, Any]) -> list[tuple[str, Any, type, str]]:
    """(case, out value, error type, a pattern of its message)."""
    good = _filled(result)[0]
    other = np.float32 if good.dtype == np.float64 else np.float64
    read_only = np.empty_like(good)
    read_only.flags.writeable = False
    return [
        ("list", good.tolist(), TypeError, "must be a NumPy array"),
        ("dtype", np.empty(good.shape, other), TypeError, "has dtype"),
        ("shape", np.empty((good.shape[0], good.shape[1] + 1), good.dtype), ValueError, "shape"),
        ("F-order", np.asfortranarray(np.empty_like(good)), ValueError, "not C-contiguous"),
        ("read-only", read_only, ValueError, "read-only"),
        ("input", batch["a"], ValueError, "shares memory with"),
        ("view-of-input", batch["a"][:, :], ValueError, "shares memory"),
    ]


@pytest.mark.parametrize("stage", STAGES)
def test_bad_out_is_an_error_naming_it(stage):
    call, keyword = STAGES[stage]
    batch = _batch(np.float32)
    copies = {name: array.copy() for name, array in batch.items()}
    expected = call(batch)
    pair = isinstance(expected, ppo_fast.GAEResult)
    for case, bad, error, pattern in _bad_outs(expected, batch):
        if case == "input" and stage == "kl_penalty":
            bad = batch["b"]  # kl_penalty reads a and b
        if case.endswith("input") and stage == "whiten":
            # out=a (or all of it) whitens in place: tests/test_whiten.py; an overlap without
            # being it is refused there too
            continue
        value = (bad, np.empty_like(expected[1])) if pair else bad
        name = r"out\[0\] \(advantages\)" if pair else keyword
        with pytest.raises(error, match=f"{name}.*{pattern}|{pattern}.*{name}"):
            call(batch, **{keyword: value})
    for name, array in batch.items():
        assert _same(array, copies[name]), f"{stage} modified its input {name}"


def test_gae_out_must_be_a_pair_of_separate_arrays():
    batch = _batch(np.float64)
    with pytest.raises(TypeError, match=r"out must be a tuple \(advantages, returns\)"):
        ppo_fast.gae(batch["a"], batch["b"], out=np.empty(SHAPE))
    with pytest.raises(TypeError, match="out must be a tuple"):
        ppo_fast.gae(batch["a"], batch["b"], out=(np.empty(SHAPE),))
    shared = np.empty(SHAPE)
    with pytest.raises(ValueError, match=r"out\[1\] \(returns\) shares memory with out\[0\]"):
        ppo_fast.gae(batch["a"], batch["b"], out=(shared, shared))
    buffer = np.zeros(SHAPE[0] * SHAPE[1])
    bootstrap = buffer[: SHAPE[0]]  # a per-row input inside the memory of an output
    with pytest.raises(ValueError, match=r"out\[1\] \(returns\) shares memory with bootstrap"):
        ppo_fast.gae(
            batch["a"],
            batch["b"],
            bootstrap=bootstrap,
            out=(np.empty(SHAPE), buffer.reshape(SHAPE)),
        )
    assert not buffer.any()
    # An output that owns its memory, under an input that is a view of it (two arrays that each
    # own theirs cannot overlap; a view can).
    owner = np.zeros(SHAPE)
    with pytest.raises(ValueError, match=r"out\[0\] \(advantages\) shares memory with rewards"):
        ppo_fast.gae(owner[:, :], batch["b"], out=(owner, np.empty(SHAPE)))
    assert not owner.any()


def _inside(out: np.ndarray, values: Any, dtype: type) -> np.ndarray:
    """``values`` as an array of ``dtype`` in the last bytes of ``out``'s memory."""
    values = np.asarray(values, dtype=dtype)
    inner = out.reshape(-1).view(np.uint8)[-values.nbytes :].view(dtype).reshape(values.shape)
    inner[...] = values
    return inner


def test_an_out_array_over_a_selection_weights_or_groups_is_an_error(backend):
    """The inputs beside the token arrays are inputs too: KL-Cov's and Clip-Cov's selection,
    Clip-Cov's weights (it hands clipped_surrogate weights of its own making) and the optimal
    token baseline's groups, inside the memory of an output, are refused, and nothing is written
    (the gradient over the selection once changed the loss and the clip fraction silently)."""
    rng = np.random.default_rng(5)
    logp, old, advantages = (rng.standard_normal(SHAPE) - 1.0 for _ in range(3))
    picked = rng.random(SHAPE) < 0.3
    for loss in (ppo_fast.kl_cov_loss, ppo_fast.clip_cov_loss):
        grad = np.zeros(SHAPE)
        selected = _inside(grad, picked, np.bool_)
        with pytest.raises(ValueError, match="grad_out shares memory with selected"):
            loss(logp, old, advantages, selected, grad_out=grad, backend=backend)
        assert np.array_equal(selected, picked), loss.__name__
    weights = rng.uniform(0.5, 1.5, SHAPE)
    grad = weights.copy()
    with pytest.raises(ValueError, match="grad_out shares memory with weights"):
        ppo_fast.clip_cov_loss(
            logp, old, advantages, picked, weights=grad, grad_out=grad, backend=backend
        )
    assert np.array_equal(grad, weights)
    advantages_out, returns_out = np.empty(SHAPE), np.empty(SHAPE)
    groups = _inside(returns_out, [0, 1, 0, 1, 2], np.int64)
    with pytest.raises(ValueError, match=r"out\[1\] \(returns\) shares memory with groups"):
        ppo_fast.optimal_token_baseline(
            advantages, old, np.abs(logp), groups, out=(advantages_out, returns_out),
            backend=backend,
        )  # fmt: skip
    assert np.array_equal(groups, [0, 1, 0, 1, 2])
