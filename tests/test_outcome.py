"""Outcome estimators: each against a plain-Python oracle over generated batches, against the
real peers (verl's loop and vectorised functions, OpenRLHF's and TRL's formulas) with the options
that reproduce them, in every layout, and on hostile input."""

from __future__ import annotations

import math
import uuid
from collections import Counter, defaultdict

import numpy as np
import pytest
from conftest import RTOL, assert_matches_oracle
from hypothesis import given
from hypothesis import strategies as st

import ppo_fast
from ppo_fast import _outcome_groups
from ppo_fast._groups import factorize

# ---- the oracle: plain Python, float64, one group at a time ------------------------------------


def _members(labels, x, nan):
    """label -> the rows of the group, and the rows whose score enters its statistics."""
    if nan == "raise" and any(math.isnan(v) for v in x):
        raise ValueError("scores[...] is NaN")
    rows = defaultdict(list)
    for b, label in enumerate(labels):
        rows[label].append(b)
    used = {
        label: [b for b in members if not (nan == "omit" and math.isnan(x[b]))]
        for label, members in rows.items()
    }
    return rows, used


def _mean(values):
    return sum(values) / len(values) if values else math.nan


def _variance(values, ddof):
    if len(values) <= ddof:
        return math.nan
    mean = _mean(values)
    return sum((v - mean) * (v - mean) for v in values) / (len(values) - ddof)


def _alone(singleton):
    if singleton == "error":
        raise ValueError("a group of one")


def oracle_grpo(
    scores,
    labels,
    *,
    std="group",
    eps=1e-6,
    eps_in_sqrt=False,
    ddof=1,
    singleton="raw",
    nan="propagate",
):
    x = [float(v) for v in scores]
    rows, used = _members(labels, x, nan)
    kept = [v for v in x if not (nan == "omit" and math.isnan(v))]
    out = [math.nan] * len(x)
    for label, members in rows.items():
        values = [x[b] for b in used[label]]
        if len(values) == 1:
            _alone(singleton)
            mean, variance = (0.0 if singleton == "raw" else values[0]), 1.0
        else:
            mean = _mean(values)
            variance = _variance(values if std == "group" else kept, ddof)
        if std is None:
            scale = 1.0
        elif eps_in_sqrt:
            scale = math.sqrt(variance + eps)
        else:
            scale = math.sqrt(variance) + eps
        for b in members:
            out[b] = (x[b] - mean) / scale
    return out


def oracle_rloo(scores, labels, *, singleton="raw", nan="propagate"):
    x = [float(v) for v in scores]
    rows, used = _members(labels, x, nan)
    out = [math.nan] * len(x)
    for label, members in rows.items():
        values = [x[b] for b in used[label]]
        n = len(values)
        for b in members:
            if n == 1:
                _alone(singleton)
                out[b] = x[b] if singleton == "raw" else x[b] - x[b]
            elif n > 1:
                out[b] = x[b] - (sum(values) - x[b]) / (n - 1) if b in used[label] else math.nan
    return out


def oracle_opo(scores, labels, tokens, *, singleton="raw", nan="propagate"):
    x = [float(v) for v in scores]
    rows, used = _members(labels, x, nan)
    out = [math.nan] * len(x)
    for label, members in rows.items():
        if len(used[label]) == 1:
            _alone(singleton)
        total = sum(float(tokens[b]) for b in used[label])
        for b in members:
            if len(used[label]) == 1:
                baseline = 0.0 if singleton == "raw" else x[b]
            elif total == 0:
                baseline = x[b]
            else:
                baseline = sum(float(tokens[j]) * x[j] for j in used[label]) / total
            out[b] = x[b] - baseline
    return out


def oracle_gpg(scores, labels, *, alpha=None, f_norm=1.0, singleton="raw", nan="propagate"):
    x = [float(v) for v in scores]
    if alpha is None:
        counted = [v for v in x if not (nan == "omit" and math.isnan(v))]
        alpha = len(counted) / max(sum(1 for v in counted if v != 0), 1)
    centred = oracle_grpo(scores, labels, std=None, singleton=singleton, nan=nan)
    return [alpha * c / f_norm for c in centred]


def oracle_pass_at_k(
    scores, labels, *, normalize=True, eps=1e-6, ddof=1, singleton="error", nan="propagate"
):
    x = [float(v) for v in scores]
    rows, used = _members(labels, x, nan)
    out = [0.0] * len(x)
    for label, members in rows.items():
        values = [x[b] for b in used[label]]
        if len(values) == 1:
            _alone(singleton)
            b = used[label][0]
            out[b] = (
                (x[b] / (1 + eps) if normalize else x[b]) if singleton == "raw" else x[b] - x[b]
            )
        elif len(values) > 1:
            ranked = sorted((v for v in values if not math.isnan(v)), reverse=True)
            # With nan="propagate" a NaN may leave fewer than two: the group is NaN below.
            if len(ranked) >= 2 and ranked[0] != ranked[1]:
                best = [b for b in used[label] if x[b] == ranked[0]]
                gap = ranked[0] - ranked[1]
                if normalize:
                    gap /= math.sqrt(_variance(values, ddof)) + eps
                out[best[0]] = gap
        if any(math.isnan(x[b]) for b in members):
            for b in members:
                if nan == "propagate" or math.isnan(x[b]):
                    out[b] = math.nan
    return out


def oracle_whiten(values, tokens, *, unbiased=False, eps=1e-8, counted=None):
    """Whiten per-row values as the tokens they are broadcast onto (row b: tokens[b] copies)."""
    weights = [1.0] * len(values) if tokens is None else [float(n) for n in tokens]
    n_tokens = sum(weights)
    if n_tokens == 0 or (unbiased and n_tokens == 1):
        raise ValueError("whiten: no valid token")
    used = [b for b in range(len(values)) if weights[b] > 0 and (counted is None or counted[b])]
    total = sum(weights[b] for b in used)
    if total == 0:
        return [math.nan] * len(values)
    mean = sum(weights[b] * values[b] for b in used) / total
    denominator = total - 1 if unbiased else total
    variance = (
        sum(weights[b] * (values[b] - mean) * (values[b] - mean) for b in used) / denominator
        if denominator > 0
        else math.nan
    )
    if variance + eps == 0:
        raise ValueError("whiten: the variance is 0 and whiten_eps=0")
    return [(v - mean) / math.sqrt(variance + eps) for v in values]


def oracle_rfpp(
    scores,
    labels,
    tokens,
    *,
    whiten=True,
    unbiased=False,
    whiten_eps=1e-8,
    singleton="raw",
    nan="propagate",
):
    centred = oracle_grpo(scores, labels, std=None, singleton=singleton, nan=nan)
    if not whiten:
        return centred
    counted = [not math.isnan(float(v)) for v in scores] if nan == "omit" else None
    return oracle_whiten(centred, tokens, unbiased=unbiased, eps=whiten_eps, counted=counted)


def oracle_gdpo(
    scores,
    labels,
    tokens,
    *,
    weights=None,
    whiten=True,
    unbiased=False,
    whiten_eps=1e-8,
    nan="propagate",
    **grpo_options,
):
    n_rows, n_keys = scores.shape
    scores = scores.astype(np.float64).tolist()
    weights = [1.0] * n_keys if weights is None else [float(w) for w in weights]
    if nan == "raise" and any(math.isnan(v) for row in scores for v in row):
        raise ValueError("scores[...] is NaN")
    columns = [
        oracle_grpo([row[k] for row in scores], labels, nan=nan, **grpo_options)
        for k in range(n_keys)
    ]
    combined, counted = [], []
    for b in range(n_rows):
        present = [k for k in range(n_keys) if not (nan == "omit" and math.isnan(scores[b][k]))]
        counted.append(bool(present))
        combined.append(sum(weights[k] * columns[k][b] for k in present) if present else math.nan)
    if not whiten:
        return combined
    return oracle_whiten(
        combined,
        tokens,
        unbiased=unbiased,
        eps=whiten_eps,
        counted=counted if nan == "omit" else None,
    )


# ---- generated batches ---------------------------------------------------------------------------

LABEL_KINDS = {
    "int": st.integers(-5, 40),
    "huge": st.sampled_from([10**12, -1, -(10**12), 2**62, 0, 7]),
    "str": st.text(alphabet="abcxyz", min_size=1, max_size=4),
    "uuid": st.uuids(),
    "mixed": st.one_of(st.integers(-3, 3), st.text(max_size=2), st.uuids()),
}


@st.composite
def grouped_labels(draw, max_groups=7):
    """Uneven groups (groups of one among them), adjacent or shuffled, of one kind of label."""
    kind = draw(st.sampled_from(sorted(LABEL_KINDS)))
    labels = draw(st.lists(LABEL_KINDS[kind], min_size=0, max_size=max_groups, unique=True))
    sizes = draw(st.lists(st.integers(1, 5), min_size=len(labels), max_size=len(labels)))
    rows = [label for label, size in zip(labels, sizes, strict=True) for _ in range(size)]
    if draw(st.booleans()):
        rows = draw(st.permutations(rows))
    if kind == "int" and draw(st.booleans()):
        return np.array(rows, dtype=np.int64)
    return rows


@st.composite
def scored_batches(draw, keys=None, nan_rate=0.15):
    """(scores, labels): ties (scores from a few values), NaN and now and then inf."""
    labels = draw(grouped_labels())
    n_rows = len(labels)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (n_rows,) if keys is None else (n_rows, keys)
    if draw(st.booleans()):
        scores = rng.choice([0.0, 1.0, 0.5, -1.0], size=shape)
    else:
        scores = rng.normal(size=shape) * draw(st.sampled_from([1.0, 1e-3, 1e4]))
    special = rng.random(shape)
    if draw(st.booleans()):
        scores[special < nan_rate] = np.nan
    if draw(st.integers(0, 5)) == 0:
        scores[(special > 0.95)] = np.inf
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    return scores.astype(dtype), labels


SINGLETON = st.sampled_from(["raw", "zero", "error"])
NAN = st.sampled_from(["propagate", "omit", "raise"])


def check_against(oracle, call, scores):
    """``call()`` equals ``oracle()``, or both raise ValueError."""
    try:
        expected = oracle()
    except ValueError:
        with pytest.raises(ValueError):
            call()
        return
    actual = call()
    dtype = scores.dtype if scores.dtype.kind == "f" else np.dtype(np.float64)
    assert actual.dtype == dtype
    assert_matches_oracle(actual, np.array(expected, dtype=np.float64).astype(dtype), dtype)


@given(
    batch=scored_batches(),
    std=st.sampled_from(["group", "batch", None]),
    eps=st.sampled_from([1e-6, 1e-4, 0.5]),
    eps_in_sqrt=st.booleans(),
    ddof=st.sampled_from([0, 1]),
    singleton=SINGLETON,
    nan=NAN,
)
def test_grpo_equals_the_oracle(batch, std, eps, eps_in_sqrt, ddof, singleton, nan):
    scores, labels = batch
    options = {
        "std": std,
        "eps": eps,
        "eps_in_sqrt": eps_in_sqrt,
        "ddof": ddof,
        "singleton": singleton,
        "nan": nan,
    }
    check_against(
        lambda: oracle_grpo(scores, labels, **options),
        lambda: ppo_fast.grpo(scores, labels, **options),
        scores,
    )


@given(batch=scored_batches(), singleton=SINGLETON, nan=NAN)
def test_rloo_equals_the_oracle(batch, singleton, nan):
    scores, labels = batch
    check_against(
        lambda: oracle_rloo(scores, labels, singleton=singleton, nan=nan),
        lambda: ppo_fast.rloo(scores, labels, singleton=singleton, nan=nan),
        scores,
    )


@given(batch=scored_batches(), singleton=SINGLETON, nan=NAN, data=st.data())
def test_opo_equals_the_oracle(batch, singleton, nan, data):
    scores, labels = batch
    # Zero counts now and then, and groups whose rows hold no token at all.
    tokens = data.draw(st.lists(st.integers(0, 4), min_size=len(labels), max_size=len(labels)))
    check_against(
        lambda: oracle_opo(scores, labels, tokens, singleton=singleton, nan=nan),
        lambda: ppo_fast.opo(scores, labels, token_counts=tokens, singleton=singleton, nan=nan),
        scores,
    )


@given(
    batch=scored_batches(),
    alpha=st.sampled_from([None, 0.5, 3.0]),
    f_norm=st.sampled_from([1.0, 0.25]),
    singleton=SINGLETON,
    nan=NAN,
)
def test_gpg_equals_the_oracle(batch, alpha, f_norm, singleton, nan):
    scores, labels = batch
    options = {"alpha": alpha, "f_norm": f_norm, "singleton": singleton, "nan": nan}
    check_against(
        lambda: oracle_gpg(scores, labels, **options),
        lambda: ppo_fast.gpg(scores, labels, **options),
        scores,
    )


@given(
    batch=scored_batches(),
    normalize=st.booleans(),
    ddof=st.sampled_from([0, 1]),
    singleton=SINGLETON,
    nan=NAN,
)
def test_pass_at_k_equals_the_oracle(batch, normalize, ddof, singleton, nan):
    scores, labels = batch
    options = {"normalize": normalize, "ddof": ddof, "singleton": singleton, "nan": nan}
    check_against(
        lambda: oracle_pass_at_k(scores, labels, **options),
        lambda: ppo_fast.pass_at_k(scores, labels, **options),
        scores,
    )


@given(
    batch=scored_batches(nan_rate=0.05),
    whiten=st.booleans(),
    unbiased=st.booleans(),
    whiten_eps=st.sampled_from([1e-8, 0.0, 0.1]),
    singleton=st.sampled_from(["raw", "zero"]),
    nan=NAN,
    data=st.data(),
)
def test_reinforce_plus_plus_baseline_equals_the_oracle(
    batch, whiten, unbiased, whiten_eps, singleton, nan, data
):
    scores, labels = batch
    tokens = data.draw(
        st.one_of(
            st.none(), st.lists(st.integers(0, 4), min_size=len(labels), max_size=len(labels))
        )
    )
    options = {
        "whiten": whiten,
        "unbiased": unbiased,
        "whiten_eps": whiten_eps,
        "singleton": singleton,
        "nan": nan,
    }
    check_against(
        lambda: oracle_rfpp(scores, labels, tokens, **options),
        lambda: ppo_fast.reinforce_plus_plus_baseline(
            scores, labels, token_counts=tokens, **options
        ),
        scores,
    )


@given(
    batch=scored_batches(keys=3, nan_rate=0.1),
    weighted=st.booleans(),
    whiten=st.booleans(),
    unbiased=st.booleans(),
    std=st.sampled_from(["group", "batch", None]),
    eps_in_sqrt=st.booleans(),
    singleton=st.sampled_from(["raw", "zero"]),
    nan=NAN,
    data=st.data(),
)
def test_gdpo_equals_the_oracle(
    batch, weighted, whiten, unbiased, std, eps_in_sqrt, singleton, nan, data
):
    scores, labels = batch
    tokens = data.draw(st.lists(st.integers(1, 4), min_size=len(labels), max_size=len(labels)))
    options = {
        "weights": [0.5, -2.0, 1.0] if weighted else None,
        "whiten": whiten,
        "unbiased": unbiased,
        "std": std,
        "eps_in_sqrt": eps_in_sqrt,
        "singleton": singleton,
        "nan": nan,
    }
    check_against(
        lambda: oracle_gdpo(scores, labels, tokens, **options),
        lambda: ppo_fast.gdpo(scores, labels, token_counts=tokens, **options),
        scores,
    )


# ---- conventions, by hand ------------------------------------------------------------------------


def test_grpo_by_hand():
    scores = np.array([1.0, 3.0, 10.0, 2.0, 2.0, 5.0])
    labels = ["q1", "q1", "q2", "q3", "q3", "q1"]
    # q1: mean 3, unbiased std 2; q2 alone; q3: std 0.
    advantages = ppo_fast.grpo(scores, labels, eps=1e-6)
    np.testing.assert_allclose(
        advantages, [-2 / (2 + 1e-6), 0.0, 10 / (1 + 1e-6), 0.0, 0.0, 2 / (2 + 1e-6)], rtol=1e-15
    )
    zero = ppo_fast.grpo(scores, labels, singleton="zero")
    assert zero[2] == 0.0
    np.testing.assert_allclose(ppo_fast.grpo(scores, labels, std=None), [-2, 0, 10, 0, 0, 2])
    population = ppo_fast.grpo(scores, labels, ddof=0, eps_in_sqrt=True, eps=0.25)
    np.testing.assert_allclose(population[0], -2 / math.sqrt(8 / 3 + 0.25), rtol=1e-15)
    np.testing.assert_allclose(population[2], 10 / math.sqrt(1.25), rtol=1e-15)
    batch_std = np.std(scores, ddof=1)
    np.testing.assert_allclose(
        ppo_fast.grpo(scores, labels, std="batch")[[0, 3, 5]],
        [-2 / (batch_std + 1e-6), 0.0, 2 / (batch_std + 1e-6)],
        rtol=1e-15,
    )


def test_rloo_opo_gpg_by_hand():
    scores = np.array([1.0, 3.0, 10.0, 5.0])
    labels = [0, 0, 9, 0]
    np.testing.assert_allclose(ppo_fast.rloo(scores, labels), [1 - 4, 3 - 3, 10, 5 - 2])
    assert ppo_fast.rloo(scores, labels, singleton="zero")[2] == 0.0
    tokens = [1, 2, 7, 1]
    baseline = (1 * 1 + 3 * 2 + 5 * 1) / 4
    np.testing.assert_allclose(
        ppo_fast.opo(scores, labels, token_counts=tokens),
        [1 - baseline, 3 - baseline, 10, 5 - baseline],
    )
    np.testing.assert_allclose(ppo_fast.gpg(scores, labels), [-2, 0, 10, 2])
    # alpha = B / (number of nonzero scores): 4 / 2 here.
    np.testing.assert_allclose(
        ppo_fast.gpg(np.array([0.0, 1.0, 0.0, 1.0]), [0, 0, 1, 1], f_norm=0.5),
        np.array([-0.5, 0.5, -0.5, 0.5]) * 2 / 0.5,
    )
    np.testing.assert_allclose(ppo_fast.gpg(scores, labels, alpha=0.5), [-1, 0, 5, 1])
    # With nan="omit", n and m count the scores in the statistics: alpha = 3 / 2 here.
    np.testing.assert_allclose(
        ppo_fast.gpg([1.0, np.nan, 0.0, 2.0], [0, 0, 1, 1], nan="omit"), [1.5, np.nan, -1.5, 1.5]
    )


def test_pass_at_k_by_hand_and_ties():
    scores = np.array([0.0, 1.0, 0.5, 3.0, 3.0, 1.0, 2.0, 2.0])
    labels = ["a", "a", "a", "b", "b", "b", "c", "c"]
    advantages = ppo_fast.pass_at_k(scores, labels)
    std_a = np.std([0.0, 1.0, 0.5], ddof=1)
    np.testing.assert_allclose(advantages, [0, 0.5 / (std_a + 1e-6), 0, 0, 0, 0, 0, 0])
    # The maximum shared ("b", "c"): every row gets 0, whichever row torch.topk designates.
    assert np.array_equal(advantages[3:], np.zeros(5))
    np.testing.assert_allclose(
        ppo_fast.pass_at_k(scores, labels, normalize=False), [0, 0.5, 0, 0, 0, 0, 0, 0]
    )
    with pytest.raises(ValueError, match=r"group 'z' has one score \(row 2\)"):
        ppo_fast.pass_at_k([1.0, 2.0, 3.0], ["y", "y", "z"])
    np.testing.assert_allclose(
        ppo_fast.pass_at_k([1.0, 2.0, 3.0], ["y", "y", "z"], singleton="raw"),
        [0.0, 1 / (math.sqrt(0.5) + 1e-6), 3 / (1 + 1e-6)],
    )


def test_singleton_options():
    scores = np.array([4.0, 1.0, 2.0, np.inf])
    labels = ["alone", "pair", "pair", "inf alone"]
    raw = ppo_fast.grpo(scores, labels)
    assert raw[0] == 4 / (1 + 1e-6) and raw[3] == np.inf
    zero = ppo_fast.grpo(scores, labels, singleton="zero")
    # The baseline is the row's own score: s - s, so 0, and NaN for inf (IEEE).
    assert zero[0] == 0.0 and np.isnan(zero[3])
    for estimator in (ppo_fast.grpo, ppo_fast.rloo, ppo_fast.gpg):
        with pytest.raises(ValueError, match=r"group 'alone' has one score \(row 0\).*singleton="):
            estimator(scores, labels, singleton="error")
    # Every estimator, "zero": the row's own score is its baseline, s - s exactly.
    scores = np.array([0.1, np.inf, 1.0, 2.0, np.nan])
    labels = ["finite", "inf", "pair", "pair", "nan"]
    tokens = [3, 1, 1, 1, 1]
    for estimator in (
        ppo_fast.grpo,
        ppo_fast.rloo,
        ppo_fast.gpg,
        ppo_fast.pass_at_k,
        lambda s, g, **k: ppo_fast.opo(s, g, token_counts=tokens, **k),
        lambda s, g, **k: ppo_fast.reinforce_plus_plus_baseline(s, g, whiten=False, **k),
    ):
        zero = estimator(scores, labels, singleton="zero")
        assert zero[0] == 0.0 and np.isnan(zero[1]) and np.isnan(zero[4])
    with pytest.raises(ValueError, match=r"group 1000000000000 has one score \(row 2\)"):
        ppo_fast.rloo([1.0, 2.0, 3.0], [5, 5, 10**12], singleton="error")


def test_nan_options():
    scores = np.array([1.0, np.nan, 3.0, 5.0, 7.0])
    labels = ["a", "a", "a", "b", "b"]
    propagated = ppo_fast.grpo(scores, labels)
    assert np.isnan(propagated[:3]).all() and np.isfinite(propagated[3:]).all()
    omitted = ppo_fast.grpo(scores, labels, nan="omit")
    assert np.isnan(omitted[1])
    # Statistics over 1 and 3: mean 2, std sqrt(2), as TRL's nanmean and nanstd.
    np.testing.assert_allclose(omitted[[0, 2]], [-1 / (math.sqrt(2) + 1e-6), 1 / (2**0.5 + 1e-6)])
    with pytest.raises(ValueError, match=r"scores\[1\] is NaN: pass nan='omit'"):
        ppo_fast.grpo(scores, labels, nan="raise")
    # A group left with one score is a group of one.
    lone = ppo_fast.rloo(np.array([np.nan, 2.0, 5.0, 7.0]), ["a", "a", "b", "b"], nan="omit")
    assert np.isnan(lone[0]) and lone[1] == 2.0
    with pytest.raises(ValueError, match="one score that is not NaN"):
        ppo_fast.rloo(np.array([np.nan, 2.0]), ["a", "a"], nan="omit", singleton="error")
    with pytest.raises(ValueError, match=r"scores\[1, 0\] is NaN"):
        ppo_fast.gdpo(np.array([[1.0, 2.0], [np.nan, 0.0]]), [0, 0], nan="raise")


def test_variance_is_centred_and_float32_sums_in_float64():
    # E[x^2] - E[x]^2 loses everything here (1e18 against a spread of 1).
    scores = 1e9 + np.array([0.0, 1.0, 2.0])
    np.testing.assert_allclose(ppo_fast.grpo(scores, [0, 0, 0], eps=1e-300), [-1, 0, 1], rtol=1e-12)
    big = np.array([2**24, 1, 1], dtype=np.float32)
    assert ppo_fast.grpo(big, [0, 0, 0], std=None)[1] == np.float32(1 - (2**24 + 2) / 3)


def test_dtypes():
    labels = [0, 0, 1, 1]
    for scores, dtype in (
        (np.array([1, 0, 1, 1], np.float32), np.float32),
        (np.array([1, 0, 1, 1], np.float64), np.float64),
        (np.array([1, 0, 1, 1], np.int32), np.float64),
        (np.array([True, False, True, True]), np.float64),
        ([1, 0, 1, 1], np.float64),
    ):
        for estimator in (ppo_fast.grpo, ppo_fast.rloo, ppo_fast.gpg):
            result = estimator(scores, labels)
            assert result.dtype == dtype
            np.testing.assert_allclose(
                result, estimator(np.asarray(scores, np.float64), labels), rtol=RTOL[result.dtype]
            )
        tokens = ppo_fast.grpo(scores, labels, mask=np.ones((4, 3), bool))
        assert tokens.dtype == dtype and tokens.shape == (4, 3)


def test_groups_of_every_kind_give_the_same_result():
    scores = np.array([0.3, 1.0, -2.0, 0.5, 4.0, 2.0, 1.5])
    u = [uuid.uuid4() for _ in range(3)]
    kinds = [
        [2, 2, 7, 2, 7, 9, 9],
        np.array([2, 2, 7, 2, 7, 9, 9], np.uint8),
        np.array([10**12, 10**12, -1, 10**12, -1, -(10**12), -(10**12)]),
        ["b", "b", "a", "b", "a", "c", "c"],
        np.array(["b", "b", "a", "b", "a", "c", "c"]),
        [u[0], u[0], u[1], u[0], u[1], u[2], u[2]],
        [str(u[0]), str(u[0]), 3, str(u[0]), 3, u[2], u[2]],
        np.array([1.0, 1.0, 5.0, 1.0, 5.0, 3.0, 3.0]),
        factorize([2, 2, 7, 2, 7, 9, 9], 7),
    ]
    expected = ppo_fast.grpo(scores, kinds[0])
    for labels in kinds[1:]:
        assert np.array_equal(ppo_fast.grpo(scores, labels), expected)
        assert np.array_equal(ppo_fast.rloo(scores, labels), ppo_fast.rloo(scores, kinds[0]))


@given(batch=scored_batches(nan_rate=0.0))
def test_shuffling_rows_shuffles_the_advantages(batch):
    scores, labels = batch
    order = np.random.default_rng(len(labels)).permutation(len(labels))
    shuffled = [labels[b] for b in order]
    for estimator in (ppo_fast.grpo, ppo_fast.rloo, ppo_fast.gpg):
        plain = estimator(scores, labels)
        assert_matches_oracle(estimator(scores[order], shuffled), plain[order], scores.dtype)


def test_empty_batch():
    empty = np.zeros(0)
    for estimator in (ppo_fast.grpo, ppo_fast.rloo, ppo_fast.gpg, ppo_fast.pass_at_k):
        assert estimator(empty, []).shape == (0,)
        assert estimator(empty, [], mask=np.zeros((0, 4), bool)).shape == (0, 4)
        assert estimator(empty, [], cu_seqlens=[0]).shape == (0,)
        assert estimator(empty, [], lengths=[], padded_length=3).shape == (0, 3)
    assert ppo_fast.opo(empty, [], token_counts=[]).shape == (0,)
    assert ppo_fast.reinforce_plus_plus_baseline(empty, [], whiten=False).shape == (0,)
    assert ppo_fast.gdpo(np.zeros((0, 2)), [], whiten=False).shape == (0,)
    # Whitening needs a valid token, as ppo_fast.whiten does.
    with pytest.raises(ValueError, match=r"whiten: no valid token.*pass whiten=False"):
        ppo_fast.reinforce_plus_plus_baseline(empty, [])
    with pytest.raises(ValueError, match="whiten: no valid token"):
        ppo_fast.gdpo(np.zeros((0, 2)), [])
    with pytest.raises(ValueError, match="whiten: no valid token"):
        ppo_fast.reinforce_plus_plus_baseline([1.0, 2.0], [0, 0], mask=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="a single valid token and unbiased=True"):
        ppo_fast.reinforce_plus_plus_baseline(
            [1.0, 2.0], [0, 0], lengths=[1, 0], padded_length=2, unbiased=True
        )
    assert ppo_fast.broadcast_to_tokens(empty, cu_seqlens=[0]).shape == (0,)


# ---- layouts ------------------------------------------------------------------------------------

MASK = np.array(
    [
        [0, 1, 1, 0, 1],  # left padding and a hole
        [1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0],  # empty
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ],
    dtype=bool,
)
SCORES = np.array([1.0, 0.0, 2.0, 1.0, 0.5])
LABELS = ["p", "q", "p", "q", "p"]


def layouts():
    """Five rows in each layout (a bool mask, an int mask, a bool mask whose bytes are 7,
    lengths, cu_seqlens): (keywords, the valid positions)."""
    lengths = np.array([4, 0, 2, 5, 1])
    padded = np.arange(5)[None, :] < lengths[:, None]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    yield {"mask": MASK}, MASK
    yield {"mask": MASK.astype(np.int64)}, MASK
    yield {"mask": np.where(MASK, 7, 0).astype(np.uint8).view(bool)}, MASK
    yield {"lengths": lengths, "padded_length": 5}, padded
    yield {"cu_seqlens": cu}, np.ones(int(cu[-1]), bool)


def loop_broadcast(per_row, keywords, shape):
    """One value per row onto its valid tokens, by hand."""
    out = np.zeros(shape, dtype=per_row.dtype)
    if "cu_seqlens" in keywords:
        cu = keywords["cu_seqlens"]
        for b in range(len(per_row)):
            out[cu[b] : cu[b + 1]] = per_row[b]
        return out
    for b in range(len(per_row)):
        for t in range(shape[1]):
            if "mask" in keywords and keywords["mask"][b, t] != 0:
                out[b, t] = per_row[b]
            if "lengths" in keywords and t < keywords["lengths"][b]:
                out[b, t] = per_row[b]
    return out


def token_counts(keywords, valid):
    if "cu_seqlens" in keywords:
        return np.diff(keywords["cu_seqlens"])
    return valid.sum(axis=1)


ESTIMATORS = {
    "grpo": lambda s, g, **k: ppo_fast.grpo(s, g, **k),
    "rloo": lambda s, g, **k: ppo_fast.rloo(s, g, **k),
    "gpg": lambda s, g, **k: ppo_fast.gpg(s, g, **k),
    "pass_at_k": lambda s, g, **k: ppo_fast.pass_at_k(s, g, **k),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layouts_broadcast_the_per_row_advantages(name, dtype):
    scores = SCORES.astype(dtype)
    per_row = ESTIMATORS[name](scores, LABELS)
    for keywords, valid in layouts():
        tokens = ESTIMATORS[name](scores, LABELS, **keywords)
        expected = loop_broadcast(per_row, keywords, valid.shape)
        assert tokens.dtype == dtype and tokens.shape == valid.shape
        assert np.array_equal(tokens, expected), keywords
        assert np.array_equal(ppo_fast.broadcast_to_tokens(per_row, **keywords), expected)


@pytest.mark.parametrize("unbiased", [False, True])
def test_token_weights_come_from_the_layout(unbiased):
    """opo's baseline and the whitening count each row once per valid token: the layout's
    counts, or the same counts given as token_counts for a per-row result."""
    for keywords, valid in layouts():
        counts = token_counts(keywords, valid)
        for estimator, options in (
            (ppo_fast.opo, {}),
            (ppo_fast.reinforce_plus_plus_baseline, {"unbiased": unbiased}),
        ):
            per_row = estimator(SCORES, LABELS, token_counts=counts, **options)
            tokens = estimator(SCORES, LABELS, **keywords, **options)
            assert np.array_equal(tokens, loop_broadcast(per_row, keywords, valid.shape))
        per_row = ppo_fast.gdpo(np.stack([SCORES, -SCORES], 1), LABELS, token_counts=counts)
        tokens = ppo_fast.gdpo(np.stack([SCORES, -SCORES], 1), LABELS, **keywords)
        assert np.array_equal(tokens, loop_broadcast(per_row, keywords, valid.shape))


def test_a_row_without_a_token_is_not_in_the_whitening():
    """Nothing it holds changes a result: here a NaN score, alone in its group."""
    mask = np.ones((5, 3), bool)
    mask[2] = False
    scores = [1.0, 2.0, np.nan, 4.0, 6.0]
    labels = [0, 0, 1, 2, 2]
    advantages = ppo_fast.reinforce_plus_plus_baseline(scores, labels, mask=mask)
    assert np.isfinite(advantages).all() and not advantages[2].any()
    finite = ppo_fast.reinforce_plus_plus_baseline([1.0, 2.0, 0.0, 4.0, 6.0], labels, mask=mask)
    assert np.array_equal(advantages, finite)


def test_whitening_equals_ppo_fast_whiten_of_the_broadcast():
    centred = ppo_fast.reinforce_plus_plus_baseline(SCORES, LABELS, whiten=False)
    for keywords, _ in layouts():
        spread = ppo_fast.broadcast_to_tokens(centred, **keywords)
        # whiten takes T from the shape of its input.
        layout = {name: value for name, value in keywords.items() if name != "padded_length"}
        for unbiased in (False, True):
            expected = ppo_fast.whiten(spread, **layout, unbiased=unbiased, eps=1e-8)
            actual = ppo_fast.reinforce_plus_plus_baseline(
                SCORES, LABELS, **keywords, unbiased=unbiased
            )
            np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


def test_broadcast_out_and_its_checks():
    per_row = np.array([1.5, -2.0, 3.0], np.float32)
    mask = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1]], bool)
    out = np.full((3, 3), np.nan, np.float32)
    result = ppo_fast.broadcast_to_tokens(per_row, mask=mask, out=out)
    assert result is out
    assert np.array_equal(out, [[1.5, 0, 1.5], [0, 0, 0], [3, 3, 3]])
    with pytest.raises(TypeError, match="out has dtype float64 but the result is float32"):
        ppo_fast.broadcast_to_tokens(per_row, mask=mask, out=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="out has shape"):
        ppo_fast.broadcast_to_tokens(per_row, mask=mask, out=np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="broadcast_to_tokens needs a layout"):
        ppo_fast.broadcast_to_tokens(per_row)
    packed = ppo_fast.broadcast_to_tokens(per_row, cu_seqlens=[0, 2, 2, 5])
    assert np.array_equal(packed, [1.5, 1.5, 3, 3, 3])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inputs_are_never_modified(dtype):
    scores = np.array([1.0, np.nan, 3.0, 5.0, 7.0], dtype)
    labels = np.array(["a", "a", "a", "b", "c"])
    mask = np.array([[1, 1], [1, 0], [0, 1], [1, 1], [0, 0]], np.int64)
    groups = factorize(labels, 5)
    keys = np.stack([scores, scores * 2], 1)
    for array in (scores, labels, mask, keys):
        array.flags.writeable = False  # a read-only input is enough, too
    before = [a.copy() for a in (scores, labels, mask, keys, groups.ids)]
    calls = [
        lambda: ppo_fast.grpo(scores, labels, nan="omit", mask=mask),
        lambda: ppo_fast.rloo(scores, groups, nan="omit"),
        lambda: ppo_fast.opo(scores, labels, nan="omit", mask=mask),
        lambda: ppo_fast.gpg(scores, labels, mask=mask),
        lambda: ppo_fast.pass_at_k(scores, labels, singleton="raw", mask=mask),
        lambda: ppo_fast.reinforce_plus_plus_baseline(scores, labels, nan="omit", mask=mask),
        lambda: ppo_fast.gdpo(keys, groups, nan="omit", mask=mask),
        lambda: ppo_fast.broadcast_to_tokens(scores, mask=mask),
    ]
    for call in calls:
        result = call()
        assert not np.shares_memory(result, scores) and not np.shares_memory(result, keys)
    after = [scores, labels, mask, keys, groups.ids]
    for b, a in zip(before, after, strict=True):
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    assert not groups.ids.flags.writeable


# ---- the peers ----------------------------------------------------------------------------------


def _verl():
    pytest.importorskip("torch")
    return pytest.importorskip("verl.trainer.ppo.core_algos")


def verl_batch(seed, kind):
    """scores, labels and a right-padded response mask (every row has a token), and the same
    as verl's token-level rewards (the score on the last valid token)."""
    import torch

    rng = np.random.default_rng(seed)
    n_groups = 5
    sizes = rng.integers(1, 6, n_groups)
    sizes[0] = 1  # a group of one
    names = {
        "int": list(range(100, 100 + n_groups)),
        "str": [str(uuid.uuid4()) for _ in range(n_groups)],
        "uuid": [uuid.uuid4() for _ in range(n_groups)],
    }[kind]
    labels = [names[g] for g in range(n_groups) for _ in range(sizes[g])]
    order = rng.permutation(len(labels))
    labels = np.array([labels[b] for b in order], dtype=object)
    n_rows, width = len(labels), 7
    scores = rng.choice([0.0, 1.0, 0.25, 2.0], n_rows).astype(np.float32)
    lengths = rng.integers(1, width + 1, n_rows)
    mask = np.arange(width)[None, :] < lengths[:, None]
    rewards = np.zeros((n_rows, width), np.float32)
    rewards[np.arange(n_rows), lengths - 1] = scores
    return (
        scores,
        labels,
        mask,
        torch.from_numpy(rewards),
        torch.from_numpy(mask.astype(np.float32)),
    )


def group_sizes(labels):
    """The size of each row's group."""
    sizes = Counter(labels.tolist())
    return np.array([sizes[label] for label in labels.tolist()])


def assert_like_peer(ours, theirs):
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    assert ours.shape == theirs.shape
    scale = max(1.0, float(np.abs(theirs[np.isfinite(theirs)]).max(initial=0.0)))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * scale)


KINDS = pytest.mark.parametrize("kind", ["int", "str", "uuid"])
SEEDS = pytest.mark.parametrize("seed", [0, 1, 2])


@KINDS
@SEEDS
def test_verl_grpo_loop_and_vectorised(kind, seed):
    verl = _verl()
    scores, labels, mask, rewards, response_mask = verl_batch(seed, kind)
    for norm in (True, False):
        std = "group" if norm else None
        ours = ppo_fast.grpo(scores, labels, std=std, eps=1e-6, mask=mask)
        for peer in (
            verl.compute_grpo_outcome_advantage,
            verl.compute_grpo_vectorized_outcome_advantage,
        ):
            advantages = peer(
                rewards, response_mask, labels, epsilon=1e-6, norm_adv_by_std_in_grpo=norm
            )[0]
            assert_like_peer(ours, advantages)
    # verl's vectorised GRPO keeps the loop's groups of one (group_mean_std gives mean 0, std 1):
    # "raw", not "zero", reproduces both.
    row = np.flatnonzero(group_sizes(labels) == 1)[0]
    vectorised = verl.compute_grpo_vectorized_outcome_advantage(rewards, response_mask, labels)[0]
    assert vectorised[row, 0].item() == pytest.approx(scores[row] / (1 + 1e-6), rel=1e-6)


@KINDS
@SEEDS
def test_verl_rloo_loop_and_vectorised(kind, seed):
    verl = _verl()
    scores, labels, mask, rewards, response_mask = verl_batch(seed, kind)
    loop = verl.compute_rloo_outcome_advantage(rewards, response_mask, labels)[0]
    assert_like_peer(ppo_fast.rloo(scores, labels, mask=mask), loop)
    vectorised = verl.compute_rloo_vectorized_outcome_advantage(rewards, response_mask, labels)[0]
    # rloo_vectorized zeroes a group of one (the (c > 1) factor): singleton="zero".
    assert_like_peer(ppo_fast.rloo(scores, labels, singleton="zero", mask=mask), vectorised)


@KINDS
@SEEDS
def test_verl_opo_gpg_passk_rfpp(kind, seed):
    verl = _verl()
    scores, labels, mask, rewards, response_mask = verl_batch(seed, kind)
    assert_like_peer(
        ppo_fast.opo(scores, labels, mask=mask),
        verl.compute_opo_outcome_advantage(rewards, response_mask, labels)[0],
    )
    for f_norm in (1.0, 0.5):
        assert_like_peer(
            ppo_fast.gpg(scores, labels, f_norm=f_norm, mask=mask),
            verl.compute_gpg_outcome_advantage(rewards, response_mask, labels, f_norm=f_norm)[0],
        )
    assert_like_peer(
        ppo_fast.reinforce_plus_plus_baseline(scores, labels, unbiased=True, mask=mask),
        verl.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, response_mask, labels)[
            0
        ],
    )
    with pytest.raises(ValueError, match="at least 2 samples"):
        verl.compute_grpo_passk_outcome_advantage(rewards, response_mask, labels, config={})
    with pytest.raises(ValueError, match="has one score"):
        ppo_fast.pass_at_k(scores, labels, mask=mask)
    keep = group_sizes(labels) > 1  # verl's pass@k refuses a group of one
    for norm in (True, False):
        config = {"norm_adv_by_std_in_grpo": norm}
        theirs = verl.compute_grpo_passk_outcome_advantage(
            rewards[keep], response_mask[keep], labels[keep], config=config
        )[0]
        ours = ppo_fast.pass_at_k(scores[keep], labels[keep], normalize=norm, mask=mask[keep])
        assert_like_peer(ours, theirs)


@SEEDS
def test_verl_gdpo_with_several_reward_keys(seed):
    verl = _verl()
    import torch

    scores, labels, mask, rewards, response_mask = verl_batch(seed, "str")
    n_rows = mask.shape[0]
    rng = np.random.default_rng(seed + 10)
    keys = np.stack([scores, rng.choice([0.0, 1.0], n_rows).astype(np.float32)], 1)
    prompt = 3
    batch = {
        "prompts": torch.zeros(n_rows, prompt, dtype=torch.long),
        "attention_mask": torch.cat(
            [torch.ones(n_rows, prompt, dtype=torch.long), response_mask.long()], 1
        ),
    }
    for weights in (None, [0.7, 2.0]):
        config = {"gdpo_reward_keys": ["accuracy", "format"], "gdpo_reward_weights": weights}
        non_tensor = {"accuracy": keys[:, 0], "format": keys[:, 1]}
        theirs = verl.compute_gdpo_outcome_advantage(
            rewards, response_mask, labels, config=config, non_tensor_batch=non_tensor, batch=batch
        )[0]
        ours = ppo_fast.gdpo(keys, labels, weights=weights, unbiased=True, mask=mask)
        assert_like_peer(ours, theirs)
    # Without reward keys verl's GDPO is GRPO on the one score, whitened.
    assert_like_peer(
        ppo_fast.gdpo(scores[:, None], labels, unbiased=True, mask=mask),
        verl.compute_gdpo_outcome_advantage(rewards, response_mask, labels)[0],
    )


def nanstd(tensor, dim, keepdim):
    """trl.trainer.utils.nanstd (0.29.1), whose module does not import without pandas."""
    import torch

    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction
    std = torch.sqrt(variance)
    return std if keepdim else std.squeeze(dim)


def fixed_groups(seed, n_prompts=4, n_samples=4):
    """A batch as OpenRLHF and TRL see it: n_samples rows per prompt, adjacent."""
    rng = np.random.default_rng(seed)
    scores = rng.choice([0.0, 1.0, 0.5], n_prompts * n_samples)
    scores[:n_samples] = 1.0  # a group with no spread
    labels = np.repeat(np.arange(n_prompts), n_samples)
    return scores, labels


@SEEDS
def test_openrlhf_formulas(seed):
    """openrlhf/trainer/ppo_utils/experience_maker.py (0.11.2), the group baselines and the
    normalisation of reinforce_baseline, written as it computes them."""
    torch = pytest.importorskip("torch")
    scores, labels = fixed_groups(seed)
    n = 4
    rewards = torch.from_numpy(scores).reshape(-1, n)
    group_norm = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)
    assert_like_peer(ppo_fast.grpo(scores, labels, eps=1e-9), group_norm.reshape(-1))
    baseline = (rewards.sum(-1, keepdim=True) - rewards) / (n - 1)
    assert_like_peer(ppo_fast.rloo(scores, labels), (rewards - baseline).reshape(-1))
    dr_grpo = rewards - rewards.mean(-1, keepdim=True)
    assert_like_peer(ppo_fast.grpo(scores, labels, std=None), dr_grpo.reshape(-1))
    # reinforce_baseline: the centred score on every action token, then whitened over them with
    # the population variance clamped at 1e-8.
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 6, len(scores))
    action_mask = torch.from_numpy(np.arange(6)[None, :] < lengths[:, None]).float()
    advantages = dr_grpo.reshape(-1, 1) * action_mask
    num_actions = action_mask.sum()
    mean = (advantages * action_mask).sum() / num_actions
    var = ((advantages - mean).pow(2) * action_mask).sum() / num_actions
    whitened = (advantages - mean) * var.clamp(min=1e-8).rsqrt() * action_mask
    ours = ppo_fast.reinforce_plus_plus_baseline(
        scores, labels, unbiased=False, whiten_eps=0.0, lengths=lengths, padded_length=6
    )
    assert_like_peer(ours, whitened)


@SEEDS
def test_trl_formulas(seed):
    """trl/trainer/grpo_trainer.py and rloo_trainer.py (0.29.1), written as they compute them."""
    torch = pytest.importorskip("torch")
    scores, labels = fixed_groups(seed)
    n = 4
    rewards = torch.from_numpy(scores)
    mean = rewards.view(-1, n).mean(dim=1).repeat_interleave(n, dim=0)
    std_group = rewards.view(-1, n).std(dim=1).repeat_interleave(n, dim=0)
    assert_like_peer(ppo_fast.grpo(scores, labels, eps=1e-4), (rewards - mean) / (std_group + 1e-4))
    std_batch = rewards.std().expand_as(rewards)
    assert_like_peer(
        ppo_fast.grpo(scores, labels, std="batch", eps=1e-4), (rewards - mean) / (std_batch + 1e-4)
    )
    assert_like_peer(ppo_fast.grpo(scores, labels, std=None), rewards - mean)
    # num_generations=1 (evaluation): std 0 and advantage 0, i.e. singleton="zero".
    single = ppo_fast.grpo(scores, np.arange(len(scores)), singleton="zero", eps=1e-4)
    assert np.array_equal(single, np.zeros(len(scores)))
    grouped = rewards.view(-1, n)
    baselines = ((grouped.sum(dim=1, keepdim=True) - grouped) / (n - 1)).view(-1)
    assert_like_peer(ppo_fast.rloo(scores, labels), rewards - baselines)
    # normalize_then_sum: nanmean and nanstd per key and group, a weighted nansum. Group 0 keeps
    # one score of key 0: nanstd makes it NaN and nansum drops it, as singleton="zero" does.
    rng = np.random.default_rng(seed)
    keys = rng.choice([0.0, 1.0, 0.5], (len(scores), 2))
    keys[[1, 2, 3, 6], 0] = np.nan
    keys[9, 1] = np.nan
    grouped = torch.from_numpy(keys).view(-1, n, 2)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, 2)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    summed = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    ours = ppo_fast.gdpo(
        keys, labels, weights=[1.0, 0.5], eps=1e-4, nan="omit", singleton="zero", whiten=False
    )
    assert_like_peer(ours, summed)


# ---- hostile input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (
            lambda: ppo_fast.grpo([1.0, 2.0, 3.0], [0, 0]),
            ValueError,
            r"scores has 3 rows but groups has 2 labels",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], factorize([0, 0, 1], 3)),
            ValueError,
            r"scores has 2 rows but groups has 3 labels",
        ),
        (lambda: ppo_fast.grpo([[1.0, 2.0]], [0]), ValueError, r"scores must be 1-D \(B,\)"),
        (lambda: ppo_fast.gdpo([1.0, 2.0], [0, 0]), ValueError, r"scores must be 2-D \(B, K\)"),
        (lambda: ppo_fast.grpo(["1", "2"], [0, 0]), TypeError, r"scores must hold real numbers"),
        (
            lambda: ppo_fast.grpo(np.ones(2, np.float16), [0, 0]),
            TypeError,
            r"scores must hold real numbers .*astype\(np.float32\)",
        ),
        (lambda: ppo_fast.grpo(np.ones(2, ">f8"), [0, 0]), TypeError, r"native byte order"),
        (lambda: ppo_fast.grpo(np.ones(2, complex), [0, 0]), TypeError, r"scores must hold"),
        (lambda: ppo_fast.grpo([1.0, None], [0, 0]), TypeError, r"scores must hold"),
        (lambda: ppo_fast.grpo([1.0, 2.0], ["a", None]), ValueError, r"groups\[1\] is None"),
        (lambda: ppo_fast.grpo([1.0, 2.0], ["a", float("nan")]), ValueError, r"groups\[1\] is NaN"),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], ["a", ["b"]]),
            TypeError,
            r"groups\[1\] = \['b'\] is not hashable",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], np.array([True, False])),
            TypeError,
            r"groups is a bool array",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], np.array([0.5, 1.0])),
            TypeError,
            r"groups\[0\] = 0.5 is not an integer",
        ),
        (lambda: ppo_fast.grpo([1.0, 2.0], "ab"), TypeError, r"groups must be a sequence"),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], std="all"),
            ValueError,
            r"std must be 'group', 'batch' or None",
        ),
        (lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], eps=0.0), ValueError, r"eps must lie in"),
        (lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], eps=True), TypeError, r"eps must be a real"),
        (lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], ddof=2), ValueError, r"ddof must be 0"),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], ddof=True),
            TypeError,
            r"ddof must be the int 0",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], eps_in_sqrt=1),
            TypeError,
            r"eps_in_sqrt must be True or False",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], singleton="keep"),
            ValueError,
            r"singleton must be one of 'raw', 'zero', 'error'",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], nan="ignore"),
            ValueError,
            r"nan must be one of 'propagate', 'omit', 'raise'",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], mask=np.ones((3, 2))),
            ValueError,
            r"mask must be 2-D \(B, T\) with B = 2, one row per row of scores",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], mask=np.ones(2)),
            ValueError,
            r"mask must be 2-D",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], mask=np.full((2, 2), 2)),
            ValueError,
            r"mask must hold only 0 and 1",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], lengths=[1, 2]),
            ValueError,
            r"lengths needs padded_length=T",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], padded_length=3),
            ValueError,
            r"padded_length .* pass it with lengths only",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], lengths=[1, 4], padded_length=3),
            ValueError,
            r"lengths must lie in \[0, T=3\]",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], lengths=[1, 2], padded_length=2.0),
            TypeError,
            r"padded_length must be an int",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], lengths=[1, 2], padded_length=-1),
            ValueError,
            r"padded_length must be >= 0",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], cu_seqlens=[0, 3]),
            ValueError,
            r"cu_seqlens must have B\+1 = 3 entries, one more than the 2 rows of scores",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], cu_seqlens=[0, 3, 2]),
            ValueError,
            r"cu_seqlens must be non-decreasing",
        ),
        (
            lambda: ppo_fast.grpo([1.0, 2.0], [0, 0], mask=np.ones((2, 2)), cu_seqlens=[0, 1, 2]),
            ValueError,
            r"pass at most one of mask, lengths and cu_seqlens",
        ),
        (
            lambda: ppo_fast.opo([1.0, 2.0], [0, 0]),
            ValueError,
            r"opo weighs each row by its valid tokens: pass token_counts",
        ),
        (
            lambda: ppo_fast.opo([1.0, 2.0], [0, 0], token_counts=[1, 1], mask=np.ones((2, 2))),
            ValueError,
            r"token_counts and a layout",
        ),
        (
            lambda: ppo_fast.opo([1.0, 2.0], [0, 0], token_counts=[1, -1]),
            ValueError,
            r"token_counts\[1\]=-1 is negative",
        ),
        (
            lambda: ppo_fast.opo([1.0, 2.0], [0, 0], token_counts=[1.5, 1.0]),
            TypeError,
            r"token_counts must hold integers",
        ),
        (
            lambda: ppo_fast.opo([1.0, 2.0], [0, 0], token_counts=[1, 2, 3]),
            ValueError,
            r"token_counts must have shape \(2,\)",
        ),
        (lambda: ppo_fast.gpg([1.0, 2.0], [0, 0], alpha=0.0), ValueError, r"alpha must lie in"),
        (
            lambda: ppo_fast.gpg([1.0, 2.0], [0, 0], f_norm=math.inf),
            ValueError,
            r"f_norm must be finite",
        ),
        (
            lambda: ppo_fast.pass_at_k([1.0, 2.0], [0, 0], normalize="yes"),
            TypeError,
            r"normalize must be True or False",
        ),
        (
            lambda: ppo_fast.gdpo(np.ones((2, 2)), [0, 0], weights=[1.0]),
            ValueError,
            r"weights must have shape \(2,\), one weight per reward key",
        ),
        (
            lambda: ppo_fast.gdpo(np.ones((2, 2)), [0, 0], weights=[1.0, math.nan]),
            ValueError,
            r"weights\[1\] must be finite",
        ),
        (
            lambda: ppo_fast.gdpo(np.ones((2, 2)), [0, 0], weights=["a", "b"]),
            TypeError,
            r"weights must hold real numbers",
        ),
        (
            lambda: ppo_fast.gdpo(np.ones((2, 2)), [0, 0], whiten_eps=-1.0),
            ValueError,
            r"whiten_eps must lie in",
        ),
        (
            lambda: ppo_fast.reinforce_plus_plus_baseline(
                [1.0, 1.0], [0, 1], whiten_eps=0.0, singleton="zero"
            ),
            ValueError,
            r"the variance is 0 and whiten_eps=0",
        ),
        (
            lambda: ppo_fast.reinforce_plus_plus_baseline([1.0, 2.0], [0, 0], whiten="no"),
            TypeError,
            r"whiten must be True or False",
        ),
        (
            lambda: ppo_fast.broadcast_to_tokens(np.ones((2, 2)), mask=np.ones((2, 2))),
            ValueError,
            r"per_row must be 1-D",
        ),
    ],
)
def test_bad_input_is_named_with_the_fix(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_options_are_keyword_only():
    for estimator in (ppo_fast.grpo, ppo_fast.rloo, ppo_fast.gpg, ppo_fast.pass_at_k):
        with pytest.raises(TypeError, match="positional"):
            estimator([1.0, 2.0], [0, 0], "group")
    with pytest.raises(TypeError, match="positional"):
        ppo_fast.broadcast_to_tokens([1.0], [[1]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("width", [1, 7, _outcome_groups.NARROW_ROWS - 1, 200])
def test_broadcast_paths_give_the_same_bits(dtype, width, monkeypatch):
    """Narrow rows take repeat-and-AND, wide ones a masked copy: both give +0.0 at every masked
    position whatever the row's value (NaN, inf, -0.0, negative), and the value at valid ones;
    masks whose bool bytes are not 0/1 count as valid."""
    rng = np.random.default_rng(width)
    n_rows = 40
    per_row = rng.standard_normal(n_rows).astype(dtype)
    per_row[:4] = [np.nan, np.inf, -np.inf, -0.0]
    mask = rng.integers(0, 3, (n_rows, width)).astype(np.uint8).view(bool)
    lengths = rng.integers(0, width + 1, n_rows)
    expected = {
        "mask": np.where(mask.view(np.uint8) != 0, per_row[:, None], dtype(0)),
        "lengths": np.where(np.arange(width) < lengths[:, None], per_row[:, None], dtype(0)),
    }
    for narrow in (0, 10**9):
        monkeypatch.setattr(_outcome_groups, "NARROW_ROWS", narrow)
        for name, layout in (("mask", {"mask": mask}), ("lengths", {"lengths": lengths})):
            extra = {"padded_length": width} if name == "lengths" else {}
            tokens = ppo_fast.broadcast_to_tokens(per_row, **layout, **extra)
            bits = np.int32 if dtype == np.float32 else np.int64
            assert np.array_equal(tokens.view(bits), expected[name].view(bits)), (name, narrow)


def test_reinforce_plus_plus_baseline_by_default_whitens_with_the_population_variance():
    scores = np.array([1.0, 0.0, 3.0, 5.0, 2.0, 2.5])
    groups = np.array([0, 0, 1, 1, 1, 2])
    counts = np.array([3, 1, 4, 2, 5, 3])
    centred = scores - np.array([0.5, 0.5, 10 / 3, 10 / 3, 10 / 3, 0.0])  # a group of one: 0
    mean = np.sum(counts * centred) / counts.sum()
    variance = np.sum(counts * (centred - mean) ** 2) / counts.sum()  # n, not n - 1
    expected = (centred - mean) / np.sqrt(variance + 1e-8)
    got = ppo_fast.reinforce_plus_plus_baseline(scores, groups, token_counts=counts)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_opo_gives_a_group_without_tokens_no_baseline():
    # The documented case: a group whose rows hold no token has no weighted baseline, so its
    # rows get s - s = 0; the other groups' baselines are token-weighted means.
    scores = np.array([1.0, 4.0, 2.0, 6.0])
    groups = np.array(["a", "a", "b", "b"])
    got = ppo_fast.opo(scores, groups, token_counts=np.array([0, 0, 1, 3]))
    np.testing.assert_array_equal(got[:2], [0.0, 0.0])
    np.testing.assert_allclose(got[2:], [2.0 - 5.0, 6.0 - 5.0], rtol=1e-15)
