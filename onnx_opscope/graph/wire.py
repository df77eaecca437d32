"""Graph edits at the protobuf wire level, for speed: the only module that encodes bytes by hand.

Why: a graph's `node` field is a repeated message, and repeated fields concatenate on the
wire. So inserting nodes is "encode the new ones, join them between the original nodes'
encodings, parse the result once in C" instead of copying millions of NodeProtos one by one
in Python (seconds on a 160k-node graph). And a tap subgraph built once with placeholder
names can be copied for another tensor by swapping names in its bytes, which is exact as
long as no length changes (`Chunk` + `count_in_strings`).

Wire format used here (protobuf encoding): GraphProto.node is field 1 of wire type 2
(length-delimited), so one entry is the tag byte 0x0A, the message length as a varint, then
the serialized NodeProto.
"""

from __future__ import annotations

from typing import NamedTuple

from google.protobuf.message import Message
from onnx import GraphProto, NodeProto

_NODE_TAG = b"\x0a"  # field 1 (GraphProto.node), wire type 2 (length-delimited)


class Chunk(NamedTuple):
    """`n` nodes already encoded as GraphProto.node entries."""

    data: bytes
    n: int


def varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf varint: 7 bits a byte, low bits first, high bit set on all but the last."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def node_entry(data: bytes) -> bytes:
    """`data` (a serialized NodeProto) as one entry of GraphProto.node."""
    return _NODE_TAG + varint(len(data)) + data


def splice(graph: GraphProto, by_pos: dict[int, list[NodeProto | Chunk]]) -> list[int]:
    """Insert nodes into `graph` in place: `by_pos[i]` goes right after original node i (-1: first).

    Returns each original node's new position. The graph's node list is rebuilt from bytes, so
    NodeProto and subgraph objects taken from it before are stale afterwards: edit subgraphs
    (and splice them, deepest first) before the graph that holds them.
    """
    parts: list[bytes] = []
    moved: list[int] = []
    count = 0

    def add(items: list[NodeProto | Chunk]) -> None:
        nonlocal count
        for x in items:
            if isinstance(x, Chunk):
                parts.append(x.data)
                count += x.n
            else:
                parts.append(node_entry(x.SerializeToString()))
                count += 1

    add(by_pos.get(-1, []))
    for i, node in enumerate(graph.node):
        moved.append(count)
        parts.append(node_entry(node.SerializeToString()))
        count += 1
        add(by_pos.get(i, []))
    del graph.node[:]
    graph.MergeFromString(b"".join(parts))
    return moved


def count_in_strings(msg: Message, words: tuple[str, ...]) -> list[int]:
    """How often each of `words` occurs in the string fields of `msg`, nested messages included.

    A placeholder may be renamed in a message's bytes only when every occurrence in the bytes is
    inside a string field (a name); this counts those, to compare with the count in the bytes.
    """
    counts = [0] * len(words)
    stack = [msg]
    while stack:
        m = stack.pop()
        for fd, value in m.ListFields():
            if fd.type == fd.TYPE_STRING:
                for v in [value] if isinstance(value, str) else value:
                    for i, w in enumerate(words):
                        counts[i] += v.count(w)
            elif fd.type == fd.TYPE_MESSAGE:
                stack.extend([value] if isinstance(value, Message) else value)
    return counts
