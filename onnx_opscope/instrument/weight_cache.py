"""Weight sketches kept between runs, so a second recording of a model pays nothing for them.

A weight does not change between runs, and sketching a 28 GB decoder's weights reads 28 GB.
Each big weight's sketch values are stored under the user's cache folder (never beside the
model), one small JSON file per weight and sketch configuration, keyed by:

- a weight inline in the model: the sha256 of the model's protobuf (which `inject` computes
  anyway, and which holds the weight's bytes), its graph path and name;
- a weight in an external data file: that file's identity (device, inode, size, modification
  time in ns) and the weight's offset and length, plus a fingerprint of 16 blocks of 4 KiB
  of its bytes. Hashing the whole tensor would read it all, which is what the cache saves;
  build caches (make, ccache's direct mode) trust the same stat identity.

and the sketches, their options and this package's version. The folder is
`$OPSCOPE_CACHE_DIR`, else `$XDG_CACHE_HOME/onnx-opscope`, else `~/.cache/onnx-opscope`;
`OPSCOPE_CACHE_DIR=off` (or an empty value) turns the cache off. A cache that cannot be
read or written is skipped silently: it only ever saves time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from onnx import TensorProto

from .. import __version__
from ..errors import OpscopeError
from ..files import write_text
from ..graph.proto import external_info, is_external

MIN_BYTES = 4 * 2**20  # smaller weights are sketched faster than their entry is found and read
_PROBES, _PROBE_BYTES = 16, 4096


def cache_dir() -> Path | None:
    """Where weight sketches are kept, or None when the cache is off."""
    env = os.environ.get("OPSCOPE_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "onnx-opscope"


def weight_key(
    t: TensorProto,
    where: tuple[str, str],
    config: dict,
    model_sha256: str,
    base_dir: str | os.PathLike | None,
) -> str | None:
    """The cache key of weight `t` (`where` = its graph path and name) under sketch `config`; None when
    it has none (an external file that cannot be found)."""
    parts: dict = {"version": __version__, "config": config, "dims": list(t.dims), "type": t.data_type}
    if is_external(t):
        info = external_info(t)
        if base_dir is None:
            return None
        path = Path(base_dir) / info["location"]
        offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
        try:
            st = path.stat()
            parts["file"] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, offset, length]
            parts["probe"] = _fingerprint(path, offset, length if length >= 0 else st.st_size - offset)
        except OSError:
            return None
    else:
        parts["inline"] = [model_sha256, *where]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load(key: str) -> tuple[dict[str, np.ndarray], list[int]] | None:
    """The values stored under `key`, or None."""
    root = cache_dir()
    if root is None:
        return None
    try:
        entry = json.loads(_entry(root, key).read_text())
        return {k: np.asarray(v, np.float64) for k, v in entry["values"].items()}, list(entry["shape"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(key: str, values: dict[str, np.ndarray], shape: list[int]) -> None:
    """Keep `values` under `key` (atomically; nothing happens when the cache is off or unwritable)."""
    root = cache_dir()
    if root is None:
        return
    entry = {"values": {k: np.asarray(v).tolist() for k, v in values.items()}, "shape": shape}
    try:
        path = _entry(root, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(entry, allow_nan=True))
    except (OSError, OpscopeError):  # an unwritable cache only costs the next run its time
        return


def _entry(root: Path, key: str) -> Path:
    return root / "weights" / key[:2] / f"{key}.json"


def _fingerprint(path: Path, offset: int, length: int) -> str:
    """blake2b of `_PROBES` blocks of the tensor's bytes spread over its length."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for i in range(_PROBES):
            f.seek(
                offset + (length - _PROBE_BYTES) * i // max(_PROBES - 1, 1)
                if length > _PROBE_BYTES
                else offset
            )
            h.update(f.read(min(_PROBE_BYTES, max(length, 0))))
    return h.hexdigest()
