"""What a site is: one node of a kind we tap, and the tensors (roles) it reads or makes.

A *site* is one node of a known kind anywhere in the model, `If` branches and `Loop` / `Scan`
bodies included. Each of its *taps* names one tensor by role (`lhs`, `rhs`, `out`, ...) and
says which axis is its feature ("channel") axis and which axis its rows are adjacent along
("seq"), so per-channel and per-row sketches mean the same thing for every op. Site ids are
the model index's node ids (`graph.index`): the node name when unique, else `<op>_<k>`,
prefixed by the subgraph path.

Kinds: `gemm` (MatMul, Gemm, Conv, ConvTranspose, LSTM / GRU / RNN, the quantized matmuls),
`attn` (Softmax and fused attention), `route` (TopK / ArgMax routers), `residual` (an Add of
x and f(x)), `norm` / `rotary` (a decoder's fused normalizations and rotary embedding,
`sites.decoder`). A kind names the sketches its sites get unless the user asks for their own
(`KIND_SKETCHES`; gemm, norm and rotary sites get the user's list).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SITE_KINDS = ("gemm", "attn", "route", "residual", "norm", "rotary", "kv")
KIND_SKETCHES: dict[str, tuple[str, ...]] = {
    "attn": ("attn_qmax", "attn_krecv"),
    "route": ("route_load",),
    "residual": ("sumsq",),
    # the KV cache (`sites.kv`): ranges, and per head and per (head, head_dim channel) what KV-cache
    # quantization scales need (`sketch.heads`), the same figures on plain and fused exports
    "kv": (
        "min",
        "max",
        "mean",
        "sumsq",
        "nan_count",
        "inf_count",
        "hist",
        "elemsig",
        "head_min",
        "head_max",
        "head_sumsq",
        "head_chan_maxabs",
    ),  # fmt: skip
}
"""The sketches a site of each non-gemm kind gets by default (sketch names, see onnx_opscope.sketch)."""


@dataclass(frozen=True)
class Dequant:
    """A tap that dequantizes its quantized tensor first, as the DequantizeLinear it stands in for
    (`sites.qdq`): scale and zero point tensor names ("" when absent), integer attributes, domain."""

    scale: str
    zero_point: str = ""
    attrs: tuple[tuple[str, int], ...] = ()
    domain: str = ""


@dataclass(frozen=True)
class Tap:
    role: str
    tensor: str
    channel_axis: int = -1
    seq_axis: int = -2
    bins: int | None = None  # groups along the channel axis: a route tap's experts E (None: not static), a
    # fused kv tap's heads packed head-major (`sketch.heads`)
    dequant: Dequant | None = None  # read `tensor` through a DequantizeLinear (QDQ models)


@dataclass(frozen=True)
class Site:
    id: str
    op_type: str
    kind: str  # gemm, attn, route or residual
    node: str  # the node's own name, may be empty
    graph: str  # subgraph path, "" for the main graph
    order: int  # position in a depth-first walk: execution order within a graph
    taps: tuple[Tap, ...]
    attrs: dict = field(default_factory=dict, compare=False, hash=False)
    shape_only: tuple[Tap, ...] = ()  # roles left out by the selection: only their shape is taken (M, K, N)

    def role(self, name: str) -> Tap | None:
        return next((t for t in self.taps if t.role == name), None)

    def with_taps(self, taps: tuple[Tap, ...], shape_only: tuple[Tap, ...] = ()) -> Site:
        return replace(self, taps=taps, shape_only=shape_only)


def all_roles(sites: list[Site]) -> list[str]:
    return sorted({t.role for s in sites for t in s.taps})
