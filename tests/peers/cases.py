"""Batches for the compat parity tests, and the parity check itself.

Every batch is (B, T) with a 0/1 mask in one of the shapes trainers produce: right padding,
left padding, holes (tool or observation tokens inside a response), rows of length 1, and an
empty row. Log-ratios include extreme values (|log ratio| up to 30) so that verl's and OpenRLHF's
clamp at 20, the trust-region clip and the dual clip are all taken. Values at masked positions
are finite: the peers multiply them by 0, which keeps a NaN (parity holds for finite inputs).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

MASKS = ("right-padded", "left-padded", "holes", "length-1-rows", "with-empty-row")
RTOL = {torch.float32: 1e-6, torch.float64: 1e-10}


@dataclass
class Batch:
    mask: torch.Tensor  # int64 0/1
    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    advantages: torch.Tensor
    values: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    rewards: torch.Tensor
    scores: torch.Tensor


def mask_of(kind: str, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    lengths = rng.integers(1, width + 1, rows)
    positions = np.arange(width)[None, :]
    if kind == "right-padded":
        return positions < lengths[:, None]
    if kind == "left-padded":
        return positions >= width - lengths[:, None]
    if kind == "holes":
        mask = (positions < lengths[:, None]) & (rng.random((rows, width)) > 0.3)
        mask[:, 0] = True
        return mask
    if kind == "length-1-rows":
        mask = np.zeros((rows, width), dtype=bool)
        mask[np.arange(rows), rng.integers(0, width, rows)] = True
        mask[0] = positions[0] < width  # one full row, so there is something to whiten
        return mask
    if kind == "with-empty-row":
        mask = (positions >= rng.integers(0, 3, rows)[:, None]) & (positions < lengths[:, None] + 2)
        mask[1] = False
        return mask
    raise ValueError(kind)


def batch(kind: str, dtype=torch.float32, rows: int = 6, width: int = 17, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    mask = mask_of(kind, rows, width, rng)

    def tensor(array):
        return torch.tensor(array, dtype=dtype)

    old = rng.uniform(-3.0, -0.1, (rows, width))
    log_ratio = rng.normal(0.0, 0.4, (rows, width))
    extreme = rng.random((rows, width)) < 0.15
    log_ratio[extreme] = rng.choice([-30.0, -2.0, 1.5, 25.0], int(extreme.sum()))
    advantages = rng.normal(0.0, 1.0, (rows, width))
    values = rng.normal(0.0, 1.0, (rows, width))
    return Batch(
        mask=torch.tensor(mask.astype(np.int64)),
        logprobs=tensor(old + log_ratio),
        old_logprobs=tensor(old),
        ref_logprobs=tensor(old + rng.normal(0.0, 0.5, (rows, width))),
        advantages=tensor(advantages),
        values=tensor(values),
        old_values=tensor(values + rng.normal(0.0, 0.3, (rows, width))),
        returns=tensor(rng.normal(0.0, 1.0, (rows, width))),
        rewards=tensor(rng.normal(0.0, 0.1, (rows, width))),
        scores=tensor(rng.normal(0.0, 1.0, rows)),
    )


def assert_parity(
    actual, expected, what: str = "", dtype: torch.dtype | None = None, rtol: float | None = None
) -> None:
    """Same type, shape and dtype, and equal to RTOL of the dtype (or ``rtol``), judged on the
    scale of the whole array for entries that come out of cancellation (as tests/conftest.py
    does). A Python number (a metric) is judged at RTOL of ``dtype``, the dtype it was computed
    in."""
    if isinstance(expected, float | int):
        assert isinstance(actual, float | int), f"{what}: {type(actual)} is not a number"
        assert dtype is not None, f"{what}: pass the dtype the number was computed in"
        rtol = RTOL[dtype] if rtol is None else rtol
        np.testing.assert_allclose(
            actual, expected, rtol=rtol, atol=rtol * max(1.0, abs(expected)), err_msg=what
        )
        return
    assert isinstance(actual, torch.Tensor), f"{what}: {type(actual)} is not a tensor"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    rtol = RTOL.get(expected.dtype, 1e-6) if rtol is None else rtol
    expected_np = expected.detach().double().numpy()
    finite = np.abs(expected_np[np.isfinite(expected_np)])
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    np.testing.assert_allclose(
        actual.detach().double().numpy(), expected_np, rtol=rtol, atol=rtol * scale, err_msg=what
    )


def signatures(ours, theirs):
    """(ours, theirs) signature pairs to compare: the function's own, or for a class every method
    that ours defines (its ``forward``), and its constructor."""
    if not isinstance(ours, type):
        return [(inspect.signature(ours), inspect.signature(theirs))]
    pairs = []
    for name in ("__init__", *(n for n in vars(ours) if not n.startswith("_"))):
        if callable(getattr(ours, name, None)) and hasattr(theirs, name):
            pairs.append(
                (inspect.signature(getattr(ours, name)), inspect.signature(getattr(theirs, name)))
            )
    return pairs


def assert_same_arguments(ours, theirs, what: str = "") -> None:
    """The same parameters, in the same order, with the same defaults (annotations aside): code
    written against the peer calls ours with the same meaning, defaults included. ``self`` aside:
    a peer's method may be a function of ours (OpenRLHF's get_advantages_and_returns)."""

    def parameters(signature):
        return [
            (p.name, p.kind, p.default) for p in signature.parameters.values() if p.name != "self"
        ]

    for mine, peer in signatures(ours, theirs):
        assert parameters(mine) == parameters(peer), f"{what}: {mine} != {peer}"


# ---- batches of grouped rows, for the critic-free estimators ------------------------------------

# How the rows of a batch fall into groups (the samples of one prompt): each is a list of group
# sizes and whether the rows of a group are adjacent.
GROUPINGS = {
    "adjacent": ([4, 4, 4], False),
    "shuffled": ([4, 4, 4], True),
    "uneven": ([5, 3, 2, 2, 1], True),
    "with-singletons": ([3, 1, 4, 1, 2], False),
    "all-singletons": ([1, 1, 1, 1, 1], False),
}
# How the groups are labelled: verl's trainer uses uuid strings (an object array); integers are
# the other common choice, and huge integers are what verl's vectorised GRPO must not allocate by.
UIDS = ("str", "int", "huge-int")


@dataclass
class GroupBatch:
    mask: torch.Tensor  # int64 0/1 (B, T)
    rewards: torch.Tensor  # (B, T): a score on each row's last valid token, noise everywhere
    index: np.ndarray  # (B,) the rows' group uids
    groups: np.ndarray  # int64 (B,): the group of each row, 0 .. G-1 in first-seen order
    old_log_probs: torch.Tensor  # (B, T)
    sum_pi_squared: torch.Tensor  # (B, T), at least exp(old_log_probs)**2
    is_weights: torch.Tensor  # (B, T)
    baselines: torch.Tensor  # (B,)


def uids_of(kind: str, groups: np.ndarray) -> np.ndarray:
    if kind == "str":
        return np.array([f"prompt-{g:03d}-{(g * 7919) % 1000:03x}" for g in groups], dtype=object)
    if kind == "int":
        return (groups * 7 + 3).astype(np.int64)
    if kind == "huge-int":
        return (groups * 10**9 + 10**12).astype(np.int64)
    raise ValueError(kind)


def group_batch(
    grouping: str,
    kind: str,
    dtype=torch.float64,
    uids: str = "str",
    width: int = 9,
    seed: int = 0,
) -> GroupBatch:
    """Rows in groups (``GROUPINGS``) with a ``kind`` of mask (``MASKS``). The rows of the first
    group of two or more share one reward row, so that their scores are equal (a std of 0); the
    rewards at masked positions are nonzero too (verl sums every position into a score)."""
    rng = np.random.default_rng(seed)
    sizes, shuffled = GROUPINGS[grouping]
    groups = np.repeat(np.arange(len(sizes)), sizes)
    if shuffled:
        groups = groups[rng.permutation(groups.size)]
        # Renumber in first-seen order, as factorisation numbers them.
        first_seen = {g: i for i, g in enumerate(dict.fromkeys(groups.tolist()))}
        groups = np.array([first_seen[g] for g in groups.tolist()], dtype=np.int64)
    rows = groups.size
    mask = mask_of(kind, rows, width, rng)
    rewards = rng.normal(0.0, 0.3, (rows, width))
    last_valid = width - 1 - np.argmax(mask[:, ::-1], axis=1)
    rewards[np.arange(rows), last_valid] += rng.choice([0.0, 1.0, 0.11, 0.7], rows)
    tied = [g for g, size in enumerate(np.bincount(groups)) if size > 1]
    if tied:
        members = np.flatnonzero(groups == tied[0])
        rewards[members] = rewards[members[0]]
    pi = rng.uniform(0.05, 0.95, (rows, width))

    def tensor(array):
        return torch.tensor(array, dtype=dtype)

    return GroupBatch(
        mask=torch.tensor(mask.astype(np.int64)),
        rewards=tensor(rewards),
        index=uids_of(uids, groups),
        groups=groups,
        old_log_probs=tensor(np.log(pi)),
        sum_pi_squared=tensor(pi**2 + rng.uniform(0.0, 0.3, (rows, width))),
        is_weights=tensor(rng.uniform(0.5, 1.5, (rows, width))),
        baselines=tensor(rng.normal(0.0, 0.5, rows)),
    )
