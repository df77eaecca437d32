"""Build the onnxruntime-fused variant of the SmolLM2 test decoder: contrib normalization, rotary and attention ops.

Derived from scripts/make_decoder.py's export (built first when missing), in two passes:

1. `onnxruntime.transformers.optimizer` (opt_level 0, so the graph stays provider-neutral) fuses the
   RMSNorms: one SimplifiedLayerNormalization on the embedding, then a SkipSimplifiedLayerNormalization
   for every residual Add + RMSNorm pair (2 a layer, the last one carrying the final norm). It fuses
   no attention and no rotary on this graph: its attention fusions match only the mask and rotary
   code transformers 4.3x writes, and the MultiHeadAttention it makes for LLaMA does not load with
   3 KV heads for 9 query heads.
2. Our own pass packs each layer's attention: its q / k / v projections (MatMul nodes
   `/layers.{i}/{q,k,v}/MatMul`, named by the export's module names) feed two RotaryEmbedding ops
   (q and k, rotate-half) and one com.microsoft GroupQueryAttention (9 heads over 3 KV heads, rotary
   outside the op so each is a site of its own), whose present key / value outputs are the model's
   `present.{i}.key/value` [batch, kv_heads, total, head_dim], the layout `generate` feeds back. The
   exported mask, rotary and attention nodes are then dead and removed.

The inputs and outputs are the plain export's, so `generate` drives both the same way: the extra
inputs GroupQueryAttention needs are computed in the graph from `attention_mask` (positions =
cumsum - 1 for RotaryEmbedding, seqlens_k = row sum - 1, total_sequence_length = its width). As
GroupQueryAttention assumes, padding can only be on the right; `generate` feeds all-ones masks.

    python scripts/make_decoder_fused.py --layers 2 --check   # models/real/smollm2_135m_l2_fused/

Cached like make_decoder.py: rebuilt when the plain build or this script's version changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_decoder  # noqa: E402
from fetch_models import DEFAULT_DEST  # noqa: E402

FUSED_VERSION = 1  # bump when the fused graph changes: cached builds are redone
MS = "com.microsoft"
FUSED_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RotaryEmbedding",
             "GroupQueryAttention")  # fmt: skip


def default_out(layers: int | None, dest: Path = DEFAULT_DEST) -> Path:
    plain = make_decoder.default_out(layers, dest)
    return plain.with_name(plain.name + "_fused")


def fuse_norms(plain_path: Path, config: dict):
    """The plain export with its RMSNorms fused by onnxruntime's transformer optimizer (a ModelProto)."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("gpt2")
    options.enable_attention = options.enable_rotary_embeddings = False  # packed by `pack_attention`
    noisy = logging.getLogger("symbolic_shape_infer")  # "Cannot determine if ..." for every node
    level = noisy.level
    noisy.setLevel(logging.ERROR)
    try:
        optimized = optimize_model(str(plain_path), model_type="gpt2", num_heads=config["heads"],
                                   hidden_size=config["hidden"], optimization_options=options, opt_level=0)  # fmt: skip
    finally:
        noisy.setLevel(level)
    return optimized.model


def rope_caches(config: dict) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [context, head_dim / 2] of every position, in float32 as the plain graph computes them."""
    head_dim = config["hidden"] // config["heads"]
    inv = (1.0 / (config["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(
        np.float32
    )
    freqs = np.arange(config["context"], dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(freqs), np.sin(freqs)


def pack_attention(model, config: dict) -> None:
    """Replace each layer's exported attention by RotaryEmbedding (q, k) + GroupQueryAttention, in place."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    producer = {o: n for n in graph.node for o in n.output}
    cos, sin = rope_caches(config)
    graph.initializer.extend([numpy_helper.from_array(cos, "opscope_rope_cos"),
                              numpy_helper.from_array(sin, "opscope_rope_sin")])  # fmt: skip
    c = "/opscope_gqa/"
    for name, value in (("one", [1]), ("axis", 1), ("zero", 0), ("end", [1 << 62])):
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), c + name))
    # what every layer's ops take beside q / k / v, from the graph inputs only: first in the graph
    shared = [
        helper.make_node("CumSum", ["attention_mask", c + "axis"], [c + "cumsum"]),
        helper.make_node("Sub", [c + "cumsum", c + "one"], [c + "pos_all"]),
        helper.make_node("Max", [c + "pos_all", c + "zero"], [c + "pos_clamped"]),
        helper.make_node("Shape", ["input_ids"], [c + "seq"], start=1, end=2),
        helper.make_node("Neg", [c + "seq"], [c + "minus_seq"]),
        helper.make_node(
            "Slice", [c + "pos_clamped", c + "minus_seq", c + "end", c + "one"], [c + "positions"]
        ),
        helper.make_node("ReduceSum", ["attention_mask", c + "one"], [c + "lengths"], keepdims=0),
        helper.make_node("Sub", [c + "lengths", c + "one"], [c + "last"]),
        helper.make_node("Cast", [c + "last"], [c + "seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], [c + "total_1"], start=1, end=2),
        helper.make_node("Squeeze", [c + "total_1"], [c + "total_64"]),
        helper.make_node("Cast", [c + "total_64"], [c + "total"], to=TensorProto.INT32),
    ]
    stale: list[str] = []
    for i in range(config["layers"]):
        p = f"/layers.{i}/"
        q, k, v, o = (nodes.get(f"{p}{n}/MatMul") for n in ("q", "k", "v", "o"))
        if None in (q, k, v, o):
            raise SystemExit(
                f"error: layer {i}'s q / k / v / o MatMul nodes not found: not make_decoder's export"
            )
        present = (f"present.{i}.key", f"present.{i}.value")
        past = (f"past_key_values.{i}.key", f"past_key_values.{i}.value")
        for name, past_name in zip(present, past):
            concat = producer.get(name)
            if concat is None or concat.op_type != "Concat" or concat.input[0] != past_name:
                raise SystemExit(f"error: {name} is not a Concat of {past_name}: not make_decoder's export")
            stale.append(concat.name)
        rot = [
            helper.make_node("RotaryEmbedding", [t.output[0], c + "positions", "opscope_rope_cos", "opscope_rope_sin"],
                             [f"{p}{n}/rotary_output"], f"{p}{n}/RotaryEmbedding", domain=MS, interleaved=0)
            for n, t in (("q", q), ("k", k))
        ]  # fmt: skip
        gqa = helper.make_node(
            "GroupQueryAttention",
            [rot[0].output[0], rot[1].output[0], v.output[0], *past, c + "seqlens_k", c + "total"],
            [f"{p}attn/output", *present], f"{p}attn/GroupQueryAttention", domain=MS,
            num_heads=config["heads"], kv_num_heads=config["kv_heads"],
        )  # fmt: skip
        o.input[0] = gqa.output[0]
        at = list(graph.node).index(o)
        for j, node in enumerate([*rot, gqa]):
            graph.node.insert(at + j, node)
    # the optimizer's "SkipLayerNorm_3" renamed for its norm: "/layers.1/ffn_norm/SkipSimplifiedLayerNormalization"
    for node in graph.node:
        if node.op_type in FUSED_OPS[:2] and "/" in node.output[0]:
            node.name = f"{node.output[0].rsplit('/', 1)[0]}/{node.op_type}"
    keep = [n for n in graph.node if n.name not in stale]
    del graph.node[:]
    graph.node.extend(shared + keep)
    _remove_dead(graph)
    del graph.value_info[:]  # the optimizer's shapes name tensors that are gone
    if not any(op.domain == MS for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))


def _remove_dead(graph) -> None:
    """Drop nodes and initializers no graph output depends on (the exported mask, rotary and attention)."""
    needed = {o.name for o in graph.output}
    alive = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            alive.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(alive))
    used = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used)


def fused_ops(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node if n.op_type in FUSED_OPS)


def options_key(layers: int | None) -> str:
    blob = json.dumps({"plain": make_decoder.options_key(layers), "fused": FUSED_VERSION})
    return hashlib.sha256(blob.encode()).hexdigest()


def build(
    layers: int | None = None, out: Path | None = None, dest: Path = DEFAULT_DEST, quiet: bool = False
) -> Path:
    """The fused decoder's .onnx path in `out` (default `default_out`), built unless already cached."""
    import onnx

    out = out or default_out(layers, dest)
    model_path, info_path = out / "model.onnx", out / "build.json"
    key = options_key(layers)
    if model_path.is_file() and info_path.is_file() and json.loads(info_path.read_text()).get("key") == key:
        make_decoder.refresh_tokenizer(out, dest)  # a build cached before the tokenizer files gets them
        return model_path
    started = time.perf_counter()
    plain = make_decoder.build(layers, dest=dest, quiet=quiet)
    config = json.loads((plain.parent / "build.json").read_text())["config"]
    model = fuse_norms(plain, config)
    pack_attention(model, config)
    counts = fused_ops(model)
    want = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2 * config["layers"],
            "RotaryEmbedding": 2 * config["layers"], "GroupQueryAttention": config["layers"]}  # fmt: skip
    if counts != want:
        raise SystemExit(
            f"error: fused ops {dict(counts)}, expected {want}: onnxruntime's optimizer changed?"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        big = sum(len(t.raw_data) for t in model.graph.initializer) > make_decoder.EXTERNAL_OVER
        onnx.save(model, str(tmp / "model.onnx"), save_as_external_data=big,
                  location="model.onnx.data" if big else None)  # fmt: skip
        for name in make_decoder.TOKENIZER_FILES:
            shutil.copy(plain.parent / name, tmp / name)
        seconds = round(time.perf_counter() - started, 1)
        info = {
            "key": key,
            "config": config,
            "seconds": seconds,
            "fused_ops": dict(counts),
            "plain": plain.parent.name,
        }
        (tmp / "build.json").write_text(json.dumps(info, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"{model_path}: {dict(counts)}, built in {seconds}s")
    return model_path


def check(fused: Path, plain: Path, steps: int = 12) -> None:
    """Greedy tokens of the fused decoder equal the plain one's, with and without the cache; print the worst
    next-token logits difference relative to the logits' largest magnitude."""
    import onnxruntime as ort

    tok = make_decoder.read_tokenizer(fused.parent)
    prompt = make_decoder.encode(make_decoder.chat_prompt(make_decoder.PROMPT), tok)
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (plain, fused)]
    ref_tokens, ref_logits = make_decoder.greedy(sessions[0], prompt, steps, cache=True)
    worst = 0.0
    for cache in (True, False):
        tokens, logits = make_decoder.greedy(sessions[1], prompt, steps, cache=cache)
        worst = max(
            [worst, *(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits))]
        )
        if tokens != ref_tokens:
            raise SystemExit(
                f"error: fused greedy tokens {tokens} differ from the plain decoder's {ref_tokens}"
            )
    answer = ref_tokens[: ref_tokens.index(tok["eos_id"])] if tok["eos_id"] in ref_tokens else ref_tokens
    print(f"continuation: {make_decoder.decode(answer, tok)!r}")
    print(f"fused == plain: {steps} greedy tokens equal (cache loop and full sequence), "
          f"worst logits difference {worst:.2g} of max")  # fmt: skip
    if worst > 1e-4:
        raise SystemExit("error: the fused decoder's logits differ from the plain one's by more than 1e-4")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all 30)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: models/real/smollm2_135m[_lN]_fused)")  # fmt: skip
    p.add_argument("--dest", type=Path, default=Path(os.environ.get("OPSCOPE_MODELS", DEFAULT_DEST)),
                   help="the cache folder of the GGUF file, the plain build and default outputs")  # fmt: skip
    p.add_argument(
        "--check", action="store_true", help="check greedy tokens and logits against the plain decoder"
    )
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    path = build(args.layers, args.out, args.dest)
    print(path)
    if args.check:
        check(path, make_decoder.build(args.layers, dest=args.dest, quiet=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
