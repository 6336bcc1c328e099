"""Hostile input: every bad argument gets a ValueError or TypeError that names it.

Each case is (id, call, error type, pattern); the pattern must name the argument. Every case runs
on every backend: validation is shared, and no bad input may reach a kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

import ppo_fast

X = np.zeros((2, 3))
X32 = np.zeros((2, 3), dtype=np.float32)
P = np.zeros(5)


def gae(*args, **kwargs):
    return lambda backend: ppo_fast.gae(*args, **kwargs, backend=backend)


def shape(*args, **kwargs):
    return lambda backend: ppo_fast.shape_rewards(*args, **kwargs, backend=backend)


def whiten(*args, **kwargs):
    return lambda backend: ppo_fast.whiten(*args, **kwargs, backend=backend)


def moments(*args, **kwargs):
    return lambda backend: ppo_fast.masked_moments(*args, **kwargs, backend=backend)


def kl(*args, **kwargs):
    return lambda backend: ppo_fast.kl_penalty(*args, **kwargs, backend=backend)


CASES = [
    ("shape-mismatch", gae(X, np.zeros((2, 4))), ValueError, "values has shape"),
    ("3-d", gae(np.zeros((2, 3, 1)), np.zeros((2, 3, 1))), ValueError, "rewards must be 2-D"),
    ("0-d", gae(np.float64(1.0), np.float64(1.0)), ValueError, "rewards must be 2-D"),
    ("int-dtype", gae(np.zeros((2, 3), int), X), TypeError, "rewards must be float32 or float64"),
    ("complex", gae(X, X.astype(complex)), TypeError, "values must be float32 or float64"),
    ("object", gae(X.astype(object), X), TypeError, "rewards must be float32 or float64"),
    ("float16", gae(X.astype(np.float16), X), TypeError, "rewards must be float32"),
    ("mixed-dtypes", gae(X32, X), TypeError, "values is float64 but rewards is float32"),
    ("none-array", gae(None, X), TypeError, "rewards is required"),
    ("strings", gae([["a"]], [["b"]]), TypeError, "rewards must be float32"),
    ("lengths-negative", gae(X, X, lengths=[-1, 2]), ValueError, r"lengths must lie in \[0, T=3\]"),
    # The message names the first length out of range, whichever side it is out on.
    (
        "lengths-named",
        gae(X, X, lengths=[-1, 4]),
        ValueError,
        r"lengths must lie in \[0, T=3\], got lengths\[0\]=-1",
    ),
    ("lengths-too-long", gae(X, X, lengths=[4, 2]), ValueError, r"lengths\[0\]=4"),
    ("lengths-shape", gae(X, X, lengths=[1, 2, 3]), ValueError, r"lengths must have shape \(2,\)"),
    ("lengths-float", gae(X, X, lengths=[1.0, 2.0]), TypeError, "lengths must hold integers"),
    ("lengths-2d", gae(X, X, lengths=[[1, 2]]), ValueError, "lengths must be 1-D"),
    ("cu-not-zero", gae(P, P, cu_seqlens=[1, 5]), ValueError, "cu_seqlens must start at 0"),
    ("cu-decreasing", gae(P, P, cu_seqlens=[0, 3, 2, 5]), ValueError, "non-decreasing"),
    (
        "cu-short",
        gae(P, P, cu_seqlens=[0, 1, 3]),
        ValueError,
        "end at the number of tokens N=5, got 3",
    ),
    # An empty row is no error: the message names the first decrease, after it.
    (
        "cu-decreasing-after-an-empty-row",
        gae(P, P, cu_seqlens=[0, 2, 2, 1, 5]),
        ValueError,
        r"cu_seqlens\[3\]=1 < cu_seqlens\[2\]=2",
    ),
    ("cu-short", gae(P, P, cu_seqlens=[0, 4]), ValueError, "must end at the number of tokens N=5"),
    ("cu-long", gae(P, P, cu_seqlens=[0, 6]), ValueError, "must end at the number of tokens"),
    ("cu-empty", gae(P, P, cu_seqlens=[]), ValueError, "cu_seqlens must have B\\+1 entries"),
    ("cu-float", gae(P, P, cu_seqlens=[0.0, 5.0]), TypeError, "cu_seqlens must hold integers"),
    ("cu-on-2d", gae(X, X, cu_seqlens=[0, 6]), ValueError, "cu_seqlens describes packed 1-D"),
    ("1d-no-layout", gae(P, P), ValueError, "pass cu_seqlens for packed rows"),
    ("empty-1d", gae(np.zeros(0), np.zeros(0)), ValueError, "pass cu_seqlens"),
    ("mask-values", gae(X, X, mask=np.full((2, 3), 2)), ValueError, "mask must hold only 0 and 1"),
    ("mask-nan", gae(X, X, mask=np.full((2, 3), np.nan)), ValueError, "mask must hold only 0"),
    # The message names the first value that is neither 0 nor 1, not the 0s and 1s before it.
    (
        "mask-value-named",
        gae(X, X, mask=[[0, 1, 0], [1, 3, 2]]),
        ValueError,
        r"found (np\.\w+\()?3\b",
    ),
    (
        "mask-negative",
        gae(X, X, mask=[[1, 0, -1], [0, 0, 0]]),
        ValueError,
        r"found (np\.\w+\()?-1\b",
    ),
    ("mask-shape", gae(X, X, mask=np.ones((2, 4))), ValueError, "mask has shape"),
    ("mask-strings", gae(X, X, mask=np.full((2, 3), "1")), TypeError, "mask must be bool"),
    (
        "two-layouts",
        gae(X, X, mask=np.ones((2, 3)), lengths=[1, 1]),
        ValueError,
        "at most one of mask, lengths and cu_seqlens",
    ),
    ("gamma-above-1", gae(X, X, gamma=1.5), ValueError, r"gamma must lie in \[0, 1\]"),
    ("gamma-negative", gae(X, X, gamma=-0.1), ValueError, "gamma must lie in"),
    ("gamma-nan", gae(X, X, gamma=float("nan")), ValueError, "gamma must lie in"),
    ("lam-nan", gae(X, X, lam=float("nan")), ValueError, "lam must lie in"),
    ("lam-row-nan", gae(X, X, lam=np.array([0.5, np.nan])), ValueError, "lam must lie in"),
    ("lam-shape", gae(X, X, lam=np.ones(3)), ValueError, r"lam must be a scalar or have shape"),
    ("lam-string", gae(X, X, lam="0.9"), TypeError, "lam must be a real number"),
    ("bootstrap-shape", gae(X, X, bootstrap=np.ones(3)), ValueError, "bootstrap must"),
    ("bootstrap-scalar", gae(X, X, bootstrap=1.0), ValueError, "bootstrap must have shape"),
    ("scores-shape", shape(np.ones(3), X, X, kl_coef=0.1), ValueError, "scores must"),
    ("scores-scalar", shape(1.0, X, X, kl_coef=0.1), ValueError, "scores must have shape"),
    ("kl-coef-negative", shape(np.ones(2), X, X, kl_coef=-1), ValueError, "kl_coef must lie"),
    ("kl-coef-nan", shape(np.ones(2), X, X, kl_coef=float("nan")), ValueError, "kl_coef"),
    ("kl-coef-string", shape(np.ones(2), X, X, kl_coef="a"), TypeError, "kl_coef must be a real"),
    (
        "estimator",
        shape(np.ones(2), X, X, kl_coef=0.1, estimator="k4"),
        ValueError,
        "estimator must be one of",
    ),
    ("kl-estimator", kl(X, X, "full"), ValueError, "estimator must be one of"),
    ("kl-clamp-zero", kl(X, X, clamp=0.0), ValueError, "clamp must lie in"),
    ("kl-shape", kl(X, np.zeros((3, 2))), ValueError, "ref_logprobs has shape"),
    ("whiten-eps", whiten(X, eps=-1.0), ValueError, "eps must lie in"),
    ("whiten-moments-type", whiten(X, moments=(1, 2, 3)), TypeError, "moments must be"),
    ("whiten-empty", whiten(np.zeros((0, 3))), ValueError, "no valid position"),
    # Only the token arrays are positional: a layout or an option passed by position (is it a
    # mask or lengths?) is refused, not guessed.
    ("moments-positional-mask", moments(X, np.ones((2, 3))), TypeError, "1 positional argument"),
    ("whiten-positional-mask", whiten(X, np.ones((2, 3))), TypeError, "1 positional argument"),
    ("gae-positional-gamma", gae(X, X, 0.9), TypeError, "2 positional arguments"),
    ("shape-positional-coef", shape(np.ones(2), X, X, 0.1), TypeError, "3 positional arguments"),
]


@pytest.mark.parametrize(("case", "call", "error", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(backend, case, call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(backend)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        ppo_fast.gae(X, X, backend="fortran")


def test_inputs_are_never_modified_and_read_only_non_contiguous_inputs_work(backend, dtype):
    rng = np.random.default_rng(0)
    big = rng.normal(size=(4, 12)).astype(dtype)
    rewards, values = big[:, ::2], big[:, 1::2]  # non-contiguous views
    mask = rng.random((4, 6)) < 0.8
    scores = rng.normal(size=4)
    arrays = [big, mask, scores]
    for array in arrays:
        array.flags.writeable = False
    snapshot = [a.copy() for a in arrays]
    shaped = ppo_fast.shape_rewards(
        scores, rewards, values, kl_coef=0.1, mask=mask, backend=backend
    )
    result = ppo_fast.gae(shaped, values, mask=mask, backend=backend)
    expected = ppo_fast.gae(
        np.ascontiguousarray(shaped),
        np.ascontiguousarray(values),
        mask=mask.copy(),
        backend="python",
    )
    np.testing.assert_allclose(result.advantages, expected.advantages, rtol=1e-5)
    ppo_fast.whiten(values, mask=mask, backend=backend)
    ppo_fast.kl_penalty(rewards, values, "k3", backend=backend)
    ppo_fast.masked_moments(values, mask=mask, backend=backend)
    for array, before in zip(arrays, snapshot, strict=True):
        np.testing.assert_array_equal(array, before)


def test_lists_are_accepted_as_arrays(backend):
    result = ppo_fast.gae([[1.0, 0.0]], [[0.5, 0.5]], gamma=1.0, lam=1.0, backend=backend)
    np.testing.assert_allclose(result.advantages, [[0.5, -0.5]])


def test_a_torch_tensor_is_refused_with_the_way_to_pass_it(backend):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"values is a torch tensor: use ppo_fast.torch"):
        ppo_fast.gae(X, torch.zeros(2, 3, dtype=torch.float64), backend=backend)


def test_torch_layouts_and_per_row_values_are_taken_as_their_numbers(backend):
    """Token arrays must be numpy; a layout (lengths, cu_seqlens, mask) or per-row gamma may be a
    tensor (one that requires grad too: it is detached), read as the same numbers."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
    mask = np.array([[1, 1, 0], [1, 0, 1]])
    gamma = np.array([0.9, 0.5])
    for layout in ({"lengths": np.array([3, 1])}, {"mask": mask}):
        expected = ppo_fast.gae(rewards, values, gamma=gamma, **layout, backend=backend)
        as_tensors = {k: torch.from_numpy(v) for k, v in layout.items()}
        actual = ppo_fast.gae(
            rewards,
            values,
            gamma=torch.tensor(gamma, requires_grad=True),
            **as_tensors,
            backend=backend,
        )
        np.testing.assert_array_equal(actual.advantages, expected.advantages)
        np.testing.assert_array_equal(actual.returns, expected.returns)
    flat = rewards.reshape(-1)
    cu = np.array([0, 2, 6])
    expected = ppo_fast.gae(flat, flat, cu_seqlens=cu, backend=backend)
    actual = ppo_fast.gae(flat, flat, cu_seqlens=torch.from_numpy(cu), backend=backend)
    np.testing.assert_array_equal(actual.advantages, expected.advantages)
