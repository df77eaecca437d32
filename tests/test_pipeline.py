"""The record pipeline's worker: batches that pile up while it decodes go to it as one group, in step order,
bounded, with its errors raised where the caller waits; a grouped run writes fewer parts, the same rows."""

from __future__ import annotations

import threading
import time

import pyarrow.compute as pc
import pytest
from conftest import generated_model_path

from onnx_opscope.run import read_table, record, recorder
from onnx_opscope.run.feeds import FeedSpec
from onnx_opscope.run.recorder import BatchPipeline


def blocked_pipeline() -> tuple[BatchPipeline, list[list[int]], threading.Event]:
    """A pipeline whose work records each group's steps and waits for `go` on its first group."""
    groups: list[list[int]] = []
    go = threading.Event()

    def work(batches):
        if not groups:
            go.wait(10)
        groups.append([step for step, _ in batches])

    return BatchPipeline(work), groups, go


def test_batches_that_pile_up_go_to_the_worker_together():
    pipeline, groups, go = blocked_pipeline()
    for step in range(6):
        pipeline.submit(step, {"x": bytes(8)})
    go.set()
    pipeline.close()
    assert groups == [[0], [1, 2, 3, 4, 5]]


def test_a_worker_that_keeps_up_gets_groups_of_one():
    groups: list[list[int]] = []
    pipeline = BatchPipeline(lambda batches: groups.append([s for s, _ in batches]))
    for step in range(5):
        pipeline.submit(step, {})
        time.sleep(0.02)  # a run longer than the work
    pipeline.close()
    assert groups == [[0], [1], [2], [3], [4]]


def test_waiting_batches_are_bounded(monkeypatch):
    monkeypatch.setattr(BatchPipeline, "MAX_BATCHES", 3)
    pipeline, groups, go = blocked_pipeline()
    threading.Timer(0.2, go.set).start()
    for step in range(8):
        pipeline.submit(step, {})  # the 4th waits for the worker instead of holding a 4th batch
    pipeline.close()
    assert [s for g in groups for s in g] == list(range(8))
    assert max(len(g) for g in groups) == 3 and groups[:2] == [[0], [1, 2, 3]]


def test_an_error_in_the_work_is_raised_where_the_caller_waits():
    def work(batches):
        raise ValueError(f"bad group {[s for s, _ in batches]}")

    pipeline = BatchPipeline(work)
    pipeline.submit(0, {})
    time.sleep(0.05)  # the worker has failed: the next submit waits for it and raises
    with pytest.raises(ValueError, match=r"bad group \[0\]"):
        pipeline.submit(1, {})
    pipeline.close(quiet=True)  # another error is being raised: this one's is dropped, and what waits
    quiet = BatchPipeline(work)
    quiet.submit(0, {})
    with pytest.raises(ValueError, match="bad group"):
        quiet.close()


def test_a_slow_decode_writes_fewer_parts_with_the_same_rows(tmp_path, monkeypatch):
    """A decode slower than the run (made so here): groups of batches, one Parquet part each; the table
    reads the same as one written a part a batch, and progress still comes once a batch."""
    model, feeds = generated_model_path("mlp"), FeedSpec(batches=12)
    decode_many = recorder.decode_many

    def slow(manifest, batches, host):
        time.sleep(0.03 * len(batches))
        return decode_many(manifest, batches, host)

    monkeypatch.setattr(recorder, "decode_many", slow)
    seen: list[int] = []
    grouped = record(
        model, out=tmp_path / "grouped.parquet", feeds=feeds, progress=lambda d, t: seen.append(d)
    )
    monkeypatch.setattr(BatchPipeline, "MAX_BATCHES", 1)
    single = record(model, out=tmp_path / "single.parquet", feeds=feeds)
    parts = [len(list(r.table.glob("part-*.parquet"))) for r in (grouped, single)]
    assert parts[1] == 12 and parts[0] < 12, parts
    assert seen == list(range(1, 13)) and grouped.batches == single.batches == 12
    keys = ["step", "site", "role", "stat", "idx"]
    a, b = (read_table(r.table).drop_columns(["run_id"]).sort_by([(k, "ascending") for k in keys])
            for r in (grouped, single))  # fmt: skip
    assert a.num_rows == b.num_rows > 0 and a.column_names == b.column_names
    for name in a.column_names:
        assert pc.all(pc.equal(a.column(name), b.column(name)).fill_null(True)).as_py(), name


def test_a_group_is_cut_into_parts_of_at_most_part_rows(tmp_path, monkeypatch):
    """However many batches pile up, a part holds at most PART_ROWS rows (a batch at least): the first
    batch goes alone (its rows size the next parts), so the tables a group builds stay bounded."""
    import pyarrow.parquet as pq

    model, feeds = generated_model_path("mlp"), FeedSpec(batches=12)
    one = record(model, out=tmp_path / "one.parquet", feeds=FeedSpec(batches=1)).rows
    decode_many = recorder.decode_many

    def slow(manifest, batches, host):
        time.sleep(0.03 * len(batches))
        return decode_many(manifest, batches, host)

    monkeypatch.setattr(recorder, "decode_many", slow)
    monkeypatch.setattr(recorder, "PART_ROWS", 3 * one)
    result = record(model, out=tmp_path / "cut.parquet", feeds=feeds)
    parts = sorted(result.table.glob("part-*.parquet"))
    steps = [sorted(set(pq.read_table(p).column("step").to_pylist())) for p in parts]
    assert [s for part in steps for s in part] == list(range(12))
    assert steps[0] == [0] and max(len(s) for s in steps) == 3 and all(len(s) <= 3 for s in steps)
    assert all(pq.read_metadata(p).num_rows <= 3 * one for p in parts)
