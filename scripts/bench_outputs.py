"""What a graph output costs in `InferenceSession.run`, against the same values packed into one.

Why `instrument.packing` exists: N distinct whole-tensor reductions (an `Add` of a distinct
constant first, so onnxruntime's common-subexpression pass keeps them apart) returned as

- N rank-0 outputs (what each tap's scalar raws were),
- N outputs of shape [1] (`keepdims=1`): whether the rank matters,
- one output: each `Reshape`d to [1], then one `Concat` (what `packing` builds),
- one output: each `Unsqueeze`d to [1] (axes an attribute, as before opset 13), then one `Concat`,
- one output: `SequenceConstruct` + `ConcatFromSequence(new_axis=1)`, two nodes for all N (in
  priority order no cheaper than the Reshapes: the sequence copies each value in),
- one output: `keepdims=1` and one `Concat` (no Reshape: the floor),

timed alternately, at one intra-op thread, in onnxruntime's default node order or in priority
order (what `record` uses); median and quartiles over rounds.

    python scripts/bench_outputs.py [--n 800] [--rounds 30] [--order priority]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, TensorProto, helper, numpy_helper

MODES = {
    "outputs": "N rank-0 outputs",
    "outputs1": "N outputs of shape [1]",
    "packed": "Reshape [1] each + one Concat",
    "unsqueeze": "Unsqueeze (attribute) each + one Concat",
    "sequence": "SequenceConstruct + ConcatFromSequence",
    "floor": "keepdims=1 + one Concat",
}


def model(n: int, mode: str) -> ModelProto:
    inits = [numpy_helper.from_array(np.array([i], np.float32), f"c{i}") for i in range(n)]
    if mode == "packed":
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    keep = int(mode in ("floor", "outputs1"))
    nodes = [helper.make_node("Add", ["x", f"c{i}"], [f"a{i}"]) for i in range(n)]
    nodes += [helper.make_node("ReduceMax", [f"a{i}"], [f"m{i}"], keepdims=keep) for i in range(n)]
    outs = [f"m{i}" for i in range(n)]
    if mode == "packed":
        nodes += [helper.make_node("Reshape", [f"m{i}", "one"], [f"r{i}"]) for i in range(n)]
        outs = [f"r{i}" for i in range(n)]
    if mode == "unsqueeze":
        nodes += [helper.make_node("Unsqueeze", [f"m{i}"], [f"u{i}"], axes=[0]) for i in range(n)]
        outs = [f"u{i}" for i in range(n)]
    if mode == "sequence":
        nodes.append(helper.make_node("SequenceConstruct", outs, ["seq"]))
        nodes.append(helper.make_node("ConcatFromSequence", ["seq"], ["all"], axis=0, new_axis=1))
        outs = ["all"]
    elif mode not in ("outputs", "outputs1"):
        nodes.append(helper.make_node("Concat", outs, ["all"], axis=0))
        outs = ["all"]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
        initializer=inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 12 if mode == "unsqueeze" else 13)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=800, help="values (default 800: ~90 default taps' scalars)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--order", choices=("default", "priority"), default="default", help="node order")
    a = p.parse_args()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if a.order == "priority":
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    sessions = {
        m: ort.InferenceSession(model(a.n, m).SerializeToString(), so, providers=["CPUExecutionProvider"])
        for m in MODES
    }
    x = {"x": np.ones(16, np.float32)}
    ref = np.array(sessions["outputs"].run(None, x)).ravel()
    assert np.array_equal(np.array(sessions["outputs1"].run(None, x)).ravel(), ref)
    for m in ("packed", "unsqueeze", "sequence", "floor"):
        assert np.array_equal(sessions[m].run(None, x)[0], ref), m
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(a.rounds):
        for m, s in sessions.items():
            t = time.perf_counter()
            for _ in range(20):
                s.run(None, x)
            times[m].append((time.perf_counter() - t) / 20 * 1e6)
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"{a.n} values, {a.rounds} rounds, {a.order} node order, µs a run: median [quartiles]")
    for m, t in times.items():
        q = np.percentile(t, [25, 75])
        print(
            f"  {MODES[m]:42s} {med[m]:8.0f} [{q[0]:.0f}-{q[1]:.0f}]  ×{med[m] / med['floor']:.2f} the floor"
        )
    print(f"an output costs {(med['outputs'] - med['floor']) / a.n:.2f} µs; a packed value "
          f"{(med['packed'] - med['floor']) / a.n:.2f} µs over the floor")  # fmt: skip


if __name__ == "__main__":
    main()
