"""`--engine ray`: the same rows as one process, a killed worker loses and duplicates nothing, the
calibration passes merge exactly, and without Ray the option is one line naming the extra."""

from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np
import pytest
from conftest import generated_model_path

import onnx_opscope
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run import FeedSpec, read_table
from onnx_opscope.run.engine import Engine


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _sorted(table):
    df = table.to_pandas()
    return df.sort_values(list(df.columns[:6])).reset_index(drop=True)


def test_ray_records_the_rows_one_process_records(ray_cluster, tmp_path):
    model = generated_model_path("transformer_block")
    feeds = FeedSpec(batches=6, dist="outlier")
    local = onnx_opscope.record(model, out=tmp_path / "local.parquet", feeds=feeds, run_id="r")
    spread = onnx_opscope.record(model, out=tmp_path / "ray.parquet", feeds=feeds, run_id="r",
                                 engine=Engine("ray", workers=2))  # fmt: skip
    a, b = read_table(local.table), read_table(spread.table)
    assert a.num_rows == b.num_rows > 0 and spread.batches == 6
    assert a.equals(b)  # same rows, same order: written by the driver in step order
    assert spread.runtime["engine"]["kind"] == "ray"


def _ray_worker_pids() -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ray::_Worker" in f.read():
                    pids.append(int(pid))
        except (OSError, ValueError):
            continue
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker process in /proc")
def test_a_killed_worker_loses_and_duplicates_no_batch(ray_cluster, tmp_path):
    model = generated_model_path("transformer_block")
    feeds = FeedSpec(batches=40)
    killed = []

    def progress(done, total):
        if done == 5 and not killed:
            pids = _ray_worker_pids()
            assert pids, "no Ray worker process found"
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    local = onnx_opscope.record(model, out=tmp_path / "local.parquet", feeds=feeds, run_id="k")
    spread = onnx_opscope.record(model, out=tmp_path / "ray.parquet", feeds=feeds, run_id="k",
                                 engine=Engine("ray", workers=2), progress=progress)  # fmt: skip
    assert killed and spread.batches == 40
    a, b = read_table(local.table), read_table(spread.table)
    steps = b.column("step").to_numpy()
    assert sorted(set(steps)) == list(range(40))
    assert a.num_rows == b.num_rows and a.equals(b)


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_calibrate_on_ray_equals_one_process(ray_cluster, method):
    model = generated_model_path("transformer_block")
    feeds = FeedSpec(batches=5)
    local = onnx_opscope.calibrate(model, feeds, method=method)
    spread = onnx_opscope.calibrate(model, feeds, method=method, engine=Engine("ray", workers=2))
    assert local.ranges.keys() == spread.ranges.keys() and spread.batches == 5
    for k, (lo, hi) in local.ranges.items():
        assert (np.float32(lo), np.float32(hi)) == (
            np.float32(spread.ranges[k][0]),
            np.float32(spread.ranges[k][1]),
        )


def test_without_ray_the_option_is_one_line(monkeypatch, tmp_path, capsys):
    from onnx_opscope.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails, as when not installed
    with pytest.raises(OpscopeError, match="needs Ray") as exc:
        onnx_opscope.record(generated_model_path("mlp"), out=tmp_path / "t.parquet", engine=Engine("ray"))
    assert "pip install 'onnx-opscope[ray]'" in exc.value.hint
    assert (
        main(
            ["record", str(generated_model_path("mlp")), "-o", str(tmp_path / "u.parquet"), "--engine", "ray"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "needs Ray" in err
        and "onnx-opscope[ray]" in err
        and "Traceback" not in err
        and not (tmp_path / "u.parquet").exists()
    )


def test_progress_counts_batches_across_workers(ray_cluster, tmp_path):
    seen = []
    lock = threading.Lock()

    def progress(done, total):
        with lock:
            seen.append((done, total))

    onnx_opscope.record(generated_model_path("mlp"), out=tmp_path / "p.parquet", feeds=FeedSpec(batches=7),
                        engine=Engine("ray", workers=2), progress=progress)  # fmt: skip
    assert [d for d, _ in seen] == list(range(1, 8)) and {t for _, t in seen} == {7}
