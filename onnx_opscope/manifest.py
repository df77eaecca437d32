"""The manifest: what each extra output of an instrumented model means, and how to decode it.

Saved as JSON beside the instrumented model. Outputs are *raw* per tapped tensor (one tensor
feeding three sites is reduced once), so the manifest has three parts:

- `sites`: id, op type, node, subgraph, execution order, and for each role the tap it uses;
- `taps`: one per tapped tensor: tensor name, subgraph, rank, channel/seq axes, static numel
  (null when symbolic), whether it is a weight (`constant`: no outputs, computed on the host),
  how many Loop/Scan levels stack its outputs, and raw -> output name;
- `outputs`: the flat view DESIGN.md asks for, one entry per appended output (output, tap,
  tensor, raw stat, the (site, role) pairs it serves, static length where known).

`decode` turns a run's outputs into tidy rows (site, op_type, role, stat, idx, value, numel)
plus per-site GEMM dims M, K, N resolved from the run-time shapes. Taps on weights
(`constant`) have no outputs: their values come from `weights.host_values`, computed once on
the host and passed to `decode(..., host=...)`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from . import sketches as sk
from .errors import OpscopeError

FORMAT = "onnx-opscope/manifest"
VERSION = 1


@dataclass
class TapRecord:
    id: str
    tensor: str
    graph: str
    rank: int | None
    elem_type: int
    channel_axis: int
    seq_axis: int
    numel: int | None
    constant: bool
    stacked: int  # Loop/Scan levels between the tap and the main graph: outputs gain that many axes
    sketches: list[str]
    outputs: dict[str, str]  # raw name -> graph output name
    bins: int | None = None  # route taps: the number of experts E, when static

    def info(self) -> sk.TapInfo:
        return sk.TapInfo(self.rank, self.elem_type, self.channel_axis, self.seq_axis, self.bins)


@dataclass
class SiteRecord:
    id: str
    op_type: str
    node: str
    graph: str
    order: int
    roles: dict[str, str]  # role -> tap id (sketched)
    shape_roles: dict[str, str] = field(default_factory=dict)  # role -> tap id (shape only)
    attrs: dict = field(default_factory=dict)


@dataclass
class Manifest:
    source: str
    source_sha256: str
    opset: int
    original_outputs: list[str]
    sketches: list[str]
    options: dict
    placement: str
    sites: list[SiteRecord]
    taps: list[TapRecord]
    format: str = FORMAT
    version: int = VERSION

    def sketch_options(self) -> sk.SketchOptions:
        opts = dict(self.options)
        if opts.get("hist_range") is not None:
            opts["hist_range"] = tuple(opts["hist_range"])
        return sk.SketchOptions(**opts)

    def output_names(self) -> list[str]:
        return [name for t in self.taps for name in t.outputs.values()]

    def outputs(self) -> list[dict]:
        """One entry per appended output, as DESIGN.md's manifest lists them."""
        uses: dict[str, list[list[str]]] = {}
        for s in self.sites:
            for role, tap in s.roles.items():
                uses.setdefault(tap, []).append([s.id, s.op_type, role])
        entries = []
        for t in self.taps:
            for raw, name in t.outputs.items():
                entries.append(
                    {
                        "output": name,
                        "tap": t.id,
                        "tensor": t.tensor,
                        "stat": raw,
                        "uses": uses.get(t.id, []),
                        "graph": t.graph,
                        "stacked": t.stacked,
                        "numel": t.numel,
                    }
                )
        return entries

    def to_json(self) -> str:
        d = asdict(self)
        d["outputs"] = self.outputs()
        return json.dumps(d, indent=1)

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.write_text(self.to_json())
        return p


def load_manifest(path: str | os.PathLike) -> Manifest:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise OpscopeError(f"{p}: no such manifest file") from None
    except json.JSONDecodeError as exc:
        raise OpscopeError(f"{p}: not a manifest (bad JSON: {exc.msg})") from None
    if d.get("format") != FORMAT:
        raise OpscopeError(f"{p}: not an onnx-opscope manifest")
    if d.get("version") != VERSION:
        raise OpscopeError(f"{p}: manifest version {d.get('version')} is not {VERSION}")
    d.pop("outputs", None)
    d["sites"] = [SiteRecord(**s) for s in d["sites"]]
    d["taps"] = [TapRecord(**t) for t in d["taps"]]
    return Manifest(**d)


def manifest_path_for(model_path: str | os.PathLike) -> Path:
    p = Path(model_path)
    return p.with_name(p.stem + ".manifest.json")


# --------------------------------------------------------------------------------------------
# decoding


class Rows:
    """Tidy rows of one batch, kept as one chunk per (site, role, stat) until columns are asked for.

    `to_arrow()` builds the table with dictionary codes and numpy repeats; building Python
    lists of ~100k strings per batch made decoding cost more than the taps on small models.
    The list-valued attributes (site, op_type, role, stat, idx, value, numel, M, K, N) stay for
    callers that iterate.
    """

    COLUMNS = ("site", "op_type", "role", "stat", "idx", "value", "numel", "M", "K", "N")
    _META = ("site", "op_type", "role", "stat", "numel", "M", "K", "N")

    def __init__(self) -> None:
        self._meta: list[tuple] = []  # one (site, op_type, role, stat, numel, M, K, N) per chunk
        self._values: list[np.ndarray] = []

    def add(self, meta: tuple, values: np.ndarray) -> None:
        if len(values):
            self._meta.append(meta)
            self._values.append(np.asarray(values, np.float64))

    def __len__(self) -> int:
        return sum(len(v) for v in self._values)

    def _repeat(self, field_name: str) -> list:
        i = self._META.index(field_name)
        return [m[i] for m, v in zip(self._meta, self._values) for _ in range(len(v))]

    def __getattr__(self, name: str) -> list:
        if name in self._META:
            return self._repeat(name)
        if name == "idx":
            return [j for v in self._values for j in range(len(v))]
        if name == "value":
            return np.concatenate(self._values).tolist() if self._values else []
        raise AttributeError(name)

    def chunks(self) -> list[tuple]:
        """One (site, op_type, role, stat, numel, M, K, N) per chunk of rows, in row order."""
        return list(self._meta)

    def to_pydict(self) -> dict[str, list]:
        return {c: getattr(self, c) for c in self.COLUMNS}

    def to_arrow(self) -> pa.Table:
        """The rows as a pyarrow Table with columns M, K, N, numel, site, op_type, role, stat, idx, value."""
        counts = np.array([len(v) for v in self._values], np.int64)
        chunk = np.repeat(np.arange(len(counts)), counts)
        starts = np.cumsum(counts) - counts
        cols: dict[str, pa.Array] = {}
        for name in ("M", "K", "N", "numel"):
            i = self._META.index(name)
            per_chunk = [m[i] for m in self._meta]
            missing = np.array([v is None for v in per_chunk], bool)
            ints = np.array([0 if v is None else v for v in per_chunk], np.int64)
            cols[name] = arrow_int64(ints[chunk], missing[chunk])
        for name in ("site", "op_type", "role", "stat"):
            i = self._META.index(name)
            labels = [m[i] for m in self._meta]
            uniq = list(dict.fromkeys(labels))
            code = {u: i for i, u in enumerate(uniq)}
            cols[name] = arrow_strings(uniq, np.array([code[v] for v in labels], np.int64)[chunk])
        cols["idx"] = arrow_int64(np.arange(len(chunk), dtype=np.int64) - starts[chunk])
        cols["value"] = arrow_float64(np.concatenate(self._values) if self._values else np.zeros(0))
        return pa.table(cols)


# Arrow columns straight from numpy buffers: pa.array() imports pandas when it is installed, and
# with it pyarrow.compute and numpy.ma (+40 MB RSS for a recording that needs none of them).


def arrow_int64(values: np.ndarray, missing: np.ndarray | None = None) -> pa.Array:
    v = np.ascontiguousarray(values, np.int64)
    valid = None
    if missing is not None and missing.any():
        valid = pa.py_buffer(np.packbits(~missing.astype(bool), bitorder="little"))
    return pa.Array.from_buffers(pa.int64(), len(v), [valid, pa.py_buffer(v)])


def arrow_float64(values: np.ndarray) -> pa.Array:
    v = np.ascontiguousarray(values, np.float64)
    return pa.Array.from_buffers(pa.float64(), len(v), [None, pa.py_buffer(v)])


def arrow_strings(labels: list[str], codes: np.ndarray) -> pa.Array:
    """A string column whose row i is labels[codes[i]]."""
    enc = [lab.encode() for lab in labels]
    lengths = np.array([len(e) for e in enc], np.int64)[codes]
    offsets = np.zeros(len(codes) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("string column over 2 GiB")
    data = b"".join(enc[c] for c in codes.tolist())
    return pa.Array.from_buffers(
        pa.string(), len(codes), [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)]
    )


def decode_tap(
    tap: TapRecord, raw_out: dict[str, np.ndarray], opts: sk.SketchOptions
) -> tuple[dict[str, np.ndarray], list[int] | None]:
    """Sketch values of one tap (merged over Loop/Scan iterations) and its run-time shape.

    Returns ({}, None) when the tap's subgraph did not run (an If branch not taken). Not for
    weight taps (`tap.constant`): they have no outputs, `decode_taps` takes them from the host.
    """
    if tap.constant:
        raise OpscopeError(
            f"tap {tap.id} ({tap.tensor!r}) is a weight: it has no graph outputs to decode",
            hint="its values come from weights.host_values(); decode() and decode_taps() take them as host=",
        )
    parts = _split_iterations(tap, raw_out)
    if not parts:
        return {}, None
    values = [{name: sk.finalize(name, raw, opts) for name in tap.sketches} for raw in parts]
    shapes = [raw["shape"][1:].astype(np.int64).tolist() for raw in parts]
    numels = [int(np.prod(s)) if s else 1 for s in shapes]
    if len(values) == 1:
        return values[0], shapes[0]
    merged = {name: _merge(name, [v[name] for v in values], numels) for name in tap.sketches}
    if "chan_outlier" in merged and "chan_maxabs" in merged:
        merged["chan_outlier"] = sk._chan_outlier(merged["chan_maxabs"])
    return merged, shapes[-1]


def _split_iterations(tap: TapRecord, raw_out: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    arrays = {raw: np.asarray(raw_out[name]) for raw, name in tap.outputs.items()}
    if tap.stacked == 0:
        return [] if arrays["shape"].size == 0 else [{k: _raw_values(k, v) for k, v in arrays.items()}]
    parts = []
    lead = arrays["shape"].shape[: tap.stacked]
    for i in np.ndindex(*lead):
        part = {k: _raw_values(k, np.asarray(v[i])) for k, v in arrays.items()}
        if part["shape"].size:
            parts.append(part)
    return parts


def _raw_values(raw: str, v: np.ndarray) -> np.ndarray:
    """A raw output as the host side reads it: float64, but bin indices stay small integers."""
    return v.ravel() if raw == "hidx" else v.astype(np.float64).ravel()


def _merge(name: str, vals: list[np.ndarray], numels: list[int]) -> np.ndarray:
    how = sk.REGISTRY[name].merge
    with np.errstate(all="ignore"):
        if how == "min":
            return np.array([np.nanmin(np.concatenate(vals))]) if vals else np.array([np.nan])
        if how == "max":
            return np.array([np.nanmax(np.concatenate(vals))])
        if how == "sum":
            return np.sum(vals, axis=0)
        if how == "mean":
            w = np.asarray(numels, np.float64)
            v = np.concatenate(vals)
            ok = np.isfinite(v)
            return np.array([np.sum(v[ok] * w[ok]) / np.sum(w[ok]) if ok.any() else np.nan])
        if how == "concat":
            return np.concatenate(vals)
        if how == "maxelem":
            return np.nanmax(np.stack(vals), axis=0)
        return vals[0]  # first / derived (recomputed by the caller)


def gemm_dims(site: SiteRecord, shapes: dict[str, list[int]]) -> tuple[int | None, int | None, int | None]:
    """(M, K, N) of a site as an implicit GEMM, from its roles' run-time shapes (None if unknown).

    MatMul-like: lhs [..., M, K] @ rhs [..., K, N], M counts the batch dims too. Gemm honours
    transA/transB. Conv: M = batch x output positions, K = Cin/group x kernel, N = Cout.
    ConvTranspose: M = batch x input positions, K = Cin, N = Cout/group x kernel. LSTM/GRU/RNN:
    M = seq x batch, K = input size, N = gates x hidden.
    """
    op, a = site.op_type, site.attrs
    prod = lambda v: int(np.prod(v)) if v else 1  # noqa: E731
    try:
        if op in ("MatMul", "MatMulInteger", "QLinearMatMul"):
            lhs, rhs = shapes["lhs"], shapes["rhs"]
            m = prod(lhs[:-1]) if len(lhs) > 1 else 1
            return m, lhs[-1], rhs[-1] if len(rhs) > 1 else 1
        if op == "Gemm":
            sa, sb = shapes["a"], shapes["b"]
            m, k = (sa[1], sa[0]) if a.get("transA") else (sa[0], sa[1])
            n = sb[0] if a.get("transB") else sb[1]
            return m, k, n
        if op == "Conv":
            w, y = shapes["weight"], shapes["out"]
            return y[0] * prod(y[2:]), prod(w[1:]), w[0]
        if op == "ConvTranspose":
            x, w = shapes["in"], shapes["weight"]
            return x[0] * prod(x[2:]), w[0], prod(w[1:])
        if op in ("LSTM", "GRU", "RNN"):
            x, w = shapes["x"], shapes["w"]
            return x[0] * x[1], x[2], w[1]
    except (KeyError, IndexError):
        pass
    return None, None, None


HostValues = dict[str, tuple[dict[str, np.ndarray], list[int]]]  # what weights.host_values returns


def decode_taps(
    manifest: Manifest, outputs: dict[str, np.ndarray], host: HostValues | None = None
) -> dict[str, tuple[dict[str, np.ndarray], list[int] | None]]:
    """tap id -> (sketch values, run-time shape) for one run; ({}, None) for a tap that did not run.

    Taps with graph outputs are decoded from `outputs` (`decode_tap`); constant taps (weights)
    have none and take their values from `host` (`weights.host_values`), computed once. A weight
    tap in a subgraph follows the subgraph: ({}, None) when the other taps of its graph, or of
    a graph around it, say it did not run (an If branch not taken, a Loop run zero times). In a
    subgraph where only weights are tapped there is nothing to tell: the weight's values are given.
    """
    const = [t for t in manifest.taps if t.constant]
    if const and host is None:
        raise OpscopeError(
            f"the manifest has {len(const)} weight taps, computed on the host, not in the graph: "
            "pass host=host_values(manifest, model) (from onnx_opscope.weights) to decode",
            hint="host_values reads the weights once from the source or the instrumented model",
        )
    opts = manifest.sketch_options()
    decoded = {t.id: decode_tap(t, outputs, opts) for t in manifest.taps if not t.constant}
    if not const:
        return decoded
    ran: dict[str, bool] = {}  # graph -> whether its live taps ran (they all run, or none)
    for t in manifest.taps:
        if not t.constant:
            ran[t.graph] = ran.get(t.graph, False) or decoded[t.id][1] is not None
    skipped = [g for g, r in ran.items() if g and not r]
    for t in const:
        if any(t.graph == g or t.graph.startswith(g + "/") for g in skipped):
            decoded[t.id] = ({}, None)
            continue
        if t.id not in host:
            raise OpscopeError(
                f"host values have no entry for weight tap {t.id} ({t.tensor!r})",
                hint="compute them with host_values() for this manifest",
            )
        values, shape = host[t.id]
        decoded[t.id] = ({name: values[name] for name in t.sketches}, list(shape))
    return decoded


def decode(manifest: Manifest, outputs: dict[str, np.ndarray], host: HostValues | None = None) -> Rows:
    """Tidy rows for one run: every (site, role, sketch, element) that ran.

    `host`: the weight taps' values, `weights.host_values(manifest, model)` computed once and
    passed to every decode; needed when the manifest has weight taps (`TapRecord.constant`).
    """
    decoded = decode_taps(manifest, outputs, host)
    rows = Rows()
    for site in manifest.sites:
        shapes = {
            role: decoded[tid][1]
            for role, tid in {**site.shape_roles, **site.roles}.items()
            if decoded[tid][1] is not None
        }
        m, k, n = gemm_dims(site, shapes)
        for role, tid in site.roles.items():
            values, shape = decoded[tid]
            if shape is None:
                continue
            numel = int(np.prod(shape)) if shape else 1
            for stat, vals in values.items():
                rows.add((site.id, site.op_type, role, stat, numel, m, k, n), vals)
    return rows
