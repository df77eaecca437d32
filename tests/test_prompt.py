"""Text prompts through the Hugging Face tokenizer beside a decoder (`run.prompt`, generate --prompt).

The tokenizer is the one scripts/make_decoder.py writes from SmolLM2's GGUF; its encodings are held
against the script's own byte-level BPE (an independent implementation over the same merges), and a
text prompt's generation against the same decoder fed the reference ids.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
from conftest import DECODER_PROMPT, ROOT, decoder_path

from onnx_opscope import OpscopeError, generate, prompt_ids_of, text_of
from onnx_opscope.cli import build_parser, main
from onnx_opscope.cli.generate import generation_from_args
from onnx_opscope.run.prompt import Eos, default_eos

STEPS = 4
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def decoder():
    return decoder_path()


@pytest.fixture(scope="module")
def make_decoder(decoder):
    """scripts/make_decoder.py (`decoder_path` put scripts/ on the path): its own BPE and chat template."""
    return importlib.import_module("make_decoder")


@pytest.fixture(scope="module")
def reference(decoder, make_decoder):
    """The script's own tokenizer (tokens, merges, ids), read from the Hugging Face files beside the decoder."""
    return make_decoder.read_tokenizer(decoder.parent)


@pytest.fixture(scope="module")
def answer(decoder, reference, make_decoder):
    """The plain loop's tokens after QUESTION's reference ids, and their text."""
    ids = make_decoder.encode(QUESTION, reference)
    result = generate(decoder, ids, steps=STEPS)
    return ids, result.generated[0].tolist(), make_decoder.decode(result.generated[0].tolist(), reference)


def _generated(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("generated:")]


def test_round_trip_on_the_real_tokenizer(decoder, reference, make_decoder):
    text = text_of(DECODER_PROMPT, decoder)
    assert text == "<|im_start|>system\nYou are a helpful AI assistant"
    assert make_decoder.chat_prompt(QUESTION).startswith(text)
    assert prompt_ids_of(text, decoder) == DECODER_PROMPT
    # digits one by one, accents, an emoji, runs of spaces and tabs, special tokens inside the text
    mixed = "In 2024, 3.14 café naïve 😀  two  spaces\n\ttab <|im_end|> it's <|im_start|>user"
    ids = prompt_ids_of(mixed, decoder)
    assert ids == make_decoder.encode(mixed, reference)
    assert text_of(ids, decoder) == mixed == make_decoder.decode(ids, reference)


def test_chat_renders_the_tokenizers_template(decoder, reference, make_decoder):
    """--chat: the Jinja template of tokenizer_config.json gives what the hand-written SmolLM2 template does."""
    expected = make_decoder.encode(make_decoder.chat_prompt(QUESTION), reference)
    assert prompt_ids_of(QUESTION, decoder, chat=True) == expected
    assert expected[: len(DECODER_PROMPT)] == DECODER_PROMPT


def test_text_prompt_generates_what_its_ids_generate(decoder, answer, tmp_path, capsys):
    ids, _, text = answer
    assert main(["generate", str(decoder), "--prompt", QUESTION, "--steps", str(STEPS), "--plain"]) == 0
    printed = capsys.readouterr().out
    assert f"prefill {len(ids)} tokens" in printed
    assert f"generated: {text!r}" in printed.splitlines()
    # a --prompt-file of text is the same prompt, its last newline dropped
    (tmp_path / "q.txt").write_text(QUESTION + "\n")
    args = ["generate", str(decoder), "--prompt-file", str(tmp_path / "q.txt"), "--steps", str(STEPS)]
    assert main([*args, "--plain"]) == 0
    assert _generated(capsys) == [f"generated: {text!r}"]


def test_a_prompt_file_of_ids_is_still_ids(decoder, answer, tmp_path, capsys):
    ids, tokens, text = answer
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)) + "\n")
    args = [
        "generate",
        str(decoder),
        "--prompt-file",
        str(tmp_path / "ids.txt"),
        "--steps",
        str(STEPS),
        "--plain",
    ]
    assert main(args) == 0
    assert _generated(capsys) == [f"generated: {text!r}"]
    # no tokenizer beside the model: the ids are shown, as before text prompts
    alone = tmp_path / "alone" / "model.onnx"
    alone.parent.mkdir()
    alone.symlink_to(decoder)
    assert main(["generate", str(alone), "--prompt-file", str(tmp_path / "ids.txt"), "--steps", str(STEPS),
                 "--plain"]) == 0  # fmt: skip
    assert _generated(capsys) == ["generated: " + " ".join(map(str, tokens))]


def test_calibrate_and_parity_take_the_same_text_prompt(decoder, reference, make_decoder):
    ids = make_decoder.encode(make_decoder.chat_prompt(QUESTION), reference)
    for command in ("calibrate", "parity"):
        args = build_parser().parse_args(
            [command, str(decoder), "--generate", "--prompt", QUESTION, "--chat"]
        )
        assert generation_from_args(args)["prompt_ids"] == ids
    args = build_parser().parse_args(["calibrate", str(decoder), "--prompt", QUESTION])
    with pytest.raises(OpscopeError, match="--prompt goes with --generate"):
        generation_from_args(args)


def _one_error(capsys, argv: list[str], expected: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith("error: ") and expected in lines[0], err
    assert len(lines) <= 2 and all(line.startswith(("error: ", "hint: ")) for line in lines), err
    return err


def test_errors_are_one_line(decoder, tmp_path, capsys):
    alone = tmp_path / "model.onnx"
    alone.symlink_to(decoder)
    err = _one_error(capsys, ["generate", str(alone), "--prompt", "hi", "--plain"], "no tokenizer for")
    assert str(tmp_path / "tokenizer.json") in err and "--prompt-ids" in err
    (tmp_path / "bad.json").write_text('{"model": ')
    _one_error(capsys, ["generate", str(decoder), "--prompt", "hi", "--tokenizer", str(tmp_path / "bad.json"),
                        "--plain"], "not a readable Hugging Face tokenizer.json")  # fmt: skip
    _one_error(capsys, ["generate", str(decoder), "--prompt-ids", "1,2", "--tokenizer", str(tmp_path / "no.json"),
                        "--plain"], "no such tokenizer file")  # fmt: skip
    _one_error(capsys, ["generate", str(decoder), "--prompt", "", "--plain"], "the prompt is empty")
    (tmp_path / "empty.txt").write_text(" \n\n")
    _one_error(capsys, ["generate", str(decoder), "--prompt-file", str(tmp_path / "empty.txt"), "--plain"],
               "the prompt is empty")  # fmt: skip
    _one_error(capsys, ["generate", str(decoder), "--prompt-ids", "1,2", "--chat", "--plain"], "--chat wraps")


@pytest.mark.parametrize(
    "blocked, argv, expected",
    [
        ("tokenizers", ["--prompt", "hi"], "pip install 'onnx-opscope[text]'"),
        ("jinja2", ["--prompt", "hi", "--chat"], "jinja2 is not installed"),
    ],
)
def test_without_the_optional_packages(decoder, blocked, argv, expected):
    """A package set to None in sys.modules cannot be imported: as if it were not installed."""
    code = (f"import sys; sys.modules[{blocked!r}] = None; from onnx_opscope.cli import main; "
            f"sys.exit(main(sys.argv[1:]))")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code, "generate", str(decoder), *argv, "--plain"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ}, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("error: ") and expected in run.stderr


# ---------------------------------------------------------------------------------------------
# The eos a decoder's files name: generate's default stop


def _beside(tmp_path, decoder, files=("tokenizer.json", "tokenizer_config.json")):
    """The decoder in a folder of its own, with links to the tokenizer files named."""
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    (folder / "model.onnx").symlink_to(decoder)
    for name in files:
        (folder / name).symlink_to(decoder.parent / name)
    return folder / "model.onnx"


def test_default_eos_is_what_the_files_name(decoder, tmp_path):
    eos = default_eos(
        decoder
    )  # SmolLM2's chat eos: tokenizer_config.json's eos_token, id from tokenizer.json
    assert eos == Eos((2,), "tokenizer_config.json eos_token '<|im_end|>'")
    assert eos.describe(decoder) == "2 '<|im_end|>' (from tokenizer_config.json eos_token '<|im_end|>')"
    model = _beside(tmp_path, decoder)
    # a generation_config.json comes first, as transformers' generate reads it: an id or a list of ids
    (model.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert default_eos(model) == Eos((0,), "generation_config.json eos_token_id")
    (model.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 2]}))
    assert default_eos(model).ids == (2, 0)
    assert (
        default_eos(model).describe(model)
        == "2 '<|im_end|>', 0 '<|endoftext|>' (from generation_config.json eos_token_id)"
    )
    (model.parent / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1})
    )  # none there: the tokenizer's
    assert default_eos(model).ids == (2,)
    for bad in ('{"eos_token_id": "2"}', '{"eos_token_id": [-1]}', "{"):
        (model.parent / "generation_config.json").write_text(bad)
        with pytest.raises(OpscopeError, match="generation_config.json"):
            default_eos(model)
    (model.parent / "generation_config.json").unlink()
    # an AddedToken-style eos_token; one the tokenizer lacks is an error, not a silent run to --steps
    config = json.loads((decoder.parent / "tokenizer_config.json").read_text())
    (model.parent / "tokenizer_config.json").unlink()
    (model.parent / "tokenizer_config.json").write_text(
        json.dumps({**config, "eos_token": {"content": "<|endoftext|>"}})
    )
    assert default_eos(model) == Eos((0,), "tokenizer_config.json eos_token '<|endoftext|>'")
    (model.parent / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
    with pytest.raises(OpscopeError, match="does not have"):
        default_eos(model)
    assert default_eos(_beside(tmp_path / "alone", decoder, files=())) is None


def _eos_line(capsys) -> str:
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("eos:"))


def test_generate_stops_at_the_default_eos(decoder, tmp_path, capsys):
    model = _beside(tmp_path, decoder)
    tokens = generate(model, DECODER_PROMPT, steps=6).generated[0].tolist()
    stop = tokens[2]  # an id the greedy loop makes: named the eos, the loop stops where it first comes
    at = tokens.index(stop) + 1
    (model.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    ids = ",".join(map(str, DECODER_PROMPT))
    args = ["generate", str(model), "--prompt-ids", ids, "--steps", "6"]
    assert main([*args, "--plain"]) == 0
    line = _eos_line(capsys)
    assert (
        line.startswith(f"eos: {stop} ")
        and f"(from generation_config.json eos_token_id); stopped at it after {at} of 6 steps" in line
    )
    out = tmp_path / "gen.parquet"  # recorded: the eos is in the run's record (the decoder in its own folder)
    assert (
        main(["generate", str(decoder), *args[2:], "-o", str(out), "--no-parity", "--eos-id", str(stop)]) == 0
    )
    assert f"stopped at it after {at} of 6 steps" in _eos_line(capsys)
    assert json.loads(out.with_suffix(".run.json").read_text())["generation"]["eos_id"] == [stop]
    # --eos-id overrides it; --no-eos runs every step
    assert main([*args, "--plain", "--eos-id", f"{tokens[0]}"]) == 0
    assert _eos_line(capsys).endswith("(from --eos-id); stopped at it after 1 of 6 steps")
    assert main([*args, "--plain", "--no-eos"]) == 0
    assert _eos_line(capsys) == "eos: none (--no-eos)"
    alone = _beside(tmp_path / "alone", decoder, files=())
    assert main(["generate", str(alone), "--prompt-ids", ids, "--steps", "2", "--plain"]) == 0
    assert _eos_line(capsys) == "eos: none (the model's files name none; --eos-id ID sets one)"
    _one_error(capsys, [*args, "--plain", "--eos-id", "2,x"], "--eos-id '2,x': expected token ids")
    with pytest.raises(SystemExit):
        main([*args, "--plain", "--eos-id", "2", "--no-eos"])
