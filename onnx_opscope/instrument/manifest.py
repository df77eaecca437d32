"""The manifest: what each extra output of an instrumented model means, and how to decode it.

Saved as JSON beside the instrumented model. Outputs are *raw* per tapped tensor (one tensor
feeding three sites is reduced once), so the manifest has three parts:

- `sites`: id, op type, node, subgraph, execution order, and for each role the tap it uses;
- `taps`: one per tapped tensor: tensor name, subgraph, rank, channel/seq axes, static numel
  (null when symbolic), whether it is a weight (`constant`: no outputs, computed on the host),
  how many Loop/Scan levels stack its outputs, and raw -> output name;
- `outputs`: the flat view DESIGN.md asks for, one entry per appended output (output, tap,
  tensor, raw stat, the (site, role) pairs it serves, static length where known).

`decode.decode` turns a run's outputs into tidy rows through it. Taps on weights
(`constant`) have no outputs: their values come from `host.host_values`, computed once on
the host and passed to `decode(..., host=...)`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import OpscopeError
from ..files import write_text
from ..sketch import SketchOptions, TapInfo

FORMAT = "onnx-opscope/manifest"
VERSION = 5  # 2: the main graph's small raws packed into a few outputs (`packing`); 3: the masking
# branch's raws of a main-graph tap in one vector (`TapRecord.slow`); 4: a tap in If branches packs its
# scalars and sample into one vector (`packing.pack_branch_raws`), empty when its branch did not run, and the
# copied tensors of a graph leave it as two outputs, their values and their shapes (`packing.pack_copied`);
# 5: scalars and tensors of unknown rank join their graph's copied pack (no shape marker of their own), and
# from opset 11 the taps of If branches leave in one stream of two outputs (`branches`)


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
    bins: int | None = None  # groups along the channel axis: a route tap's experts E, a fused kv tap's heads
    # QDQ models: `tensor` is quantized and read through DequantizeLinear(tensor, scale, zero_point,
    # **attrs) in `domain` (sites.qdq); the sketches describe the dequantized values. None: as is.
    dequant: dict | None = None
    # copied out whole (its one output "tensor" is the tensor itself), sketched on the host at decode
    # (`sketch.batched_references`): a small tensor costs less that way than a tap's nodes in the graph
    copied: bool = False
    # a main-graph tap (`packing`): the raws its masking branch's one vector (raw "slow", empty when the
    # clean branch ran, which its raw "check" tells) holds in order, and overrides (`sketch.build_tap`)
    slow: list[str] = field(default_factory=list)

    def info(self) -> TapInfo:
        return TapInfo(self.rank, self.elem_type, self.channel_axis, self.seq_axis, self.bins)


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
    kind: str = "gemm"  # gemm, attn, route or residual


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
    # taps not placed because they would change what onnxruntime computes (run.kernels): one dict
    # per (site, role) with the tensor, the optimization level and the kernels that would change
    left_out: list[dict] = field(default_factory=list)
    # the packed outputs (`packing`): {"output", "pack": shapes | scalars | samples | slow | tap | copied,
    # "raws": [[tap id, raw]]} (and "shapes", the copied tensors' shapes, for a copied pack), and the If
    # branches' stream {"output", "pack": "branches", "shapes": its ids, "graphs": [[path, [[tap id, its
    # vector or None]]]]} (`branches.build_stream`); a member's `TapRecord.outputs` name is then a tensor
    # inside the model, read out of its pack
    packed: list[dict] = field(default_factory=list)

    def sketch_options(self) -> SketchOptions:
        return SketchOptions.from_dict(self.options)

    @functools.cached_property
    def layout(self) -> PackLayout:
        """Where each packed member lies in its pack (made on first use)."""
        return PackLayout(self)

    def output_names(self) -> list[str]:
        """The model outputs a run fetches for the taps: the packs and every raw outside them."""
        members = self.layout.members if self.packed else set()
        own = [name for t in self.taps for name in t.outputs.values() if name not in members]
        return own + [
            o for p in self.packed for o in (p["output"], p.get("shapes")) if o and o not in members
        ]

    def outputs(self) -> list[dict]:
        """One entry per appended output, as DESIGN.md's manifest lists them."""
        uses: dict[str, list[list[str]]] = {}
        for s in self.sites:
            for role, tap in s.roles.items():
                uses.setdefault(tap, []).append([s.id, s.op_type, role])
        entries = []
        where = self.layout.where if self.packed else {}
        pack_of = self.layout.pack_of if self.packed else {}
        streams = {o for s in self.layout.streams for o in s[:2]} if self.packed else set()
        for t in self.taps:
            for raw, name in t.outputs.items():  # a stream member's place changes from run to run
                at = None if pack_of.get(name) in streams else where.get(name)
                entries.append(
                    {
                        "output": pack_of.get(name, name),
                        "at": None if at is None else [at[1], at[2]],
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
        """Write the manifest JSON at `path`, whole or not at all."""
        return write_text(path, self.to_json())


class PackLayout:
    """Where each packed member (`packing`) lies in its pack: made once per manifest (`Manifest.layout`)."""

    def __init__(self, manifest: Manifest):
        by_id = {t.id: t for t in manifest.taps}
        self.sample_size = manifest.sketch_options().sample_size
        self.where: dict[str, tuple[str, int, int, bool]] = {}  # member -> (pack output, start, stop, scalar)
        self.samples: tuple[str, list[str], list[str]] | None = None  # (output, members, their shape members)
        self.pack_of: dict[str, str] = {}  # member -> its pack's output
        # (output, per member tap: its own member, its check's, the members its masking branch overrides in order)
        self.slow: tuple[str, list[tuple[str, str, list[str]]]] | None = None
        self.copied: dict[str, tuple[str, list[str], list[int]]] = {}  # pack -> (its shapes, members, ranks)
        self.copied_in: dict[str, str] = {}  # a copied tensor -> its pack
        # a branch tap's sample -> (its vector, where the sample starts, the tap's shape)
        self.tap_samples: dict[str, tuple[str, int, str]] = {}
        # the If branches' streams (`branches`): (floats, ids, per graph id its members: a copied tensor's
        # ("copied", name, rank), an in-graph tap's ("tap", its vector, its shape, its scalars, a sample?))
        self.streams: list[tuple[str, str, list[list[tuple]]]] = []
        self.stream_of: dict[str, int] = {}  # a stream member -> its stream
        # (a pack's or stream's output, the bytes of its dims or ids) -> where its members lie
        # (`packing.Unpacked._cuts_of`): a model's runs give each a handful, each cut apart in Python once
        self.cuts: dict[tuple[str, bytes], tuple] = {}
        vectors: dict[str, list[str]] = {}  # a branch tap's vector -> its raws
        for entry in manifest.packed:
            out, pack = entry["output"], entry["pack"]
            if pack == "branches":
                continue
            if pack == "tap":
                vectors[out] = [raw for _, raw in entry["raws"]]
            members = [(by_id[tid], raw) for tid, raw in entry["raws"]]
            self.pack_of.update((t.outputs[r], out) for t, r in members)
            if pack == "copied":
                names = [t.outputs[r] for t, r in members]
                # a member of a branch not run is empty, of its rank (one dim where it has none or an unknown one)
                self.copied[out] = (entry["shapes"], names, [max(t.rank or 1, 1) for t, _ in members])
                self.copied_in.update((name, out) for name in names)
                continue
            if pack == "slow":
                self.slow = (
                    out,
                    [(t.outputs[r], t.outputs["check"], [t.outputs[s] for s in t.slow]) for t, r in members],
                )
                continue
            if pack == "samples":
                self.samples = (
                    out,
                    [t.outputs[r] for t, r in members],
                    [t.outputs["shape"] for t, _ in members],
                )
                continue
            at = 0
            for tap, raw in members:
                if raw == "samples":  # last in a branch tap's vector ("tap"), of a length its shape gives
                    self.tap_samples[tap.outputs[raw]] = (out, at, tap.outputs["shape"])
                    continue
                n = tap.rank + 1 if pack == "shapes" else 1
                self.where[tap.outputs[raw]] = (out, at, at + n, pack in ("scalars", "tap"))
                at += n
        for entry in (e for e in manifest.packed if e["pack"] == "branches"):
            self._stream(entry, by_id, vectors)
        self.members = set(self.pack_of)
        self.slow_members = {own for own, _, _ in self.slow[1]} if self.slow else set()

    def key_of(self, out: str) -> str:
        """The output that says how copied pack or stream `out` is cut (empty when it did not run): the pack's
        shapes, the stream's ids."""
        if out in self.copied:
            return self.copied[out][0]
        return next(ids for values, ids, _ in self.streams if values == out)

    def _stream(self, entry: dict, by_id: dict[str, TapRecord], vectors: dict[str, list[str]]) -> None:
        out, ids, k = entry["output"], entry["shapes"], len(self.streams)
        graphs = []
        for _, listed in entry["graphs"]:
            members = []
            for tid, vector in listed:
                t = by_id[tid]
                if vector is None:
                    members.append(("copied", t.outputs["tensor"], max(t.rank or 1, 1)))
                    self.stream_of[t.outputs["tensor"]] = k
                    self.pack_of[t.outputs["tensor"]] = out
                    continue
                raws = vectors[vector]
                n = len(raws) - ("samples" in raws)
                members.append(("tap", vector, t.outputs["shape"], n, "samples" in raws))
                self.stream_of.update({vector: k, t.outputs["shape"]: k})  # the raws: cut from the vector
                self.pack_of.update({vector: out, t.outputs["shape"]: ids})
                self.pack_of.update((t.outputs[r], out) for r in raws)  # for `Manifest.outputs`
            graphs.append(members)
        self.streams.append((out, ids, graphs))


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
        raise OpscopeError(
            f"{p}: manifest version {d.get('version')} is not {VERSION}",
            hint="instrument the model again with this version (`opscope inject MODEL`): the layout of "
            "its outputs changed",
        )
    d.pop("outputs", None)
    d["sites"] = [SiteRecord(**s) for s in d["sites"]]
    d["taps"] = [TapRecord(**t) for t in d["taps"]]
    return Manifest(**d)


def manifest_path_for(model_path: str | os.PathLike) -> Path:
    p = Path(model_path)
    return p.with_name(p.stem + ".manifest.json")
