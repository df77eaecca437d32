"""Region time with the skip rewrite: how long the attention blocks, the MLP blocks and the rest take.

A residual Add x + f(x) (`sites.residual`) closes a block f. A block holding a Softmax or a
fused attention op is an attention block; any other block through a dense layer (MatMul, Gemm,
their quantized and fused forms) is an MLP block. A block of convolutions only is neither (a
ResNet's blocks are not MLPs) and stays in "other". `transform.skip_blocks` turns chosen Adds into Identity(x)
and removes the dead block, so four models are timed on the same feeds and session options:
the model (T), without its attention blocks (T_a), without its MLP blocks (T_m) and without
both (T_0, "other": embeddings, norms between blocks, heads). Then attention = T - T_a,
MLP = T - T_m, other = T_0, and the slack T - (attention + MLP + other) = T_a + T_m - T - T_0 is
what does not add up: kernels that overlap, caches warmed by a neighbour, noise. It is
reported, never spread over the regions. Each time is the best of `repeats` wall-clock runs
after a warm-up, so that another process on the machine does not decide the answer.

The nodes of each region (what the rewrite removes) are found here too, so that measured
per-node time can be rolled up by region as well (`profile.NodeProfile.by_region`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from onnx import ModelProto

from ..errors import OpscopeError
from ..graph.index import ModelIndex
from ..graph.io import ModelLike, load_model
from ..run.session import RuntimeConfig, make_session, run
from ..sites import Site
from ..transform.skip import residual_sites, skip_blocks

ATTENTION_OPS = frozenset({"Softmax", "Attention", "MultiHeadAttention", "GroupQueryAttention"})
DENSE_OPS = frozenset(
    {"MatMul", "Gemm", "FusedMatMul", "MatMulInteger", "QLinearMatMul", "MatMulNBits", "Einsum"}
)
REGIONS = ("attention", "mlp", "other")
REPEATS = 10


@dataclass
class Blocks:
    """The residual Adds of each kind, and the node ids the skip rewrite would remove for each kind."""

    attention: list[str]  # residual Add site ids closing an attention block
    mlp: list[str]
    nodes: dict[str, str]  # node id -> "attention" | "mlp" (nodes of neither are "other")

    def region(self, node: str) -> str:
        return self.nodes.get(node, "other")


@dataclass
class RegionTimes:
    """Best-of wall seconds of the model with each kind of block skipped, and what they imply."""

    full_s: float
    no_attention_s: float
    no_mlp_s: float
    neither_s: float
    attention_blocks: int
    mlp_blocks: int
    repeats: int

    @property
    def attention_s(self) -> float:
        return self.full_s - self.no_attention_s

    @property
    def mlp_s(self) -> float:
        return self.full_s - self.no_mlp_s

    @property
    def other_s(self) -> float:
        return self.neither_s

    @property
    def slack_s(self) -> float:
        """What does not add up: T - (attention + MLP + other); reported, never hidden."""
        return self.full_s - (self.attention_s + self.mlp_s + self.other_s)

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("attention_s", "mlp_s", "other_s", "slack_s"):
            out[name] = getattr(self, name)
        for name in ("attention", "mlp", "other", "slack"):
            out[f"{name}_share"] = getattr(self, f"{name}_s") / self.full_s if self.full_s else None
        return out


def _live(entry, replaced: Mapping[int, str]) -> set[int]:
    """Positions of the nodes some graph output depends on, with each Add in `replaced` reading only
    its kept input (what `skip_blocks` makes of it)."""
    seen: set[int] = set()
    stack = list(entry.outputs)
    while stack:
        i = entry.producer_index(stack.pop())
        if i is None or i in seen:
            continue
        seen.add(i)
        stack.extend([replaced[i]] if i in replaced else [x for x in entry.graph.node[i].input if x])
    return seen


def _block_nodes(index: ModelIndex, sites: list[Site]) -> set[str]:
    """Node ids that die when all `sites` (residual Adds) are skipped together, as `prune` would find."""
    out: set[str] = set()
    for path in sorted({s.graph for s in sites}):
        entry = index[path]
        replaced = {}
        for s in sites:
            if s.graph == path:
                i = entry.ids.index(s.id)
                replaced[i] = entry.graph.node[i].input[int(s.attrs.get("skip", 0))]
        dead = _live(entry, {}) - _live(entry, replaced) - set(replaced)
        out.update(entry.ids[j] for j in dead)
    return out


def find_blocks(model: ModelLike) -> Blocks:
    """Which residual blocks are attention and which MLP, and the nodes each kind holds."""
    proto = load_model(model)
    index = ModelIndex(proto)
    sites = residual_sites(proto)
    ops = {
        nid: node.op_type for entry in index.graphs.values() for nid, node in zip(entry.ids, entry.graph.node)
    }
    kinds: dict[str, list[Site]] = {"attention": [], "mlp": []}
    for s in sites:
        inside = _block_nodes(index, [s])
        held = {ops[n] for n in inside}
        if held & ATTENTION_OPS:
            kinds["attention"].append(s)
        elif held & DENSE_OPS:
            kinds["mlp"].append(s)
    nodes = {n: kind for kind, chosen in kinds.items() if chosen for n in _block_nodes(index, chosen)}
    return Blocks([s.id for s in kinds["attention"]], [s.id for s in kinds["mlp"]], nodes)


def _best_walls(
    models: list[ModelLike],
    feeds: Mapping[str, np.ndarray],
    config: RuntimeConfig,
    repeats: int,
    base_dir: Path | None,
) -> list[float]:
    """Best wall seconds of each model, timed in turns (one run of each per round) so that a load
    that comes and goes on the machine falls on all of them alike."""
    sessions = [make_session(m, config, base_dir=base_dir) for m in models]
    for sess in sessions:
        run(sess, feeds)  # warm-up, with the feeds checked
    best = [float("inf")] * len(sessions)
    for _ in range(repeats):
        for k, sess in enumerate(sessions):
            t0 = time.perf_counter()
            sess.run(None, dict(feeds))
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def region_times(
    model: ModelLike,
    feeds: Mapping[str, np.ndarray],
    config: RuntimeConfig | None = None,
    *,
    blocks: Blocks | None = None,
    repeats: int = REPEATS,
) -> RegionTimes:
    """Time the model with its attention blocks, its MLP blocks and both skipped (see the module doc)."""
    config = config or RuntimeConfig()
    proto = load_model(model)
    blocks = blocks or find_blocks(proto)
    if not blocks.attention and not blocks.mlp:
        raise OpscopeError(
            "--regions needs residual attention or MLP blocks (x + f(x) through a Softmax or a dense layer); "
            "this model has none",
            hint="`opscope rewrite skip MODEL --list` lists the residual Adds",
        )

    base_dir = None if isinstance(model, ModelProto) else Path(model).parent
    variants = [blocks.attention, blocks.mlp, blocks.attention + blocks.mlp]
    full, no_attn, no_mlp, neither = _best_walls(
        [model, *(skip_blocks(proto, adds).model if adds else proto for adds in variants)],
        feeds, config, repeats, base_dir,
    )  # fmt: skip
    return RegionTimes(
        full_s=full,
        no_attention_s=no_attn,
        no_mlp_s=no_mlp,
        neither_s=neither,
        attention_blocks=len(blocks.attention),
        mlp_blocks=len(blocks.mlp),
        repeats=repeats,
    )
