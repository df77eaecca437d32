"""Text prompts: a decoder's text in and out through the Hugging Face tokenizer exported beside it.

transformers / optimum exports put `tokenizer.json` (and `tokenizer_config.json`, with the chat
template) next to `model.onnx`, so that is where we look unless told a file. The loop itself only
ever sees ids: `prompt_ids_of` turns text into the ids that `generate`, `calibrate_generation` and
`parity_generation` already take, and `text_of` turns generated ids back, so one helper serves all
three instead of a `prompt=` argument on each. Hugging Face's `tokenizers` (a small Rust wheel) is
an optional dependency, imported only here; `--chat` renders the config's Jinja template with jinja2
when it is installed (transformers renders it the same way), else says so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import OpscopeError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
EXTRA = "pip install 'onnx-opscope[text]'"
PathLike = str | os.PathLike


def _folder(model: PathLike) -> Path:
    """Where a model's companion files lie: its folder, or `model` when it is a folder."""
    return Path(model) if Path(model).is_dir() else Path(model).parent


def _tokenizer_file(model: PathLike, tokenizer: PathLike | None) -> Path:
    """`tokenizer` when given, else tokenizer.json beside the model; whether it exists is the caller's test."""
    return Path(tokenizer) if tokenizer is not None else _folder(model) / TOKENIZER_FILE


def tokenizer_path(model: PathLike, tokenizer: PathLike | None = None) -> Path:
    """The tokenizer file: `tokenizer` when given, else tokenizer.json in the model's folder (or in `model`
    when it is a folder)."""
    path = _tokenizer_file(model, tokenizer)
    if tokenizer is not None:
        if not path.is_file():
            raise OpscopeError(f"{path}: no such tokenizer file", hint="give a Hugging Face tokenizer.json")
        return path
    if not path.is_file():
        raise OpscopeError(
            f"no tokenizer for {model}: looked for {path}",
            hint="give one with --tokenizer FILE (tokenizer=), or the prompt as ids with --prompt-ids ID,... "
            "which needs no tokenizer",
        )
    return path


def load_tokenizer(path: PathLike) -> Any:
    """The `tokenizers.Tokenizer` of a tokenizer.json (read once per file and modification time)."""
    path = Path(path)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError as exc:
        raise OpscopeError(f"{path}: cannot read the tokenizer ({exc.__class__.__name__})") from None
    return _load(str(path), stamp)


@lru_cache(maxsize=4)
def _load(path: str, stamp: int) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise OpscopeError("text prompts need Hugging Face's tokenizers package", hint=EXTRA) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises a bare Exception with serde's message
        why = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise OpscopeError(f"{path}: not a readable Hugging Face tokenizer.json ({why})") from None


def chat_text(text: str, tokenizer_file: PathLike) -> str:
    """`text` as one user message in the chat template of the tokenizer_config.json beside `tokenizer_file`,
    with the assistant's turn opened (transformers' apply_chat_template(add_generation_prompt=True))."""
    config_path = Path(tokenizer_file).parent / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise OpscopeError(f"--chat: cannot read {config_path} ({exc.__class__.__name__})",
                           hint="--chat needs the chat_template of the tokenizer's tokenizer_config.json") from None  # fmt: skip
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # transformers' named templates: [{"name": "default", "template": ...}]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) or not template:
        raise OpscopeError(f"--chat: {config_path} has no chat_template", hint="give the prompt as it is")
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise OpscopeError("--chat renders the tokenizer's Jinja chat_template: jinja2 is not installed",
                           hint="pip install 'onnx-opscope[text]' (jinja2), or give the prompt with its template already applied") from None  # fmt: skip

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    tokens = {k: _token(config.get(k)) for k in ("bos_token", "eos_token")}
    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": text}], add_generation_prompt=True, **tokens
        )
    except TemplateError as exc:
        raise OpscopeError(f"--chat: the chat_template of {config_path} failed: {exc}") from None


def _token(value: Any) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else value or ""


def prompt_ids_of(
    text: str, model: PathLike, *, tokenizer: PathLike | None = None, chat: bool = False
) -> list[int]:
    """The token ids of a text prompt, by the tokenizer beside `model` (or the file `tokenizer`): what
    `generate`, `calibrate_generation` and `parity_generation` take as `prompt_ids`. `chat` wraps the text
    in the tokenizer's chat template first. Special tokens written in the text (<|im_start|>) are kept."""
    if not text:
        raise OpscopeError("the prompt is empty", hint="give some text, or ids with --prompt-ids")
    path = tokenizer_path(model, tokenizer)
    tok = load_tokenizer(path)
    ids = tok.encode(chat_text(text, path) if chat else text).ids
    if not ids:
        raise OpscopeError(f"the prompt {text[:40]!r} encodes to no tokens with {path}")
    return ids


def text_of(ids: Sequence[int], model: PathLike, *, tokenizer: PathLike | None = None) -> str:
    """The text of token ids by the tokenizer beside `model` (or `tokenizer`), special tokens included."""
    tok = load_tokenizer(tokenizer_path(model, tokenizer))
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# The end-of-sequence token a decoder's own files name


@dataclass(frozen=True)
class Eos:
    """The token ids that end a generation and where they were read: `source` names the file and its key
    ("generation_config.json eos_token_id", "tokenizer_config.json eos_token '<|im_end|>'", "--eos-id")."""

    ids: tuple[int, ...]
    source: str

    def describe(self, model: PathLike | None = None, tokenizer: PathLike | None = None) -> str:
        """`2 '<|im_end|>' (from generation_config.json eos_token_id)`: the ids, their text when a tokenizer
        reads them, and the source."""
        names = [_token_text(i, model, tokenizer) if model is not None else None for i in self.ids]
        shown = ", ".join(f"{i} {n!r}" if n else str(i) for i, n in zip(self.ids, names))
        return f"{shown} (from {self.source})"


def default_eos(model: PathLike, tokenizer: PathLike | None = None) -> Eos | None:
    """The eos a decoder's files name, as transformers' `generate` would stop on it: `eos_token_id` (an id or
    a list) of the generation_config.json beside the model, else the `eos_token` of the tokenizer_config.json
    beside the tokenizer (`tokenizer`, else tokenizer.json beside the model), looked up in that tokenizer.json.
    None when neither names one. Plain JSON: no tokenizers package needed. A file that is there but unreadable,
    or an eos_token its tokenizer.json does not have, is an error (a silent run to --steps would hide it)."""
    gen = _folder(model) / GENERATION_CONFIG_FILE
    if gen.is_file():
        value = _json(gen).get("eos_token_id")
        ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if (
            isinstance(ids, list)
            and ids
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            return Eos(tuple(dict.fromkeys(ids)), f"{GENERATION_CONFIG_FILE} eos_token_id")
        if value is not None:
            raise OpscopeError(f"{gen}: eos_token_id {value!r} is not a token id or a list of them",
                               hint="give the eos with --eos-id ID, or --no-eos")  # fmt: skip
    tok = _tokenizer_file(model, tokenizer)
    config = tok.parent / CONFIG_FILE
    if not config.is_file():
        return None
    token = _token(_json(config).get("eos_token"))
    if not token:
        return None
    if not tok.is_file():
        raise OpscopeError(f"{config} names eos_token {token!r} but there is no {tok} to give its id",
                           hint="give the eos with --eos-id ID, or --no-eos")  # fmt: skip
    got = _vocabulary(str(tok), tok.stat().st_mtime_ns).get(token)
    if got is None:
        raise OpscopeError(f"{config} names eos_token {token!r}, which {tok} does not have",
                           hint="give the eos with --eos-id ID, or --no-eos")  # fmt: skip
    return Eos((got,), f"{CONFIG_FILE} eos_token {token!r}")


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise OpscopeError(f"{path}: cannot read it as JSON ({exc.__class__.__name__})") from None
    if not isinstance(value, dict):
        raise OpscopeError(f"{path}: expected a JSON object")
    return value


@lru_cache(maxsize=4)
def _vocabulary(path: str, stamp: int) -> dict[str, int]:
    """token -> id of a tokenizer.json: its added tokens (the special ones) over its model's vocabulary."""
    data = _json(Path(path))
    vocab = data.get("model", {}).get("vocab") if isinstance(data.get("model"), dict) else None
    out = {k: v for k, v in vocab.items() if isinstance(v, int)} if isinstance(vocab, dict) else {}
    for added in data.get("added_tokens") or []:
        if (
            isinstance(added, dict)
            and isinstance(added.get("content"), str)
            and isinstance(added.get("id"), int)
        ):
            out[added["content"]] = added["id"]
    return out


def _token_text(token_id: int, model: PathLike, tokenizer: PathLike | None) -> str | None:
    """The token's text in the tokenizer.json beside `model` (or `tokenizer`); None when there is none."""
    tok = _tokenizer_file(model, tokenizer)
    if not tok.is_file():
        return None
    try:
        vocab = _vocabulary(str(tok), tok.stat().st_mtime_ns)
    except OpscopeError:
        return None
    return next((t for t, i in vocab.items() if i == token_id), None)
