"""Write the generated model zoo (`onnx_opscope.zoo.MODELS`) to models/<name>.onnx and models/README.md.

Every model is deterministic (seeded weights), so re-running gives the same bytes; each
file must stay under 1 MB. `--check` writes nothing and fails when a committed file is
missing, stale or too big.

    python scripts/make_models.py              # all models + README
    python scripts/make_models.py mlp moe      # just these (README is rewritten in full)
    python scripts/make_models.py --check      # are models/ up to date?
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onnx import ModelProto, TensorProto, helper

from onnx_opscope import zoo

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models"
MAX_BYTES = 1_000_000  # "under 1 MB": committed models must stay small


def model_bytes(model: ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


def describe_inputs(model: ModelProto) -> str:
    """`x` float32 [batch, 64]; `flag` bool [] ... for the graph inputs that are not initializers."""
    inits = {t.name for t in model.graph.initializer}
    parts = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        is_bool = tt.elem_type == TensorProto.BOOL
        dtype = "bool" if is_bool else helper.tensor_dtype_to_np_dtype(tt.elem_type).name
        dims = ", ".join(d.dim_param or str(d.dim_value) for d in tt.shape.dim)
        parts.append(f"`{vi.name}` {dtype} [{dims}]" + (" (scalar)" if not tt.shape.dim else ""))
    return "; ".join(parts)


def describe_opsets(model: ModelProto) -> str:
    parts = [str(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")]
    parts += [f"{o.domain} {o.version}" for o in model.opset_import if o.domain not in ("", "ai.onnx")]
    return " + ".join(parts)


def readme(models: dict[str, ModelProto]) -> str:
    lines = [
        "# Generated models",
        "",
        "Small deterministic models built by `onnx_opscope/zoo.py` (numpy weights from a fixed seed,",
        "no training). Regenerate with `python scripts/make_models.py`; check they are current with",
        "`python scripts/make_models.py --check`. Each file is under 1 MB.",
        "",
        "| name | opset | IR | exercises | inputs |",
        "|---|---|---|---|---|",
    ]
    for name, model in models.items():
        what = zoo.describe(name).replace("|", "\\|")
        opsets, inputs = describe_opsets(model), describe_inputs(model)
        lines.append(f"| `{name}` | {opsets} | {model.ir_version} | {what} | {inputs} |")
    lines += [
        "",
        "Integer inputs must stay inside their tables: `transformer_tiny_lm.input_ids` < 100 (seq <= 64),",
        "`bool_int_inputs.ids` < 50; `onnx_opscope.zoo.example_feeds(name)` gives a valid seeded feed.",
        "",
        "Bigger models for benchmarks and big-model tests are built at run time and never committed:",
        "`zoo.bert_like`, `zoo.resnet_like`, `zoo.gpt2_like`, `zoo.wide_graph(n_nodes)` and",
        "`zoo.write_external_weights_model(folder, total_bytes)` (weights in `big.onnx.data`).",
        "",
        "Real trained models are fetched into `models/real/` (git-ignored) by",
        "`python scripts/fetch_models.py`.",
        "",
    ]
    return "\n".join(lines)


def _write(path: Path, data: bytes) -> None:
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    part.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"models to write (default: all of {', '.join(zoo.MODELS)})")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write into (default: models/)")
    p.add_argument("--check", action="store_true", help="write nothing; fail if a file is missing or stale")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in zoo.MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(zoo.MODELS)}")
    models = {name: zoo.build(name) for name in zoo.MODELS}
    problems: list[str] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or list(zoo.MODELS):
        data = model_bytes(models[name])
        path = args.out / f"{name}.onnx"
        if len(data) >= MAX_BYTES:
            problems.append(f"{name}: {len(data)} bytes, over the {MAX_BYTES}-byte limit")
            continue
        if args.check:
            if not path.is_file() or path.read_bytes() != data:
                problems.append(f"{path.name}: missing or stale")
            continue
        _write(path, data)
        print(f"{path.name}\t{len(data) / 1e3:.1f} kB")
    text = readme(models)
    readme_path = args.out / "README.md"
    if args.check:
        if not readme_path.is_file() or readme_path.read_text(encoding="utf-8") != text:
            problems.append("README.md: missing or stale")
    else:
        _write(readme_path, text.encode("utf-8"))
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems and args.check:
        print("run `python scripts/make_models.py` to regenerate", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
