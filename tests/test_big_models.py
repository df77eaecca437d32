"""Models of LLM size: weights sketched a chunk at a time, cached between runs, never held twice.

The streamed sketches are held to the whole-tensor numpy references on real weights, cut into
many chunks; the cache to what it must never do (write beside the model, serve a changed
file); the memory to a plain session's peak, each measured in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import real_model_path
from onnx import numpy_helper

from onnx_opscope import FeedSpec, read_table, record, zoo
from onnx_opscope import sketch as sk
from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph import load_model
from onnx_opscope.graph.chunks import chunkable, tensor_chunks, weight_bytes
from onnx_opscope.graph.inplace import load_in_place
from onnx_opscope.graph.io import read_external_tensor
from onnx_opscope.instrument import host_values, inject
from onnx_opscope.run import recorder

STREAMED = [n for n in sk.REGISTRY if n in sk.streamed.CHUNKED | sk.streamed.SAMPLED]
SUMS = {"mean", "sumsq", "l1"}


def _real_weights(name: str, n: int = 4) -> list[np.ndarray]:
    model = load_model(real_model_path(name))
    floats = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == 1]
    return sorted((w for w in floats if w.size >= 2000), key=lambda w: -w.size)[:n]


def _assert_same(got: dict, ref: dict, names, label: str) -> None:
    for stat in names:
        if stat in SUMS:
            np.testing.assert_allclose(got[stat], ref[stat], rtol=1e-12, atol=0, err_msg=f"{label} {stat}")
        else:
            np.testing.assert_array_equal(got[stat], ref[stat], err_msg=f"{label} {stat}")


@pytest.mark.parametrize("name", ["captcha_crnn", "ppocrv4_det", "magika_standard_v3_3"])
def test_streamed_sketches_equal_the_whole_tensor_references_on_real_weights(name):
    opts = sk.SketchOptions()
    rng = np.random.default_rng(0)
    for i, w in enumerate(_real_weights(name)):
        for poisoned in (False, True):
            x = w.copy()
            if poisoned:  # a NaN and an Inf in different chunks: those chunks take the masked path
                flat = x.reshape(-1)
                flat[rng.integers(flat.size)] = np.nan
                flat[rng.integers(flat.size)] = -np.inf
            t = numpy_helper.from_array(x, "w")
            info = sk.TapInfo(rank=x.ndim)
            ref = sk.references(STREAMED, x, info, opts)
            step = max(64, x.nbytes // 7 + 4)  # 7-8 chunks that end mid-row and mid-sample-block
            got = sk.streamed_references(STREAMED, tensor_chunks(t, None, step), x.size, info, opts)
            _assert_same(got, ref, STREAMED, f"{name} weight {i} {x.shape} poisoned={poisoned}")


def test_chunks_of_an_external_tensor_are_its_bytes_and_a_short_file_is_one_line(tmp_path):
    path = zoo.write_external_weights_model(tmp_path / "m", 3 * 2**20, 3)
    model = load_model(path)
    for t in model.graph.initializer:
        assert chunkable(t)
        whole = read_external_tensor(t, path.parent).ravel()
        pieces = list(np.concatenate([c.copy() for c in tensor_chunks(t, path.parent, 10_000)]))
        np.testing.assert_array_equal(np.asarray(pieces), whole)
    assert weight_bytes(model) == sum(t.dims[0] * t.dims[1] * 4 for t in model.graph.initializer)
    data = path.parent / "big.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    instrumented, manifest = inject(model)
    with pytest.raises(OpscopeError, match=r"'big.onnx.data' is truncated: tensor 'W1'") as exc:
        host_values(manifest, instrumented, path.parent)
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="ends inside tensor 'W2'"):  # a file cut while it is read
        list(tensor_chunks(model.graph.initializer[2], path.parent, 10_000))


def _folder_state(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_the_weight_cache_serves_a_second_run_and_never_a_changed_file(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("OPSCOPE_CACHE_DIR", str(cache))
    path = zoo.write_external_weights_model(tmp_path / "m", 24 * 2**20, 2)  # 12 MiB per weight
    before = _folder_state(path.parent)
    first = record(path, out=tmp_path / "a.parquet", feeds=FeedSpec(batches=1))
    assert _folder_state(path.parent) == before  # nothing written beside the model
    entries = sorted(cache.rglob("*.json"))
    assert len(entries) == 2

    def no_sketching(*args, **kwargs):
        raise AssertionError("a cached weight was sketched again")

    with monkeypatch.context() as m:
        m.setattr(sk, "streamed_references", no_sketching)
        again = record(path, out=tmp_path / "b.parquet", feeds=FeedSpec(batches=1))
    rows = [read_table(r.table).to_pandas() for r in (first, again)]
    weights = [r[r["role"] == "rhs"].sort_values(["site", "stat", "idx"])["value"].to_numpy() for r in rows]
    np.testing.assert_array_equal(*weights)

    # the file rewritten in place with one value changed: a new mtime, so both its weights get new keys
    data = path.parent / "big.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[-4:] = np.float32(7.5).tobytes()  # the last element of W1
    data.write_bytes(bytes(blob))
    changed = record(path, out=tmp_path / "c.parquet", feeds=FeedSpec(batches=1))
    table = read_table(changed.table).to_pandas()
    maxes = table[(table["role"] == "rhs") & (table["stat"] == "max")]["value"]
    assert maxes.max() == 7.5
    assert len(sorted(cache.rglob("*.json"))) == 4

    monkeypatch.setenv("OPSCOPE_CACHE_DIR", "off")
    off = tmp_path / "off"
    record(path, out=tmp_path / "d.parquet", feeds=FeedSpec(batches=1), weight_cache=True)
    assert not off.exists() and len(sorted(cache.rglob("*.json"))) == 4


def test_a_big_model_gets_its_parity_gate_after_the_last_batch(tmp_path, monkeypatch):
    path = zoo.write_external_weights_model(tmp_path / "m", 2**20, 2)
    calls = []
    real_gate = recorder._parity_gate

    def spy(*args, **kwargs):
        calls.append(kwargs.get("late", False))
        return real_gate(*args, **kwargs)

    monkeypatch.setattr(recorder, "_parity_gate", spy)
    monkeypatch.setattr(recorder, "LATE_PARITY_BYTES", 2**19)
    res = record(path, out=tmp_path / "late.parquet", feeds=FeedSpec(batches=3))
    meta = json.loads(res.run.read_text())
    assert calls == [True] and meta["parity"]["ok"] and res.batches == 3 and not meta["interrupted"]
    monkeypatch.setattr(recorder, "LATE_PARITY_BYTES", 2**40)
    record(path, out=tmp_path / "early.parquet", feeds=FeedSpec(batches=3))
    assert calls == [True, False]

    real_check = recorder.check_drop_in

    def moved(names, plain, tapped, rtol, atol):
        return real_check(names, plain, [x + 1 for x in tapped], rtol, atol)

    monkeypatch.setattr(recorder, "check_drop_in", moved)
    monkeypatch.setattr(recorder, "LATE_PARITY_BYTES", 2**19)
    with pytest.raises(OpscopeError, match="after the last batch") as exc:
        record(path, out=tmp_path / "failed.parquet", feeds=FeedSpec(batches=2))
    assert exc.value.exit_code == 3
    assert read_table(tmp_path / "failed.parquet").num_rows > 0  # what was recorded stays readable


_MEASURE = r"""
import json, sys, time
from pathlib import Path
import onnxruntime as ort
import onnx_opscope.run  # the same imports in both processes
from onnx_opscope import FeedSpec, record
model, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "plain":
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    import numpy as np
    x = np.random.default_rng(0).standard_normal((1, sess.get_inputs()[0].shape[1])).astype(np.float32)
    for _ in range(2):
        sess.run(None, {"x": x})
else:
    record(model, out=out, feeds=FeedSpec(batches=2))
hwm = next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM"))
print(json.dumps({"peak_mb": hwm / 1024}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS is read from /proc (Linux)")
def test_recording_an_external_data_model_costs_little_more_memory_than_plain_inference(tmp_path):
    """320 MiB of weights (over LATE_PARITY_BYTES): before streaming, the host sketches' float64
    copies and a second session for the parity gate added ~600 MB to a ~600 MB plain peak."""
    path = zoo.write_external_weights_model(tmp_path / "m", 320 * 2**20, 2)
    assert weight_bytes(load_model(path)) >= recorder.LATE_PARITY_BYTES
    env = {**os.environ, "OPSCOPE_CACHE_DIR": "off"}
    peaks = {}
    for kind in ("plain", "record"):
        cmd = [sys.executable, "-c", _MEASURE, str(path), kind, str(tmp_path / "t.parquet")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        peaks[kind] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]
    # the goal is +10% of plain's peak plus a bounded sketch buffer (the chunk, the decode, Parquet)
    assert peaks["record"] <= 1.10 * peaks["plain"] + 64, peaks


def test_inline_weights_referenced_in_place_give_the_same_table(tmp_path, monkeypatch):
    """captcha_crnn's inline weights read from the model file by onnxruntime and the host sketches,
    never parsed: the same rows as with them parsed, and the same parity."""
    path = real_model_path("captcha_crnn")
    placed = load_in_place(path)
    full = onnx.load(str(path))
    moved = [t for t in placed.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(moved) >= 10 and placed.ByteSize() < path.stat().st_size // 20
    inline = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer}
    for t in moved:
        np.testing.assert_array_equal(read_external_tensor(t, path.parent), inline[t.name])
    tables = {}
    for label, threshold in (("parsed", 2**62), ("in place", 0)):
        monkeypatch.setattr(recorder, "IN_PLACE_BYTES", threshold)
        res = record(path, out=tmp_path / f"{label}.parquet", feeds=FeedSpec(batches=2), run_id="r")
        assert res.parity.ok and res.manifest.source == str(path)
        tables[label] = read_table(res.table).to_pandas().sort_values(["step", "site", "role", "stat", "idx"])
    a, b = (t.reset_index(drop=True) for t in tables.values())
    assert a.drop(columns="value").equals(b.drop(columns="value"))
    np.testing.assert_allclose(a["value"], b["value"], rtol=1e-12, atol=0)  # weight sums: chunk order


def test_a_file_that_is_not_a_whole_model_gets_load_models_error(tmp_path):
    bad = tmp_path / "cut.onnx"
    bad.write_bytes(real_model_path("captcha_crnn").read_bytes()[:100_000])
    with pytest.raises(OpscopeError, match="truncated or corrupt"):
        load_in_place(bad)
    with pytest.raises(OpscopeError, match="no such file"):
        load_in_place(tmp_path / "missing.onnx")
