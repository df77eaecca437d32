"""`--engine ray`: the same rows as one process, a killed worker loses and duplicates nothing, an
interrupted driver keeps the finished batches as one process does, a slow worker gets fewer batches,
the calibration passes merge exactly, and without Ray the option is one line naming the extra."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from conftest import generated_model_path

import onnx_opscope
from onnx_opscope.errors import OpscopeError
from onnx_opscope.run import FeedSpec, read_table, sidecar_paths
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker processes in /proc")
def test_an_interrupted_driver_keeps_the_finished_batches(ray_cluster, tmp_path, capsys):
    """Ctrl-C in the driver while it waits on the workers: exit 130 and the line of the single-process
    `record`, a table of whole batches 0..k-1 at the user's path, run.json saying so, no actor left."""
    import pyarrow.parquet as pq

    from onnx_opscope.cli import main

    pd = pytest.importorskip("pandas")
    out = tmp_path / "run.parquet"
    model = str(generated_model_path("transformer_block"))
    running: list[int] = []  # the actors' processes seen while recording

    def interrupt_after_parts() -> None:
        deadline = time.time() + 60
        while len(list(out.glob("part-*.parquet"))) < 3 and time.time() < deadline:
            time.sleep(0.02)
        running.extend(_ray_worker_pids())
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: KeyboardInterrupt in the main thread

    # pytest-xdist's workers ignore SIGINT: give this test Python's own handler, as a terminal has
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_after_parts, daemon=True).start()
        argv = ["record", model, "-o", str(out), "--batches", "5000", "-q", "--dim", "batch=4,seq=64",
                "--engine", "ray", "--workers", "2"]  # fmt: skip
        assert main(argv) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    steps = pq.read_table(out).column("step").to_pylist()
    kept = sorted(set(steps))
    assert len(kept) >= 3 and kept == list(range(len(kept)))  # whole batches from 0, no gap
    assert len({steps.count(s) for s in kept}) == 1  # no batch twice, none in part
    assert len(pd.read_parquet(out)) == len(steps) == read_table(out).num_rows
    assert all(p.name.startswith("part-") for p in out.iterdir())  # no _SUCCESS, no temporary file
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"interrupted: kept {len(kept)} of 5000 batches in {out}", line
    meta = json.loads(sidecar_paths(out)[1].read_text())
    assert meta["interrupted"] is True and meta["batches"] == len(kept)
    assert running, "no Ray actor seen while recording"
    deadline = time.time() + 30
    while _ray_worker_pids() and time.time() < deadline:  # ray.kill ends an actor's process
        time.sleep(0.1)
    assert not _ray_worker_pids(), "a Ray actor outlived the interrupted recording"


def test_a_slow_worker_gets_fewer_batches(ray_cluster, tmp_path):
    """Each batch goes to the worker that should be through its queue first by its pace, not to worker
    i mod n: with one worker ten times slower the fast one takes most of the batches (as far as the
    driver's window of results lets it run ahead), and the results still come back once each, in order."""
    import onnx

    from onnx_opscope.run import RuntimeConfig, iter_feeds
    from onnx_opscope.run.engine import run_batches, sessions_for

    model = onnx.load(generated_model_path("mlp"))
    engine = Engine("ray", workers=2)
    model_bytes, factory = sessions_for(engine, model, RuntimeConfig(threads=1), None)
    claim = tmp_path / "slow"

    def slow_or_fast(data):  # the first worker built claims the file: it is the slow one
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL))
            os.environ["OPSCOPE_TEST_PAUSE"] = "0.2"
        except FileExistsError:
            os.environ["OPSCOPE_TEST_PAUSE"] = "0.02"
        return factory(data)

    def pid_after_pause(step, outputs):
        time.sleep(float(os.environ["OPSCOPE_TEST_PAUSE"]))
        return os.getpid()

    want = [o.name for o in model.graph.output]
    got = list(run_batches(engine, model_bytes, slow_or_fast, iter_feeds(model, FeedSpec(batches=40)), want,
                           pid_after_pause))  # fmt: skip
    assert [s for s, _ in got] == list(range(40))
    later = [pid for s, pid in got if s >= 8]  # after the first window, dealt before any pace is known
    counts = sorted(later.count(p) for p in set(later))
    assert len(counts) == 2 and counts[0] <= 13, counts  # i mod n would give each 16
