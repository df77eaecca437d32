"""Writing files so that a reader never sees half of one and a failure never costs an earlier one.

Every file a command writes goes through `atomic_path`: it is written under a temporary name
in its target folder and renamed over the target at the end (onnxruntime's `save_tensors_data`
does the same), so the path holds the old content or the new, never a mix, and a failure
removes the temporary and leaves the old file as it was. A folder (a Parquet dataset) cannot
be renamed over an existing path, so `replace` swaps the two in one step with Linux's
renameat2(RENAME_EXCHANGE); elsewhere it takes two renames, with an instant between them when
the path is absent. Nothing is fsynced: this guards against a failing or killed process, not
against a power cut, which would cost a sync per batch of a recording.

`check_writable` runs before any work, so an output that cannot be written (a folder, the input
itself, a read-only or forbidden folder) is one error line before minutes of running; `writing`
turns the OSErrors a write still meets (a full disk, ...) into the same one line, in one place.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import OpscopeError

_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EISDIR: "it is a folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENAMETOOLONG: "the name is too long",
    getattr(errno, "EDQUOT", errno.ENOSPC): "no space left on the device",
}
_HINT = "nothing was half-written and earlier files are as they were; write elsewhere with -o"


def os_error(exc: OSError, path: str | os.PathLike) -> OpscopeError:
    """The one-line error (exit 2) for an OSError met while writing `path`."""
    reason = _REASONS.get(exc.errno, exc.strerror or str(exc))
    return OpscopeError(f"cannot write {path}: {reason}", hint=_HINT)


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """An OSError in the block is a user's problem with `path` (disk full, read-only, ...), not a bug."""
    try:
        yield
    except OSError as exc:
        raise os_error(exc, path) from None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, temp_dir: str | os.PathLike | None = None) -> Iterator[Path]:
    """A temporary path to write `path`'s new content at (a file, or a folder the block creates): moved
    over `path` when the block ends, removed when it raises.

    `temp_dir` (on the same file system) holds the temporary instead of `path`'s folder, for a folder
    that must only ever show whole files (a Parquet dataset, whose readers take every file in it).
    """
    final = Path(path)
    where = Path(temp_dir) if temp_dir is not None else final.parent
    name = final.name if where == final.parent else f"{final.parent.name}.{final.name}"
    tmp = where / f".{name}.{secrets.token_hex(4)}.tmp"
    try:
        with writing(final):
            where.mkdir(parents=True, exist_ok=True)
            yield tmp
            replace(tmp, final)
    except BaseException:
        remove(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path`, whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_table(table: Any, path: str | os.PathLike, fmt: str | None = None) -> Path:
    """A pyarrow Table as json (records), csv or parquet (by `fmt` or the suffix), whole or not at all."""
    import json

    out = Path(path)
    fmt = (fmt or out.suffix.lstrip(".") or "json").lower()
    if fmt not in ("json", "csv", "parquet"):
        raise OpscopeError(f"unknown output format {fmt!r}", hint="use json, csv or parquet")
    with atomic_path(out) as tmp:
        if fmt == "json":
            tmp.write_text(json.dumps(table.to_pylist(), indent=1, default=float) + "\n")
        elif fmt == "csv":
            import pyarrow.csv as pacsv

            pacsv.write_csv(table, str(tmp))
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, str(tmp))
    return out


def write_document(
    path: str | os.PathLike, fmt: str | None, table: Callable[[], Any], text: Callable[[], str]
) -> Path:
    """A result as json (one document, `text()`), or csv / parquet (its rows, `table()`: a pyarrow
    Table), chosen by `fmt` or the suffix, whole or not at all."""
    out = Path(path)
    fmt = (fmt or out.suffix.lstrip(".") or "json").lower()
    if fmt not in ("json", "csv", "parquet"):
        raise OpscopeError(f"unknown output format {fmt!r}", hint="use json, csv or parquet")
    if fmt != "json":
        return write_table(table(), out, fmt)
    with atomic_path(out) as tmp:
        tmp.write_text(text())
    return out


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path`, whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def replace(src: Path, dst: Path) -> None:
    """Move `src` over `dst` in one step: os.replace for a file (which refuses to replace a folder), an
    exchange for a folder (a rename cannot put one over an existing path), the old content then removed.
    Only a folder replaces a folder, so a caller that did not `check_writable` can lose no user folder
    to a file."""
    if src.is_dir() and os.path.lexists(dst):
        _exchange(src, dst)
        remove(src)
    else:
        os.replace(src, dst)


def remove(path: Path) -> None:
    """Remove a file or a folder tree if it is there (clean-up: errors are ignored)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


@functools.cache
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+, musl 1.2.3+
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> None:
    """Swap what `a` and `b` name: in one step on Linux, else by two renames (`b` absent for an instant)."""
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # EINVAL: the file system cannot
            raise OSError(err, os.strerror(err), str(b))
    aside = b.with_name(f".{b.name}.{secrets.token_hex(4)}.tmp")
    os.replace(b, aside)
    os.replace(a, b)
    os.replace(aside, a)


def check_writable(
    path: str | os.PathLike,
    *,
    inputs: Iterable[Any] = (),
    replaces: Callable[[Path], bool] | None = None,
) -> Path:
    """Fail now, before any work, when `path` cannot be written: it is a folder (unless `replaces(path)`
    says it is this command's own earlier output), it is one of `inputs` (also by another spelling or
    through a link; entries that are not paths are skipped), or its folder is read-only or forbidden."""
    p = Path(path)
    with writing(p):  # a folder that cannot even be looked into
        if p.is_dir() and not (replaces and replaces(p)):
            raise OpscopeError(f"cannot write {p}: it is a folder", hint="give the path of a file with -o")
        same = next((given for given in inputs if _same(p, given)), None) if p.exists() else None
        if same is not None:
            raise OpscopeError(f"cannot write {p}: it is the input {same}", hint="write the output elsewhere")
        folder = next(a for a in (p.parent, *p.parent.parents) if os.path.lexists(a))
        if not folder.is_dir():
            raise OpscopeError(f"cannot write {p}: {folder} is a file, not a folder")
        for target, mode in ((folder, os.W_OK | os.X_OK), (p, os.W_OK)):
            if os.path.lexists(target) and not os.access(target, mode):
                raise os_error(OSError(errno.EROFS if _read_only(folder) else errno.EACCES, ""), p)
    return p


def _same(p: Path, given: Any) -> bool:
    return isinstance(given, str | os.PathLike) and os.path.exists(given) and p.samefile(given)


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs on Windows
        return False
