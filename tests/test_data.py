"""ppo_fast.data: Arrow tables and files through the public stages, zero-copy, in batches.

Each result is held to the stages called once on the whole input (packed with cu_seqlens, or
padded with a mask): bit for bit where no statistic of the whole input is merged, and to 1e-12
(float64) where the whitening moments of several batches are merged.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import ppo_fast  # noqa: E402
from ppo_fast import data  # noqa: E402
from ppo_fast.data import _columns, _compute  # noqa: E402

MERGED_RTOL = 1e-12


def rollouts(n_rows=60, seed=0, dtype=np.float64, max_len=9, n_groups=9, mask=True) -> pa.Table:
    """Rows of up to max_len tokens; ``mask=False``: no mask column (every token valid, whatever
    the columns: the default columns read a ``mask`` column where there is one)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, n_rows)
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    n = int(lengths.sum())

    def tokens(x):
        return pa.ListArray.from_arrays(offsets, pa.array(np.asarray(x, dtype=dtype)))

    table = pa.table(
        {
            "uid": pa.array([f"q{i}" for i in rng.integers(0, n_groups, n_rows)]),
            "score": rng.normal(size=n_rows),
            "logprobs": tokens(rng.normal(-1, 0.5, n)),
            "ref_logprobs": tokens(rng.normal(-1, 0.5, n)),
            "values": tokens(rng.normal(size=n)),
            "mask": pa.ListArray.from_arrays(offsets, pa.array(rng.random(n) > 0.2)),
            "bootstrap": rng.normal(size=n_rows),
        }
    )
    return table if mask else table.drop_columns(["mask"])


def flat(table, name) -> np.ndarray:
    return table[name].combine_chunks().flatten().to_numpy(zero_copy_only=False)


def packed(table):
    cu = np.concatenate(([0], np.cumsum(pa.compute.list_value_length(table["values"]))))
    return {k: flat(table, k) for k in ("logprobs", "ref_logprobs", "values")}, cu


def test_gae_whitened_in_batches_equals_the_stages_on_the_whole_table():
    table = rollouts(mask=False)
    out = data.advantages(table, kl_coef=0.1, lam=0.9, batch_rows=7)
    x, cu = packed(table)
    rewards = ppo_fast.shape_rewards(
        table["score"].to_numpy(), x["logprobs"], x["ref_logprobs"], kl_coef=0.1, cu_seqlens=cu
    )
    bootstrap = table["bootstrap"].to_numpy()  # read by default: the table has the column
    expected = ppo_fast.gae(rewards, x["values"], lam=0.9, cu_seqlens=cu, bootstrap=bootstrap)
    np.testing.assert_array_equal(flat(out, "returns"), expected.returns)
    whitened = ppo_fast.whiten(expected.advantages, cu_seqlens=cu)
    np.testing.assert_allclose(flat(out, "advantages"), whitened, rtol=MERGED_RTOL, atol=1e-14)
    assert out.select(table.column_names).equals(table)  # the input columns, the row order


def test_mask_and_bootstrap_equal_the_padded_masked_stages():
    table = rollouts(seed=1, dtype=np.float32)
    columns = data.resolve_columns(mask="mask", bootstrap="bootstrap")
    out = data.advantages(table, columns=columns, gamma=0.99, whiten=False, batch_rows=11)
    assert out.schema.field("advantages").type == pa.list_(pa.float32())
    rows = table.to_pylist()
    width = max(len(r["values"]) for r in rows)
    padded = {
        k: np.array([r[k] + [0] * (width - len(r[k])) for r in rows], dtype=np.float32)
        for k in ("logprobs", "values")
    }
    mask = np.array([r["mask"] + [False] * (width - len(r["mask"])) for r in rows])
    rewards = ppo_fast.shape_rewards(
        table["score"].to_numpy(), padded["logprobs"], padded["logprobs"], kl_coef=0.0, mask=mask
    )
    expected = ppo_fast.gae(
        rewards,
        padded["values"],
        gamma=0.99,
        mask=mask,
        bootstrap=table["bootstrap"].to_numpy(),
    )
    got = out.to_pylist()
    for b, row in enumerate(got):
        n = len(row["values"])
        np.testing.assert_array_equal(row["advantages"], expected.advantages[b, :n])
        np.testing.assert_array_equal(row["returns"], expected.returns[b, :n])


def test_the_default_columns_read_a_mask_and_a_bootstrap_column_where_there_are_some(tmp_path):
    """ppo_fast's preset names its mask ``IfPresent("mask")`` and its bootstrap
    ``IfPresent("bootstrap")``: a table or file with such a column is computed with it, as when
    it is named; ``""`` reads none (as a table without the column); a column named outright must
    be there."""
    table = rollouts(seed=15)
    named = data.advantages(table, columns=data.resolve_columns(mask="mask", bootstrap="bootstrap"))
    assert data.advantages(table).equals(named)
    for field in ("mask", "bootstrap"):
        default = getattr(data.PRESETS["ppo_fast"], field)
        assert isinstance(default, data.IfPresent) and default == field
        unread = data.advantages(table, columns=data.resolve_columns(**{field: ""}))
        without = data.advantages(table.drop_columns([field]))
        np.testing.assert_array_equal(flat(unread, "advantages"), flat(without, "advantages"))
        assert not np.array_equal(flat(unread, "advantages"), flat(named, "advantages")), field
    source = tmp_path / "in.parquet"
    pq.write_table(table, source)
    data.advantages_file(source, tmp_path / "out.parquet")
    written = pq.read_table(tmp_path / "out.parquet")
    np.testing.assert_array_equal(flat(written, "advantages"), flat(named, "advantages"))
    for field in ("mask", "bootstrap"):
        with pytest.raises(data.DataError, match=f"no column '{field}' \\(the {field} column\\)"):
            data.advantages(
                table.drop_columns([field]), columns=data.resolve_columns(**{field: field})
            )


def test_sliced_and_chunked_columns_give_the_contiguous_result():
    table = rollouts(n_rows=80, seed=2)
    whole = data.advantages(table, estimator="reinforce_plus_plus", gamma=0.97)
    # Offsets of a slice do not start at 0; a chunked table is several arrays.
    sliced = table.slice(13, 50)
    chunked = pa.concat_tables([table.slice(0, 13), table.slice(13, 30), table.slice(43)])
    from_slice = data.advantages(sliced, estimator="reinforce_plus_plus", gamma=0.97)
    alone = data.advantages(
        pa.Table.from_pylist(sliced.to_pylist(), schema=table.schema),
        estimator="reinforce_plus_plus",
        gamma=0.97,
    )
    assert from_slice["advantages"].to_pylist() == alone["advantages"].to_pylist()
    out = data.advantages(chunked, estimator="reinforce_plus_plus", gamma=0.97)
    assert out["returns"].to_pylist() == whole["returns"].to_pylist()
    np.testing.assert_allclose(flat(out, "advantages"), flat(whole, "advantages"), rtol=1e-12)
    batch = data.advantages(table.to_batches()[0], estimator="reinforce_plus_plus", gamma=0.97)
    assert isinstance(batch, pa.RecordBatch)
    assert batch.column("returns").to_pylist() == whole["returns"].to_pylist()


def test_token_values_are_views_of_the_arrow_buffers_and_outputs_share_the_offsets():
    table = rollouts(n_rows=20, seed=4)
    batch = table.to_batches()[0].slice(3, 10)
    column = _columns.token_column(batch, "values", "values", 0)
    buffer = np.frombuffer(batch.column("values").values.buffers()[1], dtype=np.float64)
    assert np.shares_memory(column.values, buffer)
    assert column.cu_seqlens[0] == 0 and column.values.shape[0] == column.cu_seqlens[-1]
    out = data.advantages(table, whiten=False)
    assert (
        out["advantages"].chunk(0).offsets.buffers()[1].address
        == table["values"].chunk(0).offsets.buffers()[1].address
    )


def test_uids_of_any_arrow_type_are_numbered_in_first_seen_order():
    chunks = [
        pa.array(["b", "a"]).dictionary_encode(),
        pa.array(["c", "a", "b"]).dictionary_encode(),
    ]
    assert _columns.group_ids(chunks).tolist() == [0, 1, 2, 1, 0]
    assert _columns.group_ids([pa.array([7, 3]), pa.array([7, 9])]).tolist() == [0, 1, 0, 2]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline", "opo"])
def test_group_estimators_over_batches_equal_the_whole_table(estimator):
    table = rollouts(n_rows=70, seed=6, mask=False)
    out = data.advantages(table, estimator=estimator, batch_rows=8)
    _, cu = packed(table)
    scores, uids = table["score"].to_numpy(), table["uid"].to_pylist()
    if estimator == "reinforce_plus_plus_baseline":
        expected = ppo_fast.reinforce_plus_plus_baseline(scores, uids, cu_seqlens=cu)
    else:
        expected = getattr(ppo_fast, estimator)(scores, uids, cu_seqlens=cu)
    np.testing.assert_array_equal(flat(out, "advantages"), expected)
    np.testing.assert_array_equal(flat(out, "returns"), expected)


def test_opo_weighs_rows_by_their_valid_tokens_as_the_in_memory_opo():
    table = rollouts(n_rows=70, seed=13)
    columns = data.resolve_columns(mask="mask")
    out = data.advantages(table, estimator="opo", columns=columns, batch_rows=8)
    valid_counts = [sum(row) for row in table["mask"].to_pylist()]
    per_row = ppo_fast.opo(
        table["score"].to_numpy(), table["uid"].to_pylist(), token_counts=valid_counts
    )
    for b, row in enumerate(out.to_pylist()):
        expected = np.where(row["mask"], per_row[b], 0.0)
        np.testing.assert_array_equal(row["advantages"], expected)
        np.testing.assert_array_equal(row["returns"], expected)


def test_remax_equals_the_in_memory_remax_with_a_mask_kl_and_bootstrap():
    table = rollouts(seed=14, dtype=np.float32)
    rng = np.random.default_rng(14)
    table = table.append_column("greedy_score", pa.array(rng.normal(size=table.num_rows)))
    columns = data.resolve_columns(mask="mask", bootstrap="bootstrap", baseline="greedy_score")
    options = {"kl_coef": 0.1, "gamma": 0.9}
    out = data.advantages(table, estimator="remax", columns=columns, batch_rows=7, **options)
    rows = table.to_pylist()
    width = max(len(r["values"]) for r in rows)
    padded = {
        k: np.array([r[k] + [0] * (width - len(r[k])) for r in rows], dtype=np.float32)
        for k in ("logprobs", "ref_logprobs")
    }
    mask = np.array([r["mask"] + [False] * (width - len(r["mask"])) for r in rows])
    rewards = ppo_fast.shape_rewards(
        table["score"].to_numpy(),
        padded["logprobs"],
        padded["ref_logprobs"],
        kl_coef=0.1,
        mask=mask,
    )
    expected = ppo_fast.remax(
        rewards,
        table["greedy_score"].to_numpy(),
        gamma=0.9,
        mask=mask,
        bootstrap=table["bootstrap"].to_numpy(),
    )
    for b, row in enumerate(out.to_pylist()):  # not whitened (whiten=True is the default)
        n = len(row["values"])
        np.testing.assert_array_equal(row["advantages"], expected.advantages[b, :n])
        np.testing.assert_array_equal(row["returns"], expected.returns[b, :n])
    assert data.PRESETS["verl"].baseline == "reward_baselines"
    with pytest.raises(data.DataError, match="remax subtracts each row's baseline"):
        data.advantages(table, estimator="remax")
    with pytest.raises(data.DataError, match=r"no column 'reward_baselines' \(the baseline"):
        data.advantages(
            table, estimator="remax", columns=columns.replace(baseline="reward_baselines")
        )


def test_verl_preset_equals_verls_gae_and_whitening():
    torch = pytest.importorskip("torch")
    from ppo_fast._peers import verl_0_9_1 as verl

    source = rollouts(n_rows=30, seed=7, dtype=np.float32)
    offsets = source["values"].chunk(0).offsets
    scores = np.zeros(int(offsets[-1].as_py()), dtype=np.float32)
    ends = np.asarray(offsets)[1:][np.diff(np.asarray(offsets)) > 0] - 1
    scores[ends] = source["score"].to_numpy()[np.diff(np.asarray(offsets)) > 0]
    table = pa.table(
        {
            "uid": source["uid"],
            "token_level_scores": pa.ListArray.from_arrays(offsets, pa.array(scores)),
            "old_log_probs": source["logprobs"],
            "ref_log_prob": source["ref_logprobs"],
            "values": source["values"],
            "response_mask": source["mask"],
        }
    )
    out = data.advantages(table, columns="verl", kl_coef=0.05, unbiased=True, batch_rows=9)
    rows = table.to_pylist()
    width = max(len(r["values"]) for r in rows)

    def pad(key):
        return torch.tensor([r[key] + [0] * (width - len(r[key])) for r in rows])

    mask = pad("response_mask").float()
    kl = pad("old_log_probs") - pad("ref_log_prob")
    rewards = pad("token_level_scores") - 0.05 * kl
    advantages, returns = verl.compute_gae_advantage_return(
        rewards, pad("values"), mask, torch.tensor(1.0), torch.tensor(0.95)
    )
    got = out.to_pylist()
    for b, row in enumerate(got):
        # verl leaves values at masked positions; ppo_fast puts 0 there (not actions).
        valid = np.array(row["response_mask"], dtype=bool)
        n = valid.shape[0]
        assert not np.any(np.array(row["advantages"])[~valid])
        for name, theirs in (("advantages", advantages), ("returns", returns)):
            np.testing.assert_allclose(
                np.array(row[name])[valid], theirs[b, :n].numpy()[valid], rtol=2e-5, atol=2e-5
            )


def test_files_in_every_format_equal_the_table_api(tmp_path):
    table = rollouts(n_rows=40, seed=8, mask=False)
    expected = data.advantages(table, estimator="grpo")
    paths = {"parquet": tmp_path / "in.parquet", "arrow": tmp_path / "in.arrow"}
    pq.write_table(table, paths["parquet"], row_group_size=9)
    with pa.OSFile(str(paths["arrow"]), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=11)
    jsonl = tmp_path / "in.jsonl"
    small = table.select(["uid", "score", "logprobs"])
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in small.to_pylist()))
    for kind, path in paths.items():
        output = tmp_path / f"out-{kind}.arrow"
        summary = data.advantages_file(path, output, estimator="grpo", batch_rows=5)
        assert summary["input_format"] == kind and summary["rows"] == 40
        with pa.memory_map(str(output)) as source:
            got = pa.ipc.open_file(source).read_all()
        assert got.equals(expected)
    output = tmp_path / "out.parquet"
    data.advantages_file(jsonl, output, estimator="grpo", batch_rows=5)
    np.testing.assert_array_equal(
        flat(pq.read_table(output), "advantages"), flat(expected, "advantages")
    )
    # Parquet is read in pieces of a quarter batch (3 rows), across its row groups (9 rows),
    # which the writer joins again into row groups of batch_rows.
    output = tmp_path / "out-row-groups.parquet"
    data.advantages_file(paths["parquet"], output, estimator="grpo", batch_rows=12)
    written = pq.ParquetFile(output)
    sizes = [written.metadata.row_group(i).num_rows for i in range(written.num_row_groups)]
    assert sizes == [12, 12, 12, 4]
    np.testing.assert_array_equal(flat(written.read(), "advantages"), flat(expected, "advantages"))


def test_a_parquet_row_group_is_written_once_its_pieces_hold_batch_rows_rows(tmp_path):
    """The writer's pieces (a fraction of a batch each) join into one row group as soon as they
    hold ``batch_rows`` rows, and not before: pieces of 3 rows and batch_rows=10 make row groups
    of 12 (9 rows are not enough), and what is left at the end is the last one."""
    from ppo_fast.data import _stream

    table = rollouts(n_rows=30, seed=2)
    output = tmp_path / "out.parquet"
    writer = _stream.Writer(str(output), "parquet", batch_rows=10)
    for start in range(0, 30, 3):
        writer.write(table.slice(start, 3).to_batches()[0])
    writer.close()
    written = pq.ParquetFile(output)
    sizes = [written.metadata.row_group(i).num_rows for i in range(written.num_row_groups)]
    assert sizes == [12, 12, 6]
    assert written.read().equals(table)


def test_a_run_reports_its_rows_tokens_batches_speed_and_moments(tmp_path):
    """``advantages_file``'s summary, from an Arrow IPC stream (read by pyarrow's stream reader,
    which the formats above do not take): its rows, its tokens (every position of the rows,
    valid or not), a batch for each piece of at most ``batch_rows`` rows of each record batch,
    tokens_per_s from its own tokens and seconds, and the whitening moments: those of the
    advantages before whitening, over the valid tokens (here every token: the table has no
    mask column; population variance, unbiased=False by default). An input of no rows reports
    no batch and still gets its output columns."""
    table = rollouts(n_rows=40, seed=5, mask=False)
    source = tmp_path / "in.arrows"
    with pa.OSFile(str(source), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=15)
    output = tmp_path / "out.arrow"
    summary = data.advantages_file(source, output, batch_rows=10)
    with pa.memory_map(str(output)) as written:
        got = pa.ipc.open_file(written).read_all()
    # the whitening moments merged over other pieces than the table API's: to rounding
    for name in ("advantages", "returns"):
        np.testing.assert_allclose(flat(got, name), flat(data.advantages(table), name), rtol=1e-12)
    assert summary["input_format"] == "arrow-stream"
    lengths = pa.compute.list_value_length(table["logprobs"]).to_numpy()
    assert (summary["rows"], summary["tokens"]) == (40, int(lengths.sum()))
    assert summary["batches"] == 5  # record batches of 15, 15 and 10 rows: 10+5, 10+5, 10
    assert summary["tokens_per_s"] == summary["tokens"] / summary["seconds"]
    raw = flat(data.advantages(table, whiten=False), "advantages")  # every token valid
    assert summary["whiten_mean"] == pytest.approx(raw.mean(), rel=1e-12)
    assert summary["whiten_std"] == pytest.approx(raw.std(), rel=1e-12)

    empty = tmp_path / "empty.arrows"
    with pa.OSFile(str(empty), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table.slice(0, 0))
    summary = data.advantages_file(empty, tmp_path / "empty.arrow", whiten=False)
    assert (summary["rows"], summary["tokens"], summary["batches"]) == (0, 0, 0)
    with pa.memory_map(str(tmp_path / "empty.arrow")) as written:
        got = pa.ipc.open_file(written).read_all()
    assert got.num_rows == 0 and {"advantages", "returns"} <= set(got.column_names)


def test_a_parquet_input_of_one_batch_is_read_once(tmp_path, monkeypatch):
    """A whitened run (two passes) over a Parquet file of no more rows than a batch reads it
    once: the first pass keeps every column for the second. The results are those of the same
    run reading it twice, bit for bit; a file of more rows than a batch, and an Arrow file
    (memory-mapped: reading it again costs no decoding), are read twice."""
    from ppo_fast.data import _stream

    table = rollouts(n_rows=40, seed=21)
    source = tmp_path / "in.parquet"
    pq.write_table(table, source, row_group_size=16)
    opened = []
    original = _stream.ParquetSource.batches

    def counted(self, columns):
        opened.append(columns)
        return original(self, columns)

    monkeypatch.setattr(_stream.ParquetSource, "batches", counted)

    def run(batch_rows, name, **options):
        opened.clear()
        out = tmp_path / f"{name}-{batch_rows}.parquet"
        summary = data.advantages_file(source, out, batch_rows=batch_rows, **options)
        assert summary["reads"] == len(opened)
        return summary, pq.read_table(out)

    for batch_rows, reads in ((40, 1), (64, 1), (39, 2), (8, 2)):
        summary, once = run(batch_rows, "default", kl_coef=0.05)
        assert (summary["passes"], summary["reads"]) == (2, reads)
        assert (opened[0] is None) == (reads == 1)  # else the first pass's columns alone
        with monkeypatch.context() as forced:  # the same run, reading the file twice
            forced.setattr(_stream.ParquetSource, "rereading_costs", False)
            summary, twice = run(batch_rows, "twice", kl_coef=0.05)
        assert summary["reads"] == 2 and twice.equals(once)
    expected = data.advantages(table, kl_coef=0.05, batch_rows=10)  # the pieces of 40 rows
    np.testing.assert_array_equal(
        flat(run(40, "one", kl_coef=0.05)[1], "advantages"), flat(expected, "advantages")
    )
    summary, _ = run(40, "one-pass", whiten=False)
    assert (summary["passes"], summary["reads"]) == (1, 1)
    arrow = tmp_path / "in.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    summary = data.advantages_file(arrow, tmp_path / "o.arrow", kl_coef=0.05, batch_rows=64)
    assert (summary["passes"], summary["reads"]) == (2, 2)


def test_a_row_group_larger_than_the_batch_is_read_in_pieces_in_bounded_memory(
    tmp_path, monkeypatch
):
    # pyarrow's default reader (pre_buffer=True) reads a row group's column chunks whole and
    # keeps them until the read ends; the source streams them through a buffer per column
    # (made small here: small against the row group) and decodes a quarter batch at a time.
    from ppo_fast.data import _stream

    monkeypatch.setattr(_stream, "READ_BUFFER", 1 << 14)
    table = rollouts(n_rows=30000, seed=12, max_len=60)
    source = tmp_path / "one-row-group.parquet"
    pq.write_table(table, source, row_group_size=table.num_rows)
    assert pq.ParquetFile(source).num_row_groups == 1

    def held(batches):
        """The batch sizes, and the most bytes pyarrow held while they were read."""
        before = pa.total_allocated_bytes()
        sizes, most = [], 0
        for batch in batches:
            sizes.append(batch.num_rows)
            most = max(most, pa.total_allocated_bytes() - before)
            del batch
        return sizes, most

    sizes, streamed = held(_stream.open_source(str(source), 200).batches(None))
    assert sum(sizes) == 30000 and max(sizes) == 50  # 200 / READ_PIECES
    with pq.ParquetFile(source) as file:
        _, buffered = held(file.iter_batches(batch_size=50))
    # pre-buffered: the row group's column chunks (about 40 MB here); streamed: a page of
    # each column (up to pyarrow's 1 MB page), the decoders' scratch and a piece of 50 rows
    # (about 6 MB, whatever the size of the row group).
    assert streamed < buffered / 3, (streamed, buffered)
    out = tmp_path / "out.parquet"
    data.advantages_file(source, out, batch_rows=4000, whiten=False)
    expected = data.advantages(table, whiten=False)
    np.testing.assert_array_equal(
        flat(pq.read_table(out), "advantages"), flat(expected, "advantages")
    )


def test_parquet_output_keeps_the_input_codecs_unless_told(tmp_path):
    from ppo_fast.data import _stream

    table = rollouts(n_rows=30, seed=15)
    source = tmp_path / "in.parquet"
    # ParquetWriter's per-column settings are keyed by leaf ("values.list.element").
    leaves = _stream._leaf_paths(table.schema)
    codecs = {leaf: "none" if leaf.startswith("values.") else "zstd" for leaf in leaves}
    pq.write_table(table, source, compression=codecs)

    def written(path):
        group = pq.ParquetFile(path).metadata.row_group(0)
        chunks = (group.column(i) for i in range(group.num_columns))
        return {c.path_in_schema.split(".")[0]: c.compression for c in chunks}

    assert written(source)["values"] == "UNCOMPRESSED" and written(source)["logprobs"] == "ZSTD"
    output = tmp_path / "out.parquet"
    # The new columns: uncompressed for a token estimator (float noise), snappy for a group
    # estimator (one value a row).
    data.advantages_file(source, output, batch_rows=8)
    fresh = {"advantages": "UNCOMPRESSED", "returns": "UNCOMPRESSED"}
    assert written(output) == written(source) | fresh
    data.advantages_file(source, output, batch_rows=8, estimator="grpo")
    assert written(output) == written(source) | {"advantages": "SNAPPY", "returns": "SNAPPY"}
    data.advantages_file(source, output, batch_rows=8, compression="none")
    assert set(written(output).values()) == {"UNCOMPRESSED"}
    got = pq.read_table(output)
    assert got.select(table.column_names).equals(pq.read_table(source))
    with pytest.raises(data.DataError, match="compression must be one of none, snappy"):
        data.advantages_file(source, output, compression="lzo")


def test_an_interrupted_run_leaves_no_output(tmp_path):
    source = tmp_path / "in.parquet"
    pq.write_table(rollouts(n_rows=40, seed=9), source, row_group_size=10)
    output = tmp_path / "out.parquet"

    def interrupt(phase, rows, tokens):
        if phase == "advantages" and rows >= 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        data.advantages_file(source, output, batch_rows=10, progress=interrupt)
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_failed_write_in_the_writer_thread_is_raised_and_leaves_no_output(
    tmp_path, monkeypatch, suffix
):
    # The writing runs in a thread of its own; its error reaches the caller (by the next batch
    # handed over or by the close), and the temporary file goes.
    from ppo_fast.data import _stream

    source = tmp_path / "in.parquet"
    pq.write_table(rollouts(n_rows=40, seed=9), source, row_group_size=10)
    calls = []
    real = _stream.Writer._write

    def failing(self, batch):
        calls.append(batch.num_rows)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(self, batch)

    monkeypatch.setattr(_stream.Writer, "_write", failing)
    output = tmp_path / f"out{suffix}"
    with pytest.raises(data.WriteError, match="No space left on device") as raised:
        data.advantages_file(source, output, batch_rows=10)
    assert raised.value.errno == 28 and raised.value.filename == str(output)
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]
    assert len(calls) == 2  # nothing more was handed over after the failure was seen


def test_a_write_error_of_pyarrow_is_a_write_error_not_a_read_error(tmp_path, monkeypatch):
    # pyarrow's errors while writing (ArrowIOError is an ArrowException too) must not come out
    # as the input's "cannot read it" (the command line's: tests/test_cli.py).
    from ppo_fast.data import _stream

    source = tmp_path / "in.parquet"
    pq.write_table(rollouts(n_rows=40, seed=9), source, row_group_size=10)

    def failing(self, batch):
        raise pa.ArrowIOError("IOError: a lost mount")

    monkeypatch.setattr(_stream.Writer, "_write", failing)
    with pytest.raises(data.WriteError, match="a lost mount"):
        data.advantages_file(source, tmp_path / "out.parquet", batch_rows=10)
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]


def test_the_writer_overlaps_the_reading_and_keeps_one_write_in_flight(tmp_path, monkeypatch):
    # While a row group is written, the next batches are read and computed (in the caller's
    # thread); a second row group is not handed over before the first is written.
    import threading
    import time

    from ppo_fast.data import _stream

    source = tmp_path / "in.parquet"
    table = rollouts(n_rows=40, seed=9)
    pq.write_table(table, source, row_group_size=10)
    events = []
    real = _stream.Writer._write

    def slow(self, batch):
        events.append(("write starts", threading.current_thread() is threading.main_thread()))
        time.sleep(0.05)
        real(self, batch)
        events.append(("write ends", None))

    def progress(phase, rows, tokens):
        events.append((phase, rows))

    monkeypatch.setattr(_stream.Writer, "_write", slow)
    output = tmp_path / "out.parquet"
    data.advantages_file(source, output, batch_rows=10, progress=progress, whiten=False)
    starts = [i for i, e in enumerate(events) if e[0] == "write starts"]
    ends = [i for i, e in enumerate(events) if e[0] == "write ends"]
    assert all(not on_main for _, on_main in (events[i] for i in starts))
    assert all(end < start for end, start in zip(ends, starts[1:], strict=False))  # one in flight
    # some batch was computed while a write was in flight
    assert any(e[0] == "advantages" for e in events[starts[0] + 1 : ends[0]])
    expected = data.advantages(table, whiten=False)
    assert pq.read_table(output).equals(expected)


def test_output_columns_already_in_the_input_are_replaced_where_they_are():
    table = rollouts(seed=4)
    stale = table["values"]
    given = table.add_column(0, "advantages", stale).append_column("returns", stale)
    out = data.advantages(given, whiten=False)
    expected = data.advantages(table, whiten=False)
    assert out.column_names == given.column_names  # in place: no second column of a name
    for name in ("advantages", "returns"):
        assert out[name].equals(expected[name]), name


def test_the_statistics_pass_reports_the_rows_and_the_tokens_it_read(tmp_path):
    # Progress of pass 1: its rows, and the tokens of the token columns it reads (none for
    # GRPO, whose statistics are the scores by uid; OPO weighs them by tokens, GAE whitens).
    table = rollouts(seed=5, mask=False)
    source = tmp_path / "in.parquet"
    pq.write_table(table, source)
    tokens = int(np.sum(pa.compute.list_value_length(table["values"])))
    for estimator, read in (("opo", tokens), ("grpo", 0), ("gae", tokens)):
        seen: list[tuple[str, int, int]] = []
        data.advantages_file(
            source,
            tmp_path / f"{estimator}.parquet",
            batch_rows=7,
            estimator=estimator,
            progress=lambda phase, rows, count, seen=seen: seen.append((phase, rows, count)),
        )
        statistics = [s for s in seen if s[0] == "statistics"]
        assert statistics[-1] == ("statistics", table.num_rows, read), estimator
        assert seen[-1] == ("advantages", table.num_rows, tokens), estimator


def test_merged_moments_equal_the_moments_of_the_whole():
    rng = np.random.default_rng(10)
    # A large mean: E[x^2] - E[x]^2 in float64 would be off by about 1e-5 relative here; the
    # rounding of the data themselves (ulp 1e-10 at 1e6 against a spread of 3) bounds the rest.
    x = rng.normal(1e6, 3.0, 1000)
    cuts = [0, 1, 200, 201, 650, 1000]
    parts = [
        _compute.batch_moments(x[a:b], np.array([0, b - a]), None)
        for a, b in itertools.pairwise(cuts)
    ]
    count, mean, m2 = _compute.merge_moments(parts)
    assert count == 1000
    np.testing.assert_allclose(mean, x.mean(), rtol=1e-15)
    np.testing.assert_allclose(m2 / count, x.var(), rtol=1e-10)


def test_options_and_columns_are_checked():
    table = rollouts(n_rows=5)
    with pytest.raises(ValueError, match="estimator must be one of"):
        data.advantages(table, estimator="ppo")
    with pytest.raises(ValueError, match="group estimator grpo compares row scores"):
        data.advantages(table, estimator="grpo", kl_coef=0.1)
    with pytest.raises(ValueError, match="gamma"):
        data.advantages(table, gamma=1.5)
    with pytest.raises(data.DataError, match=r"kl_coef=0\.1 needs the logprobs column"):
        data.advantages(table, kl_coef=0.1, columns=data.resolve_columns(logprobs=""))
    with pytest.raises(TypeError, match="unknown column field 'logprob'"):
        data.resolve_columns(logprob="x")
    with pytest.raises(TypeError, match=r"pyarrow\.Table or RecordBatch"):
        data.advantages({"score": [1.0]})
