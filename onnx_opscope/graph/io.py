"""Load, check and save models without touching their external weights.

Weights stored in external data files stay on disk: we parse only the `.onnx` protobuf
and check that every external location stays inside the model's folder. Saving an
edited model next to a new path makes the data file reachable from there by a hard link
(no copy, no extra disk) or, when asked, by a streamed copy; we never rewrite the
weights. Every user mistake becomes one `OpscopeError` line.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, TensorProto, helper, numpy_helper

from ..errors import OpscopeError
from ..files import atomic_path, writing
from .index import iter_tensors
from .proto import external_info, is_external

ModelLike = str | os.PathLike | ModelProto

MIN_IR_VERSION = 3
_PROTO_LIMIT = 2**31 - 1  # protobuf cannot serialise a message of 2 GiB or more


def load_model(src: ModelLike, *, check_external: bool = True) -> ModelProto:
    """Parse `src` (a path, or a ModelProto returned as is) without loading external weights.

    Raises OpscopeError for a missing, empty, truncated or non-ONNX file, an IR version
    this onnx cannot read, and external-data locations that leave the model's folder or
    point at missing or short data files.
    """
    if isinstance(src, ModelProto):
        return src
    path = Path(src)
    if not path.exists():
        raise OpscopeError(f"{path}: no such file")
    if path.is_dir():
        raise OpscopeError(f"{path}: is a folder, expected an .onnx file")
    size = path.stat().st_size
    if size == 0:
        raise OpscopeError(f"{path}: empty file, not an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise OpscopeError(f"{path}: {_why_unparsable(path)} ({type(exc).__name__})") from None
    except OSError as exc:
        raise OpscopeError(f"{path}: cannot read: {exc.strerror or exc}") from None
    _check_header(model, path)
    if check_external:
        check_external_data(model, path.parent, name=str(path))
    return model


def _why_unparsable(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(1)
    # A ModelProto starts with field 1 (ir_version, varint): byte 0x08.
    if head == b"\x08":
        return "truncated or corrupt ONNX file (protobuf parse failed)"
    return "not an ONNX model (protobuf parse failed)"


def _check_header(model: ModelProto, path: Path) -> None:
    if not model.HasField("graph") or model.ir_version == 0 or not model.opset_import:
        raise OpscopeError(f"{path}: not an ONNX model (no graph, IR version or opset)")
    if model.ir_version < MIN_IR_VERSION:
        raise OpscopeError(
            f"{path}: IR version {model.ir_version} is too old (need {MIN_IR_VERSION}+)",
            hint="re-export the model with a current exporter",
        )
    if model.ir_version > onnx.IR_VERSION:
        raise OpscopeError(
            f"{path}: IR version {model.ir_version} is newer than this onnx {onnx.__version__} "
            f"reads (up to {onnx.IR_VERSION})",
            hint="upgrade onnx and onnxruntime",
        )


def model_and_data_dir(
    model: ModelLike, base_dir: str | os.PathLike | None = None
) -> tuple[ModelProto, str | os.PathLike | None]:
    """(the model's proto, the folder of its external data): a path's own folder unless `base_dir`
    says otherwise, a ModelProto's `base_dir`. Every external location is checked to stay inside it."""
    if isinstance(model, ModelProto):
        if base_dir is not None:
            check_external_data(model, base_dir)
        return model, base_dir
    proto = load_model(model, check_external=base_dir is None)
    if base_dir is None:
        return proto, Path(model).parent
    check_external_data(proto, base_dir, name=str(model))
    return proto, base_dir


def without_weight_data(model: ModelProto, min_bytes: int = 64 * 1024) -> ModelProto:
    """A copy of `model` whose main-graph initializers of `min_bytes` or more keep their name,
    dims and dtype but no bytes: what shape inference and site finding need, and nothing more.

    onnx's shape inference serialises the model and parses it back (several copies of every
    weight); run on this copy, injecting bert_like peaked at +15 MB over the model instead of
    +64 MB. `model` itself is not touched, so no weight is copied out and back into it.
    """
    light = ModelProto()
    _copy_fields(light, model, skip="graph")
    _copy_fields(light.graph, model.graph, skip="initializer")
    for t in model.graph.initializer:
        if t.HasField("raw_data") and len(t.raw_data) >= min_bytes:
            stub = light.graph.initializer.add()
            stub.name, stub.data_type = t.name, t.data_type
            stub.dims.extend(t.dims)
        else:
            light.graph.initializer.add().CopyFrom(t)
    return light


def _copy_fields(dst, src, skip: str) -> None:
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def external_files(model: ModelProto) -> list[str]:
    """The distinct external-data locations (relative paths) the model refers to."""
    seen: dict[str, None] = {}
    for t in iter_tensors(model):
        if is_external(t):
            seen.setdefault(external_info(t).get("location", ""), None)
    return list(seen)


def check_external_data(model: ModelProto, base_dir: str | os.PathLike, name: str = "model") -> None:
    """Refuse external locations that escape `base_dir`, and missing or short data files."""
    base = Path(base_dir).resolve()
    sizes: dict[str, int] = {}
    for t in iter_tensors(model):
        if not is_external(t):
            continue
        info = external_info(t)
        loc = info.get("location", "")
        if not loc:
            raise OpscopeError(f"{name}: tensor {t.name!r} is external but names no location")
        target = (base / loc).resolve()
        if Path(loc).is_absolute() or not target.is_relative_to(base):
            raise OpscopeError(
                f"{name}: tensor {t.name!r} points outside the model's folder ({loc!r})",
                hint="external data must live in the model's folder or below it",
            )
        if loc not in sizes:
            if not target.is_file():
                raise OpscopeError(f"{name}: external data file {loc!r} is missing (tensor {t.name!r})")
            sizes[loc] = target.stat().st_size
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        if end > sizes[loc]:
            raise OpscopeError(
                f"{name}: external data file {loc!r} is truncated: tensor {t.name!r} needs bytes up to "
                f"{end}, file has {sizes[loc]}"
            )


def save_model(
    model: ModelProto,
    path: str | os.PathLike,
    *,
    base_dir: str | os.PathLike | None = None,
    copy_external: bool = False,
) -> Path:
    """Write `model` to `path`, keeping external weights where they are.

    `base_dir` is the folder the model's external locations are relative to (the source
    model's folder). When `path` is in another folder, each data file is hard-linked
    there (falling back to a symlink), or streamed across when `copy_external` is set;
    the weights are never loaded. Models whose inline weights exceed protobuf's 2 GiB
    limit are saved with their large tensors moved to `<name>.data`.
    """
    out = Path(path)
    files = external_files(model)
    if files:
        if base_dir is None:
            raise OpscopeError("model has external data but no base_dir was given to find it")
        src_dir, dst_dir = Path(base_dir).resolve(), out.parent.resolve()
        if src_dir != dst_dir:
            for loc in files:
                _place_data_file(src_dir / loc, dst_dir / loc, copy_external)
    if model.ByteSize() > _PROTO_LIMIT:
        _save_with_data_file(model, out)
    else:
        with atomic_path(out) as tmp, open(tmp, "wb") as f:
            f.write(model.SerializeToString())
    return out


def _save_with_data_file(model: ModelProto, out: Path) -> None:
    """onnx.save with the large tensors in `<name>.data`: both written in a temporary folder beside `out`,
    then renamed into place, the data first (onnx would append to a data file already there)."""
    data = out.with_name(out.name + ".data")
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as folder:
            onnx.save(model, os.path.join(folder, out.name), save_as_external_data=True,
                      all_tensors_to_one_file=True, location=data.name, size_threshold=1024)  # fmt: skip
            os.replace(os.path.join(folder, data.name), data)
            os.replace(os.path.join(folder, out.name), out)


def _place_data_file(src: Path, dst: Path, copy: bool) -> None:
    if dst.exists():
        if dst.samefile(src):
            return
        raise OpscopeError(f"{dst}: a different file is already there; will not overwrite external data")
    if copy:
        with atomic_path(dst) as tmp:
            shutil.copyfile(src, tmp)
        return
    with writing(dst):
        dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        try:
            os.symlink(src, dst)
        except OSError as exc:
            raise OpscopeError(
                f"cannot link external data {src.name} next to {dst.parent}: {exc.strerror}",
                hint="save beside the original model, or ask for a copy of the data",
            ) from None


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_sha256(model: ModelProto) -> str:
    """sha256 of the serialised protobuf (external weights are referenced, not hashed)."""
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def opset_version(model: ModelProto, domain: str = "") -> int:
    """The model's opset for `domain` ("" and "ai.onnx" are the same), 0 if not imported."""
    for o in model.opset_import:
        if o.domain == domain or (domain in ("", "ai.onnx") and o.domain in ("", "ai.onnx")):
            return o.version
    return 0


# Element types stored less than a byte apart, or not as fixed-size elements at all.
_PACKED = {
    getattr(TensorProto, n)
    for n in ("STRING", "INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(TensorProto, n)
}


def read_external_tensor(t: TensorProto, base_dir: str | os.PathLike) -> np.ndarray:
    """One external tensor's array, read from its own bytes of the data file (checked by the caller).

    Read here, not by onnx's loader: onnx refuses data files with several hard links, and
    `save_model` hard-links the data file beside an instrumented model saved in another folder.
    """
    info = external_info(t)
    path = Path(base_dir) / info["location"]
    offset = int(info.get("offset", 0))
    dims = tuple(int(d) for d in t.dims)
    count = int(np.prod(dims)) if dims else 1
    if t.data_type not in _PACKED and sys.byteorder == "little":
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        length = int(info.get("length", count * dtype.itemsize))
        if length == count * dtype.itemsize:
            arr = np.fromfile(path, dtype=dtype, count=count, offset=offset)
            if arr.size != count:
                raise ValueError(f"{info['location']} ends before the tensor's {count} elements")
            return arr.reshape(dims)
    # Anything else: the tensor's bytes, decoded by onnx as inline raw data.
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(int(info["length"])) if "length" in info else f.read()
    inline = TensorProto()
    inline.CopyFrom(t)
    inline.ClearField("external_data")
    inline.data_location = TensorProto.DEFAULT
    inline.raw_data = data
    del data
    return numpy_helper.to_array(inline)
