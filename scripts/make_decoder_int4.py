"""Build the int4 weight-only decoder: SmolLM2-135M's export with every linear projection a MatMulNBits.

From the plain export (`make_decoder.build`), each projection MatMul (q, k, v, o, gate, up, down of
every layer) becomes a com.microsoft MatMulNBits (bits 4, block_size 32, with zero points) holding
the GGUF's own Q4_1 blocks, not a re-quantization: `matmul_nbits_quantizer` on the fp32 export adds
visible error (its first-step logits correlate ~0.9 with fp32's) where these blocks are the weights
the fp32 export was dequantized from.

Q4_1 stores per block of 32 a scale d and a min m (both float16) and codes q in 0..15, the value
being d * q + m; MatMulNBits computes (q - zero_point) * scale. With scale = d and a float32 zero
point zp = -m / d, (q - zp) * d equals d * q + m up to float32 rounding (a block with d = 0 is all
m: codes 0, scale m, zp -1, exact). A uint8 zero point cannot hold these (m is no multiple of d).
The nibbles are re-packed: Q4_1 keeps codes j and j + 16 in byte j, MatMulNBits codes 2j and 2j + 1.
The lm head (the tied Q8_0 embedding, also read by the Gather) stays a float MatMul.

Every projection is checked before it is replaced: its fp32 initializer must equal the GGUF block
dequantization (so the mapping from graph nodes to GGUF tensors is right), and onnxruntime's
MatMulNBits on an identity input must give that matrix back within float32 rounding; the measured
worst error goes into `build.json` (2 and 30 layers: 2.4e-7; the fp32 initializers equal the blocks'
d * q + m exactly). Greedy decoding of the chat prompt then gives the plain decoder's tokens, logits
within 2e-6 of the max (30 layers: "The capital of France is Paris.").

The price of exactness is speed: onnxruntime's CPU MatMulNBits has fast (MLAS) kernels for uint8
zero points only; with float ones it dequantizes B on every call (measured on a 576 x 1536 weight,
M = 1, one thread: 4.6 ms against 0.55 ms with uint8 zero points and 0.22 ms for the fp32 MatMul),
so this decoder's decode step is ~4x the fp32 one's. It is test data for what the taps see on an
int4 model, not a speed reference.

    python scripts/make_decoder_int4.py --layers 2    # models/real/smollm2_135m_l2_int4/model.onnx
    python scripts/make_decoder_int4.py --check       # + greedy tokens and logits vs the plain decoder

Cached like make_decoder.py: skipped when `build.json` records the plain build's key and this
script's version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_decoder  # noqa: E402
from fetch_models import DEFAULT_DEST  # noqa: E402

BUILD_VERSION = 1  # bump when the int4 graph changes: cached builds are redone
BLOCK = 32  # Q4_1's block: MatMulNBits' block_size
PROJECTIONS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
               "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}  # fmt: skip
_NODE = re.compile(r"^/layers\.(\d+)/(q|k|v|o|gate|up|down)/MatMul$")
_MS = "com.microsoft"


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [rows, cols / 32, 32], d float32 [rows, cols / 32], m float32 [rows, cols / 32]) of a Q4_1
    tensor's bytes (`GGUFReader` data: [rows, blocks * 20], each block d f16, m f16, 16 bytes of codes)."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # byte j: code j (low), code j + 16 (high)
    return codes, d, m


def nbits_inputs(
    codes: np.ndarray, d: np.ndarray, m: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' B uint8 [N, blocks, 16], scales and float zero points [N * blocks] for Q4_1 blocks."""
    flat = d == 0  # the block is m throughout: (0 - (-1)) * m
    codes = np.where(flat[..., None], 0, codes).astype(np.uint8)
    scale = np.where(flat, m, d).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        zp = np.where(flat, np.float32(-1), -m / np.where(flat, 1, d)).astype(np.float32)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # MatMulNBits: code 2j low, 2j + 1 high
    return np.ascontiguousarray(packed), scale.ravel(), zp.ravel()


def read_projections(gguf_path: Path, layers: int) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """GGUF name -> Q4_1 (codes, d, m) of the projections of the first `layers` layers, rows in the
    export's order (llama.cpp's Q / K row permutation undone, as `make_decoder` does to the floats)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    wanted = {f"blk.{i}.{p}.weight" for i in range(layers) for p in PROJECTIONS.values()}
    out = {}
    for t in reader.tensors:
        if t.name not in wanted:
            continue
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            raise SystemExit(f"error: {t.name} is {t.tensor_type.name}, expected Q4_1")
        cols, rows = (int(x) for x in t.shape)
        codes, d, m = q4_1_blocks(t.data, rows, cols)
        group = {"attn_q": heads, "attn_k": kv_heads}.get(t.name.split(".")[2])
        if group:
            codes = make_decoder.unpermute(codes.reshape(rows, -1), group).reshape(codes.shape)
            d, m = make_decoder.unpermute(d, group), make_decoder.unpermute(m, group)
        out[t.name] = (codes, d, m)
    missing = wanted - set(out)
    if missing:
        raise SystemExit(f"error: the GGUF file lacks {sorted(missing)[:3]}")
    return out


def convert(proto, blocks: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[int, float]:
    """Rewrite `proto` in place: every projection MatMul a MatMulNBits on its GGUF blocks. Returns
    (nodes replaced, worst |fp32 initializer - d * q + m|: 0 when the export holds exactly these weights)."""
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    readers: dict[str, int] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    new_inits, dropped, replaced, worst = [], set(), 0, 0.0
    for node in proto.graph.node:
        hit = _NODE.match(node.name)
        if node.op_type != "MatMul" or not hit:
            continue
        layer, proj = hit.groups()
        codes, d, m = blocks[f"blk.{layer}.{PROJECTIONS[proj]}.weight"]
        w = numpy_helper.to_array(inits[node.input[1]])  # [K, N]
        n, k = codes.shape[0], codes.shape[1] * BLOCK
        if w.shape != (k, n) or readers[node.input[1]] != 1:
            raise SystemExit(
                f"error: {node.name} reads {node.input[1]} {list(w.shape)}, expected [{k}, {n}] once"
            )
        exact = (d[..., None] * codes + m[..., None]).reshape(n, k)  # gguf's own dequantization formula
        worst = max(worst, float(np.abs(w.T - exact).max()))
        packed, scale, zp = nbits_inputs(codes, d, m)
        base = node.input[1]
        new_inits += [numpy_helper.from_array(packed, f"{base}_q4"), numpy_helper.from_array(scale, f"{base}_scale"),
                      numpy_helper.from_array(zp, f"{base}_zp")]  # fmt: skip
        inputs = [node.input[0], f"{base}_q4", f"{base}_scale", f"{base}_zp"]
        attrs = {"K": k, "N": n, "bits": 4, "block_size": BLOCK}
        node.CopyFrom(
            helper.make_node("MatMulNBits", inputs, list(node.output), name=node.name, domain=_MS, **attrs)
        )
        dropped.add(base)
        replaced += 1
    kept = [t for t in proto.graph.initializer if t.name not in dropped]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept + new_inits)
    if not any(o.domain == _MS for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(_MS, 1))
    proto.metadata_props.add(key="weights", value="int4 MatMulNBits holding the GGUF's Q4_1 blocks")
    return replaced, worst


def kernel_error(proto, plain) -> float:
    """Worst |W_ort - W_fp32| over the projections: each MatMulNBits run by onnxruntime on an identity
    input (so it returns its own dequantized weight, [K, N]) against the plain export's fp32 initializer."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    fp32 = {t.name: t for t in plain.graph.initializer}
    nodes, checks = [n for n in proto.graph.node if n.op_type == "MatMulNBits"], []
    for j, n in enumerate(nodes):
        k = next(a.i for a in n.attribute if a.name == "K")
        check = helper.make_node(
            "MatMulNBits", [f"eye{k}", *n.input[1:]], [f"w{j}"], name=f"w{j}", domain=_MS
        )
        check.attribute.extend(n.attribute)
        checks.append(check)
    ks = sorted({c.input[0] for c in checks})
    graph = helper.make_graph(
        checks, "kernel_check",
        [helper.make_tensor_value_info(e, TensorProto.FLOAT, [int(e[3:])] * 2) for e in ks],
        [helper.make_tensor_value_info(c.output[0], TensorProto.FLOAT, None) for c in checks],
        [inits[name] for n in nodes for name in n.input[1:]],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(_MS, 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = session.run(None, {e: np.eye(int(e[3:]), dtype=np.float32) for e in ks})
    base = [n.input[1].removesuffix("_q4") for n in nodes]
    return max(float(np.abs(o - numpy_helper.to_array(fp32[b])).max()) for o, b in zip(outs, base))


# ---------------------------------------------------------------------------------------------
# Build, cache, check


def options_key(layers: int | None) -> str:
    blob = json.dumps({"plain": make_decoder.options_key(layers), "int4": BUILD_VERSION})
    return hashlib.sha256(blob.encode()).hexdigest()


def default_out(layers: int | None, dest: Path = DEFAULT_DEST) -> Path:
    plain = make_decoder.default_out(layers, dest)
    return plain.with_name(plain.name + "_int4")


def build(layers: int | None = None, dest: Path = DEFAULT_DEST, quiet: bool = False) -> Path:
    """The int4 decoder's .onnx path (beside the plain one, folder suffix `_int4`), built unless cached."""
    import onnx

    out = default_out(layers, dest)
    model_path, info_path = out / "model.onnx", out / "build.json"
    key = options_key(layers)
    if model_path.is_file() and info_path.is_file() and json.loads(info_path.read_text()).get("key") == key:
        make_decoder.refresh_tokenizer(out, dest)  # a build cached before the tokenizer files gets them
        return model_path
    started = time.perf_counter()
    plain_path = make_decoder.build(layers, dest=dest, quiet=quiet)
    config = json.loads((plain_path.parent / "build.json").read_text())["config"]
    plain = onnx.load(str(plain_path))
    proto = onnx.load(str(plain_path))
    blocks = read_projections(make_decoder.fetch_gguf(dest), config["layers"])
    replaced, init_error = convert(proto, blocks)
    expected = config["layers"] * len(PROJECTIONS)
    if replaced != expected or init_error > 0:
        raise SystemExit(f"error: {replaced} of {expected} projections replaced, fp32 export differs from the "
                         f"GGUF blocks by {init_error:.3g}")  # fmt: skip
    ort_error = kernel_error(proto, plain)
    del plain
    if ort_error > 1e-5:  # float32 rounding of -m / d is ~1e-7 on these weights (|w| < ~2)
        raise SystemExit(f"error: onnxruntime's MatMulNBits differs from the fp32 weights by {ort_error:.3g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        onnx.save(proto, str(tmp / "model.onnx"))
        for name in make_decoder.TOKENIZER_FILES:
            shutil.copyfile(plain_path.parent / name, tmp / name)
        seconds = round(time.perf_counter() - started, 1)
        info = {"key": key, "config": config, "seconds": seconds, "projections": replaced,
                "max_abs_weight_error_onnxruntime": ort_error, "gguf": make_decoder.GGUF_SHA256}  # fmt: skip
        (tmp / "build.json").write_text(json.dumps(info, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        size = model_path.stat().st_size / 1e6
        print(f"{model_path}: {replaced} MatMulNBits, {size:.0f} MB, weights within {ort_error:.2g} of fp32, "
              f"built in {seconds}s")  # fmt: skip
    return model_path


def check(model_path: Path, plain_path: Path, steps: int = 12) -> None:
    """Greedy tokens and next-token logits of the int4 decoder against the plain one on the chat prompt."""
    import onnxruntime as ort

    tok = make_decoder.read_tokenizer(model_path.parent)
    prompt = make_decoder.encode(make_decoder.chat_prompt(make_decoder.PROMPT), tok)
    runs = []
    for path in (model_path, plain_path):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        runs.append(make_decoder.greedy(session, prompt, steps, cache=True))
    (ids, logits), (ref_ids, ref_logits) = runs
    same = sum(a == b for a, b in zip(ids, ref_ids))
    worst = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits))
    answer = ids[: ids.index(tok["eos_id"])] if tok["eos_id"] in ids else ids
    print(f"continuation: {make_decoder.decode(answer, tok)!r}")
    print(f"int4 vs fp32: {same} of {steps} greedy tokens equal, worst logits difference {worst:.2g} of max")
    if same != steps or worst > 1e-4:
        raise SystemExit("error: the int4 decoder does not reproduce the plain one")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all 30)")
    p.add_argument("--dest", type=Path, default=Path(os.environ.get("OPSCOPE_MODELS", DEFAULT_DEST)),
                   help="the cache folder of the GGUF file and the decoders (default: models/real)")  # fmt: skip
    p.add_argument("--check", action="store_true", help="compare greedy decoding with the plain decoder's")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    path = build(args.layers, args.dest)
    print(path)
    if args.check:
        check(path, make_decoder.build(args.layers, dest=args.dest, quiet=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
