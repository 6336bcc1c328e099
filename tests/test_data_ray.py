"""ppo_fast.data.ray on a local Ray cluster: equal to ppo_fast.data on the whole table.

Ray starts once for the module (two CPUs); the datasets are small, in several blocks, so that the
moments of several blocks are merged and the groups meet across blocks.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


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
    columns = data.resolve_columns(mask="mask")
    options = {"estimator": "gae", "kl_coef": 0.1, "lam": 0.9, "columns": columns}
    expected = data.advantages(table, **options)
    dataset = ray.data.from_arrow(table).repartition(4)
    got = collected(ppo_ray.advantages(dataset, batch_size=50, **options))
    assert got["id"].to_pylist() == list(range(table.num_rows))
    np.testing.assert_array_equal(flat(got, "returns"), flat(expected, "returns"))
    np.testing.assert_allclose(
        flat(got, "advantages"), flat(expected, "advantages"), rtol=RTOL, atol=RTOL
    )


@pytest.mark.parametrize("estimator", ["grpo", "opo"])
def test_group_local_estimators_by_groupby_equal_one_table(estimator):
    table = rollouts(n_rows=120, seed=5)
    columns = data.resolve_columns(mask="mask")  # opo weighs by the valid tokens
    expected = data.advantages(table, estimator=estimator, columns=columns)
    dataset = ray.data.from_arrow(table).repartition(2)  # groups spread over both blocks
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
