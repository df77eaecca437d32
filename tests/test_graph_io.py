"""Loading, checking and saving models: external weights stay on disk, bad files are one clear line."""

from __future__ import annotations

import os
import re
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import generated_model_path, real_model_path
from onnx import TensorProto, helper

from onnx_opscope import zoo
from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.graph.io import external_files, load_model, opset_version, save_model
from onnx_opscope.instrument import inject, inject_file
from onnx_opscope.run.session import RuntimeConfig, make_session

WEIGHT_BYTES = 32 * 1024**2  # big enough that loading it would dwarf everything else inject allocates
OFF = RuntimeConfig(graph_opt="disable")


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """big.onnx + big.onnx.data (32 MB of weights, 4 tensors), written once for the module."""
    return zoo.write_external_weights_model(tmp_path_factory.mktemp("big"), WEIGHT_BYTES, 4)


def _y(path: Path, x: np.ndarray) -> np.ndarray:
    sess = make_session(path, OFF)
    return sess.run([sess.get_outputs()[0].name], {"x": x})[0]


# --------------------------------------------------------------------------------------------
# external data


def test_inject_does_not_load_external_weights(big, tmp_path):
    inject(big)  # warm up imports and caches outside the measurement
    tracemalloc.start()
    try:
        model, manifest = inject(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < WEIGHT_BYTES / 8, f"inject allocated {peak} bytes for {WEIGHT_BYTES} bytes of weights"
    weights = [t for t in model.graph.initializer if not t.name.startswith("opscope_c")]
    assert weights and all(t.data_location == TensorProto.EXTERNAL for t in weights)
    tap_constants = [t for t in model.graph.initializer if t.name.startswith("opscope_c")]
    assert sum(len(t.raw_data) for t in tap_constants) < 4096  # the taps' shared small constants
    assert external_files(model) == ["big.onnx.data"]
    assert len(manifest.taps) > 0


def test_save_beside_the_source_reuses_the_data_file(big):
    before = sorted(os.listdir(big.parent))
    out = big.parent / "tapped.onnx"
    inject_file(big, out)
    assert sorted(os.listdir(big.parent)) == sorted(before + ["tapped.onnx", "tapped.manifest.json"])
    assert external_files(load_model(out)) == ["big.onnx.data"]
    x = np.random.default_rng(0).standard_normal((1, _dim(big))).astype(np.float32)
    np.testing.assert_array_equal(_y(out, x), _y(big, x))
    out.unlink()
    (big.parent / "tapped.manifest.json").unlink()


def _dim(path: Path) -> int:
    return load_model(path).graph.input[0].type.tensor_type.shape.dim[1].dim_value


def test_save_in_another_folder_hard_links_the_data(big, tmp_path):
    out = tmp_path / "elsewhere" / "tapped.onnx"
    tracemalloc.start()
    try:
        inject_file(big, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < WEIGHT_BYTES / 8
    linked = out.parent / "big.onnx.data"
    assert linked.is_file() and not linked.is_symlink()
    assert os.path.samefile(linked, big.parent / "big.onnx.data")  # the same file: no copy, no extra disk
    x = np.random.default_rng(1).standard_normal((1, _dim(big))).astype(np.float32)
    np.testing.assert_array_equal(_y(out, x), _y(big, x))
    # saving there again is fine (same file); a different file of that name is never overwritten
    inject_file(big, out)
    other = tmp_path / "clash" / "tapped.onnx"
    other.parent.mkdir()
    (other.parent / "big.onnx.data").write_bytes(b"not the weights")
    with pytest.raises(OpscopeError, match="a different file is already there"):
        inject_file(big, other)
    assert (other.parent / "big.onnx.data").read_bytes() == b"not the weights"


def test_copy_external_copies(big, tmp_path):
    out = tmp_path / "copy" / "tapped.onnx"
    inject_file(big, out, copy_external=True)
    copied = out.parent / "big.onnx.data"
    assert not os.path.samefile(copied, big.parent / "big.onnx.data")
    assert copied.stat().st_size == (big.parent / "big.onnx.data").stat().st_size
    with open(copied, "rb") as a, open(big.parent / "big.onnx.data", "rb") as b:
        assert a.read(1 << 20) == b.read(1 << 20)


def test_in_memory_model_with_external_data_needs_base_dir(big, tmp_path):
    model, _ = inject(big)
    with pytest.raises(OpscopeError, match="no base_dir"):
        save_model(model, tmp_path / "t.onnx")
    x = np.zeros((1, _dim(big)), np.float32)
    sess = make_session(model, OFF, base_dir=big.parent)
    assert sess.run(None, {"x": x})[0].shape == (1, _dim(big))


def _with_location(big: Path, folder: Path, location: str, data: bytes | None = None) -> Path:
    """A copy of big.onnx in `folder` whose first tensor points at `location`."""
    model = onnx.load(big, load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = location
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    if data is not None:
        (folder / location).write_bytes(data)
    return path


def test_external_location_escaping_the_folder_is_refused(big, tmp_path):
    for loc in (str((big.parent / "big.onnx.data").resolve()), "../big/big.onnx.data", "sub/../../x.data"):
        path = _with_location(big, tmp_path / "m", loc)
        with pytest.raises(OpscopeError, match="points outside the model's folder") as err:
            inject(path)
        assert "\n" not in str(err.value) and err.value.hint


def test_missing_and_truncated_external_data(big, tmp_path):
    path = _with_location(big, tmp_path / "missing", "gone.data")
    with pytest.raises(OpscopeError, match=r"external data file 'gone.data' is missing \(tensor "):
        inject(path)
    path = _with_location(big, tmp_path / "short", "short.data", data=b"\0" * 1000)
    with pytest.raises(
        OpscopeError, match=r"external data file 'short.data' is truncated: tensor .* needs bytes up to"
    ):
        load_model(path)


# --------------------------------------------------------------------------------------------
# bad input files


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, the message it must give)."""
    real = real_model_path("ppocrv4_rec").read_bytes()
    files: dict[str, tuple[Path, str]] = {}

    def write(name: str, data: bytes, why: str) -> None:
        p = tmp_path / name
        p.write_bytes(data)
        files[name] = (p, why)

    files["missing"] = (tmp_path / "nope.onnx", "no such file")
    (tmp_path / "folder.onnx").mkdir()
    files["folder"] = (tmp_path / "folder.onnx", "is a folder, expected an .onnx file")
    write("empty.onnx", b"", "empty file, not an ONNX model")
    write("half.onnx", real[: len(real) // 2], r"truncated or corrupt ONNX file \(protobuf parse failed\)")
    write("notes.onnx", b"hello, this is text\nnot a model\n", "not an ONNX model")
    write("image.onnx", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "not an ONNX model")
    for ir, why in (
        (99, "IR version 99 is newer than this onnx"),
        (2, r"IR version 2 is too old \(need 3\+\)"),
    ):
        m = onnx.load(generated_model_path("mlp"))
        m.ir_version = ir
        write(f"ir{ir}.onnx", m.SerializeToString(), why)
    return files


def test_bad_files_are_one_clear_error(tmp_path):
    for name, (path, why) in _bad_files(tmp_path).items():
        with pytest.raises(OpscopeError, match=why) as err:
            load_model(path)
        msg = str(err.value)
        assert msg.startswith(str(path)) and "\n" not in msg, (name, msg)
        with pytest.raises(OpscopeError, match=why):
            inject(path)


def test_bad_files_through_the_cli(tmp_path, capsys):
    for name, (path, why) in _bad_files(tmp_path).items():
        out = tmp_path / "out" / f"{name}.onnx"
        assert main(["inject", str(path), "-o", str(out)]) == 2, name
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert [ln for ln in lines if ln.startswith("error:")] == lines[:1] and re.search(why, lines[0])
        assert all(ln.startswith(("error:", "hint:")) for ln in lines) and len(lines) <= 2, (name, lines)
        assert "Traceback" not in captured.err and captured.out == ""
        assert not out.exists()


def test_cli_inject_writes_model_and_manifest(tmp_path, capsys):
    out = tmp_path / "t.onnx"
    assert main(["inject", str(generated_model_path("mlp")), "-o", str(out)]) == 0
    assert out.is_file() and (tmp_path / "t.manifest.json").is_file()
    assert "sites" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# headers and round trips


def test_load_keeps_a_model_proto_and_reads_opsets():
    m = zoo.build("mlp")
    assert load_model(m) is m
    assert opset_version(m) == 17 and opset_version(m, "com.microsoft") == 0
    assert opset_version(load_model(generated_model_path("attention_contrib")), "com.microsoft") == 1


def test_save_inline_model_round_trips(tmp_path):
    m = zoo.build("cnn")
    path = save_model(m, tmp_path / "a" / "cnn.onnx")
    assert load_model(path).SerializeToString() == m.SerializeToString()


def test_model_without_graph_is_not_onnx(tmp_path):
    p = tmp_path / "nograph.onnx"
    p.write_bytes(helper.make_model(helper.make_graph([], "g", [], [])).SerializeToString()[:2])
    with pytest.raises(OpscopeError):
        load_model(p)


def test_without_weight_data_keeps_everything_but_the_weight_bytes():
    """Shape inference on the light copy gives the same value types; the model is not touched."""
    from onnx_opscope import zoo
    from onnx_opscope.graph.io import without_weight_data

    model = zoo.bert_like(layers=1)
    before = model.SerializeToString()
    light = without_weight_data(model)
    assert model.SerializeToString() == before
    big = {t.name for t in model.graph.initializer if len(t.raw_data) >= 64 * 1024}
    stubs = {t.name: t for t in light.graph.initializer}
    assert big and all(not stubs[n].raw_data and list(stubs[n].dims) for n in big)
    assert light.ByteSize() < model.ByteSize() / 10
    assert [n.name for n in light.graph.node] == [n.name for n in model.graph.node]
    full = onnx.shape_inference.infer_shapes(model).graph.value_info
    part = onnx.shape_inference.infer_shapes(light).graph.value_info
    assert {v.name: v.type for v in full} == {v.name: v.type for v in part}
