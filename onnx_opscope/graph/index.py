"""The model index: one walk over a model, subgraphs included, and what every stage asks of it.

Every stage that looks at a model's structure goes through here: the graphs (`If` branches,
`Loop` / `Scan` bodies and any other graph attribute) with their paths and owners, each
node's stable id, each tensor's producer and consumers, which names are constants
(initializers and `Constant` outputs, enclosing scopes included), and a name allocator that
never collides with a name the model uses.

**Ids.** A node's id is its name when it has one that no earlier node of its graph took; an
unnamed node is `<op_type>_<k>`, k counting the unnamed nodes of that op type before it in
the same graph; a repeated name (or a generated id a real name already took) gets `#2`,
`#3`, ... Every node opscope adds is named, so inserting taps, shadows or fake-quant nodes
never shifts an original node's id: the ids of an instrumented model are those of its
source. A subgraph's path is `<owner's full id>/<attribute>` (`<attribute><j>` for the j-th
graph of a GRAPHS attribute); a node's full id is `<path>/<id>`, or `<id>` in the main
graph (path ""). Sites, the analyzer's per-node costs and the weights found for host
sketches all use these ids, so a site id is the analyzer's node id of the same node.

Per-graph tables (ids, producers, consumers, constants) are built on first use: a
160k-node graph that is only walked for its subgraphs pays for none of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from onnx import GraphProto, ModelProto, NodeProto, TensorProto

from .proto import DEFAULT_DOMAINS, constant_value, subgraphs

CARRIERS = ("If", "Loop", "Scan")
"""Owners whose graphs can hand a new output to the graph around them (as an If output or a scan output)."""

Constant = TensorProto | NodeProto
"""Where a constant lives: an initializer, or a Constant node (its value in an attribute)."""


def node_ids(graph: GraphProto, path: str = "") -> list[str]:
    """Full ids of `graph`'s nodes, in node order (see the module doc)."""
    taken: set[str] = set()
    unnamed: dict[str, int] = {}
    prefix = f"{path}/" if path else ""
    out = []
    for n in graph.node:
        if n.name:
            base = n.name
        else:
            k = unnamed.get(n.op_type, 0)
            unnamed[n.op_type] = k + 1
            base = f"{n.op_type}_{k}"
        nid, j = base, 1
        while nid in taken:
            j += 1
            nid = f"{base}#{j}"
        taken.add(nid)
        out.append(prefix + nid)
    return out


@dataclass(eq=False)
class GraphEntry:
    """One graph of the model and its lazily built tables."""

    path: str
    graph: GraphProto
    parent: str | None = None
    owner: NodeProto | None = None
    owner_index: int | None = None  # the owner's position in the parent graph
    attr: str | None = None  # the owner's attribute that holds this graph
    carried: bool = True  # every owner up to the main graph is an If/Loop/Scan of the default domain
    _ids: list[str] | None = field(default=None, repr=False)
    _producers: dict[str, int] | None = field(default=None, repr=False)
    _consumers: dict[str, list[int]] | None = field(default=None, repr=False)
    _constants: dict[str, Constant] | None = field(default=None, repr=False)
    _io: list[tuple[tuple[str, ...], tuple[str, ...]]] | None = field(default=None, repr=False)

    @property
    def ids(self) -> list[str]:
        """Full node ids, in node order."""
        if self._ids is None:
            self._ids = node_ids(self.graph, self.path)
        return self._ids

    @property
    def io(self) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """Each node's (input names, output names), in node order: read from the protobuf once, as
        every read of a name builds a new str (~1 us under upb; 160k nodes: 0.5 s a pass)."""
        if self._io is None:
            self._io = [(tuple(n.input), tuple(n.output)) for n in self.graph.node]
        return self._io

    def producer_index(self, name: str) -> int | None:
        """Position of the node that makes `name` in this graph (None: an input, a constant, or elsewhere)."""
        if self._producers is None:
            self._producers = {}
            for i, n in enumerate(self.graph.node):
                for o in n.output:
                    if o:
                        self._producers.setdefault(o, i)
        return self._producers.get(name)

    def producer(self, name: str) -> NodeProto | None:
        i = self.producer_index(name)
        return None if i is None else self.graph.node[i]

    def consumer_indices(self, name: str) -> list[int]:
        if self._consumers is None:
            self._consumers = {}
            for i, n in enumerate(self.graph.node):
                for x in n.input:
                    if x:
                        self._consumers.setdefault(x, []).append(i)
        return self._consumers.get(name, [])

    def consumers(self, name: str) -> list[NodeProto]:
        """Nodes of this graph reading `name` (reads from inside their subgraphs not included)."""
        nodes = self.graph.node
        return [nodes[i] for i in self.consumer_indices(name)]

    @property
    def constants(self) -> dict[str, Constant]:
        """This graph's own constants: initializers and Constant outputs, by name."""
        if self._constants is None:
            found: dict[str, Constant] = {t.name: t for t in self.graph.initializer}
            for n in self.graph.node:
                if n.op_type == "Constant" and n.output:
                    found[n.output[0]] = n
            self._constants = found
        return self._constants

    def defines(self, name: str) -> bool:
        """Whether this graph itself defines `name` (an input, an initializer or a node output)."""
        g = self.graph
        return (
            self.producer_index(name) is not None
            or name in self.constants
            or any(i.name == name for i in g.input)
        )

    @property
    def outputs(self) -> list[str]:
        return [o.name for o in self.graph.output]


def walk_graphs(graph: GraphProto) -> Iterator[GraphEntry]:
    """Every graph under `graph` (itself first), depth first, children in node order.

    The one walk every other traversal builds on: paths and owners are assigned here only.
    """
    stack = [GraphEntry("", graph)]
    while stack:
        entry = stack.pop()
        yield entry
        found: list[GraphEntry] = []
        for i, node in enumerate(entry.graph.node):
            if not node.attribute:
                continue
            subs = subgraphs(node)
            if not subs:
                continue
            carried = entry.carried and node.op_type in CARRIERS and node.domain in DEFAULT_DOMAINS
            owner_id = entry.ids[i]
            for attr_name, suffix, g in subs:
                found.append(GraphEntry(f"{owner_id}/{suffix}", g, entry.path, node, i, attr_name, carried))
        stack.extend(reversed(found))


def iter_graphs(graph: GraphProto) -> Iterator[tuple[str, GraphProto]]:
    """(path, graph) of `graph` and every graph under it, depth first."""
    for entry in walk_graphs(graph):
        yield entry.path, entry.graph


def iter_tensors(model: ModelProto) -> Iterator[TensorProto]:
    """Every TensorProto that may carry weights: initializers, sparse ones and Constant values, subgraphs too."""
    for entry in walk_graphs(model.graph):
        g = entry.graph
        yield from g.initializer
        for sparse in g.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in g.node:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors


class Names:
    """The names in use, and fresh ones that collide with none of them. State is real (the taken set)."""

    def __init__(self, taken: Iterable[str] = ()):
        self._taken = set(taken)
        self._next: dict[
            str, int
        ] = {}  # per hint, the suffix to try first: a hint used n times costs O(1), not O(n)

    def __contains__(self, name: str) -> bool:
        return name in self._taken

    def add(self, name: str) -> str:
        self._taken.add(name)
        return name

    def fresh(self, hint: str) -> str:
        """`hint`, or `hint_1`, `hint_2`, ... : the first not yet taken (it is taken from now on)."""
        i = self._next.get(hint, 0)
        name = f"{hint}_{i}" if i else hint
        while name in self._taken:
            i += 1
            name = f"{hint}_{i}"
        self._next[hint] = i + 1
        self._taken.add(name)
        return name

    def any_startswith(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self._taken)


class ModelIndex:
    """Every graph of a model by path, and the questions asked about them. Build it once per model state:
    an edit that replaces a graph's node list (graph.wire.splice) makes its entry's tables stale."""

    def __init__(self, model: ModelProto | GraphProto):
        self.model = model if isinstance(model, ModelProto) else None
        self.graphs: dict[str, GraphEntry] = {e.path: e for e in walk_graphs(_graph_of(model))}
        self._children: dict[tuple[str, int], list[GraphEntry]] | None = None

    def __getitem__(self, path: str) -> GraphEntry:
        return self.graphs[path]

    def __contains__(self, path: str) -> bool:
        return path in self.graphs

    @property
    def main(self) -> GraphEntry:
        return self.graphs[""]

    def scopes(self, path: str | None) -> Iterator[GraphEntry]:
        """The graph at `path`, then each graph around it up to the main graph."""
        while path is not None:
            entry = self.graphs[path]
            yield entry
            path = entry.parent

    def children(self, path: str, index: int) -> list[GraphEntry]:
        """The subgraphs of node `index` of the graph at `path`, in attribute order."""
        if self._children is None:
            self._children = {}
            for e in self.graphs.values():
                if e.parent is not None:
                    self._children.setdefault((e.parent, e.owner_index), []).append(e)
        return self._children.get((path, index), [])

    def nodes(
        self, path: str = "", subgraphs_first: bool = False
    ) -> Iterator[tuple[GraphEntry, int, NodeProto]]:
        """(graph, position, node) depth first: each node, then its subgraphs' nodes (or those first)."""
        entry = self.graphs[path]
        for i, node in enumerate(entry.graph.node):
            if not subgraphs_first:
                yield entry, i, node
            for child in self.children(path, i) if node.attribute else ():
                yield from self.nodes(child.path, subgraphs_first)
            if subgraphs_first:
                yield entry, i, node

    def constant(self, path: str | None, name: str) -> Constant | None:
        """The initializer or Constant node called `name` seen from the graph at `path` (enclosing ones too)."""
        for entry in self.scopes(path):
            hit = entry.constants.get(name)
            if hit is not None:
                return hit
        return None

    def is_constant(self, path: str | None, name: str) -> bool:
        return self.constant(path, name) is not None

    def defines(self, path: str | None, name: str) -> bool:
        """Whether `name` is visible in the graph at `path`: defined there or in a graph around it."""
        return any(e.defines(name) for e in self.scopes(path))

    def constant_dims(self, path: str | None, name: str) -> list[int] | None:
        """Dims of a visible constant (a Constant with a non-tensor value: []), None when not a constant."""
        hit = self.constant(path, name)
        if hit is None:
            return None
        if isinstance(hit, TensorProto):
            return [int(d) for d in hit.dims]
        value = constant_value(hit)
        return [int(d) for d in value.dims] if value is not None else []

    def find_constant(self, name: str) -> list[Constant]:
        """Every constant called `name`, in any graph (for names whose graph path no longer resolves)."""
        return [e.constants[name] for e in self.graphs.values() if name in e.constants]

    def names(self) -> Names:
        """A name allocator holding every node, tensor and graph-input name of the model."""
        taken: set[str] = set()
        for e in self.graphs.values():
            g = e.graph
            taken.update(i.name for i in g.input)
            taken.update(t.name for t in g.initializer)
            taken.update(o.name for o in g.output)
            for n in g.node:
                taken.update(n.output)
                taken.update(n.input)
                taken.add(n.name)
        taken.discard("")
        return Names(taken)


def _graph_of(model: ModelProto | GraphProto) -> GraphProto:
    return model.graph if isinstance(model, ModelProto) else model
