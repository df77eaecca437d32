"""Where a tap's run time goes: the floor under the default set, and what each sketch of a set adds.

    python scripts/bench_floor.py --models ppocrv4_det,bert_like
    python scripts/bench_floor.py --models ppocrv4_det --sketch-costs --rounds 12
    python scripts/bench_floor.py --models ppocrv4_det,bert_like --sketch-costs default

The floor: the model with the tensors the default set taps (its in-graph taps of the main graph) read
by bare ONNX nodes and nothing else, their results leaving as one output per op (packed, as the default
set packs its scalars: a graph output costs ~2 µs a run):

- `+ Shape`: one Shape node a tensor: what reading it at all costs (fusions it blocks, the NCHWc
  layout reordered back for it);
- `+ ReduceMax`: one whole-tensor reduction a tensor;
- `+ 4 reductions`: ReduceMin, ReduceMax, ReduceSum and ReduceSumSquare, the passes the default set
  makes (its min, max, sum and finite check Σx²), with none of its structure (the If, the sample,
  the shapes);
- `default set`: the model as `record` instruments it.

A goal under `+ 4 reductions` cannot be met by arranging the default set's nodes better on this
provider. `--sketch-costs` times `--sketch all` and `--sketch all` without each sketch in turn: what
each one costs on this model (the `cost` each sketch's registry entry quotes); `--sketch-costs default`
does the same for the default set (what a default set without one of its passes would cost). Every variant is timed
against plain in one process, in `--sessions` sessions each (`bench_ab.time_sessions`: 1 intra-op thread,
the tapped models in priority order as `record` runs them; one session of a model can sit ~5% off
another for its whole life), × plain as a paired median with quartiles and the spread of the sessions'
medians. The run alone: no decode.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - sibling scripts: the models, feeds and ops bench.py measures
from bench_ab import load_case, positive, spread, time_sessions  # noqa: E402
from bench_peers import FLOOR_READERS, in_graph_tensors, instrumented, with_readers  # noqa: E402

from onnx_opscope.sketch import SKETCH_SETS  # noqa: E402


def variants(case: bench.Case, shapes: dict, sketch_costs: str | None) -> dict[str, onnx.ModelProto]:
    """label -> model to time against plain: the floor's, or with `sketch_costs` (a set's name) the set
    and the set without each of its sketches."""
    default, manifest = instrumented(str(case.model), case.ops, shapes, None)
    tensors = in_graph_tensors(manifest)
    plain = onnx.load(str(case.model))
    if not sketch_costs:
        if not tensors:  # silero_vad_v6, captcha_crnn: every tap copied out or in a subgraph
            return {"default set (no in-graph tap in the main graph to read bare)": default}
        got = {
            f"{label} ({len(tensors)} tensors)": with_readers(plain, tensors, ops)
            for label, ops in FLOOR_READERS.items()
        }
        return got | {"default set": default}
    chosen = SKETCH_SETS[sketch_costs]
    got = {f"--sketch {sketch_costs}": instrumented(str(case.model), case.ops, shapes, list(chosen))[0]}
    for name in chosen:
        got[f"without {name}"] = instrumented(
            str(case.model), case.ops, shapes, [n for n in chosen if n != name]
        )[0]
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", default="ppocrv4_det,bert_like", help="bench.py's model names, comma-separated"
    )
    p.add_argument(
        "--sketch-costs",
        nargs="?",
        const="all",
        choices=sorted(SKETCH_SETS),
        metavar="SET",
        help="what each sketch of a set adds (all, the default, or default), not the floor",
    )
    p.add_argument("--rounds", type=positive, default=20, help="alternations (default 20)")
    p.add_argument("--runs", type=positive, default=3, help="runs per variant and round (default 3)")
    p.add_argument(
        "--sessions", type=positive, default=2, help="sessions per variant, alternating (default 2)"
    )
    p.add_argument(
        "--quick", action="store_true", help="bench.py's quick models (a smoke run; never judge by it)"
    )
    a = p.parse_args(argv)
    what = f"each sketch's cost in --sketch {a.sketch_costs}" if a.sketch_costs else "the floor"
    print(f"{what}; {a.rounds} rounds × {a.runs} runs × {a.sessions} sessions, 1 thread, the run alone")
    print("| model | variant | ms a run | × plain, paired median [quartiles], sessions' medians |")
    print("|---|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in a.models.split(","):
            case, feeds, shapes = load_case(work, name, a.quick)
            models = variants(case, shapes, a.sketch_costs)
            paths = [case.model]
            for i, m in enumerate(models.values()):
                paths.append(work / f"{name}_{i}.onnx")
                onnx.save(m, paths[-1])
            plain, *ratios = time_sessions(paths, feeds, a.rounds, a.runs, a.sessions)
            print(f"| {name} | plain | {np.median(plain) * 1e3:.2f} | 1 |")
            for label, x in zip(models, ratios):
                print(f"| {name} | {label} | {np.median(x * plain) * 1e3:.2f} | {spread(x)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
