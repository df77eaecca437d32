"""onnx's own backend node tests, instrumented: every one that has a site still computes its outputs.

The corpus is onnx's `backend/test/data/node/*/model.onnx` with `test_data_set_0` where the
installed onnx ships it, else the same cases generated from onnx's own case definitions
(`onnx.backend.test.case.node.collect_testcases`, what onnx writes that folder from): each op
at the opset it was introduced in, so the corpus reaches back to opset 7 (MatMulInteger at 10,
...). A case counts when plain onnxruntime reproduces its expected outputs and `find_sites`
finds a site in it. Then the model instrumented with the default sketches must give the
expected outputs (the original outputs keep their places) and every sketch value of a
main-graph tap must be finite wherever its numpy reference is. Models are tapped as they are,
at their own opset: no version conversion.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import ModelProto, TensorProto, numpy_helper
from test_sketches import reference_input, tapped_names, tensor_values

from onnx_opscope import inject
from onnx_opscope import sketch as sk
from onnx_opscope.graph.io import opset_version
from onnx_opscope.instrument import decode_taps, host_values
from onnx_opscope.sites import SHADOW_SUFFIX, find_sites

NODE_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"


@dataclass
class NodeCase:
    name: str
    model: ModelProto
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]
    rtol: float = 1e-3  # onnx's backend runner defaults
    atol: float = 1e-7


def _read_tensor(path: Path, type_proto: onnx.TypeProto) -> np.ndarray | None:
    if not type_proto.HasField("tensor_type") or not path.is_file():
        return None  # sequences, maps, optionals: no GEMM-kind site reads them
    t = TensorProto()
    t.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(t)


def _from_folder(folder: Path) -> NodeCase | None:
    model = onnx.load(str(folder / "model.onnx"))
    data = folder / "test_data_set_0"
    if not data.is_dir():
        return None
    inits = {t.name for t in model.graph.initializer}
    inputs_vi = [i for i in model.graph.input if i.name not in inits]
    ins = [_read_tensor(data / f"input_{i}.pb", vi.type) for i, vi in enumerate(inputs_vi)]
    outs = [_read_tensor(data / f"output_{i}.pb", vi.type) for i, vi in enumerate(model.graph.output)]
    if any(v is None for v in ins + outs):
        return None
    return NodeCase(folder.name, model, ins, outs)


def node_cases() -> list[NodeCase]:
    if NODE_DATA.is_dir() and any(NODE_DATA.glob("*/model.onnx")):
        cases = [_from_folder(f) for f in sorted(NODE_DATA.iterdir()) if (f / "model.onnx").is_file()]
        return [c for c in cases if c is not None]
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        generated = collect_testcases()
    cases = []
    for c in generated:
        if not c.data_sets or not all(
            isinstance(v, np.ndarray) for v in [*c.data_sets[0][0], *c.data_sets[0][1]]
        ):
            continue
        cases.append(
            NodeCase(c.name, c.model, list(c.data_sets[0][0]), list(c.data_sets[0][1]), c.rtol, c.atol)
        )
    return cases


def _session(model: ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(model: ModelProto, case: NodeCase) -> dict[str, np.ndarray]:
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    return dict(zip(names, case.inputs))


def _same(got: list, want: list[np.ndarray], rtol: float, atol: float) -> bool:
    if len(got) < len(want):
        return False
    for g, w in zip(got, want):
        g = np.asarray(g)
        if g.shape != w.shape:
            return False
        if w.dtype.kind in "fc" or g.dtype.kind in "fc":
            with np.errstate(all="ignore"):
                ok = np.allclose(
                    g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True
                )
        else:
            ok = np.array_equal(g, w)
        if not ok:
            return False
    return True


def _has_site(model: ModelProto) -> bool:
    try:
        return bool(find_sites(model))
    except Exception:  # a model our shape inference cannot read is not a tapping case
        return False


def _plain_passes(case: NodeCase) -> bool:
    try:
        got = _session(case.model).run(None, _feeds(case.model, case))
    except Exception:  # an op or type onnxruntime does not run
        return False
    return len(got) == len(case.outputs) and _same(got, case.outputs, case.rtol, case.atol)


def _check_instrumented(case: NodeCase) -> str | None:
    """None when the instrumented model passes, else what went wrong."""
    feeds = _feeds(case.model, case)
    try:
        inst, manifest = inject(case.model)
        sess = _session(inst)
        names = [o.name for o in sess.get_outputs()]
        got = sess.run(None, feeds)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    n = len(case.outputs)
    if names[:n] != [o.name for o in case.model.graph.output]:
        return "the original outputs moved"
    if not _same(got[:n], case.outputs, case.rtol, case.atol):
        return "the original outputs changed"
    outs = dict(zip(names, got))
    decoded = decode_taps(manifest, outs, host_values(manifest, case.model))
    # main-graph taps of the model's own tensors (a fused attention op's shadow softmax is not one)
    taps = [t for t in manifest.taps if t.graph == "" and t.sketches and not t.tensor.endswith(SHADOW_SUFFIX)]
    values = tensor_values(case.model, tapped_names(taps), feeds) if taps else {}
    opts = manifest.sketch_options()
    for tap in taps:
        stats, shape = decoded[tap.id]
        x = reference_input(tap, values)
        if shape != list(np.shape(x)):
            return f"{tap.tensor}: shape {shape} != {list(np.shape(x))}"
        with np.errstate(all="ignore"):
            refs = sk.references(tap.sketches, x, tap.info(), opts)
        for stat, ref in refs.items():
            v = stats[stat]
            if v.shape != ref.shape or not np.isfinite(v[np.isfinite(ref)]).all():
                return f"{tap.tensor} {stat}: {v} where the reference is {ref}"
    return None


def test_node_corpus_keeps_outputs_and_sketches_are_finite():
    eligible, failures, opsets = [], [], {}
    for case in node_cases():
        if not _has_site(case.model) or not _plain_passes(case):
            continue
        eligible.append(case.name)
        opsets[case.name] = opset_version(case.model)
        problem = _check_instrumented(case)
        if problem is not None:
            failures.append(f"{case.name} (opset {opsets[case.name]}): {problem}")
    passed = len(eligible) - len(failures)
    print(f"node corpus: {passed} of {len(eligible)} tappable cases pass after inject")
    assert not failures, "\n".join(failures)
    assert len(eligible) >= 150, len(eligible)  # the corpus is there, and most of it is tappable
    old = sorted(n for n, o in opsets.items() if o < 11)
    assert "test_matmulinteger" in old, old  # opset 10: tapped as it is
