"""The miner's rules against ground truth: known patterns planted at known sites of real models.

    python scripts/eval_findings.py                     # every model and plant (about 3 minutes on 2 cores)
    python scripts/eval_findings.py --quick             # a fast subset (what tests/test_findings_eval.py runs)
    python scripts/eval_findings.py --models ppocrv4_rec transformer_block --json eval.json

Models: the real ones `scripts/fetch_models.py` fetches into models/real/ (or `OPSCOPE_MODELS`), the
zoo models of `onnx_opscope.zoo` where a structure is needed (attention, residual blocks, a router),
or any `.onnx` path (plain feeds at the defaults of `onnx_opscope.run.feeds`).

How a case is built, and where its truth comes from (nothing is typed in):

1. Cuts. One plain run of the model (`synthetic_feeds`, batch 0) gives every main-graph tensor. A
   cut tensor is a float activation that a GEMM-kind site reads, straight or after layout-only ops
   (Identity, Reshape, Flatten, Squeeze, Unsqueeze, Transpose); a few per model, spread over the
   graph and over op types. The model is cut there with `onnx.utils.Extractor`: the cut tensor
   becomes a graph input, the real weights downstream are kept up to the outputs of the sites
   that read it, and any other tensor those nodes need is an input fed its value from the plain run.
2. Targets, the scored (site, role)s: every operand that is the cut tensor after layout-only ops,
   found by walking the graph. The walk maps axes too (a Transpose by its perm; the other ops keep
   an axis when an output axis has its size and as many elements after it), so a pattern laid along
   channels or rows is planted along the cut tensor's axes that land on the site's own channel and
   row axes; a target where they land elsewhere is left unscored for that plant.
3. Plants, fed with `FeedSpec(data=...)` (one .npz per batch): sparse, outlier channels, few levels,
   heavy tails, values piled on one value, coherent rows, loud positions (a rule each), plain
   Gaussian and uniform data (no rule); across steps, the same batch at every step and pools of
   two or three batches replayed (memoize), a slow walk (delta). Per-batch plants draw every batch
   afresh, so they are the negatives of the rules across steps.
4. Near-identity residual blocks: a derived model whose residual branch is multiplied by 1e-3 just
   before its Add (weak_residual_branch), against the same Add of the model as it is.
5. Whole-model plain runs: weights are stationary, so is an operand that depends on no graph input;
   a softmax output (l1 fixed by construction) gets no stationary verdict.

The truth of a target: `small` below `numel_min` elements whatever was planted; unscored when the
plant's other minimum (channels, rows) is not met or its axes do not land; else the plant's rules.
An operand the same at every step in a weight's place (the roles a kernel prepacks) is stationary,
an activation's is memoize. Per rule: precision = TP / (TP + FP) over every scored (site, role),
recall = TP / positives. The goal: both >= 0.9 for every rule, and no finding of any run (scored or
not) standing on less than its rule's minimum size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.utils
from onnx import ModelProto, helper, numpy_helper

from onnx_opscope import FeedSpec, MineConfig, make_session, mine, record
from onnx_opscope.findings import Finding
from onnx_opscope.run.feeds import synthetic_feeds
from onnx_opscope.sites import Selection, find_sites

ROOT = Path(__file__).resolve().parent.parent
REAL = Path(os.environ.get("OPSCOPE_MODELS", ROOT / "models" / "real"))

# feeds of the plain run of each named model: shapes they accept, kept small
FEEDS: dict[str, dict] = {
    "ppocrv4_rec": {"shapes": {"x": [1, 3, 48, 320]}},
    "ppocrv4_det": {"shapes": {"x": [1, 3, 96, 96]}},
    "silero_vad_v6": {"shapes": {"input": [1, 512], "state": [2, 1, 128]}, "values": {"sr": 16000}},
    "captcha_crnn": {"dims": {"batch": 1}},
    "magika_standard_v3_3": {"dims": {"unk__214": 1}},
    "transformer_block": {"dims": {"batch": 2, "seq": 32}},
    "moe": {"dims": {"tokens": 64}},
    "cnn": {"dims": {"batch": 2}},
    "mlp": {"dims": {"batch": 2}},
}
REAL_NAMES = ("ppocrv4_rec", "ppocrv4_det", "silero_vad_v6", "captcha_crnn", "magika_standard_v3_3")
ZOO_NAMES = ("transformer_block", "moe", "cnn", "mlp")
QUICK_MODELS = ("ppocrv4_rec", "transformer_block", "mlp")
LAYOUT_OPS = ("Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose")
WEIGHT_ROLES = ("rhs", "b", "weight", "w", "r")  # the operands a kernel prepacks (findings.plan.RHS_ROLES)
BRANCH_SCALE = 1e-3  # a near-identity block's residual branch, relative to the model's own
PER_BATCH_STEPS = 3  # MineConfig.min_steps: the per-batch plants get a verdict across steps too
TEMPORAL_STEPS = 6
CUTS, QUICK_CUTS = 4, 2  # cut tensors per model
BLOCKS, QUICK_BLOCKS = 2, 1  # residual blocks per model

Shape = tuple[int, ...]
Draw = Callable[[np.random.Generator, tuple[int, ...], int, int], np.ndarray]  # (rng, shape, step, seed)


# --------------------------------------------------------------------------------------------
# Plants: each draws one run's batches with rows along axis -2 and channels along -1


@dataclass(frozen=True)
class Plant:
    """A pattern: the per-batch rule and the rule across steps it should fire (None: none), the axes it
    is laid along ("": none, "channel", "rows") and how many steps its run has."""

    name: str
    rule: str | None
    temporal: str | None
    axes: str
    steps: int
    draw: Draw


def _gauss(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    return rng.standard_normal(shape)


def _sparse(density: float) -> Draw:
    return lambda rng, shape, k, seed: _gauss(rng, shape) * (rng.random(shape) < density)


def _outlier(share: float, factor: float) -> Draw:
    """A `share` of the channels (at least one) `factor` times wider, the same channels at every step
    as real outlier channels are."""

    def draw(rng: np.random.Generator, shape: Shape, k: int, seed: int) -> np.ndarray:
        c = shape[-1]
        chosen = np.random.default_rng([seed, 7, c]).choice(c, max(1, round(share * c)), replace=False)
        x = _gauss(rng, shape)
        x[..., chosen] *= factor
        return x

    return draw


def _levels(kind: str) -> Draw:
    def draw(rng: np.random.Generator, shape: Shape, k: int, seed: int) -> np.ndarray:
        if kind == "ternary":  # {-1, 0, 1} with 40 % zeros
            return rng.choice([-1.0, 0.0, 1.0], size=shape, p=[0.3, 0.4, 0.3])
        if kind == "grid8":  # 8 evenly spaced levels, a 3-bit uniform quantizer
            return (2 * rng.integers(0, 8, shape) - 7) / 7.0
        if kind == "round5":  # a Gaussian rounded to -2..2
            return np.clip(np.round(_gauss(rng, shape)), -2, 2)
        return np.clip(np.round(2 * _gauss(rng, shape)) / 2, -4, 4)  # 17 levels 0.5 apart

    return draw


def _lognormal_scale(sigma: float) -> Draw:
    """Gaussian values with a log-normal scale each: kurtosis 3 exp(4 sigma^2), no channel or row structure."""
    return lambda rng, shape, k, seed: _gauss(rng, shape) * np.exp(sigma * _gauss(rng, shape))


def _student(dof: float) -> Draw:
    """Student's t: at 3 degrees of freedom no finite kurtosis (a sample of 4096 reads 11-26)."""
    return lambda rng, shape, k, seed: rng.standard_t(dof, shape)


def _saturated(level: float) -> Draw:
    """A saturating activation: every value above `level` is `level` (P(x > 0.3) = 38 %)."""
    return lambda rng, shape, k, seed: np.minimum(_gauss(rng, shape), level)


def _padded(share: float, value: float) -> Draw:
    """A `share` of the values replaced by one padding value."""
    return lambda rng, shape, k, seed: np.where(rng.random(shape) < share, value, _gauss(rng, shape))


def _walk(step: float) -> Draw:
    """Rows form a random walk: adjacent rows differ by `step` x N(0, 1)."""

    def draw(rng: np.random.Generator, shape: Shape, k: int, seed: int) -> np.ndarray:
        x = _gauss(rng, shape)
        x[..., 1:, :] *= step
        return np.cumsum(x, axis=-2)

    return draw


def _loud_rows(share: float, factor: float) -> Draw:
    """A fixed `share` of the positions (separator or sink tokens, the same at every step) `factor` times
    louder. Not periodic: a period could alias with the evenly strided rows `pos_sumsq` keeps."""

    def draw(rng: np.random.Generator, shape: Shape, k: int, seed: int) -> np.ndarray:
        rows = shape[-2]
        loud = np.random.default_rng([seed, 8, rows]).choice(rows, max(1, round(share * rows)), replace=False)
        x = _gauss(rng, shape)
        x[..., loud, :] *= factor
        return x

    return draw


def _plain(rng: np.random.Generator, shape: Shape, k: int, seed: int) -> np.ndarray:
    return _gauss(rng, shape)


def _uniform(rng: np.random.Generator, shape: Shape, k: int, seed: int) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, shape)


def _pool(size: int) -> Draw:
    """Step k is batch k mod `size` of a pool (size 1: the same batch at every step)."""
    return lambda rng, shape, k, seed: _gauss(np.random.default_rng([seed, 12, k % size]), shape)


def _drift(step: float) -> Draw:
    """Step k is one Gaussian batch after k steps of a walk of `step` x N(0, 1)."""

    def draw(rng: np.random.Generator, shape: Shape, k: int, seed: int) -> np.ndarray:
        walk = np.random.default_rng([seed, 13])
        x = _gauss(walk, shape)
        for _ in range(k):
            x = x + step * _gauss(walk, shape)
        return x

    return draw


def _per_batch(family: str, axes: str, variants: Sequence[tuple[str, Draw]]) -> list[Plant]:
    return [Plant(f"{family}:{tag}", family, None, axes, PER_BATCH_STEPS, d) for tag, d in variants]


def _across(name: str, rule: str, draw: Draw) -> Plant:
    return Plant(name, None, rule, "", TEMPORAL_STEPS, draw)


PLANTS: tuple[Plant, ...] = (
    *_per_batch("sparse", "", [("d0.05", _sparse(0.05)), ("d0.2", _sparse(0.2)), ("d0.4", _sparse(0.4))]),
    *_per_batch("outlier", "channel", [("1%x30", _outlier(0.01, 30)), ("3%x15", _outlier(0.03, 15)),
                                       ("2%x10", _outlier(0.02, 10))]),
    *_per_batch("levels", "", [("17", _levels("q17")), ("grid8", _levels("grid8")),
                               ("ternary", _levels("ternary")), ("round5", _levels("round5"))]),
    *_per_batch("heavy_tail", "", [("lognormal0.8", _lognormal_scale(0.8)), ("t3", _student(3))]),
    *_per_batch("concentrated", "", [("sat0.3", _saturated(0.3)), ("pad35%", _padded(0.35, 0.7))]),
    *_per_batch("coherent", "rows", [("walk0.15", _walk(0.15)), ("walk0.3", _walk(0.3))]),
    *_per_batch("positional", "rows", [("12%x3", _loud_rows(0.125, 3.0))]),
    Plant("plain:gaussian", None, None, "", PER_BATCH_STEPS, _plain),
    Plant("plain:uniform", None, None, "", PER_BATCH_STEPS, _uniform),
    _across("repeat:same", "memoize", _pool(1)),
    _across("repeat:pool2", "memoize", _pool(2)),
    _across("repeat:pool3", "memoize", _pool(3)),
    _across("drift:walk0.05", "delta", _drift(0.05)),
    _across("drift:walk0.15", "delta", _drift(0.15)),
)  # fmt: skip
QUICK_PLANTS = (
    "sparse:d0.2", "outlier:1%x30", "levels:17", "heavy_tail:lognormal0.8", "concentrated:sat0.3",
    "coherent:walk0.15", "positional:12%x3", "plain:gaussian", "repeat:same", "repeat:pool2", "drift:walk0.05",
)  # fmt: skip


def _rows_and_channels(rank: int, ch: int | None, seq: int | None) -> tuple[int, int]:
    """The (rows, channels) axes of a tensor of rank >= 2: `seq` and `ch` where given and distinct,
    else the last axes left."""
    ch = ch if ch is not None else next(a for a in range(rank - 1, -1, -1) if a != seq)
    seq = seq if seq is not None and seq != ch else next(a for a in range(rank - 1, -1, -1) if a != ch)
    return seq, ch


def draw_batches(plant: Plant, shape: Shape, ch: int | None, seq: int | None, seed: int) -> list[np.ndarray]:
    """The plant's batches in `shape`, its rows along axis `seq` and its channels along `ch`."""
    if len(shape) < 2:  # one row
        canon, back = (1, *shape) if shape else (1, 1), lambda a: a.reshape(shape)
    else:
        axes = _rows_and_channels(len(shape), ch, seq)
        canon = np.moveaxis(np.zeros(shape, np.int8), axes, (-2, -1)).shape
        back = lambda a: np.moveaxis(a, (-2, -1), axes)  # noqa: E731
    return [back(plant.draw(np.random.default_rng([seed, k]), canon, k, seed)).astype(np.float32)
            for k in range(plant.steps)]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The graph: one plain run's values, consumers, layout-only paths, cuts


@dataclass
class Graph:
    """A model's main graph with every tensor of one plain run (batch 0)."""

    name: str
    model: ModelProto
    feeds: FeedSpec
    values: dict[str, np.ndarray]
    consumers: dict[str, list[onnx.NodeProto]]
    producer: dict[str, onnx.NodeProto]
    constants: set[str]

    @classmethod
    def load(cls, name: str, model: ModelProto, feeds: FeedSpec) -> Graph:
        consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        producer = {}
        for n in model.graph.node:
            for t in n.input:
                consumers[t].append(n)
            for t in n.output:
                producer[t] = n
        constants = {t.name for t in model.graph.initializer}
        constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
        return cls(name, model, feeds, plain_values(model, feeds), consumers, producer, constants)

    def numel(self, tensor: str) -> int | None:
        """Elements of a tensor of the plain run or of an initializer (None: unknown)."""
        if tensor in self.values:
            return int(self.values[tensor].size)
        init = next((t for t in self.model.graph.initializer if t.name == tensor), None)
        return int(np.prod(init.dims)) if init is not None else None

    def depends_on_input(self) -> dict[str, bool]:
        """Whether each tensor depends on a graph input (False: it folds to a constant)."""
        dep = {i.name: True for i in self.model.graph.input if i.name not in self.constants}
        for n in self.model.graph.node:  # topological order
            d = any(dep.get(t, False) for t in [*n.input, *_outer_names(n)])
            dep.update(dict.fromkeys(n.output, d))
        return dep


def _outer_names(node: onnx.NodeProto) -> set[str]:
    """Every name the bodies of a control-flow node read (a superset of what they take from outside)."""
    names: set[str] = set()
    for a in node.attribute:
        for body in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
            for n in body.node:
                names.update(n.input)
                names |= _outer_names(n)
    return names


def plain_values(model: ModelProto, feeds: FeedSpec) -> dict[str, np.ndarray]:
    """Every main-graph tensor on batch 0 of the plain feeds: one run with every node output exposed."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    names = [o for n in probe.graph.node if n.op_type != "Constant" for o in n.output if o and o not in known]
    probe.graph.output.extend(onnx.ValueInfoProto(name=o) for o in names)
    session = make_session(probe)
    inputs = synthetic_feeds(model, feeds)
    return {**inputs, **dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))}


@dataclass(frozen=True)
class Target:
    """One scored (site, role): an operand that is the cut tensor after layout-only ops. `channel` and
    `seq`: the cut tensor's axes that land on the site's channel and row axes (None: none does)."""

    site: str
    node: str
    role: str
    numel: int
    channels: int
    rows: int  # numel / channels: the positions a channel is measured over
    seq_len: int  # the length of the site's row axis, along which adjacent rows are compared
    channel: int | None
    seq: int | None


def map_axis(node: onnx.NodeProto, axis: int | None, src: Shape, dst: Shape) -> int | None:
    """Where axis `axis` of a layout-only op's input lands in its output (None: it does not survive)."""
    if axis is None:
        return None
    if node.op_type == "Transpose":
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), list(range(len(src)))[::-1])
        return perm.index(axis)
    size, after = src[axis], math.prod(src[axis + 1 :])
    if size == 1:
        return None
    return next((j for j, d in enumerate(dst) if d == size and math.prod(dst[j + 1 :]) == after), None)


def _operands(graph: Graph, sites: Sequence) -> dict[str, list[tuple]]:
    """tensor -> (site, tap) of every activation operand of a main-graph GEMM-kind site."""
    out: dict[str, list[tuple]] = defaultdict(list)
    for s in sites:
        if s.kind == "gemm" and s.graph == "":
            for t in s.taps:
                if t.role != "out" and t.tensor not in graph.constants and t.tensor in graph.values:
                    out[t.tensor].append((s, t))
    return out


def targets_of(graph: Graph, tensor: str, operands: dict[str, list[tuple]]) -> list[Target]:
    """The (site, role)s whose operand is `tensor` after layout-only ops, with where its axes land."""
    found: list[Target] = []
    stack = [(tensor, {a: a for a in range(graph.values[tensor].ndim)})]  # cut axis -> axis here
    seen: set[str] = set()
    while stack:
        name, axes = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        shape = graph.values[name].shape
        back = {v: k for k, v in axes.items() if v is not None}
        for s, t in operands.get(name, []):
            r, numel = len(shape), int(np.prod(shape))
            ch, sq = (t.channel_axis % r if r else None), (t.seq_axis % r if r > 1 else None)
            channels = int(shape[ch]) if ch is not None else 1
            found.append(Target(s.id, s.node, t.role, numel, channels, numel // max(channels, 1),
                                int(shape[sq]) if sq is not None else 1, back.get(ch), back.get(sq)))  # fmt: skip
        for n in graph.consumers.get(name, []):
            if n.op_type in LAYOUT_OPS and n.input[0] == name and n.output[0] in graph.values:
                out = graph.values[n.output[0]].shape
                stack.append((n.output[0], {k: map_axis(n, v, shape, out) for k, v in axes.items()}))
    return found


def _value_info(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(
        name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)
    )


def cut(graph: Graph, tensor: str, outputs: Sequence[str]) -> tuple[ModelProto, dict[str, np.ndarray]]:
    """The model from `tensor` (now a graph input) to `outputs` with its real weights, and the other
    inputs it needs (tensors `tensor` does not feed, e.g. attention's V beside the softmax): their
    values from the plain run."""
    downstream = {tensor}
    for n in graph.model.graph.node:
        if any(t in downstream for t in n.input):
            downstream.update(n.output)
    context: dict[str, np.ndarray] = {}
    stack, seen = list(outputs), set()
    while stack:
        t = stack.pop()
        if not t or t in seen or t == tensor or t in graph.constants:
            continue
        seen.add(t)
        n = graph.producer.get(t)
        if n is not None and t in downstream:
            stack.extend(n.input)
        elif t in graph.values:
            context[t] = graph.values[t]
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    io = {tensor: graph.values[tensor], **context, **{o: graph.values[o] for o in outputs}}
    model.graph.value_info.extend(_value_info(k, v) for k, v in io.items())
    return onnx.utils.Extractor(model).extract_model([tensor, *context], list(outputs)), context


def pick_cuts(graph: Graph, sites: Sequence, count: int) -> list[tuple[str, list[Target]]]:
    """`count` cut tensors spread over the graph and over op types: per op type the first, middle and
    last float activation a site of that type reads, taken round-robin over the op types."""
    operands = _operands(graph, sites)
    by_op: dict[str, list[tuple[str, list[Target]]]] = defaultdict(list)
    taken: set[str] = set()
    for tensor, uses in operands.items():
        if tensor in taken or graph.values[tensor].dtype != np.float32:
            continue
        found = targets_of(graph, tensor, operands)
        taken.add(tensor)
        by_op[uses[0][0].op_type].append((tensor, found))
    spread = [[c[i] for i in sorted({0, len(c) // 2, len(c) - 1})] for c in by_op.values()]
    out: list[tuple[str, list[Target]]] = []
    while len(out) < count and any(spread):
        for group in spread:
            if group and len(out) < count:
                out.append(group.pop(0))
    return out


# --------------------------------------------------------------------------------------------
# Cases: one recording each, with the truth of its scored (site, role)s

Truth = tuple[str | None, str | None]  # (per-batch rule, rule across steps); "" : not scored


@dataclass
class Case:
    model: str
    kind: str  # plant, residual, whole-model
    label: str
    truth: dict[tuple[str, str], Truth] = field(default_factory=dict)
    unscored: int = 0
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0


def truth_of(plant: Plant, t: Target, ch: int | None, seq: int | None, cfg: MineConfig) -> Truth | None:
    """What target `t` should get when `plant` is laid along the cut axes (`ch`, `seq`); None: unscored."""
    if t.numel < cfg.numel_min:
        return ("small", None)
    if plant.axes == "channel" and (t.channel is None or t.channel != ch or t.channels < cfg.channels_min
                                    or t.rows < cfg.rows_min):  # fmt: skip
        return None
    if plant.axes == "rows" and (t.seq is None or t.seq != seq or t.channels < cfg.channels_min
                                 or min(t.rows, t.seq_len) < cfg.rows_min):  # fmt: skip
        return None
    if plant.name == "repeat:same" and t.role in WEIGHT_ROLES:
        return (plant.rule, "stationary")  # the same at every step in a weight's place: prepack it
    return (plant.rule, plant.temporal)


def _glob(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def record_and_mine(model: ModelProto, out: Path, run_id: str, feeds: FeedSpec, sites: Selection,
                    cfg: MineConfig) -> list[Finding]:  # fmt: skip
    table = record(
        model, out=out, feeds=feeds, sites=sites, sketches=["all"], run_id=run_id, parity=False
    ).table
    return mine(table, config=cfg)


def plant_cases(graph: Graph, tmp: Path, plants: Sequence[Plant], cuts: int, cfg: MineConfig, seed: int,
                log: Callable[[str], None]) -> list[Case]:  # fmt: skip
    """Every plant at each of `cuts` cut tensors of the model."""
    cases = []
    for c, (tensor, targets) in enumerate(pick_cuts(graph, find_sites(graph.model), cuts)):
        nodes = {t.node for t in targets}
        outputs = sorted({o for n in graph.model.graph.node if n.name in nodes for o in n.output if o})
        sub, context = cut(graph, tensor, outputs)
        shape, ch, seq = graph.values[tensor].shape, targets[0].channel, targets[0].seq
        log(f"  cut {tensor} {list(shape)} -> {', '.join(f'{t.site}/{t.role}' for t in targets)}")
        names = Selection(names=tuple(_glob(t.site) for t in targets), kinds=("gemm",))
        for plant in plants:
            case = Case(graph.name, "plant", f"{tensor} <- {plant.name}")
            for t in targets:
                truth = truth_of(plant, t, ch, seq, cfg)
                if truth is None:
                    case.unscored += 1
                else:
                    case.truth[(t.site, t.role)] = truth
            cases.append(case)
            if not case.truth:
                continue  # kept for its unscored count, nothing to record
            folder = tmp / f"c{c}-{re.sub(r'[^A-Za-z0-9.]+', '-', plant.name)}"
            folder.mkdir(parents=True)
            for k, x in enumerate(draw_batches(plant, shape, ch, seq, seed + 97 * c)):
                np.savez(folder / f"b{k}.npz", **{tensor: x}, **context)
            started = time.perf_counter()
            case.findings = record_and_mine(sub, folder / "t.parquet", f"{graph.name}-{c}-{plant.name}",
                                            FeedSpec(data=folder), names, cfg)  # fmt: skip
            case.seconds = time.perf_counter() - started
    return cases


def scaled_branch(model: ModelProto, add: str, branch: str, scale: float = BRANCH_SCALE) -> ModelProto:
    """`model` with input `branch` of the residual Add node `add` multiplied by `scale` just before it."""
    derived = onnx.ModelProto()
    derived.CopyFrom(model)
    factor, scaled = f"{add}/eval_branch_scale", f"{add}/eval_branch_scaled"
    derived.graph.initializer.append(numpy_helper.from_array(np.array(scale, np.float32), factor))
    nodes = list(derived.graph.node)
    at = next(i for i, n in enumerate(nodes) if n.name == add)
    for k, t in enumerate(nodes[at].input):
        if t == branch:
            nodes[at].input[k] = scaled
    nodes.insert(at, helper.make_node("Mul", [branch, factor], [scaled], name=f"{add}/eval_scale"))
    del derived.graph.node[:]
    derived.graph.node.extend(nodes)
    return derived


def residual_cases(
    graph: Graph, tmp: Path, blocks: int, cfg: MineConfig, log: Callable[[str], None]
) -> list[Case]:
    """Residual Adds (first, middle, last) in a derived model whose branch is scaled down, and as they are."""
    adds = [s for s in find_sites(graph.model) if s.kind == "residual" and s.graph == "" and s.node]
    cases = []
    for i in sorted({0, len(adds) // 2, len(adds) - 1})[:blocks] if adds else []:
        site = adds[i]
        node = next(n for n in graph.model.graph.node if n.name == site.node)
        branch = node.input[1 - site.attrs["skip"]]
        log(f"  residual {site.id}: branch {branch} x {BRANCH_SCALE:g}")
        derived = scaled_branch(graph.model, node.name, branch)
        for kind, model, want in (
            ("near-identity", derived, "weak_residual_branch"),
            ("as is", graph.model, None),
        ):
            case = Case(graph.name, "residual", f"{site.id} {kind}", {(site.id, "residual"): (want, None)})
            feeds = FeedSpec(**{**asdict(graph.feeds), "batches": PER_BATCH_STEPS})
            started = time.perf_counter()
            case.findings = record_and_mine(model, tmp / f"res{i}-{kind.replace(' ', '')}.parquet",
                                            f"{graph.name}-res{i}-{kind}", feeds,
                                            Selection(names=(_glob(site.id),), kinds=("residual",)), cfg)  # fmt: skip
            case.seconds = time.perf_counter() - started
            cases.append(case)
    return cases


def whole_model_case(graph: Graph, tmp: Path, cfg: MineConfig) -> Case:
    """The whole model on its plain feeds: weights and operands that depend on no input are stationary,
    softmax outputs (l1 fixed by construction) are not. Every finding is checked for its minimum size."""
    dep, softmax = graph.depends_on_input(), _softmax_outputs(graph)
    case = Case(graph.name, "whole-model", "whole model, plain feeds")
    for s in find_sites(graph.model):
        if s.kind != "gemm" or s.graph != "":
            continue
        for t in s.taps:
            numel = graph.numel(t.tensor)
            if numel is None or numel < cfg.numel_min:
                continue
            if t.tensor in graph.constants or not dep.get(t.tensor, True):
                case.truth[(s.id, t.role)] = ("", "stationary")
            elif t.tensor in softmax:
                case.truth[(s.id, t.role)] = ("", None)
    feeds = FeedSpec(**{**asdict(graph.feeds), "batches": max(cfg.min_steps, 4)})
    started = time.perf_counter()
    case.findings = record_and_mine(
        graph.model, tmp / "whole.parquet", f"{graph.name}-whole", feeds, Selection(), cfg
    )
    case.seconds = time.perf_counter() - started
    return case


def _softmax_outputs(graph: Graph) -> set[str]:
    """Softmax outputs and what layout-only ops make of them."""
    out = {o for n in graph.model.graph.node if n.op_type == "Softmax" for o in n.output}
    for n in graph.model.graph.node:  # topological order
        if n.op_type in LAYOUT_OPS and n.input and n.input[0] in out:
            out.update(n.output)
    return out


# --------------------------------------------------------------------------------------------
# Scoring

RULES_SCORED = ("sparse", "outlier", "levels", "heavy_tail", "concentrated", "coherent", "positional", "small",
                "weak_residual_branch", "stationary", "memoize", "delta")  # fmt: skip
ACROSS_STEPS = ("stationary", "memoize", "delta")


@dataclass
class Score:
    positives: int = 0
    tp: int = 0
    fp: int = 0

    @property
    def fn(self) -> int:
        return self.positives - self.tp

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        return self.tp / self.positives if self.positives else None


def score(cases: Iterable[Case]) -> tuple[dict[str, Score], list[str]]:
    """Per-rule counts over the scored (site, role)s of every case, and one line per miss."""
    scores = {r: Score() for r in RULES_SCORED}
    misses: list[str] = []
    for case in cases:
        got = {(f.site, f.role): f for f in case.findings}
        for key, (want, want_steps) in case.truth.items():
            where = f"{case.model}: {case.label}: {key[0]}/{key[1]}"
            f = got.get(key)
            if f is None:
                misses.append(f"{where}: no finding")
                continue
            if want != "":
                _count(scores, want, f.rule, f"{where}:", misses)
            steps = f.temporal.rule if f.temporal else None
            _count(
                scores, want_steps, steps if steps in ACROSS_STEPS else None, f"{where} across steps:", misses
            )
    return scores, misses


def _count(
    scores: dict[str, Score], want: str | None, got: str | None, where: str, misses: list[str]
) -> None:
    if want in scores:
        scores[want].positives += 1
        scores[want].tp += got == want
    if got in scores and got != want:
        scores[got].fp += 1
    if got != want and (want in scores or got in scores):
        misses.append(f"{where} wants {want or 'none'}, got {got or 'none'}")


def size_violations(cases: Iterable[Case], cfg: MineConfig) -> list[str]:
    """Findings of any run (scored or not) that stand on less than their rule's minimum size."""
    need = {"outlier": ("channels", cfg.channels_min), "coherent": ("rows", cfg.rows_min),
            "positional": ("rows", cfg.rows_min), "levels": ("hist_per_bin", cfg.hist_per_bin_min),
            "concentrated": ("hist_per_bin", cfg.hist_per_bin_min)}  # fmt: skip
    bad = []
    for case in cases:
        for f in case.findings:
            if f.kind != "gemm":
                continue
            where = f"{case.model}: {case.label}: {f.site}/{f.role}"
            if (
                f.numel is not None
                and f.numel < cfg.numel_min
                and (f.rule not in ("small", "nonfinite") or f.temporal)
            ):
                bad.append(f"{where}: {f.numel} elements got {f.rule}")
            signal, least = need.get(f.rule, ("", 0.0))
            v = f.signals.get(signal)
            if v is not None and v < least:
                bad.append(f"{where}: {f.rule} on {signal} {v:g} < {least:g}")
    return bad


def goal_holds(scores: dict[str, Score], violations: Sequence[str], least: float = 0.9) -> bool:
    """Precision and recall >= `least` for every rule that was scored, and no size violation."""
    return not violations and all(
        (s.precision is None or s.precision >= least) and (s.recall is None or s.recall >= least)
        for s in scores.values()
    )


def table(scores: dict[str, Score]) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    rows = ["| rule | positives | TP | FP | FN | precision | recall |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {r} | {s.positives} | {s.tp} | {s.fp} | {s.fn} | {num(s.precision)} | {num(s.recall)} |"
             for r, s in scores.items() if s.positives or s.fp]  # fmt: skip
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------
# Running it


def load_graph(name: str) -> Graph:
    """A real or zoo model by name, or an .onnx path, with its plain run."""
    from onnx_opscope import zoo

    if name in zoo.MODELS:
        return Graph.load(name, zoo.build(name), FeedSpec(**FEEDS.get(name, {})))
    path = REAL / f"{name}.onnx" if name in REAL_NAMES else Path(name)
    if not path.is_file():
        hint = "run `python scripts/fetch_models.py` first" if name in REAL_NAMES else "not a model path"
        raise SystemExit(f"{path}: missing ({hint})")
    return Graph.load(path.stem, onnx.load(str(path)), FeedSpec(**FEEDS.get(path.stem, {})))


def evaluate(models: Sequence[str], *, quick: bool = False, seed: int = 0, cfg: MineConfig | None = None,
             log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Record and mine every case on `models`: per-rule scores, misses, size violations, the table."""
    cfg = cfg or MineConfig()
    plants = [p for p in PLANTS if not quick or p.name in QUICK_PLANTS]
    cases: list[Case] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="opscope-eval-") as tmp:
        for m, name in enumerate(models):
            graph = load_graph(name)
            log(f"{graph.name}: plain run, {len(graph.values)} tensors")
            root = Path(tmp) / f"m{m}"
            cases += plant_cases(
                graph, root / "plants", plants, QUICK_CUTS if quick else CUTS, cfg, seed, log
            )
            cases += residual_cases(graph, root / "residual", QUICK_BLOCKS if quick else BLOCKS, cfg, log)
            if not quick or graph.name in ZOO_NAMES:
                root.mkdir(parents=True, exist_ok=True)
                cases.append(whole_model_case(graph, root, cfg))
            log(f"{graph.name}: {len(cases)} runs so far, {time.perf_counter() - started:.0f} s")
    scores, misses = score(cases)
    violations = size_violations(cases, cfg)
    return {
        "models": list(models), "quick": quick, "seed": seed, "config": asdict(cfg),
        "seconds": round(time.perf_counter() - started, 1), "runs": sum(1 for c in cases if c.truth),
        "scored": sum(len(c.truth) for c in cases), "unscored": sum(c.unscored for c in cases),
        "scores": {r: {**asdict(s), "fn": s.fn, "precision": s.precision, "recall": s.recall} for r, s in scores.items()},
        "goal": goal_holds(scores, violations), "misses": misses, "size_violations": violations,
        "table": table(scores),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}, one plant per family")
    ap.add_argument("--models", nargs="+", help="real or zoo model names, or .onnx paths (default: all)")
    ap.add_argument("--json", type=Path, help="write the scores, misses and size violations here")
    ap.add_argument("--seed", type=int, default=0, help="seed of the planted data")
    args = ap.parse_args(argv)
    models = args.models or (QUICK_MODELS if args.quick else (*REAL_NAMES, *ZOO_NAMES))
    result = evaluate(models, quick=args.quick, seed=args.seed, log=lambda s: print(s, flush=True))
    print(f"\n{result['table']}\n")
    print(f"{result['runs']} runs, {result['scored']} scored (site, role)s in {result['seconds']} s; "
          f"{result['unscored']} left unscored (the plant's axes or minimum size do not fit)")  # fmt: skip
    for line in result["misses"]:
        print("miss:", line)
    for line in result["size_violations"]:
        print("below a minimum size:", line)
    print("goal (precision and recall >= 0.9 for every rule, no finding below a minimum size):",
          "holds" if result["goal"] else "MISSED")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
