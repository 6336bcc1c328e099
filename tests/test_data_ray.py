"""ppo_fast.data.ray on a local Ray cluster: equal to ppo_fast.data on the whole table.

Ray starts once for the module (two CPUs); the datasets are small, in several blocks, so that the
moments of several blocks are merged and the groups meet across blocks.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from ppo_fast import data  # noqa: E402
from ppo_fast.data import ray as ppo_ray  # noqa: E402

# slow (a local Ray cluster); one cluster at a time: these run on one worker (--dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

# Whitened results: the blocks' moments are merged in another order than one table's batches.
RTOL = 1e-12


# Ray's default shuffle (SHUFFLE_V2: hash partitions by aggregator actors that each groupby starts)
# took 5-7 s a groupby of a few rows on a 2-core machine, most of this module's time; the
# pull-based sort shuffle (tasks) 0.1 s. The groups meet whichever shuffle Ray takes, so the module
# runs the sort shuffle and test_group_local_estimators_by_groupby_equal_one_table also runs under
# Ray's default (``rays_default_shuffle``).
FAST_SHUFFLE = "sort_shuffle_pull_based"


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    default = context.shuffle_strategy
    context.shuffle_strategy = type(default)(FAST_SHUFFLE)
    yield default
    context.shuffle_strategy = default
    ray.shutdown()


@contextlib.contextmanager
def shuffled_by(strategy):
    """Ray Data's shuffle strategy set to ``strategy`` inside the block."""
    context = ray.data.DataContext.get_current()
    before = context.shuffle_strategy
    context.shuffle_strategy = strategy
    try:
        yield
    finally:
        context.shuffle_strategy = before


def rollouts(n_rows: int = 240, seed: int = 3) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 12, n_rows)
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    n = int(lengths.sum())

    def tokens(x):
        return pa.ListArray.from_arrays(offsets, pa.array(x))

    return pa.table(
        {
            "id": np.arange(n_rows),
            "uid": pa.array([f"prompt-{i}" for i in rng.integers(0, 40, n_rows)]),
            "score": rng.normal(size=n_rows),
            "logprobs": tokens(rng.normal(-1, 0.5, n)),
            "ref_logprobs": tokens(rng.normal(-1, 0.5, n)),
            "values": tokens(rng.normal(size=n)),
            "mask": tokens((rng.random(n) > 0.1).astype(np.int8)),
        }
    )


def collected(dataset) -> pa.Table:
    table = pa.concat_tables(ray.get(dataset.to_arrow_refs()))
    return table.sort_by("id")


def flat(table: pa.Table, name: str) -> np.ndarray:
    return table[name].combine_chunks().flatten().to_numpy()


def test_gae_whitened_over_blocks_equals_one_table():
    table = rollouts()
    options = {"estimator": "gae", "kl_coef": 0.1, "lam": 0.9}
    expected = data.advantages(table, columns=data.resolve_columns(mask="mask"), **options)
    dataset = ray.data.from_arrow(table).repartition(4)
    # the default columns: the dataset's mask column, as it has one (IfPresent)
    got = collected(ppo_ray.advantages(dataset, batch_size=50, **options))
    assert got["id"].to_pylist() == list(range(table.num_rows))
    np.testing.assert_array_equal(flat(got, "returns"), flat(expected, "returns"))
    np.testing.assert_allclose(
        flat(got, "advantages"), flat(expected, "advantages"), rtol=RTOL, atol=RTOL
    )


@pytest.mark.parametrize(
    ("estimator", "rays_default_shuffle"), [("grpo", False), ("opo", False), ("grpo", True)]
)
def test_group_local_estimators_by_groupby_equal_one_table(
    estimator, rays_default_shuffle, local_cluster
):
    table = rollouts(n_rows=120, seed=5)
    columns = data.resolve_columns(mask="mask")  # opo weighs by the valid tokens
    expected = data.advantages(table, estimator=estimator, columns=columns)
    strategy = local_cluster if rays_default_shuffle else type(local_cluster)(FAST_SHUFFLE)
    with shuffled_by(strategy):  # a dataset takes the context of when it is made
        dataset = ray.data.from_arrow(table).repartition(2)  # groups spread over both blocks
        assert dataset.context.shuffle_strategy == strategy
        got = collected(
            ppo_ray.advantages(dataset, estimator=estimator, columns=columns, num_partitions=2)
        )
    assert got.num_rows == table.num_rows
    np.testing.assert_allclose(
        flat(got, "advantages"), flat(expected, "advantages"), rtol=RTOL, atol=RTOL
    )
    assert got.select(["id", "score"]).equals(expected.select(["id", "score"]))


def test_remax_over_blocks_equals_one_table_bit_for_bit():
    table = rollouts(n_rows=100, seed=6)
    table = table.append_column("greedy", pa.array(np.linspace(-1.0, 1.0, 100)))
    columns = data.resolve_columns(mask="mask", baseline="greedy")
    options = {"estimator": "remax", "kl_coef": 0.1, "gamma": 0.95, "columns": columns}
    expected = data.advantages(table, **options)
    dataset = ray.data.from_arrow(table).repartition(3)
    got = collected(ppo_ray.advantages(dataset, batch_size=30, **options))
    assert got.equals(expected)


def test_estimators_with_statistics_of_the_whole_batch_equal_one_table():
    # gpg: alpha from every block's row counts; reinforce_plus_plus_baseline: the group means,
    # then the token-weighted moments of every block merged (unbiased, as verl).
    table = rollouts(n_rows=120, seed=7)
    table = table.set_column(2, "score", pa.array(np.where(np.arange(120) % 3, 0.0, 1.0)))
    columns = data.resolve_columns(mask="mask")
    dataset = ray.data.from_arrow(table).repartition(3)
    for estimator, options in (("gpg", {}), ("reinforce_plus_plus_baseline", {"unbiased": True})):
        expected = data.advantages(table, estimator=estimator, columns=columns, **options)
        got = collected(
            ppo_ray.advantages(
                dataset,
                estimator=estimator,
                columns=columns,
                num_partitions=2,
                batch_size=40,
                **options,
            )
        )
        assert got.column_names == expected.column_names
        tolerance = 0 if estimator == "gpg" else RTOL  # gpg's alpha is a ratio of integers
        np.testing.assert_allclose(
            flat(got, "advantages"), flat(expected, "advantages"), rtol=tolerance, atol=tolerance
        )
        assert got.select(["id", "score"]).equals(expected.select(["id", "score"]))


def test_missing_columns_are_refused_before_the_dataset_is_read():
    dataset = ray.data.from_arrow(rollouts(n_rows=10).drop_columns(["values"]))
    with pytest.raises(data.DataError, match="no column 'values' in the dataset"):
        ppo_ray.advantages(dataset, estimator="gae")


def test_missing_columns_are_named_as_ppo_fast_data_names_them():
    # gae with a KL penalty reads both; the first of them in the columns' order is named
    table = rollouts(n_rows=10).drop_columns(["values", "ref_logprobs"])
    with pytest.raises(data.DataError) as one_table:
        data.advantages(table, estimator="gae", kl_coef=0.1)
    first = one_table.value.args[0].split("no column ")[1].split(" ")[0]
    assert first in ("'values'", "'ref_logprobs'")
    with pytest.raises(data.DataError, match=f"no column {first} in the dataset"):
        ppo_ray.advantages(ray.data.from_arrow(table), estimator="gae", kl_coef=0.1)


def test_every_option_is_keyword_only():
    import inspect

    parameters = list(inspect.signature(ppo_ray.advantages).parameters.values())
    assert parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters[1:]), parameters


def test_gpg_with_no_nonzero_score_equals_one_table():
    table = rollouts(n_rows=60, seed=8)
    table = table.set_column(2, "score", pa.array(np.zeros(60)))
    expected = data.advantages(table, estimator="gpg")
    got = collected(ppo_ray.advantages(ray.data.from_arrow(table).repartition(2), estimator="gpg"))
    np.testing.assert_array_equal(flat(got, "advantages"), flat(expected, "advantages"))


@pytest.mark.parametrize(
    ("tokens", "options", "message"),
    [
        (0, {}, "no valid token"),
        (1, {"unbiased": True}, "a single valid token and unbiased=True"),
        (5, {"whiten_eps": 0.0}, "the variance is 0 and whiten_eps=0"),
    ],
)
def test_reinforce_plus_plus_baseline_refuses_what_one_table_refuses(tokens, options, message):
    table = rollouts(n_rows=6, seed=9)
    lengths = [tokens, 0, 0, 0, 0, 0] if tokens < 5 else [1, 1, 1, 1, 1, 0]
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    n = int(sum(lengths))
    for name in ("logprobs", "ref_logprobs", "values"):
        table = table.set_column(
            table.schema.get_field_index(name),
            name,
            pa.ListArray.from_arrays(offsets, pa.array(np.full(n, -1.0))),
        )
    table = table.drop_columns(["mask"]).set_column(1, "uid", pa.array(["a"] * 6))
    if tokens == 5:  # one group, one score: every centred value is 0
        table = table.set_column(2, "score", pa.array(np.ones(6)))
    options = {"estimator": "reinforce_plus_plus_baseline", **options}
    with pytest.raises(ValueError, match=message):  # the one table's whiten
        data.advantages(table, **options)
    with pytest.raises(data.DataError, match=message):  # the merged moments of the blocks
        collected(ppo_ray.advantages(ray.data.from_arrow(table), **options))
