"""A guarded memo: a session stand-in that returns cached outputs for inputs it has seen, exactly.

`GuardedMemo(session_or_model, capacity=...)` answers `.run(output_names, input_feed)` from its
cache only when two guards pass: a BLAKE2b hash of the inputs (names, dtypes, shapes, bytes)
finds an entry, and every input equals the entry's stored copy byte for byte (`np.array_equal`
on uint8 views of the same dtype and shape). Comparing the bytes rather than the values is what
makes the outputs bit-identical to the model's: -0.0 == 0.0 as values but can give different
outputs (1/x), and NaN != NaN as values would make an input with a NaN never hit. A hash
collision therefore costs a miss, never a wrong answer. Otherwise the session computes, and the
inputs (copied: the caller may reuse its buffers) and outputs are stored.

The cache is an LRU bounded by `capacity` entries and by `max_bytes` (inputs plus outputs of every
entry); an entry bigger than `max_bytes` alone is not stored. Hits return copies of the cached
outputs (writable, like onnxruntime's); `copy=False` returns read-only views instead, for a caller
that does not write to them. Where repeats come from: `LiveRecorder.findings()` reports the model
inputs' repeat share ("memoize" on `<inputs>`), measured on live traffic. State is real: a class.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OpscopeError
from .session import RuntimeConfig, make_session


def input_key(output_names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> bytes:
    """The cache key: BLAKE2b (16 bytes) of the output names asked for and of every input's name,
    dtype, shape and bytes (of a string tensor: its values), in name order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(None if output_names is None else list(output_names)).encode())
    for name in sorted(feed):
        a = feed[name]
        h.update(f"\0{name}\0{a.dtype.str}{a.shape}".encode())
        h.update(repr(a.tolist()).encode() if a.dtype == object else _bytes_of(a))
    return h.digest()


@dataclass
class _Entry:
    inputs: dict[str, np.ndarray]
    outputs: list[np.ndarray]
    nbytes: int


class GuardedMemo:
    """A session stand-in with an exact, bounded output cache (see the module doc).

    `session_or_model`: an InferenceSession-like object (`.run(output_names, input_feed,
    run_options=None)`) or a model (path or ModelProto: a session is made on `runtime`).
    `capacity`: entries at most; `max_bytes`: bytes of stored inputs and outputs at most (None: no
    limit). Counters: `hits`, `misses`, `collisions` (hash matched, bytes did not), `evictions`.
    """

    def __init__(
        self,
        session_or_model: Any,
        capacity: int = 1024,
        *,
        max_bytes: int | None = 256 << 20,
        copy: bool = True,
        runtime: RuntimeConfig | None = None,
        base_dir: str | os.PathLike | None = None,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise OpscopeError(f"capacity {capacity!r}: expected a positive number of entries")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise OpscopeError(f"max_bytes {max_bytes!r}: expected a positive number of bytes, or None")
        if hasattr(session_or_model, "run"):
            self.session = session_or_model
        else:
            self.session = make_session(session_or_model, runtime, base_dir=base_dir)
        self.capacity, self.max_bytes, self.copy = capacity, max_bytes, copy
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.collisions = self.evictions = 0

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None):
        feed = {name: np.asarray(v) for name, v in input_feed.items()}
        key = input_key(output_names, feed)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                if _same_inputs(entry.inputs, feed):
                    self._cache.move_to_end(key)
                    self.hits += 1
                    return [o.copy() if self.copy else _read_only(o) for o in entry.outputs]
                self.collisions += 1
            self.misses += 1
        outputs = self.session.run(output_names, input_feed, run_options)
        self._store(key, feed, outputs)
        return outputs

    def __getattr__(self, name: str) -> Any:  # get_inputs, get_outputs, get_providers, ...
        if name == "session":
            raise AttributeError(name)
        return getattr(self.session, name)

    def _store(self, key: bytes, feed: dict[str, np.ndarray], outputs: list) -> None:
        kept = [np.array(o, copy=True) for o in outputs]  # the caller owns what it was given
        inputs = {name: np.array(a, copy=True) for name, a in feed.items()}
        nbytes = sum(a.nbytes for a in inputs.values()) + sum(o.nbytes for o in kept)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._cache.pop(key, None)  # a collision's entry gives way to the newer inputs
            if old is not None:
                self.bytes -= old.nbytes
            self._cache[key] = _Entry(inputs, kept, nbytes)
            self.bytes += nbytes
            while len(self._cache) > self.capacity or (
                self.max_bytes is not None and self.bytes > self.max_bytes
            ):
                _, dropped = self._cache.popitem(last=False)
                self.bytes -= dropped.nbytes
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def hit_rate(self) -> float:
        calls = self.hits + self.misses
        return self.hits / calls if calls else float("nan")

    def stats(self) -> dict:
        """Counters and sizes, for logs and benchmarks."""
        return {
            "entries": len(self._cache), "bytes": self.bytes, "capacity": self.capacity, "max_bytes": self.max_bytes,
            "hits": self.hits, "misses": self.misses, "collisions": self.collisions, "evictions": self.evictions,
            "hit_rate": self.hit_rate,
        }  # fmt: skip

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.bytes = 0


def _same_inputs(stored: dict[str, np.ndarray], feed: dict[str, np.ndarray]) -> bool:
    """Every input equal to the stored one: the same names, dtypes, shapes and bytes."""
    if stored.keys() != feed.keys():
        return False
    for name, a in stored.items():
        b = feed[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype == object:  # strings: compared as values, there are no bytes to compare
            if not np.array_equal(a, b):
                return False
        elif not np.array_equal(_bytes_of(a), _bytes_of(b)):
            return False
    return True


def _bytes_of(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8) if a.size else np.empty(0, np.uint8)


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v
