"""Every output appears whole or not at all: a failed command costs no earlier file and prints one line.

Each command is run once to leave good outputs, then again with a mistake or a failing disk; the
folder must be byte for byte as it was. A full disk and a forbidden write are simulated by an
`open` / writer that takes a budget of bytes and then raises, as a real one does, mid-file.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
from pathlib import Path

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from conftest import generated_model_path

from onnx_opscope import files
from onnx_opscope.cli import main
from onnx_opscope.errors import OpscopeError
from onnx_opscope.files import atomic_path, check_writable, replace
from onnx_opscope.run import read_table, sidecar_paths
from onnx_opscope.run.recorder import BatchPipeline
from onnx_opscope.run.table import is_table_folder

OUT = "out"  # the folder every command writes into, below each test's tmp_path
COMMANDS = {  # name -> (arguments with {model}, {other}, {table}, {out} to fill, the output's name)
    "inject": ("inject {model} -o {out}", "t.onnx"),
    "record": ("record {model} -o {out} --batches 2", "t.parquet"),
    "record-csv": ("record {model} -o {out} --batches 2", "t.csv"),
    "analyze": ("analyze {model} --format json -o {out}", "costs.json"),
    "analyze-table": ("analyze {model} -o {out}", "costs.txt"),
    "mine": ("mine {table} -o {out}", "findings.json"),
    "report": ("report {table} -o {out}", "report.html"),
    "report-md": ("report {table} -o {out}", "report.md"),
    "rewrite": ("rewrite fakequant {model} -o {out} --batches 1", "fq.onnx"),
    "parity": ("parity {model} {other} -o {out} --batches 1 --no-layers", "parity.json"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A model, a copy of it and a recorded table, in a folder of their own."""
    d = tmp_path_factory.mktemp("inputs")
    model = d / "mlp.onnx"
    shutil.copyfile(generated_model_path("mlp"), model)
    shutil.copyfile(model, d / "other.onnx")
    table = d / "t.parquet"
    assert main(["record", str(model), "-o", str(table), "--batches", "2", "-q"]) == 0
    return {"model": model, "other": d / "other.onnx", "table": table}


def _argv(name: str, inputs: dict[str, Path], out: Path) -> list[str]:
    template, _ = COMMANDS[name]
    return [*template.format(**{k: str(v) for k, v in inputs.items()}, out=str(out)).split(), "-q"]


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path below `folder` with its bytes (None for a folder)."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))
    }


def _good_outputs(name: str, inputs: dict[str, Path], tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / OUT / COMMANDS[name][1]
    assert main(_argv(name, inputs, out)) == 0
    return out, _snapshot(tmp_path / OUT)


def _one_error_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[0].startswith("error: ") and "Traceback" not in "\n".join(err), err
    assert len([line for line in err if not line.startswith("hint: ")]) == 1, err
    for w in words:
        assert w in err[0], err
    return err[0]


class _Disk:
    """A disk with `room` bytes left for files below `root`: a write past it writes what fits and raises
    OSError(`code`), as a full disk (ENOSPC) or a revoked permission (EACCES) does mid-file."""

    def __init__(self, root: Path, room: int, code: int):
        self.root, self.room, self.code = str(root), room, code

    def take(self, f, data):
        if len(data) > self.room:
            f.write(data[: self.room])
            self.room = 0
            raise OSError(self.code, os.strerror(self.code))
        self.room -= len(data)
        return f.write(data)

    def install(self, monkeypatch) -> None:
        real_open = builtins.open
        disk = self

        class Budgeted:
            def __init__(self, f):
                self._f = f

            def write(self, data):
                return disk.take(self._f, data)

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        def fake_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            writes = any(c in mode for c in "wax+")
            return Budgeted(f) if writes and str(file).startswith(disk.root) else f

        def through_open(real):
            def write(table, where, *args, **kwargs):
                if not isinstance(where, str | os.PathLike):  # a buffer: no disk involved
                    return real(table, where, *args, **kwargs)
                sink = io.BytesIO()
                real(table, sink, *args, **kwargs)
                with fake_open(where, "wb") as f:
                    f.write(sink.getvalue())

            return write

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)  # pathlib's write_text / write_bytes
        monkeypatch.setattr(pq, "write_table", through_open(pq.write_table))
        monkeypatch.setattr(pacsv, "write_csv", through_open(pacsv.write_csv))


# --------------------------------------------------------------------------------------------
# the helpers


def test_atomic_path_replaces_on_success_and_keeps_the_old_file_on_failure(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]
    with atomic_path(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"  # nothing shows until the block ends
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["a.txt"]


@pytest.mark.parametrize("exchange", ["renameat2", "two renames"])
def test_a_folder_replaces_a_file_or_a_folder(tmp_path, exchange, monkeypatch):
    """In one step with Linux's renameat2, elsewhere by two renames."""
    if exchange == "two renames":
        monkeypatch.setattr(files, "_renameat2", lambda: None)
    for old in ("file", "folder"):
        target = tmp_path / f"t-{old}"
        if old == "file":
            target.write_text("old")
        else:
            target.mkdir()
            (target / "part-00000.parquet").write_text("old")
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "part-00000.parquet").write_text("new")
        assert (target / "part-00000.parquet").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["t-file", "t-folder"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.write_text("file")
    replace(a, b)
    assert b.is_dir() and not a.exists()
    (b / "keep.txt").write_text("the user's")
    with pytest.raises(OpscopeError, match="it is a folder"), atomic_path(b) as tmp:  # a file never does
        tmp.write_text("new")
    assert (b / "keep.txt").read_text() == "the user's"


def test_check_writable_names_the_problem(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_text("x")
    (tmp_path / "link.onnx").symlink_to(model)
    with pytest.raises(OpscopeError, match="it is a folder"):
        check_writable(tmp_path)
    for spelling in (
        tmp_path / "link.onnx",
        tmp_path / "." / "m.onnx",
        tmp_path / ".." / tmp_path.name / "m.onnx",
    ):
        with pytest.raises(OpscopeError, match="it is the input"):
            check_writable(spelling, inputs=[model])
    with pytest.raises(OpscopeError, match="is a file, not a folder"):
        check_writable(model / "out.json")
    assert check_writable(tmp_path / "new" / "deeper" / "out.json", inputs=[model, None, 3])
    assert not (tmp_path / "new").exists()  # checking creates nothing


# --------------------------------------------------------------------------------------------
# every command


@pytest.mark.parametrize("name", list(COMMANDS))
def test_output_is_a_folder(tmp_path, inputs, name, capsys):
    out = tmp_path / OUT / COMMANDS[name][1]
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("the user's")
    before = _snapshot(tmp_path / OUT)
    assert main(_argv(name, inputs, out)) == 2
    _one_error_line(capsys, str(out), "it is a folder")
    assert _snapshot(tmp_path / OUT) == before


@pytest.mark.parametrize("name", ["inject", "record", "analyze", "rewrite", "parity", "mine", "report"])
def test_output_is_the_input(tmp_path, inputs, name, capsys):
    """The input model (or table) given again as the output, by another spelling or through a link."""
    folder = tmp_path / OUT
    folder.mkdir()
    if name in ("mine", "report"):  # their input is the table: a CSV file here
        src = folder / "t.csv"
        assert main(["record", str(inputs["model"]), "-o", str(src), "--batches", "1", "-q"]) == 0
        given = {**inputs, "table": src}
        out = folder / ".." / OUT / "t.csv"
    else:
        src = folder / "mlp.onnx"
        shutil.copyfile(inputs["model"], src)
        given = {**inputs, "model": src}
        out = folder / "link"
        out.symlink_to(src)
    capsys.readouterr()
    before = _snapshot(folder)
    argv = [*COMMANDS[name][0].format(**{k: str(v) for k, v in given.items()}, out=str(out)).split(), "-q"]
    assert main(argv) == 2
    _one_error_line(capsys, "it is the input")
    assert _snapshot(folder) == before


def _deny_writes(folder: Path, monkeypatch) -> None:
    """A read-only folder: chmod where it binds; as root (which chmod does not stop) `os.access` says no,
    and every write below the folder raises PermissionError, so the test still runs and can fail."""
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return
    real_access = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, **kw: (
            False if str(p).startswith(str(folder)) and mode & os.W_OK else real_access(p, mode, **kw)
        ),
    )
    _Disk(folder, 0, errno.EACCES).install(monkeypatch)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_read_only_folder(tmp_path, inputs, name, capsys, monkeypatch):
    out, before = _good_outputs(name, inputs, tmp_path)
    _deny_writes(tmp_path / OUT, monkeypatch)
    try:
        assert main(_argv(name, inputs, out)) == 2
    finally:
        (tmp_path / OUT).chmod(0o755)
    _one_error_line(capsys, "cannot write", "permission denied")
    monkeypatch.undo()
    assert _snapshot(tmp_path / OUT) == before


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_failing_disk_mid_write(tmp_path, inputs, name, code, capsys, monkeypatch):
    """The disk fills (or turns out read-only) in the middle of the first file: one line, exit 2, and
    every earlier output as it was, with no temporary left behind."""
    out, before = _good_outputs(name, inputs, tmp_path)
    _Disk(tmp_path / OUT, 100, code).install(monkeypatch)
    assert main(_argv(name, inputs, out)) == 2
    monkeypatch.undo()
    reason = "no space left" if code == errno.ENOSPC else "read-only file system"
    _one_error_line(capsys, "cannot write", reason)
    assert _snapshot(tmp_path / OUT) == before


# --------------------------------------------------------------------------------------------
# record: feed mistakes, and a disk that fills after the first batch


@pytest.mark.parametrize(
    "bad",
    [
        ["--dim", "bacth=4"],
        ["--shape", "x:1,2"],
        ["--data", "no-such-folder"],
        ["--range", "x:0,4"],
        ["--value", "nope:1"],
        ["--provider", "nosuch"],
        ["--parity-tol", "x"],
    ],
)
@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_failed_record_keeps_the_earlier_table(tmp_path, inputs, bad, suffix, capsys):
    out = tmp_path / OUT / f"good{suffix}"
    args = ["record", str(inputs["model"]), "-o", str(out), "--batches", "3", "-q"]
    assert main(args) == 0
    before = _snapshot(tmp_path / OUT)
    rows = read_table(out).num_rows
    capsys.readouterr()
    assert main([*args, *bad]) == 2
    _one_error_line(capsys)
    assert _snapshot(tmp_path / OUT) == before and read_table(out).num_rows == rows > 0


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_full_disk_after_the_first_batch_keeps_whole_batches(tmp_path, inputs, suffix, capsys, monkeypatch):
    out = tmp_path / OUT / f"t{suffix}"
    args = ["record", str(inputs["model"]), "-o", str(out), "--batches", "6", "-q"]
    monkeypatch.setattr(BatchPipeline, "MAX_BATCHES", 1)  # a part a batch, whatever the decode's pace
    assert main(args) == 0
    one_batch = read_table(out).num_rows // 6
    sizes = (
        [p.stat().st_size for p in out.glob("part-*.parquet")] if out.is_dir() else [out.stat().st_size // 6]
    )
    # room for the sidecars and two batches and a half
    room = sum(p.stat().st_size for p in sidecar_paths(out)) + int(2.5 * max(sizes))
    _Disk(tmp_path / OUT, room, errno.ENOSPC).install(monkeypatch)
    assert main(args) == 2
    monkeypatch.undo()
    _one_error_line(capsys, "no space left")
    table = read_table(out)
    steps = table.column("step").to_pylist()
    kept = sorted(set(steps))
    assert kept == list(range(len(kept))) and 1 <= len(kept) < 6, kept
    assert all(steps.count(s) == one_batch for s in kept)
    meta = json.loads(sidecar_paths(out)[1].read_text())
    assert meta["interrupted"] is True and not (out.is_dir() and (out / "_SUCCESS").exists())
    assert [p.name for p in (tmp_path / OUT).iterdir() if p.name.startswith(".")] == []


def test_table_layouts_of_earlier_versions_still_read(tmp_path, inputs):
    table = read_table(inputs["table"])
    one = tmp_path / "one.parquet"
    pq.write_table(table, one)
    parts = tmp_path / "killed.parquet.parts"
    parts.mkdir()
    pq.write_table(table, parts / "part-00000.parquet")
    for path in (one, tmp_path / "killed.parquet"):
        assert read_table(path).num_rows == table.num_rows
    with pytest.raises(OpscopeError, match="not a sketch table"):
        read_table(tmp_path)


def test_a_new_run_replaces_an_earlier_layout_and_its_leftovers(tmp_path, inputs):
    out = tmp_path / "t.parquet"
    pq.write_table(read_table(inputs["table"]), out)  # an earlier version's single file
    (tmp_path / "t.parquet.parts").mkdir()
    (tmp_path / ".t.parquet.part-00007.parquet.0123abcd.tmp").write_bytes(b"half")  # a killed run's
    assert main(["record", str(inputs["model"]), "-o", str(out), "--batches", "2", "-q"]) == 0
    assert out.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == [
        "t.parquet",
        "t.run.json",
        "t.sites.csv",
    ]
    assert is_table_folder(out)


def test_a_model_with_a_data_file_is_saved_whole_and_again_without_growing(tmp_path, monkeypatch):
    """Past protobuf's limit the weights go to `<name>.data`; saving again replaces both files (onnx alone
    would append to the data file already there)."""
    import onnx

    import onnx_opscope.graph.io as gio

    monkeypatch.setattr(gio, "_PROTO_LIMIT", 100)
    out = tmp_path / "m.onnx"
    sizes = []
    for _ in range(2):
        gio.save_model(onnx.load(generated_model_path("mlp")), out)
        sizes.append((out.stat().st_size, (tmp_path / "m.onnx.data").stat().st_size))
    assert sizes[0] == sizes[1] and sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    assert gio.load_model(out).graph.input[0].name == "x"
