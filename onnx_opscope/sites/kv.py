"""KV-cache sites: what a decoder writes into its cache each step, what KV-cache quantization has to fit.

No node of the plain or fused export is a site whose tap is the cache: a plain export makes
`present.{i}.key` with a Concat of the past and the new key, a fused one with GroupQueryAttention.
So the graph's outputs named like the caches `generate` feeds back (`present.{i}.key/value`,
`present_key_{i}`, `present.{i}` stacked, see `run.generate.cache_layout`) are sites of their own,
kind `kv`: the site id is the output's name, the op type its producer's, the role `key`, `value`
(or `kv` when the name says neither).

The tap is the step's new entries, not the whole cache: the Concat's input beside the past
([batch, kv_heads, seq, head_dim]), or GroupQueryAttention's key / value input without in-op rotary
([batch, seq, kv_heads·head_dim], the heads packed head-major; the tap's `bins` is kv_num_heads, so
the head sketches can split them). Either way the kind's head sketches (`sketch.heads`) give the
same per-head (min, max, Σx²) and per-(head, head_dim channel) max|x|. Sketching the whole present
each step costs O(past) per step: on SmolLM2-135M at 288 cached
tokens the 60 present taps added 21 ms of CPU to a 66 ms decode step (0.32x plain), the new entries
almost nothing; their ranges over the steps are the cache's range, and a phase's figures are those
of the entries it wrote. Any other producer gets the present itself ([batch, kv_heads, past+seq,
head_dim]). The sketches are the kind's own (`site.KIND_SKETCHES`: the default set and the head
sketches, whatever the user's list).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from onnx import ModelProto, NodeProto

from ..graph.index import GraphEntry, ModelIndex
from ..graph.proto import attr, input_at
from .site import Site, Tap

PRESENT = re.compile(r"^present(?=[._])")


def kv_role(name: str) -> str:
    """`key` or `value` from a cache output's name (`present.0.key`, `present_value_3`), else `kv`."""
    words = set(re.split(r"[._]", name.lower()))
    if words & {"key", "k"}:
        return "key"
    if words & {"value", "v"}:
        return "value"
    return "kv"


def new_entries(node: NodeProto, present: str, main: GraphEntry) -> Tap | None:
    """The tap on what `node` appends to the cache to make `present` (None: no such input to tap)."""
    role = kv_role(present)
    if node.op_type == "Concat" and len(node.input) == 2:
        graph_inputs = {i.name for i in main.graph.input}
        fresh = [x for x in node.input if x and x not in graph_inputs]
        if len(fresh) == 1:
            return Tap(role, fresh[0], channel_axis=-1, seq_axis=attr(node, "axis", -2))
    if (
        node.domain == "com.microsoft"
        and node.op_type == "GroupQueryAttention"
        and not attr(node, "do_rotary", 0)
    ):
        i = list(node.output).index(present)  # outputs: attention, present_key, present_value
        fresh = input_at(node, i) if i in (1, 2) else None
        if fresh:
            # the heads are packed in the channel axis: `bins` says how many (`sketch.heads` splits it)
            heads = attr(node, "kv_num_heads", 0) or None
            return Tap(role, fresh, channel_axis=-1, seq_axis=-2, bins=heads)
    return None


def kv_sites(index: ModelIndex, start: int) -> list[Site]:
    """One `kv` site per `present*` output of the main graph made by a node; `start` is the first site order."""
    main = index.main
    out = []
    for name in main.outputs:
        node = main.producer(name) if PRESENT.match(name) else None
        if node is None:
            continue
        tap = new_entries(node, name, main) or Tap(kv_role(name), name, channel_axis=-1, seq_axis=-2)
        out.append(Site(name, node.op_type, "kv", node.name, "", start + len(out), (tap,)))
    return out


# layout ops: what they make holds the same values as their data input, rearranged (or, for Concat,
# beside others); Cast keeps the values too
VIEW_OPS = frozenset(
    {"Concat", "Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Cast"}
)


def cache_views(model: ModelProto, pasts: Iterable[str]) -> set[str]:
    """Main-graph tensors that are the KV cache itself, rearranged: reached from a `pasts` input through
    layout ops alone (a plain export's Concat of the past and the step's entries, the key's Transpose, the
    grouped-query repeat's Expand and Reshape). A generation loop sketching them each step pays O(past) per
    step, O(steps^2) in all, for values the kv taps already record as each step's new entries: on
    SmolLM2-135M the 60 attention MatMul operands that are such views cost 11 ms of a 65 ms decode step
    (43 ms plain)."""
    views = set(pasts)
    for node in model.graph.node:
        if node.op_type in VIEW_OPS and node.domain in ("", "ai.onnx"):
            data = node.input if node.op_type == "Concat" else node.input[:1]
            if any(x in views for x in data):
                views.update(o for o in node.output if o)
    return views - set(pasts)


def without_cache_views(sites: list[Site], views: set[str]) -> list[Site]:
    """`sites` with the taps on `views` kept for their shape only (a GEMM's M, K, N still known)."""
    out = []
    for site in sites:
        moved = tuple(t for t in site.taps if t.tensor in views)
        kept = tuple(t for t in site.taps if t.tensor not in views)
        if not moved:
            out.append(site)
        elif kept:
            out.append(site.with_taps(kept, site.shape_only + moved))
    return out
