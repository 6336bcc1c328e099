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

pytestmark = pytest.mark.slow

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


def test_grpo_by_groupby_equals_one_table():
    table = rollouts(n_rows=120, seed=5)
    expected = data.advantages(table, estimator="grpo")
    dataset = ray.data.from_arrow(table).repartition(2)  # groups spread over both blocks
    got = collected(ppo_ray.advantages(dataset, estimator="grpo", num_partitions=2))
    assert got.num_rows == table.num_rows
    np.testing.assert_allclose(
        flat(got, "advantages"), flat(expected, "advantages"), rtol=RTOL, atol=RTOL
    )
    assert got.select(["id", "score"]).equals(expected.select(["id", "score"]))


def test_estimators_that_need_the_whole_batch_and_missing_columns_are_refused():
    dataset = ray.data.from_arrow(rollouts(n_rows=10).drop_columns(["values"]))
    with pytest.raises(data.DataError, match="gpg needs statistics of the whole batch"):
        ppo_ray.advantages(dataset, estimator="gpg")
    with pytest.raises(data.DataError, match="no column 'values' in the dataset"):
        ppo_ray.advantages(dataset, estimator="gae")
